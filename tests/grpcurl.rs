//! The gRPC contract through `grpcurl` with no .proto at hand: everything it
//! knows comes from server reflection (v1alpha, the only version grpcurl 1.8.6
//! speaks). A real server runs in-process on port 0 and grpcurl is a subprocess.
//! grpcurl comes from the tests' own venv (`common::tools`), provisioned on
//! first use; if it cannot be provisioned the tests fail, never skip.

mod common;

use common::tools::tools;
use common::{Output, Server, run};
use serde_json::Value;
use std::collections::BTreeMap;
use std::process::Command;
use std::time::Duration;

/// Upper bound of one grpcurl call; a hung call fails the test instead of
/// hanging it. Above grpcurl's own `-max-time 60`, which reports more clearly.
const CALL_TIMEOUT: Duration = Duration::from_secs(90);

impl Output {
    /// The JSON messages grpcurl printed, one object per response message.
    fn messages(&self) -> Vec<Value> {
        serde_json::Deserializer::from_str(&self.stdout)
            .into_iter::<Value>()
            .collect::<Result<_, _>>()
            .unwrap_or_else(|e| {
                panic!(
                    "grpcurl printed something that is not JSON ({e}):\n{}",
                    self.describe()
                )
            })
    }

    fn message(&self) -> Value {
        let mut messages = self.messages();
        assert_eq!(
            messages.len(),
            1,
            "expected one response message:\n{}",
            self.describe()
        );
        messages.remove(0)
    }
}

/// `grpcurl -plaintext [-d DATA] ADDR ARGS…`, defaults emitted so that zero
/// values (partition 0, offset 0, false) are present in the JSON.
fn grpcurl(server: &Server, data: Option<&str>, args: &[&str]) -> Output {
    let mut command = Command::new(&tools().grpcurl);
    command.args([
        "-plaintext",
        "-emit-defaults",
        "-connect-timeout",
        "10",
        "-max-time",
        "60",
    ]);
    if let Some(data) = data {
        command.args(["-d", data]);
    }
    command.arg(server.addr()).args(args);
    run(command, &format!("grpcurl {}", args.join(" ")), CALL_TIMEOUT)
}

/// Asserts success and returns the output.
fn grpcurl_ok(server: &Server, data: Option<&str>, args: &[&str]) -> Output {
    let output = grpcurl(server, data, args);
    assert!(
        output.status.success(),
        "grpcurl {args:?} failed:\n{}",
        output.describe()
    );
    output
}

/// Protobuf JSON writes 64-bit integers as strings and 32-bit ones as numbers.
fn int(value: &Value) -> i64 {
    match value {
        Value::Number(n) => n.as_i64().unwrap_or_else(|| panic!("not an integer: {value}")),
        Value::String(s) => s.parse().unwrap_or_else(|_| panic!("not an integer: {value}")),
        _ => panic!("not an integer: {value}"),
    }
}

fn array(value: &Value) -> &Vec<Value> {
    value
        .as_array()
        .unwrap_or_else(|| panic!("not an array: {value}"))
}

/// Standard base64, as protobuf JSON encodes `bytes`.
fn base64(bytes: &[u8]) -> String {
    const ALPHABET: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut out = String::new();
    for chunk in bytes.chunks(3) {
        let n = chunk.iter().fold(0u32, |acc, &b| acc << 8 | u32::from(b)) << (8 * (3 - chunk.len()));
        for i in 0..4 {
            if i <= chunk.len() {
                out.push(ALPHABET[(n >> (18 - 6 * i) & 63) as usize] as char);
            } else {
                out.push('=');
            }
        }
    }
    out
}

const PRODUCE: &str = "taskstream.v1.StreamsService/Produce";
const METADATA: &str = "taskstream.v1.StreamsService/ProcessMetadataForStore";
const STREAM: &str = "taskstream.v1.StreamsService/GetMetadataAsync";
const DESCRIBE: &str = "taskstream.v1.AdminService/DescribeRuntime";
const READ_TOPIC: &str = "taskstream.v1.StreamsService/ReadTopic";

