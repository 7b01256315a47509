//! `taskstream produce`: records from arguments (one Produce call) or from
//! stdin lines (ProduceStream calls of at most `CALL_BYTES`, in batches of
//! 1,000, read on a plain thread so a slow server pushes back on the reader),
//! with a progress bar on stderr. A failed call says which lines were written.

use std::io::{self, BufRead, IsTerminal};

use bytes::Bytes;
use indicatif::{HumanCount, ProgressBar, ProgressDrawTarget, ProgressStyle};
use taskstream_client::{StreamsClient, v1};
use tokio::sync::mpsc;
use tokio_stream::{StreamExt, wrappers::ReceiverStream};

/// Records per ProduceStream message.
pub const BATCH_RECORDS: usize = 1_000;
/// Inputs up to this many lines finish too fast to need a progress bar.
const PROGRESS_AFTER_LINES: u64 = 10_000;
/// Batches queued between the reader thread and the stream.
const QUEUED_BATCHES: usize = 8;
/// Keys and values per ProduceStream call. The embedded log holds a call until
/// it ends and then writes all of it or nothing, up to the server's
/// `max_produce_stream_bytes` (64 MiB by default): a quarter of that keeps
/// every call well inside it, and a failure loses at most one call's work.
pub const CALL_BYTES: u64 = 16 << 20;

/// A batch for the stream, the stdin line of its last record, and whether it
/// ends its ProduceStream call.
struct Batch {
    records: Vec<v1::ProducerRecord>,
    last_line: u64,
    ends_call: bool,
}

pub struct ProduceInput {
    pub topic: String,
    /// Every record gets this key (the whole line is then the value).
    pub key: Option<String>,
    pub partition: Option<u32>,
    pub values: Vec<String>,
    pub progress: bool,
}

/// What was produced; `Ok(None)` when stdin held no record.
pub async fn run(client: &StreamsClient, input: ProduceInput) -> anyhow::Result<Option<v1::ProduceResponse>> {
    let key = input.key.map(Bytes::from);
    if !input.values.is_empty() {
        let records = input
            .values
            .into_iter()
            .map(|v| record(key.clone(), Bytes::from(v), input.partition))
            .collect();
        return Ok(Some(client.produce(&input.topic, records).await?));
    }

    let stdin = io::stdin();
    if stdin.is_terminal() {
        eprintln!(
            "reading {} lines from stdin; end with Ctrl-D",
            if key.is_some() { "value" } else { "key:value" }
        );
    }
    let mut progress = Progress::new(input.progress, stdin_len(), ProgressDrawTarget::stderr());
    let (tx, mut rx) = mpsc::channel::<Batch>(QUEUED_BATCHES);
    let partition = input.partition;
    let reader = std::thread::spawn(move || -> io::Result<u64> {
        let mut lines = io::stdin().lock();
        let mut line = Vec::new();
        let (mut records, mut bytes, mut line_number, mut call_bytes) = (0u64, 0u64, 0u64, 0u64);
        let mut batch = Vec::with_capacity(BATCH_RECORDS);
        loop {
            line.clear();
            let read = lines.read_until(b'\n', &mut line)?;
            if read == 0 {
                break;
            }
            bytes += read as u64;
            line_number += 1;
            let Some(record) = parse_line(&line, key.as_ref(), partition) else {
                continue;
            };
            call_bytes += (record.key.as_ref().map_or(0, Bytes::len) + record.value.len()) as u64;
            batch.push(record);
            records += 1;
            let ends_call = call_bytes >= CALL_BYTES;
            if batch.len() == BATCH_RECORDS || ends_call {
                let full = Batch {
                    records: std::mem::replace(&mut batch, Vec::with_capacity(BATCH_RECORDS)),
                    last_line: line_number,
                    ends_call,
                };
                // A closed channel means the stream failed; the error is reported there.
                if tx.blocking_send(full).is_err() {
                    return Ok(records);
                }
                if ends_call {
                    call_bytes = 0;
                }
                progress.update(records, bytes);
            }
        }
        let last = Batch {
            records: batch,
            last_line: line_number,
            ends_call: true,
        };
        if !last.records.is_empty() && tx.blocking_send(last).is_err() {
            return Ok(records);
        }
        progress.finish(records, bytes);
        Ok(records)
    });

    let mut acknowledged: Option<v1::ProduceResponse> = None;
    let mut written_through_line = 0u64;
    while let Some(first) = rx.recv().await {
        let (response, last_line) = produce_call(client, &input.topic, first, &mut rx).await;
        let response = response.map_err(|error| {
            let error = anyhow::Error::from(error);
            match &acknowledged {
                None => error,
                Some(done) => error.context(format!(
                    "stdin lines 1-{written_through_line} ({} records) were written by earlier calls; \
                     the records from line {} on were not: resend those (`tail -n +{}`)",
                    done.record_count,
                    written_through_line + 1,
                    written_through_line + 1,
                )),
            }
        });
        // Don't wait for the reader when a call failed: it may sit in a read
        // of an interactive stdin. Exiting the process ends it.
        let response = response?;
        written_through_line = last_line;
        acknowledged = Some(match acknowledged.take() {
            None => response,
            Some(done) => merged(done, response),
        });
    }
    let Some(response) = acknowledged else {
        // The reader ended without a record: empty input, or a read error.
        let read = reader
            .join()
            .map_err(|_| anyhow::anyhow!("the stdin reader panicked"))?;
        read.map_err(|e| anyhow::anyhow!("reading stdin: {e}"))?;
        return Ok(None);
    };
    let read = reader
        .join()
        .map_err(|_| anyhow::anyhow!("the stdin reader panicked"))?;
    let records = read.map_err(|e| {
        anyhow::anyhow!(
            "reading stdin: {e} (the {} records read before were produced)",
            response.record_count
        )
    })?;
    if records != response.record_count {
        eprintln!(
            "warning: read {records} records but the server acknowledged {}",
            response.record_count
        );
    }
    Ok(Some(response))
}

