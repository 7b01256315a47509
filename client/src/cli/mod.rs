//! Pieces of the `taskstream` CLI that are not argument parsing: output
//! (`json`, `render`), and the commands with moving parts (`produce` reads
//! stdin with a progress bar, `watch` drives a callback subscription, `read`
//! finds a topic's oldest retained offset).

pub mod json;
pub mod produce;
pub mod read;
pub mod render;
pub mod watch;

use std::io::{self, Write};

use bytes::Bytes;

/// Bytes as text: keys and values are usually UTF-8; anything else is shown lossy.
pub fn text(bytes: &Bytes) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

/// The short lowercase name of a proto enum value: `PROCESSING_ORDER_OFFSET` → `offset`.
pub fn enum_name(proto_name: &str) -> String {
    const PREFIXES: [&str; 5] = [
        "PROCESSING_ORDER_",
        "TASK_STATE_",
        "THREAD_STATE_",
        "SERVICE_STATE_",
        "RECORD_OUTCOME_",
    ];
    let short = PREFIXES
        .iter()
        .find_map(|p| proto_name.strip_prefix(p))
        .unwrap_or(proto_name);
    short.to_ascii_lowercase()
}

/// Writes to stdout and flushes, so that `watch` output reaches a pipe as it
/// happens. Errors (a closed pipe) go back to the caller, never a panic.
pub fn out(text: &str) -> io::Result<()> {
    let mut stdout = io::stdout().lock();
    stdout.write_all(text.as_bytes())?;
    stdout.flush()
}

/// One JSON document on one line.
pub fn out_json(value: &serde_json::Value) -> io::Result<()> {
    out(&format!("{value}\n"))
}

/// Pretty JSON for the one-shot commands (still one document).
pub fn out_json_pretty(value: &serde_json::Value) -> io::Result<()> {
    let text = serde_json::to_string_pretty(value).map_err(io::Error::other)?;
    out(&format!("{text}\n"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn enum_names() {
        assert_eq!(enum_name("PROCESSING_ORDER_OFFSET"), "offset");
        assert_eq!(enum_name("RECORD_OUTCOME_DEAD_LETTERED"), "dead_lettered");
        assert_eq!(enum_name("SERVICE_STATE_SHUTTING_DOWN"), "shutting_down");
        assert_eq!(enum_name("SOMETHING_ELSE"), "something_else");
    }

    #[test]
    fn text_is_lossy() {
        assert_eq!(text(&Bytes::from_static(b"ok")), "ok");
        assert_eq!(text(&Bytes::from_static(b"\xffx")), "\u{fffd}x");
    }
}
