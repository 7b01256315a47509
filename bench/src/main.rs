//! taskstream-bench: runs benchmark scenarios, each with its variants side by
//! side in one run, prints a markdown table per scenario and writes tables and
//! PNG plots under `bench/results/` (plus `summary.md` with the machine header).
//!
//! Each scenario runs in a process of its own (the harness re-runs itself as
//! `taskstream-bench __scenario NAME …`, one after the other), so that a
//! scenario's numbers do not depend on the ones run before it: heap, caches and
//! threads left by an earlier scenario made later ones 15–30 % slower.
//!
//! `cargo run --release -p taskstream-bench -- [SCENARIO…] [--quick] [--out DIR]`

mod bare;
pub mod broker;
mod plot;
mod repeat;
mod report;
mod scenarios;
mod server;
mod workload;

use scenarios::{Ctx, SCENARIOS};
use std::ffi::OsString;
use std::io::Write as _;
use std::path::PathBuf;
use std::process::{Command, ExitCode, Stdio};
use std::time::Instant;

const USAGE: &str = "usage: taskstream-bench [SCENARIO…] [--quick] [--out DIR]

Runs the named scenarios (all when none is named) and writes
<DIR>/<scenario>.md, <DIR>/<scenario>.png and <DIR>/summary.md
(DIR defaults to bench/results).

Each scenario runs in a process of its own, so that its numbers do not depend
on the scenarios run before it.

  --quick   small runs of every scenario but `peers` (the whole set in well under
            3 minutes), to check that the harness works; the numbers are only indicative
  --out DIR where to write the results
  --list    list the scenarios";

/// The hidden first argument that runs one scenario in a child process (see [`ScenarioChild`]).
const SCENARIO_CHILD: &str = "__scenario";

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args.first().map(String::as_str) == Some("__serve") {
        // The harness re-runs itself as a child server (see `server`).
        init_tracing();
        return match server::serve_main(&args[1..]) {
            Ok(()) => ExitCode::SUCCESS,
            Err(error) => {
                eprintln!("taskstream-bench server: {error:#}");
                ExitCode::FAILURE
            }
        };
    }
    if args.first().map(String::as_str) == Some(scenarios::IDLE_TASKS_PROBE) {
        return match scenarios::idle_tasks_probe(&args[1..]) {
            Ok(()) => ExitCode::SUCCESS,
            Err(error) => {
                eprintln!("taskstream-bench idle-task probe: {error:#}");
                ExitCode::FAILURE
            }
        };
    }
    if args.first().map(String::as_str) == Some(SCENARIO_CHILD) {
        init_tracing();
        return match ScenarioChild::parse(&args[1..]) {
            Ok(child) => child.run(),
            Err(error) => {
                eprintln!("taskstream-bench {SCENARIO_CHILD}: {error}");
                ExitCode::from(2)
            }
        };
    }
    init_tracing();

    let mut quick = false;
    let mut out = PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/results"));
    let mut names: Vec<&'static str> = Vec::new();
    let mut it = args.iter();
    while let Some(arg) = it.next() {
        match arg.as_str() {
            "--quick" => quick = true,
            "--out" => match it.next() {
                Some(dir) => out = PathBuf::from(dir),
                None => return usage_error("--out needs a directory"),
            },
            "--list" => {
                for scenario in SCENARIOS {
                    println!("{:<9} {}", scenario.name, scenario.summary);
                }
                return ExitCode::SUCCESS;
            }
            "-h" | "--help" => {
                println!("{USAGE}");
                return ExitCode::SUCCESS;
            }
            name => match SCENARIOS.iter().find(|s| s.name == name) {
                Some(scenario) => {
                    if !names.contains(&scenario.name) {
                        names.push(scenario.name);
                    }
                }
                None => {
                    let known: Vec<&str> = SCENARIOS.iter().map(|s| s.name).collect();
                    return usage_error(&format!(
                        "unknown scenario `{name}`; the scenarios are: {}",
                        known.join(", ")
                    ));
                }
            },
        }
    }
    if names.is_empty() {
        names = SCENARIOS
            .iter()
            .filter(|s| !quick || s.in_quick_run)
            .map(|s| s.name)
            .collect();
    }
    if let Err(error) = std::fs::create_dir_all(&out) {
        eprintln!("taskstream-bench: cannot create {}: {error}", out.display());
        return ExitCode::FAILURE;
    }

    let header = report::machine_header(quick, &names);
    println!("{header}");
    let started = Instant::now();
    let mut markdowns = Vec::new();
    let mut failed = Vec::new();
    for name in &names {
        let Some(scenario) = SCENARIOS.iter().find(|s| s.name == *name) else {
            continue;
        };
        eprintln!(
            "taskstream-bench: running {}{}",
            scenario.name,
            if quick { " (quick)" } else { "" }
        );
        let child = ScenarioChild {
            name: scenario.name.to_string(),
            quick,
            out: out.clone(),
        };
        let (markdown, ok) = run_in_child(scenario, &child);
        if !ok {
            failed.push(scenario.name);
        }
        markdowns.push(markdown);
    }

    let mut summary = header;
    for markdown in &markdowns {
        summary.push_str(markdown);
    }
    summary.push_str(&format!(
        "_Total wall time: {:.1} s._\n",
        started.elapsed().as_secs_f64()
    ));
    let summary_path = out.join("summary.md");
    if let Err(error) = std::fs::write(&summary_path, summary) {
        eprintln!(
            "taskstream-bench: cannot write {}: {error}",
            summary_path.display()
        );
        return ExitCode::FAILURE;
    }
    eprintln!(
        "taskstream-bench: wrote {} in {:.1} s",
        summary_path.display(),
        started.elapsed().as_secs_f64()
    );
    if failed.is_empty() {
        ExitCode::SUCCESS
    } else {
        eprintln!("taskstream-bench: failed scenarios: {}", failed.join(", "));
        ExitCode::FAILURE
    }
}

