//! Typed errors of the client, mapped back from gRPC status codes.
//!
//! The server turns every runtime error into a `tonic::Status` with google.rpc
//! details (DESIGN.md, "Errors are status codes"); [`ClientError::from_status`]
//! is the one place that reverses that mapping, details included.

use std::{error::Error as StdError, time::Duration};

use tonic::{Code, Status};
use tonic_types::StatusExt;

/// ErrorInfo reason of a stream ended because its subscriber was too slow.
pub const REASON_SUBSCRIBER_LAGGED: &str = "SUBSCRIBER_LAGGED";
/// ErrorInfo reason of a request over one of the server's limits.
pub const REASON_LIMIT_EXCEEDED: &str = "LIMIT_EXCEEDED";
/// ErrorInfo reason of PERMISSION_DENIED; metadata `role` names the role needed.
pub const REASON_ROLE_REQUIRED: &str = "ROLE_REQUIRED";

/// One violated precondition (google.rpc.PreconditionFailure.Violation).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PreconditionViolation {
    /// The kind of precondition, as the server names it (e.g. `PROCESSING_ORDER`).
    pub kind: String,
    /// What the precondition is about (e.g. the store name).
    pub subject: String,
    /// How it failed.
    pub description: String,
}

/// One bad request field (google.rpc.BadRequest.FieldViolation).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FieldViolation {
    /// The request field, e.g. `store` or `start_offsets`.
    pub field: String,
    /// Why its value was refused.
    pub description: String,
}

/// An error of a taskstream call.
///
/// Each variant stands for one gRPC status code (see [`ClientError::from_status`]),
/// except `Lagged`, which is also produced by the in-band notice of a
/// `GetMetadataAsync` stream, and `Transport`, which covers failures to reach
/// the server at all.
///
/// | variant | status code | [`exit_code`](ClientError::exit_code) |
/// |---|---|---|
/// | `IllegalArgument` | INVALID_ARGUMENT | 2 |
/// | `UnknownStore` | NOT_FOUND | 3 |
/// | `IllegalState` | FAILED_PRECONDITION | 4 |
/// | `NotHosted` | FAILED_PRECONDITION with ErrorInfo reason `PARTITION_NOT_HOSTED` | 4 |
/// | `NotAvailable` | UNAVAILABLE (from the server) | 5 |
/// | `OutOfRange` | OUT_OF_RANGE | 6 |
/// | `Lagged` | RESOURCE_EXHAUSTED with ErrorInfo reason `SUBSCRIBER_LAGGED`, or the in-band `Lagged` notice | 7 |
/// | `LaggedOffsets` | in-band, from a followed partition whose new owner lacks some offsets' outcomes | 7 |
/// | `Transport` | connect failures; UNKNOWN, CANCELLED; UNAVAILABLE raised by the transport | 8 |
/// | `LimitExceeded` | any other RESOURCE_EXHAUSTED (reason `LIMIT_EXCEEDED`: a size or count over a limit) | 9 |
/// | `Unauthenticated` | UNAUTHENTICATED: no bearer token, or one the server does not know | 10 |
/// | `PermissionDenied` | PERMISSION_DENIED: the token's role is below the call's | 11 |
/// | `Other` | anything else (INTERNAL, …) | 1 |
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ClientError {
    /// The request is valid but the store cannot honour it in its current
    /// configuration, e.g. `in_order` on a store whose tasks run `key` or
    /// `unordered` order with several threads per task.
    #[error("{message}")]
    IllegalState {
        message: String,
        violations: Vec<PreconditionViolation>,
    },

    /// The partition asked for is held by another instance of the
    /// application (FAILED_PRECONDITION, ErrorInfo reason
    /// `PARTITION_NOT_HOSTED`): `owner` is its `host:port` when the server
    /// knows it (Kafka mode with `forward_queries = false`), so the call can
    /// be sent there.
    #[error("{message}")]
    NotHosted { message: String, owner: Option<String> },

    /// A malformed request: empty store name or key, bad offsets or bounds,
    /// or an admin change that would make the configuration invalid.
    #[error("{message}{}", describe_fields(message, field_violations))]
    IllegalArgument {
        message: String,
        field_violations: Vec<FieldViolation>,
    },

    /// The store (or topic) does not exist on the server.
    #[error("{message}")]
    UnknownStore { message: String },

    /// The instance is starting, rebalancing, restoring or shutting down; the
    /// call may succeed if retried after `retry_after` (from google.rpc.RetryInfo).
    #[error("{message}{}", describe_retry(retry_after))]
    NotAvailable {
        message: String,
        retry_after: Option<Duration>,
    },

    /// A start offset the server no longer retains.
    #[error("{message}")]
    OutOfRange { message: String },

    /// A metadata subscriber was too slow and the server dropped batches for
    /// it. `missed_batches` is 0 when the server ended the stream with
    /// RESOURCE_EXHAUSTED without saying how many.
    #[error("subscriber lagged behind: {missed_batches} batches missed")]
    Lagged { missed_batches: u64 },

    /// In-band, from a subscription that follows moved partitions
    /// ([`get_metadata_async_all`](crate::StreamsClient::get_metadata_async_all)):
    /// `partition` moved to an instance that no longer holds the outcomes of
    /// offsets `first_offset..=last_offset` (they were processed by the old
    /// owner, or evicted past `outcome_retention_records`), so they will not
    /// be delivered. The subscription goes on after it.
    #[error(
        "partition {partition} lagged across a move: outcomes of offsets \
         {first_offset}..={last_offset} are no longer held by any instance"
    )]
    LaggedOffsets {
        partition: u32,
        first_offset: i64,
        last_offset: i64,
    },

    /// The request went over a limit of the server (message size, records per Produce,
    /// key bytes, stream threads, subscribers, …): retrying it as it is fails again.
    /// `setting` and `limit` name the server setting that raises it, when the server said.
    #[error("{message}")]
    LimitExceeded {
        message: String,
        setting: Option<String>,
        limit: Option<u64>,
    },

    /// The server checks bearer tokens and the call carried none it knows
    /// (the builder's `token`, the CLI's `--token`).
    #[error("{message}")]
    Unauthenticated { message: String },

    /// The caller's role is below what the call needs; `role` is the role
    /// needed (`read`, `write` or `admin`), when the server said.
    #[error("{message}")]
    PermissionDenied { message: String, role: Option<String> },

    /// The server could not be reached, or the connection broke mid-call.
    /// The message starts with "transport error" or "cannot connect".
    #[error("{message}")]
    Transport { message: String },

    /// Any other status (INTERNAL, DEADLINE_EXCEEDED, …).
    #[error("{message} (status {code:?})")]
    Other { code: Code, message: String },
}

