//! `taskstream produce`: records from arguments (one Produce call) or from
//! stdin lines (ProduceStream in batches of 1,000, read on a plain thread so
//! a slow server pushes back on the reader), with a progress bar on stderr.

use std::{
    io::{self, BufRead, IsTerminal, Write},
    time::{Duration, Instant},
};

use bytes::Bytes;
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
    let mut progress = Progress::new(input.progress, stdin_len());
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

/// A text progress bar on stderr, shown once the input passed 10,000 lines.
/// On a terminal it redraws one line; otherwise (a log) it writes a line per second.
struct Progress {
    enabled: bool,
    tty: bool,
    total_bytes: Option<u64>,
    started: Instant,
    last_draw: Option<Instant>,
}

impl Progress {
    fn new(enabled: bool, total_bytes: Option<u64>) -> Self {
        Progress {
            enabled,
            tty: io::stderr().is_terminal(),
            total_bytes: total_bytes.filter(|&n| n > 0),
            started: Instant::now(),
            last_draw: None,
        }
    }

    fn update(&mut self, records: u64, bytes: u64) {
        if !self.enabled || records <= PROGRESS_AFTER_LINES {
            return;
        }
        let every = if self.tty {
            Duration::from_millis(100)
        } else {
            Duration::from_secs(1)
        };
        if self.last_draw.is_some_and(|at| at.elapsed() < every) {
            return;
        }
        self.last_draw = Some(Instant::now());
        self.draw(records, bytes, false);
    }

    fn finish(&mut self, records: u64, bytes: u64) {
        // Only close a bar that was started: small inputs stay quiet.
        if self.enabled && self.last_draw.is_some() {
            self.draw(records, bytes, true);
        }
    }

    fn draw(&self, records: u64, bytes: u64, done: bool) {
        let line = progress_line(records, bytes, self.total_bytes, self.started.elapsed(), done);
        let mut stderr = io::stderr().lock();
        // Progress is a courtesy: a closed stderr must not stop the produce.
        let _ = if self.tty {
            write!(stderr, "\r{line}\x1b[K{}", if done { "\n" } else { "" })
        } else {
            writeln!(stderr, "{line}")
        };
        let _ = stderr.flush();
    }
}

/// `[########            ]  40%  120,000 records  50,000 rec/s` (the bar only with a known total).
fn progress_line(
    records: u64,
    bytes: u64,
    total_bytes: Option<u64>,
    elapsed: Duration,
    done: bool,
) -> String {
    const WIDTH: u64 = 30;
    let rate = records as f64 / elapsed.as_secs_f64().max(0.001);
    let counts = format!("{} records  {} rec/s", thousands(records), thousands(rate as u64));
    let bar = match total_bytes {
        Some(total) => {
            let percent = if done {
                100
            } else {
                (bytes.min(total) * 100 / total).min(99)
            };
            let filled = percent * WIDTH / 100;
            format!(
                "[{}{}] {percent:>3}%  ",
                "#".repeat(filled as usize),
                " ".repeat((WIDTH - filled) as usize)
            )
        }
        None => String::new(),
    };
    let state = if done { "read" } else { "reading" };
    format!("{bar}{state} {counts}")
}

/// 1234567 → "1,234,567".
pub fn thousands(n: u64) -> String {
    let digits = n.to_string();
    let mut out = String::with_capacity(digits.len() + digits.len() / 3);
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    out
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
    fn thousands_separators() {
        assert_eq!(thousands(0), "0");
        assert_eq!(thousands(999), "999");
        assert_eq!(thousands(1_000), "1,000");
        assert_eq!(thousands(1_234_567), "1,234,567");
    }

    #[test]
    fn progress_lines() {
        let line = progress_line(50_000, 500, Some(1_000), Duration::from_secs(2), false);
        assert_eq!(
            line,
            format!(
                "[{}{}]  50%  reading 50,000 records  25,000 rec/s",
                "#".repeat(15),
                " ".repeat(15)
            )
        );
        let done = progress_line(100_000, 1_000, Some(1_000), Duration::from_secs(2), true);
        assert!(
            done.starts_with(&format!("[{}] 100%  read 100,000", "#".repeat(30))),
            "{done}"
        );
        let unknown = progress_line(20_000, 0, None, Duration::from_secs(1), false);
        assert_eq!(unknown, "reading 20,000 records  20,000 rec/s");
    }
}