/// One scenario run by a child process: `taskstream-bench __scenario NAME [--quick] --out DIR`.
#[derive(Debug, Clone, PartialEq, Eq)]
struct ScenarioChild {
    name: String,
    quick: bool,
    out: PathBuf,
}

impl ScenarioChild {
    /// The child's arguments, the hidden first one included.
    fn to_args(&self) -> Vec<OsString> {
        let mut args = vec![OsString::from(SCENARIO_CHILD), OsString::from(&self.name)];
        if self.quick {
            args.push("--quick".into());
        }
        args.push("--out".into());
        args.push(self.out.clone().into_os_string());
        args
    }

    /// Reads the arguments after the hidden first one.
    fn parse(args: &[String]) -> Result<ScenarioChild, String> {
        let mut it = args.iter();
        let name = it.next().ok_or("no scenario named")?.clone();
        let mut quick = false;
        let mut out = None;
        while let Some(arg) = it.next() {
            match arg.as_str() {
                "--quick" => quick = true,
                "--out" => out = Some(PathBuf::from(it.next().ok_or("--out needs a directory")?)),
                other => return Err(format!("unexpected argument `{other}`")),
            }
        }
        let out = out.ok_or("no --out directory")?;
        Ok(ScenarioChild { name, quick, out })
    }

    /// The child's side: runs the scenario as the harness always did, prints its markdown and
    /// writes `<out>/<name>.md` (with the failure as a note if it failed). Fails if the
    /// scenario or the writing did.
    fn run(&self) -> ExitCode {
        let Some(scenario) = SCENARIOS.iter().find(|s| s.name == self.name) else {
            eprintln!(
                "taskstream-bench {SCENARIO_CHILD}: unknown scenario `{}`",
                self.name
            );
            return ExitCode::from(2);
        };
        let ctx = Ctx {
            quick: self.quick,
            out: self.out.clone(),
        };
        let scenario_started = Instant::now();
        let (mut report, ran) = match (scenario.run)(&ctx) {
            Ok(report) => (report, true),
            Err(error) => (
                failed_report(scenario, format!("**the scenario failed:** {error:#}")),
                false,
            ),
        };
        report.seconds = scenario_started.elapsed().as_secs_f64();
        let (_, written) = publish(&self.out, &report);
        if ran && written {
            ExitCode::SUCCESS
        } else {
            ExitCode::FAILURE
        }
    }
}

