//! `taskstream produce`: records from arguments (one Produce call) or from
//! stdin lines (ProduceStream in batches of 1,000, read on a plain thread so
//! a slow server pushes back on the reader), with a progress bar on stderr.

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
    let (tx, mut rx) = mpsc::channel::<Vec<v1::ProducerRecord>>(QUEUED_BATCHES);
    let partition = input.partition;
    let reader = std::thread::spawn(move || -> io::Result<u64> {
        let mut lines = io::stdin().lock();
        let mut line = Vec::new();
        let (mut records, mut bytes) = (0u64, 0u64);
        let mut batch = Vec::with_capacity(BATCH_RECORDS);
        loop {
            line.clear();
            let read = lines.read_until(b'\n', &mut line)?;
            if read == 0 {
                break;
            }
            bytes += read as u64;
            let Some(record) = parse_line(&line, key.as_ref(), partition) else {
                continue;
            };
            batch.push(record);
            records += 1;
            if batch.len() == BATCH_RECORDS {
                // A closed channel means the stream failed; the error is reported there.
                if tx
                    .blocking_send(std::mem::replace(&mut batch, Vec::with_capacity(BATCH_RECORDS)))
                    .is_err()
                {
                    return Ok(records);
                }
                progress.update(records, bytes);
            }
        }
        if !batch.is_empty() && tx.blocking_send(batch).is_err() {
            return Ok(records);
        }
        progress.finish(records, bytes);
        Ok(records)
    });

    let Some(first) = rx.recv().await else {
        // The reader ended without a record: empty input, or a read error.
        let read = reader
            .join()
            .map_err(|_| anyhow::anyhow!("the stdin reader panicked"))?;
        read.map_err(|e| anyhow::anyhow!("reading stdin: {e}"))?;
        return Ok(None);
    };
    let batches = tokio_stream::once(first).chain(ReceiverStream::new(rx));
    let response = client.produce_stream(&input.topic, batches).await;
    // Don't wait for the reader when the stream failed: it may sit in a read
    // of an interactive stdin. Exiting the process ends it.
    let response = response?;
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
