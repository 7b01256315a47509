//! taskstream-bench: runs benchmark scenarios, each with its variants side by
//! side in one run, prints a markdown table per scenario and writes tables and
//! PNG plots under `bench/results/` (plus `summary.md` with the machine header).
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
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Instant;

const USAGE: &str = "usage: taskstream-bench [SCENARIO…] [--quick] [--out DIR]

Runs the named scenarios (all when none is named) and writes
<DIR>/<scenario>.md, <DIR>/<scenario>.png and <DIR>/summary.md
(DIR defaults to bench/results).

  --quick   small runs of every scenario but `peers` (the whole set in well under
            3 minutes), to check that the harness works; the numbers are only indicative
  --out DIR where to write the results
  --list    list the scenarios";

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
    let ctx = Ctx {
        quick,
        out: out.clone(),
    };
    let started = Instant::now();
    let mut reports = Vec::new();
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
        let scenario_started = Instant::now();
        let mut report = match (scenario.run)(&ctx) {
            Ok(report) => report,
            Err(error) => {
                failed.push(scenario.name);
                let mut report = report::ScenarioReport::new(scenario.name, scenario.summary, "");
                report.notes.push(format!("**the scenario failed:** {error:#}"));
                report
            }
        };
        report.seconds = scenario_started.elapsed().as_secs_f64();
        println!("{}", report.to_markdown());
        if let Err(error) = report::write_scenario(&out, &report) {
            eprintln!("taskstream-bench: cannot write {}.md: {error:#}", report.name);
            failed.push(scenario.name);
        }
        reports.push(report);
    }

    let mut summary = header;
    for report in &reports {
        summary.push_str(&report.to_markdown());
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