/// Produces `keyed` records over ten keys, two without a key and one sent to
/// partition 7 explicitly; returns per partition the (offset, base64 key)
/// pairs the server answered, in offset order.
fn produce(server: &Server, keyed: usize) -> BTreeMap<u32, Vec<(i64, Option<String>)>> {
    let mut records: Vec<(Option<String>, Value)> = (0..keyed)
        .map(|i| {
            let key = base64(format!("user-{}", i % 10).as_bytes());
            let value = base64(i.to_string().as_bytes());
            (Some(key.clone()), serde_json::json!({"key": key, "value": value}))
        })
        .collect();
    records.push((None, serde_json::json!({"value": base64(b"no key 1")})));
    records.push((None, serde_json::json!({"value": base64(b"no key 2")})));
    records.push((
        None,
        serde_json::json!({"value": base64(b"to 7"), "partition": 7}),
    ));
    let request = serde_json::json!({
        "topic": "events",
        "records": records.iter().map(|(_, r)| r.clone()).collect::<Vec<_>>(),
    });
    let response = grpcurl_ok(server, Some(&request.to_string()), &[PRODUCE]).message();

    assert_eq!(response["topic"], "events", "{response:#}");
    assert_eq!(
        int(&response["recordCount"]),
        records.len() as i64,
        "{response:#}"
    );
    let positions = array(&response["positions"]);
    assert_eq!(
        positions.len(),
        records.len(),
        "one position per record, in request order"
    );
    let mut produced: BTreeMap<u32, Vec<(i64, Option<String>)>> = BTreeMap::new();
    for ((key, _), position) in records.iter().zip(positions) {
        let partition = int(&position["partition"]) as u32;
        assert!(partition < 8, "partition {partition} out of the topic's 8");
        produced
            .entry(partition)
            .or_default()
            .push((int(&position["offset"]), key.clone()));
    }
    assert_eq!(
        produced[&7].last().map(|(_, key)| key.is_none()),
        Some(true),
        "the record sent to partition 7 explicitly landed there: {response:#}"
    );
    // A fresh topic: each partition's offsets are 0, 1, 2, … in request order.
    for (partition, records) in &produced {
        let offsets: Vec<i64> = records.iter().map(|(offset, _)| *offset).collect();
        let expected: Vec<i64> = (0..offsets.len() as i64).collect();
        assert_eq!(offsets, expected, "offsets of partition {partition}");
    }
    produced
}

#[test]
fn reflection_lists_and_describes_every_service() {
    let server = Server::start("grpcurl-test");
    let list = grpcurl_ok(&server, None, &["list"]);
    let services: Vec<&str> = list.stdout.lines().map(str::trim).collect();
    for service in [
        "taskstream.v1.StreamsService",
        "taskstream.v1.AdminService",
        "grpc.health.v1.Health",
    ] {
        assert!(
            services.contains(&service),
            "`list` lacks {service}:\n{}",
            list.describe()
        );
    }

    let streams = grpcurl_ok(&server, None, &["list", "taskstream.v1.StreamsService"]);
    for method in [
        "ProcessMetadataForStore",
        "GetMetadataAsync",
        "Produce",
        "MetadataForKey",
        "Query",
        "ReadTopic",
    ] {
        let full = format!("taskstream.v1.StreamsService.{method}");
        assert!(
            streams.stdout.lines().any(|line| line.trim() == full),
            "StreamsService lacks {method}:\n{}",
            streams.describe()
        );
    }

    // The request field names scripts rely on, straight from the descriptors.
    let request = grpcurl_ok(
        &server,
        None,
        &["describe", "taskstream.v1.GetMetadataAsyncRequest"],
    );
    for field in ["string store = 1;", "bool in_order = 2;"] {
        assert!(
            request.stdout.contains(field),
            "no `{field}`:\n{}",
            request.describe()
        );
    }
    let health = grpcurl_ok(&server, None, &["describe", "grpc.health.v1.Health"]);
    assert!(health.stdout.contains("rpc Check"), "{}", health.describe());
    server.stop();
}

