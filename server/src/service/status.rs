//! The one place where errors become `tonic::Status`: every `RuntimeError`, the
//! service's own request validation (as `RuntimeError::InvalidArgument`) and a
//! subscriber dropped for being slow, and the outcome of a query forwarded to
//! another instance, each with the google.rpc details a client can act on
//! (BadRequest, PreconditionFailure, ResourceInfo, RetryInfo, ErrorInfo);
//! and the statuses tonic makes itself while reading a request (malformed protobuf,
//! a message over the size limit), restated in the API's terms ([`from_transport`]).
//! Whatever an answer repeats of client input is cut to `MAX_ECHO_BYTES`.

use crate::config::ConfigError;
use crate::runtime::{RuntimeError, echo, echo_up_to};
use std::collections::HashMap;
use tonic::{Code, Status};
use tonic_types::{ErrorDetails, StatusExt};

/// `ErrorInfo.domain` of every error detail this service attaches.
pub const ERROR_DOMAIN: &str = "taskstream";

/// `PreconditionViolation.type` when `in_order` is refused.
pub const PRECONDITION_PROCESSING_ORDER: &str = "PROCESSING_ORDER";

/// ErrorInfo reason: the partition asked for is held by another instance.
pub const REASON_NOT_HOSTED: &str = "PARTITION_NOT_HOSTED";
/// `ErrorInfo.metadata` key of `REASON_NOT_HOSTED`: the holder's `host:port`.
pub const METADATA_OWNER: &str = "owner";

/// `ErrorInfo.reason` of a stream ended because its subscriber fell behind
/// (RESOURCE_EXHAUSTED with `slow_subscriber = "fail"`).
pub const REASON_SUBSCRIBER_LAGGED: &str = "SUBSCRIBER_LAGGED";

/// `ErrorInfo.reason` of a request over a limit (RESOURCE_EXHAUSTED); the metadata
/// names the `setting` and its `limit`. Tells a limit apart from a slow subscriber.
pub const REASON_LIMIT_EXCEEDED: &str = "LIMIT_EXCEEDED";

/// The setting that bounds a request or response message.
pub const MESSAGE_SIZE_SETTING: &str = "max_message_bytes";

/// `ErrorInfo.reason` of PERMISSION_DENIED; metadata `role` is the role the call needs.
pub const REASON_ROLE_REQUIRED: &str = "ROLE_REQUIRED";

/// Longest server-written sentence in an answer (it may hold echoes, each cut already).
const MAX_SENTENCE_BYTES: usize = 1024;

/// When to try again after a forwarded query could not be answered.
const PEER_RETRY: std::time::Duration = std::time::Duration::from_millis(500);

/// `ErrorInfo.reason` of a stream that asked for offsets no longer retained.
pub const REASON_OFFSET_OUT_OF_RANGE: &str = "OFFSET_OUT_OF_RANGE";
/// ErrorInfo reason of a stream start past the end of its partition.
pub const REASON_OFFSET_PAST_END: &str = "OFFSET_PAST_END";

/// What a handler can fail with. Almost everything is a `RuntimeError`; the
/// one condition the runtime does not own is the slow-subscriber policy, which
/// the stream pump enforces.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ServiceError {
    #[error(transparent)]
    Runtime(#[from] RuntimeError),

    /// A query forwarded to the instance holding its partitions could not
    /// reach it (it stopped, or the network failed).
    #[error("cannot reach {host}, which holds the partitions asked for: {reason}")]
    PeerUnreachable { host: String, reason: String },

    /// The instance a query was forwarded to answered with an error: its
    /// code, message and details (the `grpc-status-details-bin` bytes).
    #[error("{host} answered: {message}")]
    Peer {
        host: String,
        code: Code,
        message: String,
        details: bytes::Bytes,
    },

    /// A GetMetadataAsync subscriber fell behind its bounded buffer while the
    /// server runs with `slow_subscriber = "fail"`.
    #[error(
        "the subscriber fell {missed_batches} batches behind the server's buffer of \
         {buffer_batches} batches (slow_subscriber = \"fail\"); read faster, or subscribe \
         again from the last offset received"
    )]
    SubscriberLagged {
        missed_batches: u64,
        buffer_batches: usize,
    },

    /// The server checks tokens and the call carried none it knows.
    #[error(
        "this server needs a bearer token: send `authorization: Bearer TOKEN` (the CLI's --token, \
         TASKSTREAM_TOKEN)"
    )]
    Unauthenticated,

    /// The caller's role is below what the call needs.
    #[error("permission denied: {what} needs the `{needed}` role")]
    PermissionDenied { needed: &'static str, what: String },
}

