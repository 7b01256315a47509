//! [`StreamsClient`]: one connection to a taskstream server, with typed
//! methods for every RPC of `StreamsService` and `AdminService`, and
//! [`ClientBuilder`]: how to reach it (bearer token, TLS with a CA certificate,
//! a client certificate for mutual TLS).
//!
//! Every method maps a failed call to a [`ClientError`]; the generated clients
//! stay reachable through `streams()` / `admin()` for anything not wrapped here.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use taskstream::v1::{
    self, admin_service_client::AdminServiceClient, streams_service_client::StreamsServiceClient,
};
use tokio_stream::{Stream, StreamExt};
use tonic::metadata::{Ascii, MetadataValue};
use tonic::service::Interceptor;
use tonic::service::interceptor::InterceptedService;
use tonic::transport::{Certificate, Channel, ClientTlsConfig, Endpoint, Identity};

use crate::{
    ClientError, FieldViolation,
    callback::{self, MetadataHandle, RecordCallback},
    error::error_chain,
    metadata::MetadataOptions,
};

/// Responses larger than tonic's 4 MiB default are normal for range queries
/// over a big store; this bounds them without getting in the way.
const MAX_MESSAGE_BYTES: usize = 64 * 1024 * 1024;

/// The channel of a [`StreamsClient`]: every call carries the client's credentials.
pub type Transport = InterceptedService<Channel, Credentials>;

/// Adds `authorization: Bearer TOKEN` to every call (unless the call set its own).
/// Its `Debug` never shows the token.
#[derive(Clone, Default)]
pub struct Credentials {
    authorization: Option<MetadataValue<Ascii>>,
}

impl Credentials {
    /// No token: the server must not require one.
    pub fn none() -> Self {
        Credentials::default()
    }

    /// `Bearer token`. A token must be visible ASCII (it travels as an HTTP/2 header);
    /// the error does not repeat it.
    pub fn bearer(token: &str) -> Result<Self, ClientError> {
        let mut value: MetadataValue<Ascii> =
            format!("Bearer {}", token.trim())
                .parse()
                .map_err(|_| ClientError::IllegalArgument {
                    message: "the token is not a valid header value: use visible ASCII characters only"
                        .into(),
                    field_violations: vec![FieldViolation {
                        field: "token".into(),
                        description: "not a valid header value".into(),
                    }],
                })?;
        // Kept out of HPACK's tables, as HTTP/2 advises for credentials.
        value.set_sensitive(true);
        Ok(Credentials {
            authorization: Some(value),
        })
    }

    pub fn has_token(&self) -> bool {
        self.authorization.is_some()
    }
}

impl fmt::Debug for Credentials {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let token = if self.has_token() { "<redacted>" } else { "none" };
        f.debug_struct("Credentials").field("token", &token).finish()
    }
}

impl Interceptor for Credentials {
    fn call(&mut self, mut request: tonic::Request<()>) -> Result<tonic::Request<()>, tonic::Status> {
        if let Some(value) = &self.authorization
            && !request.metadata().contains_key("authorization")
        {
            request.metadata_mut().insert("authorization", value.clone());
        }
        Ok(request)
    }
}

/// How to reach a taskstream server: address, bearer token, TLS. From
/// [`StreamsClient::builder`]; `connect` makes the client.
///
/// An `https://` address (or any address once a CA certificate is given) is TLS: the
/// server's certificate must be signed by the CA certificate given here (this client
/// trusts no CA by default). Its `Debug` shows neither the token nor the key.
#[derive(Clone)]
pub struct ClientBuilder {
    addr: String,
    token: Option<String>,
    tls: TlsOptions,
}

/// The TLS part of a [`ClientBuilder`], kept by the client to reach the other
/// instances of an application the same way.
#[derive(Clone, Default)]
struct TlsOptions {
    ca_cert: Option<Vec<u8>>,
    identity: Option<(Vec<u8>, Vec<u8>)>,
}

impl fmt::Debug for ClientBuilder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ClientBuilder")
            .field("addr", &self.addr)
            .field("token", &self.token.as_ref().map(|_| "<redacted>"))
            .field("ca_cert", &self.tls.ca_cert.as_ref().map(|pem| pem.len()))
            .field("client_identity", &self.tls.identity.is_some())
            .finish()
    }
}

impl ClientBuilder {
    /// Sends `authorization: Bearer TOKEN` on every call.
    pub fn token(mut self, token: impl Into<String>) -> Self {
        self.token = Some(token.into());
        self
    }

    /// Trusts servers whose certificate this CA (PEM, one or more certificates) signed,
    /// and speaks TLS: a bare `host:port` address becomes `https://host:port`.
    pub fn ca_cert_pem(mut self, pem: impl Into<Vec<u8>>) -> Self {
        self.tls.ca_cert = Some(pem.into());
        self
    }

