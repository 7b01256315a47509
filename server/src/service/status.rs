//! The one place where errors become `tonic::Status`: every `RuntimeError`, the
//! service's own request validation (as `RuntimeError::InvalidArgument`) and a
//! subscriber dropped for being slow, each with the google.rpc details a client
//! can act on (BadRequest, PreconditionFailure, ResourceInfo, RetryInfo, ErrorInfo).

use crate::runtime::RuntimeError;
use std::collections::HashMap;
use tonic::{Code, Status};
use tonic_types::{ErrorDetails, StatusExt};

/// `ErrorInfo.domain` of every error detail this service attaches.
pub const ERROR_DOMAIN: &str = "taskstream";

/// `PreconditionViolation.type` when `in_order` is refused.
pub const PRECONDITION_PROCESSING_ORDER: &str = "PROCESSING_ORDER";

/// `ErrorInfo.reason` of a stream ended because its subscriber fell behind.
/// ErrorInfo reason: the partition asked for is held by another instance.
pub const REASON_NOT_HOSTED: &str = "PARTITION_NOT_HOSTED";
pub const REASON_SUBSCRIBER_LAGGED: &str = "SUBSCRIBER_LAGGED";

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
}

/// Maps an error to the status a client sees. Messages are meant for people;
/// the details are meant for programs (the Rust client maps them back).
pub fn to_status(error: impl Into<ServiceError>) -> Status {
    let error = error.into();
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
        ServiceError::Runtime(RuntimeError::NotHosted { store, partition }) => Status::with_error_details(
            Code::FailedPrecondition,
            message,
            // The Kafka mode adds the owner's host:port here.
            ErrorDetails::with_error_info(
                REASON_NOT_HOSTED,
                ERROR_DOMAIN,
                HashMap::from([
                    ("store".to_string(), store.clone()),
                    ("partition".to_string(), partition.to_string()),
                ]),
            ),
        ),
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
