//! [`StreamsClient`]: one connection to a taskstream server, with typed
//! methods for every RPC of `StreamsService` and `AdminService`.
//!
//! Every method maps a failed call to a [`ClientError`]; the generated clients
//! stay reachable through `streams()` / `admin()` for anything not wrapped here.

use std::time::Duration;

use bytes::Bytes;
use taskstream::v1::{
    self, admin_service_client::AdminServiceClient, streams_service_client::StreamsServiceClient,
};
use tokio_stream::{Stream, StreamExt};
use tonic::transport::{Channel, Endpoint};

use crate::{
    ClientError, FieldViolation,
    callback::{self, MetadataHandle, RecordCallback},
    error::error_chain,
    metadata::MetadataOptions,
};

/// Responses larger than tonic's 4 MiB default are normal for range queries
/// over a big store; this bounds them without getting in the way.
const MAX_MESSAGE_BYTES: usize = 64 * 1024 * 1024;

/// A client of one taskstream server. Cheap to clone: clones share the connection.
#[derive(Debug, Clone)]
pub struct StreamsClient {
    streams: StreamsServiceClient<Channel>,
    admin: AdminServiceClient<Channel>,
}

impl StreamsClient {
    /// Connects to `addr`, either `host:port` (plain HTTP/2 is assumed) or a
    /// URL such as `http://127.0.0.1:50051`.
    ///
    /// Connects eagerly so that an unreachable server is reported here, as
    /// `ClientError::Transport`; a malformed address is `IllegalArgument`.
    /// After that the channel reconnects by itself when the connection drops.
    pub async fn connect(addr: impl AsRef<str>) -> Result<Self, ClientError> {
        let addr = addr.as_ref().trim();
        let uri = if addr.contains("://") {
            addr.to_owned()
        } else {
            format!("http://{addr}")
        };
        let endpoint = Endpoint::from_shared(uri.clone())
            .map_err(|e| ClientError::IllegalArgument {
                message: format!("invalid server address `{addr}` ({e})"),
                field_violations: vec![FieldViolation {
                    field: "addr".into(),
                    description: e.to_string(),
                }],
            })?
            .connect_timeout(Duration::from_secs(5))
            .tcp_nodelay(true)
            // Keep-alive pings find a dead server under a quiet `watch`.
            .http2_keep_alive_interval(Duration::from_secs(30))
            .keep_alive_timeout(Duration::from_secs(10))
            .keep_alive_while_idle(true);
        let channel = endpoint.connect().await.map_err(|error| ClientError::Transport {
            message: format!("cannot connect to {uri}: {}", error_chain(&error)),
        })?;
        Ok(Self::from_channel(channel))
    }

    /// Wraps a channel built by the caller (TLS, timeouts, a custom connector…).
    pub fn from_channel(channel: Channel) -> Self {
        StreamsClient {
            streams: StreamsServiceClient::new(channel.clone())
                .max_decoding_message_size(MAX_MESSAGE_BYTES)
                .max_encoding_message_size(MAX_MESSAGE_BYTES),
            admin: AdminServiceClient::new(channel)
                .max_decoding_message_size(MAX_MESSAGE_BYTES)
                .max_encoding_message_size(MAX_MESSAGE_BYTES),
        }
    }

    /// The generated `StreamsService` client, for calls not wrapped here.
    pub fn streams(&self) -> StreamsServiceClient<Channel> {
        self.streams.clone()
    }

    /// The generated `AdminService` client.
    pub fn admin(&self) -> AdminServiceClient<Channel> {
        self.admin.clone()
    }

    /// The StreamsMetadata of every instance hosting `store`, with per-task
    /// threads, offsets and lag. `in_order = true` fails with `IllegalState`
    /// when the store's tasks run `key` or `unordered` order with several
    /// threads per task.
    pub async fn process_metadata_for_store(
        &self,
        store: &str,
        in_order: bool,
    ) -> Result<v1::ProcessMetadataForStoreResponse, ClientError> {
        let request = v1::ProcessMetadataForStoreRequest {
            store: store.to_owned(),
            in_order,
        };
        Ok(self
            .streams()
            .process_metadata_for_store(request)
            .await?
            .into_inner())
    }

    /// `process_metadata_for_store(store, true)`, as Kafka Streams' `metadataForStore`.
    pub async fn metadata_for_store(
        &self,
        store: &str,
    ) -> Result<v1::ProcessMetadataForStoreResponse, ClientError> {
        self.process_metadata_for_store(store, true).await
    }