/// Maps an error to the status a client sees. Messages are meant for people;
/// the details are meant for programs (the Rust client maps them back).
pub fn to_status(error: impl Into<ServiceError>) -> Status {
    let error = bounded(error.into());
    let message = error.to_string();
    match &error {
        ServiceError::Runtime(RuntimeError::InvalidConfig(config)) => Status::with_error_details(
            Code::InvalidArgument,
            message,
            ErrorDetails::with_bad_request_violation(&config.setting, &config.message),
        ),
        ServiceError::Runtime(RuntimeError::InvalidArgument { field, message: why }) => {
            Status::with_error_details(
                Code::InvalidArgument,
                message,
                ErrorDetails::with_bad_request_violation(field, why),
            )
        }
        ServiceError::Runtime(RuntimeError::OrderNotGuaranteed {
            store,
            processing_order,
            threads_per_task,
        }) => Status::with_error_details(
            Code::FailedPrecondition,
            message,
            ErrorDetails::with_precondition_failure_violation(
                PRECONDITION_PROCESSING_ORDER,
                store,
                format!(
                    "in_order needs num_threads_per_task = 1 or processing_order = \"offset\"; \
                     the store runs processing_order = \"{processing_order}\" with \
                     num_threads_per_task = {threads_per_task}"
                ),
            ),
        ),
        ServiceError::Runtime(RuntimeError::UnknownStore(store)) => Status::with_error_details(
            Code::NotFound,
            message,
            ErrorDetails::with_resource_info("store", store, "", "no pipeline has this store"),
        ),
        ServiceError::Runtime(RuntimeError::UnknownTopic(topic)) => Status::with_error_details(
            Code::NotFound,
            message,
            ErrorDetails::with_resource_info("topic", topic, "", "no such topic in the log"),
        ),
        ServiceError::Runtime(RuntimeError::Unavailable { retry_after, .. }) => Status::with_error_details(
            Code::Unavailable,
            message,
            ErrorDetails::with_retry_info(Some(*retry_after)),
        ),
        ServiceError::Runtime(RuntimeError::OffsetOutOfRange {
            partition,
            requested,
            earliest,
        }) => Status::with_error_details(
            Code::OutOfRange,
            message,
            // The earliest retained offset lets a client retry from there
            // without parsing the message.
            ErrorDetails::with_error_info(
                REASON_OFFSET_OUT_OF_RANGE,
                ERROR_DOMAIN,
                HashMap::from([
                    ("partition".to_string(), partition.to_string()),
                    ("requested".to_string(), requested.to_string()),
                    ("earliest".to_string(), earliest.to_string()),
                ]),
            ),
        ),
        ServiceError::Runtime(RuntimeError::OffsetPastEnd {
            partition,
            requested,
            end,
        }) => Status::with_error_details(
            Code::OutOfRange,
            message,
            // The end offset lets a client start there without parsing the message.
            ErrorDetails::with_error_info(
                REASON_OFFSET_PAST_END,
                ERROR_DOMAIN,
                HashMap::from([
                    ("partition".to_string(), partition.to_string()),
                    ("requested".to_string(), requested.to_string()),
                    ("end".to_string(), end.to_string()),
                ]),
            ),
        ),
        ServiceError::Runtime(RuntimeError::NotHosted {
            store,
            partition,
            owner,
        }) => {
            let mut metadata = HashMap::from([
                ("store".to_string(), store.clone()),
                ("partition".to_string(), partition.to_string()),
            ]);
            // In Kafka mode: where a client routing itself sends the call.
            if let Some(owner) = owner {
                metadata.insert(METADATA_OWNER.to_string(), owner.to_string());
            }
            Status::with_error_details(
                Code::FailedPrecondition,
                message,
                ErrorDetails::with_error_info(REASON_NOT_HOSTED, ERROR_DOMAIN, metadata),
            )
        }
        ServiceError::PeerUnreachable { .. } => Status::with_error_details(
            Code::Unavailable,
            message,
            ErrorDetails::with_retry_info(Some(PEER_RETRY)),
        ),
        ServiceError::Peer { code, details, .. } => {
            let moved = Status::with_details(*code, message.clone(), details.clone())
                .get_details_error_info()
                .is_some_and(|info| info.reason == REASON_NOT_HOSTED);
            if moved {
                // The metadata topic named an instance that no longer holds
                // the partition: it is moving, ask again shortly.
                Status::with_error_details(
                    Code::Unavailable,
                    format!("{message}; the partition is moving between instances"),
                    ErrorDetails::with_retry_info(Some(PEER_RETRY)),
                )
            } else {
                // The owner's own answer (UNAVAILABLE while it restores,
                // NOT_FOUND, …), details included.
                Status::with_details(*code, message, details.clone())
            }
        }
        ServiceError::Runtime(RuntimeError::CommitFailed(failures)) => {
            // Task ids and storage errors are the server's business: logs only.
            tracing::error!(failures = ?failures, "commit failure answered as INTERNAL");
            Status::internal("commits failed; the server log has the details")
        }
        ServiceError::Runtime(RuntimeError::Internal(detail)) => {
            // The detail may name files, threads or states: logs only.
            tracing::error!(error = %detail, "internal error answered as INTERNAL");
            Status::internal("internal error; the server log has the details")
        }
        ServiceError::Runtime(RuntimeError::Storage {
            path,
            message: detail,
        }) => {
            // File paths are the server's business: logs only.
            tracing::error!(file = %path, error = %detail, "storage error answered as INTERNAL");
            Status::internal("storage error; the server log has the details")
        }
        ServiceError::Runtime(RuntimeError::LimitExceeded { setting, limit, .. }) => {
            Status::with_error_details(
                Code::ResourceExhausted,
                message,
                ErrorDetails::with_error_info(
                    REASON_LIMIT_EXCEEDED,
                    ERROR_DOMAIN,
                    HashMap::from([
                        ("setting".to_string(), setting.clone()),
                        ("limit".to_string(), limit.to_string()),
                    ]),
                ),
            )
        }
        ServiceError::Unauthenticated => Status::unauthenticated(message),
        ServiceError::PermissionDenied { needed, .. } => Status::with_error_details(
            Code::PermissionDenied,
            message,
            ErrorDetails::with_error_info(
                REASON_ROLE_REQUIRED,
                ERROR_DOMAIN,
                HashMap::from([("role".to_string(), (*needed).to_string())]),
            ),
        ),
        ServiceError::SubscriberLagged {
            missed_batches,
            buffer_batches,
        } => Status::with_error_details(
            Code::ResourceExhausted,
            message,
            ErrorDetails::with_error_info(
                REASON_SUBSCRIBER_LAGGED,
                ERROR_DOMAIN,
                HashMap::from([
                    ("missed_batches".to_string(), missed_batches.to_string()),
                    ("buffer_batches".to_string(), buffer_batches.to_string()),
                ]),
            ),
        ),
    }
}

