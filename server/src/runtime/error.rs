//! `RuntimeError`: every way a call into the runtime can fail, in the terms a
//! caller can act on. The gRPC service maps it to status codes in one place.

use crate::config::{ConfigError, ProcessingOrder};
use crate::log::LogError;
use crate::metadata::HostInfo;
use std::borrow::Cow;
use std::time::Duration;

/// Most bytes of client input an error message or detail repeats back: a 1 MB name must
/// not come back as 1 MB of `grpc-message` (stock grpcio clients refuse metadata over 16 KiB).
pub const MAX_ECHO_BYTES: usize = 256;

/// What an error may repeat of client input: `text` itself when it fits in
/// [`MAX_ECHO_BYTES`], else its first bytes (cut at a character boundary) and `…`,
/// at most `MAX_ECHO_BYTES` in all.
pub fn echo(text: &str) -> Cow<'_, str> {
    echo_up_to(text, MAX_ECHO_BYTES)
}

/// [`echo`] with another bound, for sentences that already hold echoes.
pub fn echo_up_to(text: &str, max_bytes: usize) -> Cow<'_, str> {
    if text.len() <= max_bytes {
        return Cow::Borrowed(text);
    }
    const ELLIPSIS: &str = "…";
    let mut end = max_bytes.saturating_sub(ELLIPSIS.len());
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    Cow::Owned(format!("{}{ELLIPSIS}", &text[..end]))
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RuntimeError {
    /// A configuration value is invalid (at start, or a runtime change such as
    /// removing a thread would make it invalid).
    #[error(transparent)]
    InvalidConfig(#[from] ConfigError),

    /// A request argument is malformed: empty name, bad offsets or bounds.
    #[error("invalid {field}: {message}")]
    InvalidArgument { field: String, message: String },

    /// Offset order was asked of a store whose tasks cannot guarantee it.
    #[error(
        "store `{store}` runs in `{processing_order}` order with {threads_per_task} threads per task, \
         so results are not in offset order; ask without in_order, or run the pipeline with \
         processing_order = \"offset\" or num_threads_per_task = 1"
    )]
    OrderNotGuaranteed {
        store: String,
        processing_order: ProcessingOrder,
        threads_per_task: u32,
    },

    #[error("unknown store `{0}`")]
    UnknownStore(String),

    #[error("unknown topic `{0}`")]
    UnknownTopic(String),

    /// The partition's task is not on this instance (never assigned here,
    /// or moved away); another instance of the application holds it:
    /// `owner`, when this instance knows it (Kafka mode).
    #[error(
        "partition {partition} of store `{store}` is not hosted by this instance{}",
        owner.as_ref().map(|o| format!("; {o} holds it")).unwrap_or_default()
    )]
    NotHosted {
        store: String,
        partition: u32,
        owner: Option<HostInfo>,
    },

    /// The last commit of these tasks failed (task id: error): what they
    /// processed since their previous commit runs again after a restart.
    #[error("commits failed: {}", .0.join("; "))]
    CommitFailed(Vec<String>),

    /// Temporarily unable to answer (starting, restoring, shutting down); retry after the delay.
    #[error("unavailable: {reason}")]
    Unavailable { reason: String, retry_after: Duration },

    /// A stream asked to start before what the server still retains.
    #[error("offset {requested} of partition {partition} is no longer retained; the earliest is {earliest}")]
    OffsetOutOfRange {
        partition: u32,
        requested: u64,
        earliest: u64,
    },

    /// A stream asked to start past the end of a partition: no record there
    /// exists yet, and none may ever (answered OUT_OF_RANGE, like a start
    /// before what is retained).
    #[error(
        "start offset {requested} of partition {partition} is past its end offset {end}; \
         start at or before {end}"
    )]
    OffsetPastEnd {
        partition: u32,
        requested: u64,
        end: u64,
    },

    /// The data dir cannot be read or written (corrupt, unreadable, full).
    /// At start this stops the server (exit code 2); it is never reset silently.
    #[error("data file {path}: {message}")]
    Storage { path: String, message: String },

    /// Anything unexpected; the message is for logs, not for clients.
    #[error("internal error: {0}")]
    Internal(String),

    /// A request goes over a bound the server keeps on what a client controls (a size or
    /// a count); `setting` raises it. Answered RESOURCE_EXHAUSTED, reason LIMIT_EXCEEDED.
    #[error("{message} (limit {limit}, setting `{setting}`)")]
    LimitExceeded {
        setting: String,
        limit: u64,
        message: String,
    },
}

impl RuntimeError {
    pub fn invalid_argument(field: impl Into<String>, message: impl Into<String>) -> Self {
        RuntimeError::InvalidArgument {
            field: field.into(),
            message: message.into(),
        }
    }

    pub fn limit_exceeded(setting: impl Into<String>, limit: u64, message: impl Into<String>) -> Self {
        RuntimeError::LimitExceeded {
            setting: setting.into(),
            limit,
            message: message.into(),
        }
    }

    /// Partitions without a known owner: the group is moving them.
    pub fn partitions_moving(store: &str, partitions: &[u32]) -> Self {
        RuntimeError::Unavailable {
            reason: format!(
                "partitions {partitions:?} of store `{store}` are moving between instances (the group is rebalancing)"
            ),
            retry_after: Duration::from_millis(500),
        }
    }

    pub fn shutting_down() -> Self {
        RuntimeError::Unavailable {
            reason: "the instance is shutting down".to_string(),
            retry_after: Duration::from_secs(1),
        }
    }
}

impl From<LogError> for RuntimeError {
    fn from(error: LogError) -> Self {
        match error {
            LogError::UnknownTopic(topic) => RuntimeError::UnknownTopic(topic),
            LogError::UnknownPartition { .. } => {
                RuntimeError::invalid_argument("partition", error.to_string())
            }
            LogError::PartitionCountMismatch { .. } => RuntimeError::Internal(error.to_string()),
            LogError::OffsetOutOfRange {
                partition,
                requested,
                earliest,
                ..
            } => RuntimeError::OffsetOutOfRange {
                partition,
                requested,
                earliest,
            },
            LogError::Unavailable(reason) => RuntimeError::Unavailable {
                reason,
                retry_after: Duration::from_millis(500),
            },
            LogError::Storage { path, message } => RuntimeError::Storage { path, message },
            LogError::Rejected { .. } => RuntimeError::invalid_argument("records", error.to_string()),
            LogError::TransactionAborted { .. } => RuntimeError::Unavailable {
                reason: error.to_string(),
                retry_after: Duration::from_millis(500),
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn echo_keeps_short_text_and_cuts_long_text_at_a_char_boundary() {
        assert_eq!(echo("counts"), "counts");
        let exact = "x".repeat(MAX_ECHO_BYTES);
        assert_eq!(echo(&exact), exact.as_str());
        let cut = echo(&"y".repeat(1 << 20)).into_owned();
        assert!(cut.len() <= MAX_ECHO_BYTES, "{}", cut.len());
        assert!(cut.ends_with('…') && cut.starts_with("yyy"), "{cut}");
        // Multi-byte characters are never split.
        let cut = echo(&"é".repeat(500)).into_owned();
        assert!(cut.len() <= MAX_ECHO_BYTES && cut.ends_with('…'));
        assert!(cut.trim_end_matches('…').chars().all(|c| c == 'é'));
    }
}
