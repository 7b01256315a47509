//! What a scenario hands back (tables with target and pass/miss columns,
//! notes, plots) and how it is written: markdown to stdout, to
//! `results/<scenario>.md` and, with the machine header, to `results/summary.md`.

use std::fmt::Write as _;
use std::path::Path;
use std::time::{SystemTime, UNIX_EPOCH};

/// Whether a measured value met its target.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    Pass,
    Miss,
    /// No target for this row (context, a reference figure).
    NoTarget,
    /// Not measured (skipped, or the feature is not there yet).
    NotRun,
}

impl Verdict {
    pub fn of(pass: bool) -> Verdict {
        if pass { Verdict::Pass } else { Verdict::Miss }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Verdict::Pass => "pass",
            Verdict::Miss => "**miss**",
            Verdict::NoTarget => "–",
            Verdict::NotRun => "not run",
        }
    }
}

/// A markdown table. The last two columns are conventionally "target" and "pass/miss".
#[derive(Debug, Clone)]
pub struct Table {
    pub title: String,
    pub columns: Vec<String>,
    pub rows: Vec<Vec<String>>,
}

impl Table {
    pub fn new(title: impl Into<String>, columns: &[&str]) -> Table {
        Table {
            title: title.into(),
            columns: columns.iter().map(|c| c.to_string()).collect(),
            rows: Vec::new(),
        }
    }

    pub fn row(&mut self, cells: Vec<String>) {
        debug_assert_eq!(
            cells.len(),
            self.columns.len(),
            "row width of table {}",
            self.title
        );
        self.rows.push(cells);
    }

    pub fn to_markdown(&self) -> String {
        let mut out = String::new();
        if !self.title.is_empty() {
            let _ = writeln!(out, "**{}**\n", self.title);
        }
        let widths: Vec<usize> = (0..self.columns.len())
            .map(|i| {
                self.rows
                    .iter()
                    .filter_map(|r| r.get(i))
                    .chain(std::iter::once(&self.columns[i]))
                    .map(|c| c.chars().count())
                    .max()
                    .unwrap_or(3)
                    .max(3)
            })
            .collect();
        let line = |cells: &[String]| {
            let padded: Vec<String> = cells
                .iter()
                .zip(&widths)
                .map(|(c, &w)| format!("{c:<w$}"))
                .collect();
            format!("| {} |\n", padded.join(" | "))
        };
        out.push_str(&line(&self.columns));
        let rule: Vec<String> = widths.iter().map(|&w| "-".repeat(w)).collect();
        out.push_str(&line(&rule));
        for row in &self.rows {
            out.push_str(&line(row));
        }
        out
    }
}

/// Everything one scenario produced.
#[derive(Debug, Clone)]
pub struct ScenarioReport {
    pub name: &'static str,
    pub title: String,
    /// What is measured and how, in a few sentences.
    pub method: String,
    pub tables: Vec<Table>,
    pub notes: Vec<String>,
    /// File names (inside the results folder) of the plots written.
    pub plots: Vec<String>,
    pub seconds: f64,
}

impl ScenarioReport {
    pub fn new(name: &'static str, title: impl Into<String>, method: impl Into<String>) -> Self {
        ScenarioReport {
            name,
            title: title.into(),
            method: method.into(),
            tables: Vec::new(),
            notes: Vec::new(),
            plots: Vec::new(),
            seconds: 0.0,
        }
    }

    pub fn to_markdown(&self) -> String {
        let mut out = String::new();
        let _ = writeln!(out, "## {} — {}\n", self.name, self.title);
        let _ = writeln!(out, "{}\n", self.method);
        for table in &self.tables {
            out.push_str(&table.to_markdown());
            out.push('\n');
        }
        for note in &self.notes {
            let _ = writeln!(out, "- {note}");
        }
        if !self.notes.is_empty() {
            out.push('\n');
        }
        for plot in &self.plots {
            let _ = writeln!(out, "![{}]({plot})\n", self.name);
        }
        let _ = writeln!(out, "_Scenario wall time: {:.1} s._\n", self.seconds);
        out
    }
}