/// One ProduceStream call: `first`, then batches from `rx` up to the one that
/// ends the call. Answers the call's result and the stdin line of its last record.
async fn produce_call(
    client: &StreamsClient,
    topic: &str,
    first: Batch,
    rx: &mut mpsc::Receiver<Batch>,
) -> (Result<v1::ProduceResponse, taskstream_client::ClientError>, u64) {
    let last_line = std::cell::Cell::new(first.last_line);
    let (call_tx, call_rx) = mpsc::channel::<Vec<v1::ProducerRecord>>(QUEUED_BATCHES);
    let ends_call = first.ends_call;
    let call = client.produce_stream(
        topic,
        tokio_stream::once(first.records).chain(ReceiverStream::new(call_rx)),
    );
    let forward = async {
        // Dropping the sender when done ends the call's stream.
        let call_tx = call_tx;
        if ends_call {
            return;
        }
        while let Some(batch) = rx.recv().await {
            last_line.set(batch.last_line);
            if call_tx.send(batch.records).await.is_err() || batch.ends_call {
                return;
            }
        }
    };
    tokio::pin!(call, forward);
    let mut forwarding = true;
    let response = loop {
        tokio::select! {
            response = &mut call => break response,
            () = &mut forward, if forwarding => forwarding = false,
        }
    };
    (response, last_line.get())
}

/// Two acknowledgements of one topic as one: counts added, ranges joined per partition.
fn merged(mut done: v1::ProduceResponse, next: v1::ProduceResponse) -> v1::ProduceResponse {
    done.record_count += next.record_count;
    for range in next.partitions {
        match done
            .partitions
            .iter_mut()
            .find(|r| r.partition == range.partition)
        {
            Some(known) => {
                known.first_offset = known.first_offset.min(range.first_offset);
                known.last_offset = known.last_offset.max(range.last_offset);
                known.count += range.count;
            }
            None => done.partitions.push(range),
        }
    }
    done.partitions.sort_by_key(|r| r.partition);
    done
}