    /// The partition of `key` in `store` and the hosts that serve it.
    pub async fn metadata_for_key(
        &self,
        store: &str,
        key: impl Into<Bytes>,
    ) -> Result<v1::MetadataForKeyResponse, ClientError> {
        let request = v1::MetadataForKeyRequest {
            store: store.to_owned(),
            key: key.into(),
        };
        Ok(self.streams().metadata_for_key(request).await?.into_inner())
    }

    /// An interactive query as is: results per partition, with positions.
    pub async fn query(&self, request: v1::QueryRequest) -> Result<v1::QueryResponse, ClientError> {
        Ok(self.streams().query(request).await?.into_inner())
    }

    /// The value of `key` in `store`, `None` when the store has no such key.
    pub async fn get(&self, store: &str, key: impl Into<Bytes>) -> Result<Option<Bytes>, ClientError> {
        let key = key.into();
        let request = v1::QueryRequest {
            store: store.to_owned(),
            query: Some(v1::query_request::Query::Key(v1::KeyQuery { key: key.clone() })),
            ..Default::default()
        };
        let response = self.query(request).await?;
        Ok(response
            .results
            .into_iter()
            .flat_map(|result| result.entries)
            .find(|entry| entry.key == key)
            .map(|entry| entry.value))
    }

    /// Every entry of `store` with a key in `[from, to]` (both inclusive; `None`
    /// is open), all partitions merged in key order. The server answers in pages of
    /// at most its `max_response_bytes`; this follows them to the last.
    pub async fn range(
        &self,
        store: &str,
        from: Option<Bytes>,
        to: Option<Bytes>,
    ) -> Result<Vec<(Bytes, Bytes)>, ClientError> {
        let mut request = v1::QueryRequest {
            store: store.to_owned(),
            query: Some(v1::query_request::Query::Range(v1::RangeQuery { from, to })),
            ..Default::default()
        };
        let mut entries: Vec<(Bytes, Bytes)> = Vec::new();
        loop {
            let response = self.query(request.clone()).await?;
            entries.extend(
                response
                    .results
                    .into_iter()
                    .flat_map(|result| result.entries)
                    .map(|entry| (entry.key, entry.value)),
            );
            if response.next_page_token.is_empty() {
                break;
            }
            request.page_token = response.next_page_token;
        }
        // Keys are hashed to partitions, so each partition's sorted run covers
        // the whole key space: a plain sort is the merge.
        entries.sort_by(|a, b| a.0.cmp(&b.0));
        Ok(entries)
    }

    /// Appends `records` to `topic`; answers each record's partition and offset.
    pub async fn produce(
        &self,
        topic: &str,
        records: Vec<v1::ProducerRecord>,
    ) -> Result<v1::ProduceResponse, ClientError> {
        let request = v1::ProduceRequest {
            topic: topic.to_owned(),
            records,
        };
        Ok(self.streams().produce(request).await?.into_inner())
    }

    /// Bulk append: every batch of `batches` goes on one client stream; the
    /// answer (per-partition ranges, no per-record positions) comes once
    /// `batches` ends.
    pub async fn produce_stream(
        &self,
        topic: &str,
        batches: impl Stream<Item = Vec<v1::ProducerRecord>> + Send + 'static,
    ) -> Result<v1::ProduceResponse, ClientError> {
        let topic = topic.to_owned();
        let requests = batches.map(move |records| v1::ProduceRequest {
            topic: topic.clone(),
            records,
        });
        Ok(self.streams().produce_stream(requests).await?.into_inner())
    }

    /// Up to `max_records` records (0 = the server's default of 500; at most
    /// 10,000) of one partition of any topic of the log from `offset` on, e.g.
    /// a pipeline's dead-letter topic `<application_id>-<pipeline>-dlq`, with the
    /// partition's start and end offsets. An unknown topic is `UnknownStore`
    /// (NOT_FOUND); a partition out of range, a negative offset or too large a
    /// `max_records` is `IllegalArgument`; an offset below the oldest retained
    /// is `OutOfRange`. At or after the end the answer has no records.
    pub async fn read_topic(
        &self,
        topic: &str,
        partition: u32,
        offset: i64,
        max_records: u32,
    ) -> Result<v1::ReadTopicResponse, ClientError> {
        let request = v1::ReadTopicRequest {
            topic: topic.to_owned(),
            partition,
            offset,
            max_records,
        };
        Ok(self.streams().read_topic(request).await?.into_inner())
    }