/// The machine and build a run happened on.
pub fn machine_header(quick: bool, scenarios: &[&str]) -> String {
    let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let model = cpuinfo
        .lines()
        .find_map(|l| {
            l.strip_prefix("model name")
                .and_then(|r| r.split_once(':'))
                .map(|(_, m)| m.trim())
        })
        .unwrap_or("unknown CPU")
        .to_string();
    let cores = cpuinfo.lines().filter(|l| l.starts_with("processor")).count();
    let cores = if cores == 0 {
        std::thread::available_parallelism().map_or(0, |n| n.get())
    } else {
        cores
    };
    let memory = std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|m| {
            m.lines()
                .find(|l| l.starts_with("MemTotal:"))
                .and_then(|l| l.split_whitespace().nth(1).and_then(|kb| kb.parse::<f64>().ok()))
        })
        .map_or_else(
            || "unknown".to_string(),
            |kb| format!("{:.1} GiB", kb / 1024.0 / 1024.0),
        );
    let load = std::fs::read_to_string("/proc/loadavg")
        .ok()
        .map(|l| l.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_else(|| "unknown".to_string());
    let git = |args: &[&str]| {
        std::process::Command::new("git")
            .args(args)
            .current_dir(env!("CARGO_MANIFEST_DIR"))
            .output()
            .ok()
            .filter(|o| o.status.success())
            .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
    };
    let commit = match (
        git(&["rev-parse", "--short", "HEAD"]),
        git(&["status", "--porcelain", "--untracked-files=no"]),
    ) {
        (Some(commit), Some(changes)) if !changes.is_empty() => {
            format!("{commit} (with uncommitted changes)")
        }
        (Some(commit), _) => commit,
        (None, _) => "unknown".to_string(),
    };
    let mut out = String::new();
    let _ = writeln!(out, "# taskstream benchmark results\n");
    let _ = writeln!(out, "| | |\n|---|---|");
    let _ = writeln!(out, "| date (UTC) | {} |", utc_now());
    let _ = writeln!(
        out,
        "| mode | {} |",
        if quick {
            "quick (`--quick`: small runs so the harness stays alive; numbers are indicative only)"
        } else {
            "full"
        }
    );
    let _ = writeln!(out, "| scenarios | {} |", scenarios.join(", "));
    let _ = writeln!(out, "| CPU | {model}, {cores} cores |");
    let _ = writeln!(out, "| memory | {memory} |");
    let _ = writeln!(out, "| load average at start | {load} |");
    let _ = writeln!(out, "| rustc | {} |", env!("BENCH_RUSTC_VERSION"));
    let _ = writeln!(out, "| commit | {commit} |");
    let _ = writeln!(
        out,
        "\nVariants of a scenario run side by side in one run: their ratios are what \
         count, absolute numbers depend on the machine and what else it is doing.\n"
    );
    out
}

/// `YYYY-MM-DD HH:MM` in UTC, from the system clock (no date crate needed).
fn utc_now() -> String {
    let secs = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs()) as i64;
    let days = secs.div_euclid(86_400);
    let rem = secs.rem_euclid(86_400);
    // Howard Hinnant's civil_from_days.
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!(
        "{year:04}-{month:02}-{day:02} {:02}:{:02}",
        rem / 3600,
        (rem % 3600) / 60
    )
}

/// Writes `<dir>/<name>.md` for one scenario.
pub fn write_scenario(dir: &Path, report: &ScenarioReport) -> anyhow::Result<()> {
    std::fs::write(dir.join(format!("{}.md", report.name)), report.to_markdown())?;
    Ok(())
}

/// Thousands separators: 1234567 → "1,234,567".
pub fn group(n: u64) -> String {
    let digits = n.to_string();
    let mut out = String::new();
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    out
}

/// A rate with thousands separators and no decimals.
pub fn rate(per_second: f64) -> String {
    group(per_second.max(0.0).round() as u64)
}

pub fn secs(s: f64) -> String {
    format!("{s:.3}")
}

pub fn ratio(r: f64) -> String {
    format!("{r:.3}")
}

/// Bytes as MiB with one decimal.
pub fn mib(bytes: u64) -> String {
    format!("{:.1} MiB", bytes as f64 / 1024.0 / 1024.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn groups_thousands() {
        assert_eq!(group(0), "0");
        assert_eq!(group(999), "999");
        assert_eq!(group(1000), "1,000");
        assert_eq!(group(1234567), "1,234,567");
    }

    #[test]
    fn table_renders_aligned_markdown() {
        let mut table = Table::new("", &["a", "target"]);
        table.row(vec!["1".into(), "≥ 2".into()]);
        let md = table.to_markdown();
        assert!(md.starts_with("| a   | target |\n| --- | ------ |\n"), "{md}");
    }
}