fn record(key: Option<Bytes>, value: Bytes, partition: Option<u32>) -> v1::ProducerRecord {
    v1::ProducerRecord {
        key,
        value,
        partition,
        ..Default::default()
    }
}

/// One stdin line as a record. With a fixed key the whole line is the value;
/// otherwise `key:value` splits at the first ':', and a line without ':' (or
/// with an empty key) is a value without key. Empty lines are skipped.
pub fn parse_line(line: &[u8], key: Option<&Bytes>, partition: Option<u32>) -> Option<v1::ProducerRecord> {
    let line = line.strip_suffix(b"\n").unwrap_or(line);
    let line = line.strip_suffix(b"\r").unwrap_or(line);
    if line.is_empty() {
        return None;
    }
    if let Some(key) = key {
        return Some(record(Some(key.clone()), Bytes::copy_from_slice(line), partition));
    }
    Some(match line.iter().position(|&b| b == b':') {
        Some(0) => record(None, Bytes::copy_from_slice(&line[1..]), partition),
        Some(colon) => record(
            Some(Bytes::copy_from_slice(&line[..colon])),
            Bytes::copy_from_slice(&line[colon + 1..]),
            partition,
        ),
        None => record(None, Bytes::copy_from_slice(line), partition),
    })
}

/// The size of stdin when it is a regular file (`< file`), for a bar with a total.
fn stdin_len() -> Option<u64> {
    #[cfg(unix)]
    {
        use std::os::fd::AsFd;
        let fd = io::stdin().as_fd().try_clone_to_owned().ok()?;
        let metadata = std::fs::File::from(fd).metadata().ok()?;
        metadata.is_file().then_some(metadata.len())
    }
    #[cfg(not(unix))]
    None
}

/// A progress bar on stderr, shown once the input passed 10,000 lines. With
/// stdin a regular file it has a total (bytes read of the file's size);
/// otherwise it counts records. indicatif draws it: one redrawn line on a
/// terminal, nothing when stderr is not one, width and rate worked out.
struct Progress {
    enabled: bool,
    total_bytes: Option<u64>,
    target: Option<ProgressDrawTarget>,
    bar: Option<ProgressBar>,
}

impl Progress {
    fn new(enabled: bool, total_bytes: Option<u64>, target: ProgressDrawTarget) -> Self {
        Progress {
            enabled,
            total_bytes: total_bytes.filter(|&n| n > 0),
            target: Some(target),
            bar: None,
        }
    }

    fn update(&mut self, records: u64, bytes: u64) {
        if !self.enabled || records <= PROGRESS_AFTER_LINES {
            return;
        }
        let bar = match (&self.bar, self.target.take()) {
            (Some(bar), _) => bar,
            (None, target) => self.bar.insert(new_bar(
                self.total_bytes,
                target.unwrap_or_else(ProgressDrawTarget::hidden),
            )),
        };
        bar.set_position(if self.total_bytes.is_some() {
            bytes
        } else {
            records
        });
        bar.set_message(format!("{} records", HumanCount(records)));
    }

    fn finish(&mut self, records: u64, bytes: u64) {
        // Only close a bar that was started: small inputs stay quiet.
        if let Some(bar) = &self.bar {
            bar.set_position(if self.total_bytes.is_some() {
                bytes
            } else {
                records
            });
            bar.finish_with_message(format!("{} records read", HumanCount(records)));
        }
    }
}