/// The parent's side: runs `child` (stdout and stderr pass through) and waits for it. Returns
/// the scenario's markdown, read back from the `<out>/<name>.md` the child wrote, and whether
/// it succeeded. A child that wrote no file (it crashed, or was killed) gets a report written
/// for it that says how its process ended.
fn run_in_child(scenario: &scenarios::Scenario, child: &ScenarioChild) -> (String, bool) {
    let path = child.out.join(format!("{}.md", scenario.name));
    // A file left by an earlier run must not pass for this run's.
    if let Err(error) = std::fs::remove_file(&path)
        && error.kind() != std::io::ErrorKind::NotFound
    {
        eprintln!("taskstream-bench: cannot remove {}: {error}", path.display());
    }
    let _ = std::io::stdout().flush();
    let started = Instant::now();
    let status = std::env::current_exe()
        .and_then(|exe| {
            Command::new(exe)
                .args(child.to_args())
                .stdin(Stdio::null())
                .status()
        })
        .map_err(|error| format!("could not run: {error}"))
        .and_then(|status| {
            if status.success() {
                Ok(())
            } else {
                Err(status.to_string())
            }
        });
    match (std::fs::read_to_string(&path), status) {
        (Ok(markdown), status) => (markdown, status.is_ok()),
        (Err(error), status) => {
            let why = match status {
                Err(why) => why,
                Ok(()) => format!(
                    "exited successfully but {} is unreadable: {error}",
                    path.display()
                ),
            };
            let mut report = failed_report(scenario, format!("**the scenario's process failed:** {why}"));
            report.seconds = started.elapsed().as_secs_f64();
            let (markdown, _) = publish(&child.out, &report);
            (markdown, false)
        }
    }
}

/// A report of `scenario` that holds only `note`, saying why it has no table.
fn failed_report(scenario: &scenarios::Scenario, note: String) -> report::ScenarioReport {
    let mut report = report::ScenarioReport::new(scenario.name, scenario.summary, "");
    report.notes.push(note);
    report
}

/// Prints `report` and writes `<out>/<name>.md`: its markdown, and whether the file was written.
fn publish(out: &std::path::Path, report: &report::ScenarioReport) -> (String, bool) {
    let markdown = report.to_markdown();
    println!("{markdown}");
    match report::write_scenario(out, report) {
        Ok(()) => (markdown, true),
        Err(error) => {
            eprintln!("taskstream-bench: cannot write {}.md: {error:#}", report.name);
            (markdown, false)
        }
    }
}

fn usage_error(message: &str) -> ExitCode {
    eprintln!("taskstream-bench: {message}\n\n{USAGE}");
    ExitCode::from(2)
}

/// Warnings and errors of the runtime and server reach stderr; nothing else.
fn init_tracing() {
    let filter = tracing_subscriber::EnvFilter::try_from_env("TASKSTREAM_BENCH_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn"));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .try_init();
}

#[cfg(test)]
mod tests {
    use super::*;

    fn strings(args: &[OsString]) -> Vec<String> {
        args.iter().map(|a| a.to_str().unwrap().to_string()).collect()
    }

    #[test]
    fn scenario_child_arguments_round_trip() {
        for quick in [false, true] {
            let child = ScenarioChild {
                name: "retry".into(),
                quick,
                out: PathBuf::from("/tmp/some dir/results"),
            };
            let args = strings(&child.to_args());
            assert_eq!(args[0], SCENARIO_CHILD);
            assert_eq!(ScenarioChild::parse(&args[1..]), Ok(child));
        }
    }

    #[test]
    fn scenario_child_arguments_need_a_name_and_an_out_dir() {
        let parse =
            |args: &[&str]| ScenarioChild::parse(&args.iter().map(|a| a.to_string()).collect::<Vec<_>>());
        assert!(parse(&[]).is_err());
        assert!(parse(&["floor", "--quick"]).is_err());
        assert!(parse(&["floor", "--out"]).is_err());
        assert!(parse(&["floor", "--out", "x", "--bogus"]).is_err());
        assert_eq!(parse(&["floor", "--out", "x"]).map(|c| c.quick), Ok(false));
    }
}