    /// Subscribes to record metadata of `store` and returns at once.
    ///
    /// Every streamed batch becomes exactly one `callback.on_complete(Ok(batch))`.
    /// The error that ends the stream (or keeps it from opening) becomes
    /// exactly one `on_complete(Err(e))`, after which no callback follows. An
    /// in-band lag notice becomes `on_complete(Err(ClientError::Lagged { .. }))`
    /// and the stream goes on. A bounded stream that completes normally ends
    /// without a further callback ([`MetadataHandle::join`] returns).
    ///
    /// With `options.coalesce` (bounded `end` only, otherwise the single
    /// callback is `Err(IllegalArgument)` and the server is not called), every
    /// batch is collected and the callback runs exactly once: `Ok` with all
    /// records (sorted by partition and offset when `in_order`), or `Err`
    /// with the error or lag notice that made the result incomplete.
    ///
    /// # Panics
    /// When called outside a tokio runtime (the subscription is a spawned task).
    pub fn get_metadata_async(
        &self,
        store: impl Into<String>,
        options: MetadataOptions,
        callback: impl RecordCallback,
    ) -> MetadataHandle {
        callback::spawn(self.streams(), store.into(), options, callback)
    }

    /// [`get_metadata_async`](Self::get_metadata_async) on every instance of
    /// the application (Kafka mode): asks this server's
    /// `ProcessMetadataForStore` which instances hold `store`, opens a stream
    /// to each for the partitions it holds (within `options`), and merges
    /// them into one callback sequence with the same contract. Each
    /// partition's records keep their offset order with `in_order` (a
    /// partition is on one instance); `coalesce` sorts them all. The first
    /// error of any instance ends the whole subscription; on one server (the
    /// embedded log) this is `get_metadata_async`.
    ///
    /// # Panics
    /// When called outside a tokio runtime (the subscription is a spawned task).
    pub fn get_metadata_async_all(
        &self,
        store: impl Into<String>,
        options: MetadataOptions,
        callback: impl RecordCallback,
    ) -> MetadataHandle {
        callback::spawn_all(self.clone(), store.into(), options, callback)
    }

    /// Threads, tasks, pipelines and their state.
    pub async fn describe_runtime(&self) -> Result<v1::DescribeRuntimeResponse, ClientError> {
        Ok(self
            .admin()
            .describe_runtime(v1::DescribeRuntimeRequest {})
            .await?
            .into_inner())
    }

    /// Starts one more stream thread; tasks are rebalanced onto it.
    pub async fn add_stream_thread(&self) -> Result<v1::AddStreamThreadResponse, ClientError> {
        Ok(self
            .admin()
            .add_stream_thread(v1::AddStreamThreadRequest {})
            .await?
            .into_inner())
    }

    /// Stops `thread_name` (or, with `None`, the most recently started thread)
    /// after it finishes the range in hand. `IllegalArgument` when fewer
    /// threads would remain than threads per task.
    pub async fn remove_stream_thread(
        &self,
        thread_name: Option<&str>,
    ) -> Result<v1::RemoveStreamThreadResponse, ClientError> {
        let request = v1::RemoveStreamThreadRequest {
            thread_name: thread_name.unwrap_or_default().to_owned(),
        };
        Ok(self.admin().remove_stream_thread(request).await?.into_inner())
    }
}

/// A record with a key: it goes to the key's partition (murmur2, as Kafka).
pub fn keyed_record(key: impl Into<Bytes>, value: impl Into<Bytes>) -> v1::ProducerRecord {
    v1::ProducerRecord {
        key: Some(key.into()),
        value: value.into(),
        ..Default::default()
    }
}