#[test]
fn health_check_is_serving() {
    let server = Server::start("grpcurl-test");
    let overall = grpcurl_ok(&server, None, &["grpc.health.v1.Health/Check"]).message();
    assert_eq!(overall["status"], "SERVING", "{overall:#}");
    let streams = grpcurl_ok(
        &server,
        Some(r#"{"service":"taskstream.v1.StreamsService"}"#),
        &["grpc.health.v1.Health/Check"],
    )
    .message();
    assert_eq!(streams["status"], "SERVING", "{streams:#}");
    server.stop();
}

#[test]
fn produce_metadata_and_bounded_stream() {
    let server = Server::start("grpcurl-test");
    let produced = produce(&server, 40);
    let total: usize = produced.values().map(Vec::len).sum();

    let response = grpcurl_ok(
        &server,
        Some(r#"{"store":"counts","in_order":true}"#),
        &[METADATA],
    )
    .message();
    assert_eq!(response["inOrder"], true, "{response:#}");
    assert_eq!(response["processingOrder"], "PROCESSING_ORDER_OFFSET");
    assert_eq!(response["threadsPerTask"], 2);
    let instances = array(&response["metadata"]);
    assert_eq!(instances.len(), 1, "one instance hosts the store: {response:#}");
    let instance = &instances[0];
    assert_eq!(instance["hostInfo"]["host"], "127.0.0.1", "{instance:#}");
    assert_eq!(int(&instance["hostInfo"]["port"]), i64::from(server.addr.port()));
    // As Kafka Streams' StreamsMetadata: every store the instance hosts.
    let stores = array(&instance["stateStoreNames"]);
    assert!(stores.contains(&Value::from("counts")), "{instance:#}");
    assert!(stores.contains(&Value::from("ukeys")), "{instance:#}");
    let partitions: Vec<i64> = array(&instance["topicPartitions"])
        .iter()
        .inspect(|tp| assert_eq!(tp["topic"], "events"))
        .map(|tp| int(&tp["partition"]))
        .collect();
    assert_eq!(partitions, (0..8).collect::<Vec<_>>());
    let tasks = array(&instance["tasks"]);
    assert_eq!(tasks.len(), 8, "one task per partition: {instance:#}");
    for task in tasks {
        let partition = int(&task["partition"]) as u32;
        assert_eq!(task["taskId"], format!("counts_{partition}"));
        assert_eq!(task["pipeline"], "counts");
        assert_eq!(task["processingOrder"], "PROCESSING_ORDER_OFFSET");
        assert_eq!(task["threadsPerTask"], 2);
        assert!(
            task["ownerThread"].as_str().is_some_and(|t| !t.is_empty()),
            "every task has an owner thread: {task:#}"
        );
        // The end offset is the log's, updated as soon as Produce answered.
        let expected = produced.get(&partition).map_or(0, Vec::len) as i64;
        assert_eq!(int(&task["endOffset"]), expected, "{task:#}");
    }

    // Bounded: from the oldest retained outcome to the end offsets at the time
    // of the request; grpcurl exits 0 only if the stream completes with OK.
    let stream = grpcurl_ok(
        &server,
        Some(
            r#"{"store":"counts","in_order":true,"start":"START_POSITION_EARLIEST","end":"END_POSITION_CURRENT"}"#,
        ),
        &[STREAM],
    );
    let mut seen: BTreeMap<u32, Vec<(i64, Option<String>)>> = BTreeMap::new();
    for message in stream.messages() {
        assert!(
            message.get("lagged").is_none(),
            "unexpected lag notice: {message:#}"
        );
        let batch = &message["batch"];
        let partition = int(&batch["partition"]) as u32;
        assert_eq!(batch["store"], "counts", "{batch:#}");
        assert_eq!(batch["topic"], "events", "{batch:#}");
        assert_eq!(batch["taskId"], format!("counts_{partition}"), "{batch:#}");
        assert!(
            batch["thread"].as_str().is_some_and(|t| !t.is_empty()),
            "{batch:#}"
        );
        let records = array(&batch["records"]);
        assert!(!records.is_empty(), "an empty batch: {batch:#}");
        assert_eq!(
            int(&batch["firstOffset"]),
            int(&records[0]["offset"]),
            "{batch:#}"
        );
        assert_eq!(
            int(&batch["lastOffset"]),
            int(&records[records.len() - 1]["offset"]),
            "{batch:#}"
        );
        for record in records {
            assert_eq!(record["outcome"], "RECORD_OUTCOME_PROCESSED", "{record:#}");
            assert_eq!(record["attempts"], 1, "{record:#}");
            let key = record.get("key").and_then(Value::as_str).map(str::to_owned);
            seen.entry(partition)
                .or_default()
                .push((int(&record["offset"]), key));
        }
    }
    // Arrival order per partition is offset order, every offset exactly once,
    // each with the key it was produced with.
    assert_eq!(
        seen,
        produced,
        "streamed records differ from produced ones:\n{}",
        stream.describe()
    );
    assert_eq!(seen.values().map(Vec::len).sum::<usize>(), total);

    // Once the bounded stream completed, every record is below the watermark.
    let after = grpcurl_ok(
        &server,
        Some(r#"{"store":"counts","in_order":true}"#),
        &[METADATA],
    )
    .message();
    for task in array(&after["metadata"][0]["tasks"]) {
        assert_eq!(int(&task["watermark"]), int(&task["endOffset"]), "{task:#}");
        assert_eq!(int(&task["lag"]), 0, "{task:#}");
    }
    server.stop();
}

#[test]
fn in_order_on_an_unordered_store_is_failed_precondition() {
    let server = Server::start("grpcurl-test");
    let refused = grpcurl(&server, Some(r#"{"store":"ukeys","in_order":true}"#), &[METADATA]);
    assert!(
        !refused.status.success(),
        "in_order on `ukeys` was granted:\n{}",
        refused.describe()
    );
    assert!(
        refused.stderr.contains("Code: FailedPrecondition"),
        "{}",
        refused.describe()
    );
    // The google.rpc detail names the violated precondition and the store.
    assert!(
        refused.stderr.contains("google.rpc.PreconditionFailure"),
        "{}",
        refused.describe()
    );
    assert!(
        refused.stderr.contains("PROCESSING_ORDER"),
        "{}",
        refused.describe()
    );

    let stream = grpcurl(
        &server,
        Some(r#"{"store":"ukeys","in_order":true,"end":"END_POSITION_CURRENT"}"#),
        &[STREAM],
    );
    assert!(!stream.status.success(), "{}", stream.describe());
    assert!(
        stream.stderr.contains("Code: FailedPrecondition"),
        "{}",
        stream.describe()
    );

    // Without in_order the same store answers, and says it is not ordered.
    let granted = grpcurl_ok(
        &server,
        Some(r#"{"store":"ukeys","in_order":false}"#),
        &[METADATA],
    )
    .message();
    assert_eq!(granted["inOrder"], false, "{granted:#}");
    assert_eq!(
        granted["processingOrder"], "PROCESSING_ORDER_UNORDERED",
        "{granted:#}"
    );

    let unknown = grpcurl(&server, Some(r#"{"store":"nope","in_order":true}"#), &[METADATA]);
    assert!(!unknown.status.success(), "{}", unknown.describe());
    assert!(
        unknown.stderr.contains("Code: NotFound"),
        "{}",
        unknown.describe()
    );
    server.stop();
}

#[test]
fn describe_runtime() {
    let server = Server::start("grpcurl-test");
    let runtime = grpcurl_ok(&server, None, &[DESCRIBE]).message();
    assert_eq!(runtime["applicationId"], "grpcurl-test", "{runtime:#}");
    assert_eq!(runtime["state"], "SERVICE_STATE_RUNNING", "{runtime:#}");
    assert_eq!(int(&runtime["hostInfo"]["port"]), i64::from(server.addr.port()));
    assert_eq!(runtime["numStreamThreads"], 4, "{runtime:#}");
    assert_eq!(array(&runtime["threads"]).len(), 4, "{runtime:#}");
    let pipelines: BTreeMap<&str, &Value> = array(&runtime["pipelines"])
        .iter()
        .map(|p| (p["name"].as_str().expect("pipeline name"), p))
        .collect();
    let counts = pipelines.get("counts").expect("pipeline `counts`");
    assert_eq!(counts["sourceTopic"], "events");
    assert_eq!(counts["partitions"], 8);
    assert_eq!(counts["processor"], "count");
    assert_eq!(counts["processingOrder"], "PROCESSING_ORDER_OFFSET");
    assert_eq!(counts["threadsPerTask"], 2);
    assert_eq!(counts["store"], "counts");
    let ukeys = pipelines.get("ukeys").expect("pipeline `ukeys`");
    assert_eq!(ukeys["processingOrder"], "PROCESSING_ORDER_UNORDERED");
    assert_eq!(ukeys["threadsPerTask"], 2);
    assert_eq!(array(&runtime["tasks"]).len(), 16, "8 partitions × 2 pipelines");
    server.stop();
}

#[test]
fn read_topic_returns_the_produced_records() {
    let server = Server::start("grpcurl-test");
    let produced = produce(&server, 20);
    let (&partition, expected) = produced
        .iter()
        .max_by_key(|(_, records)| records.len())
        .expect("something was produced");

    let request = serde_json::json!({"topic": "events", "partition": partition, "offset": 0});
    let response = grpcurl_ok(&server, Some(&request.to_string()), &[READ_TOPIC]).message();
    assert_eq!(response["topic"], "events", "{response:#}");
    assert_eq!(int(&response["partition"]), i64::from(partition), "{response:#}");
    assert_eq!(int(&response["startOffset"]), 0, "{response:#}");
    assert_eq!(int(&response["endOffset"]), expected.len() as i64, "{response:#}");
    let records: Vec<(i64, Option<String>)> = array(&response["records"])
        .iter()
        .inspect(|r| {
            assert_eq!(int(&r["partition"]), i64::from(partition), "{r:#}");
            assert!(int(&r["timestampMs"]) > 0, "{r:#}");
            assert!(r["value"].as_str().is_some_and(|v| !v.is_empty()), "{r:#}");
        })
        .map(|r| {
            (
                int(&r["offset"]),
                r.get("key").and_then(Value::as_str).map(str::to_owned),
            )
        })
        .collect();
    assert_eq!(&records, expected, "records read differ from those produced");

    let unknown = grpcurl(&server, Some(r#"{"topic":"nope"}"#), &[READ_TOPIC]);
    assert!(!unknown.status.success(), "{}", unknown.describe());
    assert!(
        unknown.stderr.contains("Code: NotFound"),
        "{}",
        unknown.describe()
    );
    server.stop();
}