impl ClientError {
    /// Maps a status from the server (or from tonic's transport) to a typed error.
    pub fn from_status(status: &Status) -> Self {
        // Messages are for people; say at least what kind of failure it was.
        let message = match status.message() {
            "" => status.code().description().to_owned(),
            message => message.to_owned(),
        };
        // tonic reports "server unreachable" as UNAVAILABLE too; only the
        // source chain tells it apart from the server's own UNAVAILABLE.
        if is_transport_failure(status) {
            // The cause (a refused client certificate, a reset) is in the source chain.
            let chain = status.source().map(error_chain).unwrap_or_default();
            let cause = chain.strip_prefix("transport error: ").unwrap_or(&chain);
            let detail = if cause.is_empty() || message.contains(cause) {
                message
            } else if cause.starts_with(&message) {
                cause.to_owned()
            } else {
                format!("{message}: {cause}")
            };
            let message = match detail.starts_with("transport error") {
                true => detail,
                false => format!("transport error: {detail}"),
            };
            return ClientError::Transport { message };
        }
        match status.code() {
            Code::FailedPrecondition if let Some(owner) = not_hosted_owner(status) => {
                ClientError::NotHosted { message, owner }
            }
            Code::FailedPrecondition => ClientError::IllegalState {
                message,
                violations: status
                    .get_details_precondition_failure()
                    .map(|failure| {
                        failure
                            .violations
                            .into_iter()
                            .map(|v| PreconditionViolation {
                                kind: v.r#type,
                                subject: v.subject,
                                description: v.description,
                            })
                            .collect()
                    })
                    .unwrap_or_default(),
            },
            Code::InvalidArgument => ClientError::IllegalArgument {
                message,
                field_violations: status
                    .get_details_bad_request()
                    .map(|bad| {
                        bad.field_violations
                            .into_iter()
                            .map(|v| FieldViolation {
                                field: v.field,
                                description: v.description,
                            })
                            .collect()
                    })
                    .unwrap_or_default(),
            },
            Code::NotFound => ClientError::UnknownStore { message },
            Code::Unavailable => ClientError::NotAvailable {
                message,
                retry_after: status.get_details_retry_info().and_then(|info| info.retry_delay),
            },
            Code::OutOfRange => ClientError::OutOfRange { message },
            // Two meanings, told apart by the ErrorInfo reason.
            Code::ResourceExhausted => match status.get_details_error_info() {
                Some(info) if info.reason == REASON_SUBSCRIBER_LAGGED => ClientError::Lagged {
                    missed_batches: missed_batches(status),
                },
                info => ClientError::LimitExceeded {
                    message,
                    setting: info.as_ref().and_then(|i| i.metadata.get("setting").cloned()),
                    limit: info.and_then(|i| i.metadata.get("limit").and_then(|n| n.parse().ok())),
                },
            },
            Code::Unauthenticated => ClientError::Unauthenticated { message },
            Code::PermissionDenied => ClientError::PermissionDenied {
                message,
                role: status
                    .get_details_error_info()
                    .filter(|info| info.reason == REASON_ROLE_REQUIRED)
                    .and_then(|info| info.metadata.get("role").cloned()),
            },
            // What a dropped connection or a reset stream looks like to the client.
            Code::Unknown | Code::Cancelled => ClientError::Transport {
                message: format!("transport error: {message}"),
            },
            code => ClientError::Other { code, message },
        }
    }

