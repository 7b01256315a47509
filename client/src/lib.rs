//! Typed Rust client of taskstream, and the `taskstream` CLI (`src/main.rs`).
//!
//! Layout: `client` ([`StreamsClient`]: connection and one method per RPC),
//! `callback` ([`RecordCallback`], [`MetadataHandle`]: `GetMetadataAsync` as
//! callbacks; `fan_in` merges the streams of every instance of an
//! application), `metadata` ([`MetadataOptions`] and the [`MetadataBatch`]
//! callbacks receive), `error` ([`ClientError`], mapped from status codes).
//! Everything public is re-exported here; the generated types are
//! [`taskstream::v1`], re-exported as [`v1`].
//!
//! ```no_run
//! use taskstream_client::{MetadataOptions, StreamsClient, keyed_record};
//!
//! # async fn example() -> Result<(), taskstream_client::ClientError> {
//! let client = StreamsClient::connect("127.0.0.1:50051").await?;
//! client.produce("events", vec![keyed_record("user-1", "click")]).await?;
//! let handle = client.get_metadata_async(
//!     "counts",
//!     MetadataOptions::bounded().in_order(true),
//!     |result: Result<taskstream_client::MetadataBatch, _>| match result {
//!         Ok(batch) => println!("{} records completed", batch.len()),
//!         Err(error) => eprintln!("{error}"),
//!     },
//! );
//! handle.join().await; // the bounded stream completes by itself
//! # Ok(())
//! # }
//! ```

mod callback;
mod client;
mod error;
mod fan_in;
mod follow;
mod metadata;
#[cfg(test)]
mod test_server;

pub use callback::{CancelHandle, MetadataHandle, RecordCallback};
pub use client::{ClientBuilder, Credentials, StreamsClient, Transport, keyed_record, unkeyed_record};
pub use error::{
    ClientError, FieldViolation, PreconditionViolation, REASON_LIMIT_EXCEEDED, REASON_ROLE_REQUIRED,
    REASON_SUBSCRIBER_LAGGED,
};
pub use metadata::{
    CompletedRange, DEFAULT_FOLLOW, End, MetadataBatch, MetadataOptions, RecordMetadata, Start,
};
pub use taskstream::v1;