    /// Presents this certificate (PEM) and private key (PEM) to the server: for a server
    /// that requires client certificates (`tls_client_ca`).
    pub fn client_identity(mut self, cert_pem: impl Into<Vec<u8>>, key_pem: impl Into<Vec<u8>>) -> Self {
        self.tls.identity = Some((cert_pem.into(), key_pem.into()));
        self
    }

    /// Connects eagerly, so that an unreachable server (or a failed TLS handshake) is
    /// reported here as `ClientError::Transport`; a malformed address or token is
    /// `IllegalArgument`. After that the channel reconnects by itself when the connection drops.
    pub async fn connect(self) -> Result<StreamsClient, ClientError> {
        let credentials = match &self.token {
            Some(token) => Credentials::bearer(token)?,
            None => Credentials::none(),
        };
        let channel = connect_channel(&self.addr, &self.tls).await?;
        Ok(StreamsClient::with_credentials(
            channel,
            credentials,
            Arc::new(self.tls),
        ))
    }
}

/// A connected channel to `addr` with `tls`.
async fn connect_channel(addr: &str, tls: &TlsOptions) -> Result<Channel, ClientError> {
    let addr = addr.trim();
    let uri = if addr.contains("://") {
        addr.to_owned()
    } else if tls.ca_cert.is_some() || tls.identity.is_some() {
        format!("https://{addr}")
    } else {
        format!("http://{addr}")
    };
    let illegal = |e: &dyn std::error::Error| ClientError::IllegalArgument {
        message: format!("invalid server address `{addr}` ({e})"),
        field_violations: vec![FieldViolation {
            field: "addr".into(),
            description: e.to_string(),
        }],
    };
    let mut endpoint = Endpoint::from_shared(uri.clone()).map_err(|e| illegal(&e))?;
    let is_https = uri.starts_with("https://");
    if is_https {
        let mut config = ClientTlsConfig::new();
        if let Some(ca) = &tls.ca_cert {
            config = config.ca_certificate(Certificate::from_pem(ca));
        }
        if let Some((cert, key)) = &tls.identity {
            config = config.identity(Identity::from_pem(cert, key));
        }
        endpoint = endpoint
            .tls_config(config)
            .map_err(|e| ClientError::IllegalArgument {
                message: format!("cannot use the TLS settings for {uri}: {}", error_chain(&e)),
                field_violations: vec![FieldViolation {
                    field: "ca_cert".into(),
                    description: error_chain(&e),
                }],
            })?;
    } else if tls.ca_cert.is_some() || tls.identity.is_some() {
        return Err(ClientError::IllegalArgument {
            message: format!(
                "a CA or client certificate is for TLS, but `{addr}` is plain http://; use https://"
            ),
            field_violations: vec![FieldViolation {
                field: "addr".into(),
                description: "http:// with TLS settings".into(),
            }],
        });
    }
    let endpoint = endpoint
        .connect_timeout(Duration::from_secs(5))
        .tcp_nodelay(true)
        // Keep-alive pings find a dead server under a quiet `watch`.
        .http2_keep_alive_interval(Duration::from_secs(30))
        .keep_alive_timeout(Duration::from_secs(10))
        .keep_alive_while_idle(true);
    endpoint.connect().await.map_err(|error| {
        let mut message = format!("cannot connect to {uri}: {}", error_chain(&error));
        if is_https && tls.ca_cert.is_none() {
            message.push_str(" (no CA certificate given: this client trusts no CA by default)");
        }
        ClientError::Transport { message }
    })
}

/// A client of one taskstream server. Cheap to clone: clones share the connection.
#[derive(Debug, Clone)]
pub struct StreamsClient {
    streams: StreamsServiceClient<Transport>,
    admin: AdminServiceClient<Transport>,
    credentials: Credentials,
    tls: Arc<TlsOptions>,
}

impl fmt::Debug for TlsOptions {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TlsOptions")
            .field("ca_cert", &self.ca_cert.is_some())
            .field("client_identity", &self.identity.is_some())
            .finish()
    }
}

impl StreamsClient {
    /// Connects to `addr`, either `host:port` (plain HTTP/2 is assumed) or a
    /// URL such as `http://127.0.0.1:50051`, without token or TLS settings
    /// (see [`StreamsClient::builder`] for those).
    ///
    /// Connects eagerly so that an unreachable server is reported here, as
    /// `ClientError::Transport`; a malformed address is `IllegalArgument`.
    /// After that the channel reconnects by itself when the connection drops.
    pub async fn connect(addr: impl AsRef<str>) -> Result<Self, ClientError> {
        Self::builder(addr.as_ref()).connect().await
    }