/// A record without a key: the server picks the partition.
pub fn unkeyed_record(value: impl Into<Bytes>) -> v1::ProducerRecord {
    v1::ProducerRecord {
        value: value.into(),
        ..Default::default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_server::{Fake, serve};

    fn kv(key: &str, value: &str) -> v1::KeyValue {
        v1::KeyValue {
            key: Bytes::copy_from_slice(key.as_bytes()),
            value: Bytes::copy_from_slice(value.as_bytes()),
        }
    }

    fn partition(partition: u32, entries: Vec<v1::KeyValue>) -> v1::PartitionResult {
        v1::PartitionResult {
            partition,
            position: 10,
            entries,
            committed_at_ms: 0,
            host: None,
        }
    }

    #[tokio::test]
    async fn range_merges_partitions_in_key_order_and_get_finds_the_key() {
        let fake = Fake {
            results: vec![
                partition(0, vec![kv("b", "2"), kv("d", "4")]),
                partition(1, vec![kv("a", "1"), kv("c", "3")]),
            ],
            ..Default::default()
        };
        let (client, _, _) = serve(fake).await;
        let entries = client.range("counts", None, None).await.expect("range");
        let keys: Vec<&[u8]> = entries.iter().map(|(k, _)| k.as_ref()).collect();
        assert_eq!(keys, vec![&b"a"[..], b"b", b"c", b"d"]);
        assert_eq!(
            client.get("counts", "c").await.expect("get"),
            Some(Bytes::from_static(b"3"))
        );
        assert_eq!(client.get("counts", "zz").await.expect("get"), None);
        let error = client.get("nope", "a").await.unwrap_err();
        assert!(matches!(error, ClientError::UnknownStore { .. }), "{error:?}");
    }

    #[tokio::test]
    async fn produce_and_produce_stream() {
        let (client, fake, _) = serve(Fake::default()).await;
        let response = client
            .produce("events", vec![keyed_record("k", "v")])
            .await
            .expect("produce");
        assert_eq!(response.record_count, 1);
        let batches = tokio_stream::iter(vec![
            vec![keyed_record("a", "1"), unkeyed_record("2")],
            vec![keyed_record("b", "3")],
        ]);
        let response = client
            .produce_stream("events", batches)
            .await
            .expect("produce_stream");
        assert_eq!(response.record_count, 3);
        let produced = fake.produced.lock().expect("lock");
        assert_eq!(produced.len(), 3);
        assert!(produced.iter().all(|r| r.topic == "events"));
    }

    #[tokio::test]
    async fn read_topic_sends_the_request_and_keeps_headers_in_order() {
        let (client, _, _) = serve(Fake::default()).await;
        let response = client
            .read_topic("app-p-dlq", 3, 42, 7)
            .await
            .expect("read_topic");
        assert_eq!((response.topic.as_str(), response.partition), ("app-p-dlq", 3));
        assert_eq!((response.start_offset, response.end_offset), (0, 43));
        let record = &response.records[0];
        assert_eq!((record.partition, record.offset), (3, 42));
        assert_eq!(record.value, Bytes::from_static(b"max 7"));
        let headers: Vec<(&str, &[u8])> = record
            .headers
            .iter()
            .map(|h| (h.name.as_str(), h.value.as_ref()))
            .collect();
        assert_eq!(headers, vec![("h", &b"1"[..]), ("h", b"2")]);
        let error = client.read_topic("nope", 0, 0, 0).await.unwrap_err();
        assert!(matches!(error, ClientError::UnknownStore { .. }), "{error:?}");
    }

    #[tokio::test]
    async fn in_order_reaches_the_server() {
        let (client, _, _) = serve(Fake::default()).await;
        assert!(
            client
                .metadata_for_store("counts")
                .await
                .expect("metadata")
                .in_order
        );
        assert!(
            !client
                .process_metadata_for_store("counts", false)
                .await
                .expect("metadata")
                .in_order
        );
    }

    #[test]
    fn record_helpers() {
        let record = keyed_record("user-1", "click");
        assert_eq!(record.key.as_deref(), Some(&b"user-1"[..]));
        assert_eq!(record.value, Bytes::from_static(b"click"));
        assert_eq!(record.partition, None);
        assert_eq!(record.timestamp_ms, 0);
        let record = unkeyed_record(Bytes::from_static(b"v"));
        assert_eq!(record.key, None);
    }

    #[tokio::test]
    async fn malformed_address_is_illegal_argument() {
        let error = StreamsClient::connect("http://[::1").await.unwrap_err();
        assert!(matches!(error, ClientError::IllegalArgument { .. }), "{error:?}");
        assert_eq!(error.exit_code(), 2);
    }

    #[tokio::test]
    async fn unreachable_server_is_transport() {
        // Port 1 on localhost: nothing listens there, the connect is refused at once.
        let error = StreamsClient::connect("127.0.0.1:1").await.unwrap_err();
        assert!(matches!(error, ClientError::Transport { .. }), "{error:?}");
        assert!(error.to_string().to_lowercase().contains("connect"), "{error}");
    }
}