/// `ErrorInfo.reason` of a failed ProduceStream that had appended batches before
/// the error (Kafka, which cannot take a stream back), when the error itself carries
/// no ErrorInfo; metadata `written_batches`, `written_records` are added either way.
pub const REASON_PARTLY_WRITTEN: &str = "PARTLY_WRITTEN";

/// `status` of a ProduceStream that appended its first `batches` batches (`records`
/// records) before failing: the message and ErrorInfo say so, so that a client resends
/// only from batch `batches` on. With nothing written it is `status` as it is.
pub fn partly_written(status: Status, batches: u64, records: u64) -> Status {
    if batches == 0 {
        return status;
    }
    let mut details = status.get_error_details();
    let counts = [
        ("written_batches".to_string(), batches.to_string()),
        ("written_records".to_string(), records.to_string()),
    ];
    let (reason, domain, mut metadata) = match details.error_info() {
        Some(info) => (info.reason.clone(), info.domain.clone(), info.metadata.clone()),
        None => (
            REASON_PARTLY_WRITTEN.to_string(),
            ERROR_DOMAIN.to_string(),
            HashMap::new(),
        ),
    };
    metadata.extend(counts);
    details.set_error_info(reason, domain, metadata);
    Status::with_error_details(
        status.code(),
        format!(
            "{}; the stream's first {batches} batches ({records} records) were written before \
             this error and stay written: resend from batch {batches} on",
            status.message()
        ),
        details,
    )
}