    /// The process exit code the `taskstream` CLI uses for this error (table on [`ClientError`]).
    pub fn exit_code(&self) -> i32 {
        match self {
            ClientError::IllegalArgument { .. } => 2,
            ClientError::UnknownStore { .. } => 3,
            ClientError::IllegalState { .. } | ClientError::NotHosted { .. } => 4,
            ClientError::NotAvailable { .. } => 5,
            ClientError::OutOfRange { .. } => 6,
            ClientError::Lagged { .. } | ClientError::LaggedOffsets { .. } => 7,
            ClientError::Transport { .. } => 8,
            ClientError::LimitExceeded { .. } => 9,
            ClientError::Unauthenticated { .. } => 10,
            ClientError::PermissionDenied { .. } => 11,
            ClientError::Other { .. } => 1,
        }
    }

    /// True when the same call may succeed later: the instance was not
    /// available, or the connection failed.
    pub fn is_retryable(&self) -> bool {
        matches!(
            self,
            ClientError::NotAvailable { .. } | ClientError::Transport { .. }
        )
    }

    /// The delay the server asked for before a retry, if any.
    pub fn retry_after(&self) -> Option<Duration> {
        match self {
            ClientError::NotAvailable { retry_after, .. } => *retry_after,
            _ => None,
        }
    }

    /// A client-side argument error, shaped like the server's INVALID_ARGUMENT.
    pub(crate) fn illegal_argument(field: &str, description: impl Into<String>) -> Self {
        let description = description.into();
        ClientError::IllegalArgument {
            message: format!("{field}: {description}"),
            field_violations: vec![FieldViolation {
                field: field.to_owned(),
                description,
            }],
        }
    }
}

impl From<Status> for ClientError {
    fn from(status: Status) -> Self {
        ClientError::from_status(&status)
    }
}

impl From<tonic::transport::Error> for ClientError {
    fn from(error: tonic::transport::Error) -> Self {
        ClientError::Transport {
            message: error_chain(&error),
        }
    }
}

/// True when tonic produced the status itself because the connection could
/// not be made or broke (its source chain holds a connect or I/O error).
fn is_transport_failure(status: &Status) -> bool {
    let mut source = status.source();
    while let Some(error) = source {
        if error.is::<tonic::ConnectError>()
            || error.is::<tonic::transport::Error>()
            || error.is::<std::io::Error>()
        {
            return true;
        }
        source = error.source();
    }
    false
}