    /// A builder for a client with a bearer token and/or TLS settings:
    ///
    /// ```no_run
    /// # async fn example(ca_pem: Vec<u8>) -> Result<(), taskstream_client::ClientError> {
    /// let client = taskstream_client::StreamsClient::builder("https://streams.internal:50051")
    ///     .token("s3cr3t")
    ///     .ca_cert_pem(ca_pem)
    ///     .connect()
    ///     .await?;
    /// # Ok(())
    /// # }
    /// ```
    pub fn builder(addr: impl Into<String>) -> ClientBuilder {
        ClientBuilder {
            addr: addr.into(),
            token: None,
            tls: TlsOptions::default(),
        }
    }

    /// Wraps a channel built by the caller (TLS, timeouts, a custom connector…), without
    /// a token.
    pub fn from_channel(channel: Channel) -> Self {
        Self::with_credentials(channel, Credentials::none(), Arc::default())
    }

    fn with_credentials(channel: Channel, credentials: Credentials, tls: Arc<TlsOptions>) -> Self {
        let transport = InterceptedService::new(channel, credentials.clone());
        StreamsClient {
            streams: StreamsServiceClient::new(transport.clone())
                .max_decoding_message_size(MAX_MESSAGE_BYTES)
                .max_encoding_message_size(MAX_MESSAGE_BYTES),
            admin: AdminServiceClient::new(transport)
                .max_decoding_message_size(MAX_MESSAGE_BYTES)
                .max_encoding_message_size(MAX_MESSAGE_BYTES),
            credentials,
            tls,
        }
    }

    /// A client of another instance of the same application (`host:port` as it
    /// advertises itself), with this client's token and TLS settings.
    pub(crate) async fn connect_peer(&self, addr: &str) -> Result<StreamsClient, ClientError> {
        let channel = connect_channel(addr, &self.tls).await?;
        Ok(Self::with_credentials(
            channel,
            self.credentials.clone(),
            self.tls.clone(),
        ))
    }

    /// The generated `StreamsService` client, for calls not wrapped here; it sends the
    /// client's token too.
    pub fn streams(&self) -> StreamsServiceClient<Transport> {
        self.streams.clone()
    }

    /// The generated `AdminService` client.
    pub fn admin(&self) -> AdminServiceClient<Transport> {
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
    /// partition is on one instance); `coalesce` sorts them all.
    ///
    /// A partition that moves (its stream ends UNAVAILABLE, or its instance
    /// goes away) is followed to its new owner for `options.follow_moves`
    /// (default 120 s) and resumed after the last offset delivered; outcomes
    /// the new owner repeats are dropped by offset, and offsets it no longer
    /// holds outcomes of arrive as one in-band
    /// `on_complete(Err(ClientError::LaggedOffsets { .. }))` per missed range
    /// before the resumed batches. Any other error of any instance, or a
    /// partition not back within the deadline, ends the whole subscription
    /// (so does every stream error with `follow_moves = None`). On one
    /// server (the embedded log) this is `get_metadata_async` plus following.
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

    /// Every call gets `authorization: Bearer TOKEN` (one the call set itself is kept);
    /// `Debug` never shows the token; a token that cannot be a header is refused unquoted.
    #[test]
    fn credentials_add_the_bearer_header_and_hide_the_token() {
        let mut credentials = Credentials::bearer("s3cr3t").expect("a valid token");
        let request = credentials.call(tonic::Request::new(())).expect("intercepted");
        assert_eq!(
            request
                .metadata()
                .get("authorization")
                .and_then(|v| v.to_str().ok()),
            Some("Bearer s3cr3t")
        );
        let mut own = tonic::Request::new(());
        own.metadata_mut()
            .insert("authorization", "Bearer other".parse().unwrap());
        let own = credentials.call(own).expect("intercepted");
        assert_eq!(
            own.metadata().get("authorization").and_then(|v| v.to_str().ok()),
            Some("Bearer other")
        );
        let mut none = Credentials::none();
        let request = none.call(tonic::Request::new(())).expect("intercepted");
        assert!(request.metadata().get("authorization").is_none());

        assert!(!format!("{credentials:?}").contains("s3cr3t"));
        let builder = StreamsClient::builder("127.0.0.1:1").token("s3cr3t");
        assert!(!format!("{builder:?}").contains("s3cr3t"), "{builder:?}");

        let error = Credentials::bearer("bad\ntoken").unwrap_err();
        assert!(matches!(error, ClientError::IllegalArgument { .. }), "{error:?}");
        assert!(!error.to_string().contains("bad"), "{error}");
    }

    #[tokio::test]
    async fn tls_settings_with_http_are_illegal() {
        let error = StreamsClient::builder("http://127.0.0.1:1")
            .ca_cert_pem(b"not used".to_vec())
            .connect()
            .await
            .unwrap_err();
        assert!(matches!(error, ClientError::IllegalArgument { .. }), "{error:?}");
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