/// `error` with every string that may repeat client input cut to `MAX_ECHO_BYTES` (and the
/// server's sentences, which hold such echoes, to `MAX_SENTENCE_BYTES`), so that the message
/// and the details built from it stay small whatever the request held.
fn bounded(error: ServiceError) -> ServiceError {
    let name = |text: String| echo(&text).into_owned();
    let sentence = |text: String| echo_up_to(&text, MAX_SENTENCE_BYTES).into_owned();
    let error = match error {
        ServiceError::Runtime(error) => error,
        ServiceError::PermissionDenied { needed, what } => {
            return ServiceError::PermissionDenied {
                needed,
                what: sentence(what),
            };
        }
        other => return other,
    };
    ServiceError::Runtime(match error {
        RuntimeError::InvalidConfig(ConfigError { setting, message }) => {
            RuntimeError::InvalidConfig(ConfigError::new(name(setting), sentence(message)))
        }
        RuntimeError::InvalidArgument { field, message } => RuntimeError::InvalidArgument {
            field: name(field),
            message: sentence(message),
        },
        RuntimeError::OrderNotGuaranteed {
            store,
            processing_order,
            threads_per_task,
        } => RuntimeError::OrderNotGuaranteed {
            store: name(store),
            processing_order,
            threads_per_task,
        },
        RuntimeError::UnknownStore(store) => RuntimeError::UnknownStore(name(store)),
        RuntimeError::UnknownTopic(topic) => RuntimeError::UnknownTopic(name(topic)),
        RuntimeError::NotHosted {
            store,
            partition,
            owner,
        } => RuntimeError::NotHosted {
            store: name(store),
            partition,
            owner,
        },
        RuntimeError::Unavailable { reason, retry_after } => RuntimeError::Unavailable {
            reason: sentence(reason),
            retry_after,
        },
        RuntimeError::LimitExceeded {
            setting,
            limit,
            message,
        } => RuntimeError::LimitExceeded {
            setting,
            limit,
            message: sentence(message),
        },
        // Internal errors go to the log only; the rest carry no client text.
        other => other,
    })
}

/// What tonic answers by itself when a request cannot be read, before any handler runs
/// (malformed protobuf, an empty unary call, a bad message frame as INTERNAL; a message
/// over the size limit as OUT_OF_RANGE, which this API keeps for offsets), restated in the
/// API's terms: INVALID_ARGUMENT naming the field by its path in the request, or
/// RESOURCE_EXHAUSTED naming the limit. `None` for every other status, which stands.
pub fn from_transport(status: &Status) -> Option<Status> {
    let text = status.message();
    match status.code() {
        Code::Internal => {
            if let Some(decode) = text.strip_prefix("failed to decode Protobuf message: ") {
                let (field, problem) = decode_error(decode);
                return Some(to_status(RuntimeError::invalid_argument(field, problem)));
            }
            let problem = match text {
                "Missing request message." => "the call carried no request message; send exactly one",
                "Unexpected EOF decoding stream." => "the request ended inside a message",
                _ if text.starts_with("protocol error: received message with") => {
                    "a message frame has a compressed flag the call does not allow \
                     (0, or 1 with a grpc-encoding the server supports)"
                }
                _ => return None,
            };
            Some(to_status(RuntimeError::invalid_argument("request", problem)))
        }
        Code::OutOfRange => {
            let (direction, sizes) =
                if let Some(sizes) = text.strip_prefix("Error, decoded message length too large: ") {
                    ("request", sizes)
                } else if let Some(sizes) = text.strip_prefix("Error, encoded message length too large: ") {
                    ("response", sizes)
                } else {
                    return None;
                };
            // "found {len} bytes, the limit is: {limit} bytes"
            let numbers: Vec<u64> = sizes
                .split(|c: char| !c.is_ascii_digit())
                .filter_map(|n| n.parse().ok())
                .collect();
            let (found, limit) = match numbers.as_slice() {
                [found, limit] => (*found, *limit),
                _ => (0, 0),
            };
            let message = match direction {
                "request" => format!("the request message is {found} bytes, more than the server accepts"),
                _ => format!(
                    "the response would be {found} bytes, more than the server sends in one message; \
                     ask for less at once"
                ),
            };
            Some(to_status(RuntimeError::limit_exceeded(
                MESSAGE_SIZE_SETTING,
                limit,
                message,
            )))
        }
        _ => None,
    }
}