/// For a PARTITION_NOT_HOSTED ErrorInfo: `Some(owner)`, the owner being
/// its metadata `owner` when present; `None` for any other status.
fn not_hosted_owner(status: &Status) -> Option<Option<String>> {
    let info = status.get_details_error_info()?;
    (info.reason == "PARTITION_NOT_HOSTED").then(|| info.metadata.get("owner").cloned())
}

/// For OUT_OF_RANGE with ErrorInfo reason `OFFSET_OUT_OF_RANGE`: the
/// partition and the earliest offset the server still retains outcomes of.
pub(crate) fn out_of_range_earliest(status: &Status) -> Option<(u32, i64)> {
    if status.code() != Code::OutOfRange {
        return None;
    }
    let info = status.get_details_error_info()?;
    if info.reason != "OFFSET_OUT_OF_RANGE" {
        return None;
    }
    let partition = info.metadata.get("partition")?.parse().ok()?;
    let earliest = info.metadata.get("earliest")?.parse().ok()?;
    Some((partition, earliest))
}

/// RESOURCE_EXHAUSTED may carry the count in ErrorInfo metadata `missed_batches`.
fn missed_batches(status: &Status) -> u64 {
    status
        .get_details_error_info()
        .and_then(|info| info.metadata.get("missed_batches").and_then(|n| n.parse().ok()))
        .unwrap_or(0)
}

/// "a: b: c" from an error and its sources; transport errors hide the useful
/// part ("connection refused") in the source chain.
pub(crate) fn error_chain(error: &dyn StdError) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(inner) = source {
        let part = inner.to_string();
        if !text.contains(&part) {
            text.push_str(": ");
            text.push_str(&part);
        }
        source = inner.source();
    }
    text
}

/// The field violations the message does not already spell out.
fn describe_fields(message: &str, violations: &[FieldViolation]) -> String {
    let parts: Vec<String> = violations
        .iter()
        .filter(|v| !message.contains(&v.description))
        .map(|v| format!("{}: {}", v.field, v.description))
        .collect();
    if parts.is_empty() {
        String::new()
    } else {
        format!(" [{}]", parts.join("; "))
    }
}