/// `[#########           ]  45%  120,000 records  3.20 MiB/s  eta 4s` with a
/// known size, else `⠁ 120,000 records  52,110/s` (records per second).
fn new_bar(total_bytes: Option<u64>, target: ProgressDrawTarget) -> ProgressBar {
    let (bar, template) = match total_bytes {
        Some(total) => (
            ProgressBar::with_draw_target(Some(total), target),
            "[{bar:30}] {percent:>3}%  {msg}  {binary_bytes_per_sec}  eta {eta}",
        ),
        None => (
            ProgressBar::with_draw_target(None, target),
            "{spinner} {msg}  {per_sec:0}",
        ),
    };
    // The templates are constants; should one be refused, the default style still shows progress.
    let style = ProgressStyle::with_template(template)
        .map(|style| style.progress_chars("## "))
        .unwrap_or_else(|_| ProgressStyle::default_bar());
    bar.set_style(style);
    bar
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parsed(line: &str) -> (Option<String>, String) {
        let record = parse_line(line.as_bytes(), None, None).expect("a record");
        (
            record.key.map(|k| String::from_utf8_lossy(&k).into_owned()),
            String::from_utf8_lossy(&record.value).into_owned(),
        )
    }

    fn range(partition: u32, first_offset: i64, last_offset: i64) -> v1::PartitionRange {
        v1::PartitionRange {
            partition,
            first_offset,
            last_offset,
            count: (last_offset - first_offset + 1) as u64,
        }
    }

    #[test]
    fn acknowledgements_of_several_calls_merge_per_partition() {
        let first = v1::ProduceResponse {
            topic: "t".into(),
            record_count: 15,
            positions: Vec::new(),
            partitions: vec![range(1, 0, 9), range(0, 0, 4)],
        };
        let second = v1::ProduceResponse {
            topic: "t".into(),
            record_count: 7,
            positions: Vec::new(),
            partitions: vec![range(2, 0, 1), range(1, 10, 14)],
        };
        let merged = merged(first, second);
        assert_eq!(merged.record_count, 22);
        assert_eq!(
            merged.partitions,
            vec![range(0, 0, 4), range(1, 0, 14), range(2, 0, 1)]
        );
    }

    #[test]
    fn key_value_lines() {
        assert_eq!(parsed("user-1:click\n"), (Some("user-1".into()), "click".into()));
        assert_eq!(parsed("a:b:c\r\n"), (Some("a".into()), "b:c".into()));
        assert_eq!(parsed("no key here"), (None, "no key here".into()));
        assert_eq!(parsed(":empty key"), (None, "empty key".into()));
        assert_eq!(parsed("k:"), (Some("k".into()), String::new()));
        assert!(parse_line(b"\n", None, None).is_none());
        assert!(parse_line(b"\r\n", None, None).is_none());
    }

    #[test]
    fn fixed_key_keeps_the_whole_line() {
        let key = Bytes::from_static(b"K");
        let record = parse_line(b"a:b\n", Some(&key), Some(3)).expect("a record");
        assert_eq!(record.key, Some(key));
        assert_eq!(record.value, Bytes::from_static(b"a:b"));
        assert_eq!(record.partition, Some(3));
    }

    #[test]
    fn the_bar_starts_after_many_lines_and_ends_full() {
        let mut quiet = Progress::new(true, Some(1_000), ProgressDrawTarget::hidden());
        quiet.update(PROGRESS_AFTER_LINES, 100);
        quiet.finish(PROGRESS_AFTER_LINES, 1_000);
        assert!(quiet.bar.is_none(), "small inputs get no bar");

        let mut sized = Progress::new(true, Some(1_000), ProgressDrawTarget::hidden());
        sized.update(20_000, 400);
        let bar = sized.bar.clone().expect("a bar past 10,000 lines");
        assert_eq!((bar.position(), bar.length()), (400, Some(1_000)));
        assert_eq!(bar.message(), "20,000 records");
        sized.finish(50_000, 1_000);
        assert!(bar.is_finished());
        assert_eq!(bar.position(), 1_000);
        assert_eq!(bar.message(), "50,000 records read");

        let mut counted = Progress::new(true, None, ProgressDrawTarget::hidden());
        counted.update(30_000, 9_999);
        let bar = counted.bar.clone().expect("a bar past 10,000 lines");
        assert_eq!((bar.position(), bar.length()), (30_000, None));

        let mut off = Progress::new(false, None, ProgressDrawTarget::hidden());
        off.update(30_000, 0);
        assert!(off.bar.is_none(), "--no-progress");
    }
}
