//! The Python example processors (examples/python-processor/processor.py and
//! its asyncio twin async_processor.py, both written with the taskstream
//! package of client/python) drive a pipeline end to end: each runs as it is
//! on a free port with the package's source on PYTHONPATH and the tests' venv
//! (`common::tools`) for grpcio, and the pipeline is the example's own
//! taskstream.toml pointed at it. The store and the sink topic must hold
//! exactly what the Python code computes: a count per key, and each record
//! enriched (upper-cased, numbered per key) in its key's order; a value that is
//! not UTF-8 is failed as not retryable and goes straight to the dead-letter topic.

mod common;

use common::tools::tools;
use std::collections::HashMap;
use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};
use taskstream_server::{Config, ProcessorSpec, ProducerRecord, StreamsApp, failure_headers};

const WAIT: Duration = Duration::from_secs(60);

/// The Python processor, killed when dropped.
struct Processor(Child);

impl Drop for Processor {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn wait_for(what: &str, mut done: impl FnMut() -> bool) {
    let deadline = Instant::now() + WAIT;
    while !done() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(10));
    }
}

#[test]
fn python_processor_counts_and_enriches_exactly_as_its_code_says() {
    drive("examples/python-processor/processor.py", "python-processor");
}

#[test]
fn asyncio_processor_counts_and_enriches_exactly_as_its_code_says() {
    drive(
        "examples/python-processor/async_processor.py",
        "python-async-processor",
    );
}

/// Runs `script` (the package from client/python/src on PYTHONPATH) and the
/// example's pipeline against it as application `application_id`.
fn drive(script: &str, application_id: &str) {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut child = Command::new(&tools().python)
        .current_dir(root)
        .env("PYTHONPATH", root.join("client/python/src"))
        .args(["-u", script, "127.0.0.1:0"])
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("start the Python processor");
    let stdout = child.stdout.take().expect("piped stdout");
    let processor = Processor(child);
    let mut line = String::new();
    BufReader::new(stdout)
        .read_line(&mut line)
        .expect("the processor's first line");
    let port: u16 = line
        .trim()
        .strip_prefix("processor listening on port ")
        .and_then(|p| p.parse().ok())
        .unwrap_or_else(|| panic!("unexpected first line from the processor: {line:?}"));

    // The example's own config, pointed at this processor.
    let text = std::fs::read_to_string(root.join("examples/python-processor/taskstream.toml")).unwrap();
    let mut config = Config::from_toml_str(&text).unwrap();
    let ProcessorSpec::Grpc(spec) = &mut config.pipelines[0].processor else {
        panic!("the example's pipeline is not a grpc processor");
    };
    spec.endpoint = format!("http://127.0.0.1:{port}");
    config.application_id = application_id.into();
    config.commit_interval_ms = 50;
    config.retry_backoff_ms = 10;
    let app = StreamsApp::start(config).unwrap();

    let keys = ["alice", "bob", "carol", "dave", "erin"];
    let mut records: Vec<ProducerRecord> = (0..600)
        .map(|i| ProducerRecord::keyed(keys[i % keys.len()], format!("event {i} für")))
        .collect();
    records.push(ProducerRecord::keyed("bob", vec![0xff, 0xfe]));
    app.produce("events", records.clone()).unwrap();
    assert!(app.wait_until_caught_up(WAIT));

    // What processor.py computes, record by record in each key's order.
    let mut counts: HashMap<&str, u64> = HashMap::new();
    let mut expected: HashMap<String, Vec<String>> = HashMap::new();
    for record in &records {
        let key = std::str::from_utf8(record.key.as_ref().unwrap()).unwrap();
        let Ok(text) = std::str::from_utf8(&record.value) else {
            continue;
        };
        let count = counts.entry(key).or_default();
        *count += 1;
        expected
            .entry(key.to_string())
            .or_default()
            .push(format!("{} (#{count} of {key})", text.to_uppercase()));
    }
    for key in keys {
        assert_eq!(
            app.get("enriched", key.as_bytes()).unwrap().as_deref(),
            Some(counts[key].to_string().as_bytes()),
            "count of {key}"
        );
    }
    let sink = "enriched-events";
    let partitions = app.log().partitions(sink).unwrap();
    wait_for("600 enriched records", || {
        (0..partitions)
            .map(|p| app.log().end_offset(sink, p).unwrap())
            .sum::<u64>()
            == 600
    });
    let mut got: HashMap<String, Vec<String>> = HashMap::new();
    for partition in 0..partitions {
        let read = app.read_topic(sink, partition, 0, 1_000).unwrap();
        for record in read.records {
            let key = String::from_utf8(record.key.unwrap().to_vec()).unwrap();
            assert!(
                record.headers.iter().any(|(name, _)| name == "source-offset"),
                "the Python header is kept"
            );
            got.entry(key)
                .or_default()
                .push(String::from_utf8(record.value.to_vec()).unwrap());
        }
    }
    assert_eq!(got, expected);

    let dead: Vec<_> = (0..partitions)
        .flat_map(|p| {
            app.read_topic(&format!("{application_id}-enriched-dlq"), p, 0, 10)
                .unwrap()
                .records
        })
        .collect();
    assert_eq!(dead.len(), 1, "the non-UTF-8 record, dead-lettered at once");
    let header = |name: &str| {
        dead[0]
            .headers
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| String::from_utf8_lossy(v).into_owned())
    };
    assert_eq!(header(failure_headers::EXCEPTION).as_deref(), Some("NotUtf8"));
    assert_eq!(header(failure_headers::ATTEMPTS).as_deref(), Some("1"));
    app.shutdown().unwrap();
    drop(processor);
}