fn describe_retry(retry_after: &Option<Duration>) -> String {
    match retry_after {
        Some(delay) => format!(" (retry after {} ms)", delay.as_millis()),
        None => String::new(),
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use tonic_types::ErrorDetails;

    use super::*;

    #[test]
    fn not_hosted_carries_the_owner() {
        let mut details = ErrorDetails::new();
        details.set_error_info(
            "PARTITION_NOT_HOSTED",
            "taskstream",
            std::collections::HashMap::from([("owner".to_string(), "10.0.0.2:50051".to_string())]),
        );
        let status = Status::with_error_details(Code::FailedPrecondition, "held elsewhere", details);
        let error = ClientError::from_status(&status);
        assert_eq!(
            error,
            ClientError::NotHosted {
                message: "held elsewhere".into(),
                owner: Some("10.0.0.2:50051".into()),
            }
        );
        assert_eq!(error.exit_code(), 4);
    }

    #[test]
    fn missing_tokens_and_low_roles_have_their_own_errors() {
        let error = ClientError::from_status(&Status::unauthenticated("send a bearer token"));
        assert_eq!(
            error,
            ClientError::Unauthenticated {
                message: "send a bearer token".into()
            }
        );
        assert_eq!(error.exit_code(), 10);

        let details = ErrorDetails::with_error_info(
            REASON_ROLE_REQUIRED,
            "taskstream",
            HashMap::from([("role".to_string(), "admin".to_string())]),
        );
        let status = Status::with_error_details(Code::PermissionDenied, "needs admin", details);
        let error = ClientError::from_status(&status);
        assert_eq!(
            error,
            ClientError::PermissionDenied {
                message: "needs admin".into(),
                role: Some("admin".into()),
            }
        );
        assert_eq!(error.exit_code(), 11);
    }

    #[test]
    fn failed_precondition_keeps_violations() {
        let status = Status::with_error_details(
            Code::FailedPrecondition,
            "store counts runs key order",
            ErrorDetails::with_precondition_failure(vec![tonic_types::PreconditionViolation::new(
                "PROCESSING_ORDER",
                "counts",
                "in_order needs offset order or one thread per task",
            )]),
        );
        let error = ClientError::from_status(&status);
        assert_eq!(
            error,
            ClientError::IllegalState {
                message: "store counts runs key order".into(),
                violations: vec![PreconditionViolation {
                    kind: "PROCESSING_ORDER".into(),
                    subject: "counts".into(),
                    description: "in_order needs offset order or one thread per task".into(),
                }],
            }
        );
        assert_eq!(error.exit_code(), 4);
        // The server's message says it all; the violations are for programs.
        assert_eq!(error.to_string(), "store counts runs key order");
    }

    #[test]
    fn invalid_argument_keeps_field_violations() {
        let mut details = ErrorDetails::new();
        details.set_bad_request(vec![
            tonic_types::FieldViolation::new("store", "must not be empty"),
            tonic_types::FieldViolation::new("end_offsets", "partition 9 does not exist"),
        ]);
        let status = Status::with_error_details(Code::InvalidArgument, "bad request", details);
        let error = ClientError::from_status(&status);
        let ClientError::IllegalArgument {
            message,
            field_violations,
        } = &error
        else {
            panic!("expected IllegalArgument, got {error:?}");
        };
        assert_eq!(message, "bad request");
        assert_eq!(
            field_violations,
            &vec![
                FieldViolation {
                    field: "store".into(),
                    description: "must not be empty".into()
                },
                FieldViolation {
                    field: "end_offsets".into(),
                    description: "partition 9 does not exist".into()
                },
            ]
        );
        assert_eq!(error.exit_code(), 2);
        assert_eq!(
            error.to_string(),
            "bad request [store: must not be empty; end_offsets: partition 9 does not exist]"
        );
        // Violations already in the message are not repeated.
        let status = Status::with_error_details(
            Code::InvalidArgument,
            "invalid store: must not be empty",
            ErrorDetails::with_bad_request_violation("store", "must not be empty"),
        );
        assert_eq!(
            ClientError::from_status(&status).to_string(),
            "invalid store: must not be empty"
        );
    }

    #[test]
    fn plain_statuses_without_details() {
        let error = ClientError::from_status(&Status::invalid_argument("no details"));
        assert_eq!(
            error,
            ClientError::IllegalArgument {
                message: "no details".into(),
                field_violations: vec![]
            }
        );
        let error = ClientError::from_status(&Status::failed_precondition("nope"));
        assert_eq!(
            error,
            ClientError::IllegalState {
                message: "nope".into(),
                violations: vec![]
            }
        );
    }

    #[test]
    fn not_found_is_unknown_store() {
        let error = ClientError::from_status(&Status::not_found("unknown store `nope`"));
        assert_eq!(
            error,
            ClientError::UnknownStore {
                message: "unknown store `nope`".into()
            }
        );
        assert_eq!(error.exit_code(), 3);
    }

    #[test]
    fn unavailable_carries_retry_delay() {
        let status = Status::with_error_details(
            Code::Unavailable,
            "rebalancing",
            ErrorDetails::with_retry_info(Some(Duration::from_millis(250))),
        );
        let error = ClientError::from_status(&status);
        assert_eq!(
            error,
            ClientError::NotAvailable {
                message: "rebalancing".into(),
                retry_after: Some(Duration::from_millis(250)),
            }
        );
        assert_eq!(error.retry_after(), Some(Duration::from_millis(250)));
        assert!(error.is_retryable());
        assert_eq!(error.exit_code(), 5);

        let without = ClientError::from_status(&Status::unavailable("shutting down"));
        assert_eq!(
            without,
            ClientError::NotAvailable {
                message: "shutting down".into(),
                retry_after: None
            }
        );
        // RetryInfo present but empty.
        let mut details = ErrorDetails::new();
        details.set_retry_info(None);
        let empty = ClientError::from_status(&Status::with_error_details(Code::Unavailable, "x", details));
        assert_eq!(empty.retry_after(), None);
    }

    #[test]
    fn unreachable_server_is_transport_not_unavailable() {
        // What tonic builds when the TCP connect fails.
        let connect = tonic::ConnectError(Box::new(std::io::Error::new(
            std::io::ErrorKind::ConnectionRefused,
            "connection refused",
        )));
        let status = Status::from_error(Box::new(connect));
        assert_eq!(status.code(), Code::Unavailable);
        let error = ClientError::from_status(&status);
        assert!(matches!(error, ClientError::Transport { .. }), "{error:?}");
        assert_eq!(error.exit_code(), 8);
    }

    #[test]
    fn out_of_range() {
        let error = ClientError::from_status(&Status::out_of_range("offset 3 no longer retained"));
        assert_eq!(
            error,
            ClientError::OutOfRange {
                message: "offset 3 no longer retained".into()
            }
        );
        assert_eq!(error.exit_code(), 6);
    }

    #[test]
    fn resource_exhausted_is_lagged_or_a_limit_by_its_reason() {
        let metadata = HashMap::from([("missed_batches".to_owned(), "12".to_owned())]);
        let mut details = ErrorDetails::new();
        details.set_error_info(REASON_SUBSCRIBER_LAGGED, "taskstream", metadata);
        let status = Status::with_error_details(Code::ResourceExhausted, "too slow", details);
        let error = ClientError::from_status(&status);
        assert_eq!(error, ClientError::Lagged { missed_batches: 12 });
        assert_eq!(error.exit_code(), 7);

        let metadata = HashMap::from([
            ("setting".to_owned(), "max_message_bytes".to_owned()),
            ("limit".to_owned(), "4194304".to_owned()),
        ]);
        let mut details = ErrorDetails::new();
        details.set_error_info(REASON_LIMIT_EXCEEDED, "taskstream", metadata);
        let status = Status::with_error_details(Code::ResourceExhausted, "too big", details);
        let error = ClientError::from_status(&status);
        assert_eq!(
            error,
            ClientError::LimitExceeded {
                message: "too big".into(),
                setting: Some("max_message_bytes".into()),
                limit: Some(4_194_304),
            }
        );
        assert_eq!(error.exit_code(), 9);

        // Without a reason (e.g. the client's own receive limit): a limit, not a lag.
        let error = ClientError::from_status(&Status::resource_exhausted("message too large"));
        assert!(
            matches!(error, ClientError::LimitExceeded { setting: None, .. }),
            "{error:?}"
        );
    }

    #[test]
    fn dropped_connection_is_transport() {
        for status in [
            Status::unknown("h2 protocol error"),
            Status::cancelled("stream reset"),
        ] {
            let error = ClientError::from_status(&status);
            assert!(matches!(error, ClientError::Transport { .. }), "{error:?}");
            assert_eq!(error.exit_code(), 8);
        }
    }

    #[test]
    fn everything_else_is_other() {
        let error = ClientError::from_status(&Status::internal("internal error"));
        assert_eq!(
            error,
            ClientError::Other {
                code: Code::Internal,
                message: "internal error".into()
            }
        );
        assert_eq!(error.exit_code(), 1);
        assert!(!error.is_retryable());
        assert_eq!(error.to_string(), "internal error (status Internal)");
        let empty = ClientError::from_status(&Status::new(Code::Aborted, ""));
        assert_eq!(
            empty,
            ClientError::Other {
                code: Code::Aborted,
                message: "The operation was aborted".into()
            }
        );
        let error = ClientError::from_status(&Status::deadline_exceeded("slow"));
        assert!(matches!(
            error,
            ClientError::Other {
                code: Code::DeadlineExceeded,
                ..
            }
        ));
    }

    #[test]
    fn status_conversion() {
        let error: ClientError = Status::not_found("x").into();
        assert!(matches!(error, ClientError::UnknownStore { .. }));
        // Details of another kind don't disturb the mapping.
        let status =
            Status::with_error_details(Code::FailedPrecondition, "m", ErrorDetails::with_retry_info(None));
        assert_eq!(
            ClientError::from_status(&status),
            ClientError::IllegalState {
                message: "m".into(),
                violations: vec![]
            }
        );
    }
}