/// prost's "Msg.field: Outer.field: problem" (innermost first) as the field's path in the
/// request ("records.key") and the problem in protobuf's words, without Rust type names.
fn decode_error(text: &str) -> (String, String) {
    let is_ident = |s: &str| {
        s.chars().next().is_some_and(|c| c.is_ascii_alphabetic())
            && s.chars().all(|c| c.is_ascii_alphanumeric() || c == '_')
    };
    let mut fields = Vec::new();
    let mut rest = text;
    while let Some((segment, tail)) = rest.split_once(": ") {
        match segment.split_once('.') {
            Some((message, field)) if is_ident(message) && is_ident(field.trim_start_matches("r#")) => {
                fields.push(field.trim_start_matches("r#"));
                rest = tail;
            }
            _ => break,
        }
    }
    fields.reverse();
    let field = match fields.is_empty() {
        true => "request".to_string(),
        false => fields.join("."),
    };
    let problem = if rest.starts_with("invalid string value") {
        "is not valid UTF-8".to_string()
    } else if let Some(wire) = rest.strip_prefix("invalid wire type: ") {
        format!("has the wrong protobuf wire type ({})", echo(wire))
    } else if rest == "buffer underflow" {
        "is cut short: the message ends inside it".to_string()
    } else if rest == "invalid varint" {
        "holds an invalid varint".to_string()
    } else if rest == "delimited length exceeded" {
        "runs past the end of its enclosing message".to_string()
    } else if rest.starts_with("invalid tag value") || rest.starts_with("invalid key value") {
        "holds an invalid field tag".to_string()
    } else if rest.starts_with("recursion limit") {
        "is nested too deep".to_string()
    } else {
        format!("is not valid protobuf ({})", echo(rest))
    };
    (field, problem)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{ConfigError, ProcessingOrder};
    use std::time::Duration;

    #[test]
    fn invalid_config_is_invalid_argument_naming_the_setting() {
        let status = to_status(RuntimeError::InvalidConfig(ConfigError::new(
            "num_stream_threads",
            "must be at least 1",
        )));
        assert_eq!(status.code(), Code::InvalidArgument);
        assert!(status.message().contains("num_stream_threads"), "{status:?}");
        let bad = status.get_details_bad_request().expect("BadRequest detail");
        assert_eq!(bad.field_violations.len(), 1);
        assert_eq!(bad.field_violations[0].field, "num_stream_threads");
        assert_eq!(bad.field_violations[0].description, "must be at least 1");
    }

    #[test]
    fn a_partly_written_stream_says_how_much_was_written() {
        let limit = to_status(RuntimeError::limit_exceeded(
            "max_key_bytes",
            1024,
            "key too long",
        ));
        assert_eq!(partly_written(limit.clone(), 0, 0).message(), limit.message());

        let status = partly_written(limit, 2, 2000);
        assert_eq!(status.code(), Code::ResourceExhausted);
        assert!(status.message().contains("resend from batch 2"), "{status:?}");
        let info = status.get_details_error_info().expect("ErrorInfo");
        assert_eq!(info.reason, REASON_LIMIT_EXCEEDED, "the error's own reason stays");
        assert_eq!(info.metadata["setting"], "max_key_bytes");
        assert_eq!(info.metadata["written_batches"], "2");
        assert_eq!(info.metadata["written_records"], "2000");

        // An error without ErrorInfo of its own gets one.
        let status = partly_written(Status::cancelled("the client went away"), 1, 10);
        assert_eq!(status.code(), Code::Cancelled);
        let info = status.get_details_error_info().expect("ErrorInfo");
        assert_eq!(info.reason, REASON_PARTLY_WRITTEN);
        assert_eq!(info.metadata["written_batches"], "1");
    }

    #[test]
    fn invalid_argument_carries_a_field_violation() {
        let status = to_status(RuntimeError::invalid_argument("store", "must not be empty"));
        assert_eq!(status.code(), Code::InvalidArgument);
        assert_eq!(status.message(), "invalid store: must not be empty");
        let bad = status.get_details_bad_request().expect("BadRequest detail");
        assert_eq!(bad.field_violations[0].field, "store");
        assert_eq!(bad.field_violations[0].description, "must not be empty");
    }

    #[test]
    fn order_not_guaranteed_is_failed_precondition_on_the_store() {
        let status = to_status(RuntimeError::OrderNotGuaranteed {
            store: "counts".into(),
            processing_order: ProcessingOrder::Key,
            threads_per_task: 4,
        });
        assert_eq!(status.code(), Code::FailedPrecondition);
        assert!(status.message().contains("counts"), "{status:?}");
        let failure = status
            .get_details_precondition_failure()
            .expect("PreconditionFailure detail");
        assert_eq!(failure.violations.len(), 1);
        assert_eq!(failure.violations[0].r#type, "PROCESSING_ORDER");
        assert_eq!(failure.violations[0].subject, "counts");
        assert!(failure.violations[0].description.contains("\"key\""));
    }

    #[test]
    fn unknown_store_and_topic_are_not_found_with_the_resource() {
        let status = to_status(RuntimeError::UnknownStore("nope".into()));
        assert_eq!(status.code(), Code::NotFound);
        let resource = status.get_details_resource_info().expect("ResourceInfo detail");
        assert_eq!(
            (resource.resource_type.as_str(), resource.resource_name.as_str()),
            ("store", "nope")
        );

        let status = to_status(RuntimeError::UnknownTopic("missing".into()));
        assert_eq!(status.code(), Code::NotFound);
        let resource = status.get_details_resource_info().expect("ResourceInfo detail");
        assert_eq!(
            (resource.resource_type.as_str(), resource.resource_name.as_str()),
            ("topic", "missing")
        );
    }

    #[test]
    fn unavailable_carries_the_retry_delay() {
        let status = to_status(RuntimeError::Unavailable {
            reason: "restoring".into(),
            retry_after: Duration::from_millis(750),
        });
        assert_eq!(status.code(), Code::Unavailable);
        assert!(status.message().contains("restoring"));
        let retry = status.get_details_retry_info().expect("RetryInfo detail");
        assert_eq!(retry.retry_delay, Some(Duration::from_millis(750)));

        let status = to_status(RuntimeError::shutting_down());
        assert_eq!(status.code(), Code::Unavailable);
        assert!(status.get_details_retry_info().is_some());
    }

    #[test]
    fn offset_out_of_range_tells_the_earliest_offset() {
        let status = to_status(RuntimeError::OffsetOutOfRange {
            partition: 3,
            requested: 5,
            earliest: 100,
        });
        assert_eq!(status.code(), Code::OutOfRange);
        let info = status.get_details_error_info().expect("ErrorInfo detail");
        assert_eq!(info.reason, REASON_OFFSET_OUT_OF_RANGE);
        assert_eq!(info.domain, ERROR_DOMAIN);
        assert_eq!(info.metadata["partition"], "3");
        assert_eq!(info.metadata["requested"], "5");
        assert_eq!(info.metadata["earliest"], "100");
    }

    #[test]
    fn a_start_past_the_end_tells_the_end_offset() {
        let status = to_status(RuntimeError::OffsetPastEnd {
            partition: 2,
            requested: 50,
            end: 7,
        });
        assert_eq!(status.code(), Code::OutOfRange);
        assert!(status.message().contains("end offset 7"), "{}", status.message());
        let info = status.get_details_error_info().expect("ErrorInfo detail");
        assert_eq!(info.reason, REASON_OFFSET_PAST_END);
        assert_eq!(info.metadata["end"], "7");
        assert_eq!(info.metadata["requested"], "50");
    }

    #[test]
    fn not_hosted_names_the_owner_when_known() {
        let status = to_status(RuntimeError::NotHosted {
            store: "counts".into(),
            partition: 4,
            owner: Some(crate::metadata::HostInfo {
                host: "10.0.0.7".into(),
                port: 50052,
            }),
        });
        assert_eq!(status.code(), Code::FailedPrecondition);
        assert!(status.message().contains("10.0.0.7:50052"), "{status:?}");
        let info = status.get_details_error_info().expect("ErrorInfo detail");
        assert_eq!(info.reason, REASON_NOT_HOSTED);
        assert_eq!(info.metadata[METADATA_OWNER], "10.0.0.7:50052");
        assert_eq!(info.metadata["partition"], "4");

        let status = to_status(RuntimeError::NotHosted {
            store: "counts".into(),
            partition: 4,
            owner: None,
        });
        let info = status.get_details_error_info().expect("ErrorInfo detail");
        assert!(!info.metadata.contains_key(METADATA_OWNER));
    }

    #[test]
    fn a_peers_answer_passes_through_and_a_moved_partition_is_unavailable() {
        let peer = to_status(RuntimeError::Unavailable {
            reason: "restoring".into(),
            retry_after: Duration::from_millis(200),
        });
        let status = to_status(ServiceError::Peer {
            host: "h:1".into(),
            code: peer.code(),
            message: peer.message().into(),
            details: peer.details().to_vec().into(),
        });
        assert_eq!(status.code(), Code::Unavailable);
        assert!(status.message().starts_with("h:1 answered"), "{status:?}");
        assert_eq!(
            status.get_details_retry_info().expect("RetryInfo").retry_delay,
            Some(Duration::from_millis(200))
        );

        let moved = to_status(RuntimeError::NotHosted {
            store: "counts".into(),
            partition: 1,
            owner: None,
        });
        let status = to_status(ServiceError::Peer {
            host: "h:1".into(),
            code: moved.code(),
            message: moved.message().into(),
            details: moved.details().to_vec().into(),
        });
        assert_eq!(status.code(), Code::Unavailable);
        assert!(status.get_details_retry_info().is_some());

        let status = to_status(ServiceError::PeerUnreachable {
            host: "h:1".into(),
            reason: "connection refused".into(),
        });
        assert_eq!(status.code(), Code::Unavailable);
        assert!(status.get_details_retry_info().is_some());
    }

    #[test]
    fn internal_leaks_nothing() {
        let status = to_status(RuntimeError::Internal(
            "sequencer of counts_3 poisoned at /srv/data".into(),
        ));
        assert_eq!(status.code(), Code::Internal);
        assert!(!status.message().contains("sequencer"), "{status:?}");
        assert!(!status.message().contains("/srv"), "{status:?}");
        assert!(status.details().is_empty());
    }

    #[test]
    fn a_limit_is_resource_exhausted_naming_the_setting() {
        let status = to_status(RuntimeError::limit_exceeded(
            "max_records_per_produce",
            10,
            "the request holds 11 records",
        ));
        assert_eq!(status.code(), Code::ResourceExhausted);
        assert!(status.message().contains("max_records_per_produce"), "{status:?}");
        let info = status.get_details_error_info().expect("ErrorInfo detail");
        assert_eq!(info.reason, REASON_LIMIT_EXCEEDED);
        assert_eq!(info.metadata["setting"], "max_records_per_produce");
        assert_eq!(info.metadata["limit"], "10");
    }

    #[test]
    fn echoed_input_is_cut_in_the_message_and_the_details() {
        let huge = "s".repeat(1 << 20);
        for status in [
            to_status(RuntimeError::UnknownStore(huge.clone())),
            to_status(RuntimeError::invalid_argument(huge.clone(), huge.clone())),
            to_status(RuntimeError::OrderNotGuaranteed {
                store: huge.clone(),
                processing_order: ProcessingOrder::Key,
                threads_per_task: 2,
            }),
        ] {
            assert!(
                status.message().len() <= 2 * MAX_SENTENCE_BYTES,
                "{}",
                status.message().len()
            );
            assert!(status.message().contains('…'), "{}", status.message());
            assert!(
                status.details().len() <= 4 * MAX_SENTENCE_BYTES,
                "{}",
                status.details().len()
            );
        }
    }

    #[test]
    fn malformed_protobuf_is_invalid_argument_with_the_field_path() {
        use prost::Message as _;
        use taskstream::v1 as pb;
        // records[0].key (field 1 of ProducerRecord) sent as a varint instead of bytes.
        let record = [0x08, 0x01];
        let mut wire = vec![0x0a, 0x01, b'e', 0x12, record.len() as u8];
        wire.extend_from_slice(&record);
        let error = pb::ProduceRequest::decode(wire.as_slice()).unwrap_err();
        let tonic_status = Status::internal(error.to_string());
        let status = from_transport(&tonic_status).expect("a decode error is restated");
        assert_eq!(status.code(), Code::InvalidArgument);
        let bad = status.get_details_bad_request().expect("BadRequest detail");
        assert_eq!(bad.field_violations[0].field, "records.key", "{status:?}");
        for rust_name in ["ProduceRequest", "ProducerRecord", "Protobuf message"] {
            assert!(!status.message().contains(rust_name), "{}", status.message());
        }

        // A store name that is not UTF-8.
        let error = pb::ProcessMetadataForStoreRequest::decode(&[0x0a, 0x02, 0xff, 0xfe][..]).unwrap_err();
        let status = from_transport(&Status::internal(error.to_string())).unwrap();
        assert_eq!(status.code(), Code::InvalidArgument);
        assert_eq!(status.message(), "invalid store: is not valid UTF-8");

        // Cut short: a length prefix past the end.
        let error = pb::ProcessMetadataForStoreRequest::decode(&[0x0a, 0x7f, b'x'][..]).unwrap_err();
        let status = from_transport(&Status::internal(error.to_string())).unwrap();
        assert_eq!(status.code(), Code::InvalidArgument);

        let status = from_transport(&Status::internal("Missing request message.")).unwrap();
        assert_eq!(status.code(), Code::InvalidArgument);
    }

    #[test]
    fn a_message_over_the_limit_is_resource_exhausted_not_out_of_range() {
        let tonic_status = Status::out_of_range(
            "Error, decoded message length too large: found 5242880 bytes, the limit is: 4194304 bytes",
        );
        let status = from_transport(&tonic_status).expect("restated");
        assert_eq!(status.code(), Code::ResourceExhausted);
        let info = status.get_details_error_info().expect("ErrorInfo detail");
        assert_eq!(info.reason, REASON_LIMIT_EXCEEDED);
        assert_eq!(info.metadata["setting"], MESSAGE_SIZE_SETTING);
        assert_eq!(info.metadata["limit"], "4194304");
        assert!(status.message().contains("5242880"), "{}", status.message());
    }

    #[test]
    fn the_services_own_statuses_stand() {
        for error in [
            RuntimeError::OffsetOutOfRange {
                partition: 1,
                requested: 2,
                earliest: 3,
            },
            RuntimeError::Internal("x".into()),
        ] {
            assert!(from_transport(&to_status(error)).is_none());
        }
    }

    #[test]
    fn a_lagged_subscriber_is_resource_exhausted_with_the_count() {
        let status = to_status(ServiceError::SubscriberLagged {
            missed_batches: 12,
            buffer_batches: 1024,
        });
        assert_eq!(status.code(), Code::ResourceExhausted);
        assert!(status.message().contains("12 batches"), "{status:?}");
        let info = status.get_details_error_info().expect("ErrorInfo detail");
        assert_eq!(info.reason, REASON_SUBSCRIBER_LAGGED);
        assert_eq!(info.metadata["missed_batches"], "12");
        assert_eq!(info.metadata["buffer_batches"], "1024");
    }
}
