//! `GetMetadataAsync` on every instance of an application (Kafka mode): the
//! instances `ProcessMetadataForStore` lists, one stream to each for the
//! partitions it holds, merged into one [`RecordCallback`] sequence with the
//! contract of a single stream (one `Ok` per batch or one coalesced, one
//! `Err` that ends it all, `Err(Lagged)` per notice). A partition lives on one
//! instance, so each partition's batches keep their offset order.
//!
//! Partitions move (a rebalance, an instance that died). With
//! `MetadataOptions::follow_moves` (the default) a stream that ends as
//! UNAVAILABLE, with a broken connection, or (open streams) at all, is not
//! the end: each of its partitions is looked for on the instances the
//! metadata lists now, with backoff, until the follow deadline, and resumed
//! there after what was delivered (`follow::PartitionFollow`): repeats are
//! dropped by offset, and offsets the new owner no longer holds outcomes of
//! (the server answers OUT_OF_RANGE with the earliest it has) become one
//! in-band `Err(LaggedOffsets)` per missed range before the resumed batches.
//! Only the error that makes following impossible (a deadline passed, a
//! refusal that will not change) ends the subscription.

use std::{
    collections::{BTreeMap, HashMap},
    pin::Pin,
    sync::{Arc, Mutex},
    time::Duration,
};

use taskstream::v1::{self, get_metadata_async_response::Event};
use tokio::{task::JoinSet, time::Instant};
use tokio_stream::{Stream, StreamExt, StreamMap};

use crate::{
    ClientError, StreamsClient,
    callback::{CancelState, Guarded},
    error::out_of_range_earliest,
    follow::PartitionFollow,
    metadata::{Coalescer, End, MetadataBatch, MetadataOptions, Start},
};

/// One instance to stream from, and the options narrowed to its partitions.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct InstanceStream {
    pub address: String,
    pub options: MetadataOptions,
}

/// The streams to open: every listed instance holding some of the
/// partitions `options` asks for, each asked for exactly those.
pub(crate) fn plan(
    metadata: &v1::ProcessMetadataForStoreResponse,
    options: &MetadataOptions,
) -> Vec<InstanceStream> {
    let wanted = |partition: u32| {
        (options.partitions.is_empty() || options.partitions.contains(&partition))
            && match &options.start {
                Start::Offsets(offsets) => offsets.contains_key(&partition),
                _ => true,
            }
            && match &options.end {
                End::Offsets(offsets) => offsets.contains_key(&partition),
                _ => true,
            }
    };
    let narrow = |offsets: &BTreeMap<u32, i64>, partitions: &[u32]| -> BTreeMap<u32, i64> {
        offsets
            .iter()
            .filter(|(p, _)| partitions.contains(p))
            .map(|(&p, &o)| (p, o))
            .collect()
    };
    let mut streams = Vec::new();
    for instance in &metadata.metadata {
        let Some(host) = &instance.host_info else { continue };
        let mut partitions: Vec<u32> = instance
            .topic_partitions
            .iter()
            .map(|tp| tp.partition)
            .filter(|&p| wanted(p))
            .collect();
        partitions.sort_unstable();
        partitions.dedup();
        if partitions.is_empty() {
            continue;
        }
        let mut options = options.clone();
        options.coalesce = false;
        if let Start::Offsets(offsets) = &options.start {
            options.start = Start::Offsets(narrow(offsets, &partitions));
        }
        if let End::Offsets(offsets) = &options.end {
            options.end = End::Offsets(narrow(offsets, &partitions));
        }
        options.partitions = partitions;
        let address = address_of(host);
        streams.push(InstanceStream { address, options });
    }
    streams
}

fn address_of(host: &v1::HostInfo) -> String {
    if host.host.contains(':') {
        format!("http://[{}]:{}", host.host, host.port)
    } else {
        format!("http://{}:{}", host.host, host.port)
    }
}

/// The task behind `StreamsClient::get_metadata_async_all`.
pub(crate) async fn run<C: crate::RecordCallback>(
    client: StreamsClient,
    store: String,
    options: MetadataOptions,
    mut callback: Guarded<C>,
) {
    if let Err(error) = options.validate() {
        callback.call(Err(error));
        return;
    }
    let cancel: Arc<CancelState> = callback.cancel.clone();
    let context = Arc::new(Context {
        client,
        store,
        options,
        peers: Mutex::new(Vec::new()),
    });
    let opened = tokio::select! {
        biased;
        () = cancel.cancelled() => return,
        opened = open_all(&context) => opened,
    };
    let (opened, orphans) = match opened {
        Ok(opened) => opened,
        Err(error) => {
            callback.call(Err(error));
            return;
        }
    };
    let mut fan_in = FanIn::new(context, callback);
    for (partitions, stream) in opened {
        fan_in.insert(partitions, stream);
    }
    for (partition, error) in orphans {
        fan_in.orphan(partition, &error);
    }
    fan_in.run(&cancel).await;
}

/// What every stream of one fan-in shares, the reopening tasks included.
struct Context {
    client: StreamsClient,
    store: String,
    options: MetadataOptions,
    /// Every instance address a metadata answer listed: asked for metadata
    /// when `client`'s own server is the one that went away.
    peers: Mutex<Vec<String>>,
}

/// One stream's items, then `None` once it ended (a `StreamMap` drops an
/// ended stream without a word, and an open stream ending means its
/// partitions have to be looked for).
type Events = Pin<Box<dyn Stream<Item = Option<Result<v1::GetMetadataAsyncResponse, tonic::Status>>> + Send>>;

fn events(stream: tonic::Streaming<v1::GetMetadataAsyncResponse>) -> Events {
    Box::pin(stream.map(Some).chain(tokio_stream::once(None)))
}

/// A reopening task's answer for one partition.
struct Reopened {
    partition: u32,
    result: Result<Resumed, ClientError>,
}

struct Resumed {
    stream: tonic::Streaming<v1::GetMetadataAsyncResponse>,
    owner: String,
    /// Where the stream starts (`None`: the subscription's own start).
    from: Option<i64>,
    /// Set when the owner retains outcomes from this offset on only, above
    /// the one asked for.
    available: Option<i64>,
}

/// The merge loop: live streams, partitions being looked for, and what has
/// been delivered of each partition.
struct FanIn<C> {
    context: Arc<Context>,
    callback: Guarded<C>,
    streams: StreamMap<usize, Events>,
    next_key: usize,
    /// The partitions each live stream carries.
    carries: HashMap<usize, Vec<u32>>,
    /// Resumed streams that delivered nothing new yet: the repeats a
    /// partition had dropped when its stream resumed, to log how many the
    /// new owner sent before its first new record.
    resumed: HashMap<usize, u64>,
    follows: BTreeMap<u32, PartitionFollow>,
    reopening: JoinSet<Reopened>,
    coalescer: Option<Coalescer>,
}

impl<C: crate::RecordCallback> FanIn<C> {
    fn new(context: Arc<Context>, callback: Guarded<C>) -> Self {
        let coalescer = context
            .options
            .coalesce
            .then(|| Coalescer::new(&context.store, context.options.in_order));
        FanIn {
            context,
            callback,
            streams: StreamMap::new(),
            next_key: 0,
            carries: HashMap::new(),
            resumed: HashMap::new(),
            follows: BTreeMap::new(),
            reopening: JoinSet::new(),
            coalescer,
        }
    }

    fn insert(
        &mut self,
        partitions: Vec<u32>,
        stream: tonic::Streaming<v1::GetMetadataAsyncResponse>,
    ) -> usize {
        let key = self.next_key;
        self.next_key += 1;
        self.carries.insert(key, partitions);
        self.streams.insert(key, events(stream));
        key
    }

    fn follow(&mut self, partition: u32) -> &mut PartitionFollow {
        let start = match &self.context.options.start {
            Start::Offsets(offsets) => offsets.get(&partition).copied(),
            _ => None,
        };
        self.follows
            .entry(partition)
            .or_insert_with(|| PartitionFollow::new(partition, start))
    }

    /// Starts looking for `partition`'s owner, to resume after what was delivered.
    fn orphan(&mut self, partition: u32, error: &ClientError) {
        let Some(deadline) = self.context.options.follow_moves else {
            return;
        };
        let from = self.follow(partition).resume_from();
        tracing::info!(
            store = %self.context.store,
            partition,
            resume_from = from,
            %error,
            "the stream of a partition ended; looking for its owner"
        );
        let context = self.context.clone();
        self.reopening.spawn(async move {
            let result = reopen(&context, partition, from, Instant::now() + deadline).await;
            Reopened { partition, result }
        });
    }

    async fn run(mut self, cancel: &CancelState) {
        loop {
            if self.streams.is_empty() && self.reopening.is_empty() {
                if let Some(coalescer) = self.coalescer.take() {
                    self.callback.call(Ok(coalescer.finish()));
                }
                return;
            }
            // Returning drops every stream, which tells each server the
            // subscriber is gone, and aborts every reopening task.
            tokio::select! {
                biased;
                () = cancel.cancelled() => return,
                Some(reopened) = self.reopening.join_next(), if !self.reopening.is_empty() => {
                    let Ok(reopened) = reopened else {
                        // Only a panic gets here (an abort needs the set dropped).
                        self.callback.call(Err(ClientError::Other {
                            code: tonic::Code::Internal,
                            message: "the task following a partition panicked".into(),
                        }));
                        return;
                    };
                    if !self.resumed(reopened) {
                        return;
                    }
                }
                next = self.streams.next(), if !self.streams.is_empty() => {
                    // `None`: the last stream ran out in this very poll; the
                    // loop's check above decides what follows.
                    if let Some((key, event)) = next
                        && !self.event(key, event)
                    {
                        return;
                    }
                }
            }
        }
    }

    /// A partition's new stream, or the end of looking for it; false when
    /// the subscription is over.
    fn resumed(&mut self, reopened: Reopened) -> bool {
        let partition = reopened.partition;
        let resumed = match reopened.result {
            Ok(resumed) => resumed,
            Err(error) => {
                self.callback.call(Err(error));
                return false;
            }
        };
        self.follow(partition).resume();
        if let Some(available) = resumed.available {
            for gap in self.follow(partition).missed_until(available) {
                tracing::warn!(
                    store = %self.context.store,
                    partition,
                    first_offset = gap.first,
                    last_offset = gap.last,
                    owner = %resumed.owner,
                    "the new owner no longer holds these outcomes: reported in-band as lagged"
                );
                self.callback.call(Err(ClientError::LaggedOffsets {
                    partition,
                    first_offset: gap.first,
                    last_offset: gap.last,
                }));
                if self.coalescer.is_some() {
                    return false;
                }
            }
        }
        tracing::info!(
            store = %self.context.store,
            partition,
            owner = %resumed.owner,
            resume_from = resumed.available.or(resumed.from),
            "followed the partition to its owner"
        );
        let duplicates = self.follow(partition).duplicates();
        let key = self.insert(vec![partition], resumed.stream);
        self.resumed.insert(key, duplicates);
        true
    }

    /// One event of a live stream; false when the subscription is over.
    fn event(
        &mut self,
        key: usize,
        event: Option<Result<v1::GetMetadataAsyncResponse, tonic::Status>>,
    ) -> bool {
        match event {
            Some(Ok(v1::GetMetadataAsyncResponse {
                event: Some(Event::Batch(batch)),
            })) => {
                let partition = batch.partition;
                let follow = self.follow(partition);
                let Some(batch) = follow.accept(batch) else {
                    return true;
                };
                if let Some(before) = self.resumed.remove(&key) {
                    let repeats = self.follow(partition).duplicates() - before;
                    tracing::info!(
                        store = %self.context.store,
                        partition,
                        first_offset = batch.first_offset,
                        repeats_dropped = repeats,
                        "the resumed stream delivers again"
                    );
                }
                match &mut self.coalescer {
                    Some(coalescer) => coalescer.push(batch),
                    None => self.callback.call(Ok(MetadataBatch::from(batch))),
                }
                true
            }
            Some(Ok(v1::GetMetadataAsyncResponse {
                event: Some(Event::Lagged(lagged)),
            })) => {
                self.callback.call(Err(ClientError::Lagged {
                    missed_batches: lagged.missed_batches,
                }));
                self.coalescer.is_none()
            }
            Some(Ok(v1::GetMetadataAsyncResponse { event: None })) => true,
            Some(Err(status)) => {
                self.streams.remove(&key);
                self.resumed.remove(&key);
                let partitions = self.carries.remove(&key).unwrap_or_default();
                let error = ClientError::from_status(&status);
                if self.context.options.follow_moves.is_none() || !error.is_retryable() {
                    self.callback.call(Err(error));
                    return false;
                }
                for partition in partitions {
                    self.orphan(partition, &error);
                }
                true
            }
            None => {
                self.streams.remove(&key);
                self.resumed.remove(&key);
                let partitions = self.carries.remove(&key).unwrap_or_default();
                // A bounded stream that completed is done; an open one only
                // ends when its server let the partitions go.
                if !self.context.options.end.is_bounded() {
                    let error = ClientError::NotAvailable {
                        message: "the stream ended".into(),
                        retry_after: None,
                    };
                    for partition in partitions {
                        self.orphan(partition, &error);
                    }
                }
                true
            }
        }
    }
}

/// Between two attempts to find a moved partition's owner: from this, doubling.
const FIRST_BACKOFF: Duration = Duration::from_millis(100);
const MAX_BACKOFF: Duration = Duration::from_secs(2);

/// Why one attempt to reopen a partition failed.
enum Attempt {
    /// The owner retains outcomes from this offset on only.
    OutOfRange(i64),
    /// No owner yet, or it cannot be reached or is rebalancing: try again.
    Retry(ClientError),
    /// An answer that will not change (the store is gone, access denied).
    Fatal(ClientError),
}

/// Looks for `partition`'s owner until `deadline` and opens a stream there
/// from `from` (`None`: the subscription's own start).
async fn reopen(
    context: &Context,
    partition: u32,
    from: Option<i64>,
    deadline: Instant,
) -> Result<Resumed, ClientError> {
    let mut start = from;
    let mut available = None;
    let mut backoff = FIRST_BACKOFF;
    let mut attempt = 0usize;
    loop {
        match open_partition(context, partition, start, attempt).await {
            Ok((stream, owner)) => {
                return Ok(Resumed {
                    stream,
                    owner,
                    from,
                    available,
                });
            }
            Err(Attempt::OutOfRange(earliest)) if start.is_some_and(|s| earliest > s) => {
                available = Some(earliest);
                start = Some(earliest);
            }
            Err(Attempt::OutOfRange(earliest)) => {
                return Err(ClientError::OutOfRange {
                    message: format!(
                        "partition {partition}: the owner retains outcomes from offset {earliest} on, \
                         and refused {start:?}"
                    ),
                });
            }
            Err(Attempt::Fatal(error)) => return Err(error),
            Err(Attempt::Retry(error)) => {
                let wait = error.retry_after().unwrap_or(backoff).min(MAX_BACKOFF);
                if Instant::now() + wait > deadline {
                    return Err(ClientError::NotAvailable {
                        message: format!(
                            "partition {partition} of {}: no instance serves it within the follow \
                             deadline; last: {error}",
                            context.store
                        ),
                        retry_after: None,
                    });
                }
                tracing::debug!(partition, %error, ?wait, "the partition's owner is not there yet");
                tokio::time::sleep(wait).await;
                backoff = (backoff * 2).min(MAX_BACKOFF);
                attempt += 1;
            }
        }
    }
}

/// One attempt: who holds `partition` now, and a stream from there.
async fn open_partition(
    context: &Context,
    partition: u32,
    start: Option<i64>,
    attempt: usize,
) -> Result<(tonic::Streaming<v1::GetMetadataAsyncResponse>, String), Attempt> {
    let metadata = current_metadata(context).await?;
    let mut options = context.options.clone();
    options.partitions = vec![partition];
    if let Some(start) = start {
        options.start = Start::Offsets(BTreeMap::from([(partition, start)]));
    }
    let owners: Vec<InstanceStream> = plan(&metadata, &options);
    if owners.is_empty() {
        return Err(Attempt::Retry(ClientError::NotAvailable {
            message: format!("no instance lists partition {partition} yet"),
            retry_after: None,
        }));
    }
    // While the metadata is stale, two instances may list the partition:
    // take turns.
    let owner = &owners[attempt % owners.len()];
    let peer = connect_owner(
        context,
        &owner.address,
        owners.len() == 1 && metadata.metadata.len() == 1,
    )
    .await
    .map_err(retry_or_fatal)?;
    match peer
        .streams()
        .get_metadata_async(owner.options.to_request(&context.store))
        .await
    {
        Ok(response) => Ok((response.into_inner(), owner.address.clone())),
        Err(status) => match out_of_range_earliest(&status) {
            Some((p, earliest)) if p == partition => Err(Attempt::OutOfRange(earliest)),
            _ => Err(retry_or_fatal(ClientError::from_status(&status))),
        },
    }
}

/// While a partition moves, an instance may still say it is not its own.
fn retry_or_fatal(error: ClientError) -> Attempt {
    if error.is_retryable() || matches!(error, ClientError::NotHosted { .. }) {
        Attempt::Retry(error)
    } else {
        Attempt::Fatal(error)
    }
}

/// The store's metadata from this client's server, or, when it does not
/// answer, from any instance seen before.
async fn current_metadata(context: &Context) -> Result<v1::ProcessMetadataForStoreResponse, Attempt> {
    let first = match context
        .client
        .process_metadata_for_store(&context.store, context.options.in_order)
        .await
    {
        Ok(metadata) => {
            remember_peers(context, &metadata);
            return Ok(metadata);
        }
        Err(error) => error,
    };
    let first = retry_or_fatal(first);
    let Attempt::Retry(_) = &first else {
        return Err(first);
    };
    let peers = lock(&context.peers).clone();
    for address in peers {
        let Ok(peer) = context.client.connect_peer(&address).await else {
            continue;
        };
        if let Ok(metadata) = peer
            .process_metadata_for_store(&context.store, context.options.in_order)
            .await
        {
            remember_peers(context, &metadata);
            return Ok(metadata);
        }
    }
    Err(first)
}

/// A client of the instance at `address`. When it cannot be reached and
/// it is the only instance listed, this client's own server: one server
/// (the embedded log) advertises its `application_server`, which may be a
/// name only others resolve, and it can only be the server asked.
async fn connect_owner(context: &Context, address: &str, only: bool) -> Result<StreamsClient, ClientError> {
    match context.client.connect_peer(address).await {
        Err(error) if only && error.is_retryable() => {
            tracing::debug!(address, %error, "the only instance listed is not reachable as advertised; using the server asked");
            Ok(context.client.clone())
        }
        connected => connected,
    }
}

fn remember_peers(context: &Context, metadata: &v1::ProcessMetadataForStoreResponse) {
    let mut peers = lock(&context.peers);
    for instance in &metadata.metadata {
        if let Some(host) = &instance.host_info {
            let address = address_of(host);
            if !peers.contains(&address) {
                peers.push(address);
            }
        }
    }
}

/// A poisoned lock only means a panic elsewhere; the list is still usable.
fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

type Opened = Vec<(Vec<u32>, tonic::Streaming<v1::GetMetadataAsyncResponse>)>;

/// Asks the client's server which instances hold the store and opens a
/// stream to each. The first refusal is the answer, except, when following
/// moves, an instance that cannot be reached or is not ready: its
/// partitions come back as orphans to look for.
async fn open_all(context: &Context) -> Result<(Opened, Vec<(u32, ClientError)>), ClientError> {
    let options = &context.options;
    let metadata = context
        .client
        .process_metadata_for_store(&context.store, options.in_order)
        .await?;
    remember_peers(context, &metadata);
    let mut opened = Vec::new();
    let mut orphans = Vec::new();
    let only = metadata.metadata.len() == 1;
    for instance in plan(&metadata, options) {
        let stream = async {
            let peer = connect_owner(context, &instance.address, only).await?;
            Ok::<_, ClientError>(
                peer.streams()
                    .get_metadata_async(instance.options.to_request(&context.store))
                    .await?
                    .into_inner(),
            )
        };
        match stream.await {
            Ok(stream) => opened.push((instance.options.partitions, stream)),
            Err(error) if options.follow_moves.is_some() && error.is_retryable() => {
                orphans.extend(instance.options.partitions.iter().map(|&p| (p, error.clone())));
            }
            Err(error) => return Err(error),
        }
    }
    Ok((opened, orphans))
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use std::collections::HashMap;

    use tokio::sync::mpsc;
    use tonic::Status;

    use super::*;
    use crate::test_server::{Fake, batch, serve};

    type Outcome = Result<MetadataBatch, ClientError>;

    fn instance(addr: std::net::SocketAddr, partitions: &[u32]) -> v1::StreamsMetadata {
        v1::StreamsMetadata {
            host_info: Some(v1::HostInfo {
                host: addr.ip().to_string(),
                port: u32::from(addr.port()),
            }),
            topic_partitions: partitions
                .iter()
                .map(|&partition| v1::TopicPartition {
                    topic: "events".into(),
                    partition,
                })
                .collect(),
            ..Default::default()
        }
    }

    #[test]
    fn each_instance_is_asked_for_its_own_partitions_only() {
        let metadata = v1::ProcessMetadataForStoreResponse {
            metadata: vec![
                instance("10.0.0.1:1".parse().unwrap(), &[0, 2]),
                instance("10.0.0.2:2".parse().unwrap(), &[1, 3]),
                instance("[::1]:3".parse().unwrap(), &[4]),
            ],
            ..Default::default()
        };
        let all = plan(&metadata, &MetadataOptions::bounded().coalesce(true));
        let asked: Vec<(&str, &[u32], bool)> = all
            .iter()
            .map(|s| (s.address.as_str(), &s.options.partitions[..], s.options.coalesce))
            .collect();
        assert_eq!(
            asked,
            vec![
                ("http://10.0.0.1:1", &[0, 2][..], false),
                ("http://10.0.0.2:2", &[1, 3][..], false),
                ("http://[::1]:3", &[4][..], false),
            ]
        );
        let options = MetadataOptions::default()
            .start(Start::Offsets(BTreeMap::from([(1, 5), (2, 7)])))
            .end(End::Current);
        let narrowed = plan(&metadata, &options);
        assert_eq!(
            narrowed.len(),
            2,
            "the instance with neither partition is skipped"
        );
        assert_eq!(narrowed[0].options.partitions, vec![2]);
        assert_eq!(
            narrowed[0].options.start,
            Start::Offsets(BTreeMap::from([(2, 7)]))
        );
        assert_eq!(
            narrowed[1].options.start,
            Start::Offsets(BTreeMap::from([(1, 5)]))
        );
        let only = plan(&metadata, &MetadataOptions::default().partitions([3]));
        assert_eq!(only.len(), 1);
        assert_eq!(only[0].options.partitions, vec![3]);
    }

    /// Two instances, partition 0 on one and 1 on the other; the first
    /// answers the metadata for both.
    async fn two_instances(
        first: Fake,
        second: Fake,
    ) -> (StreamsClient, std::sync::Arc<Fake>, std::sync::Arc<Fake>) {
        let (client, a, a_addr) = serve(first).await;
        let (_, b, b_addr) = serve(second).await;
        *a.instances.lock().expect("lock") = vec![instance(a_addr, &[0]), instance(b_addr, &[1])];
        (client, a, b)
    }

    #[tokio::test]
    async fn streams_of_every_instance_merge_into_one_sequence() {
        let (client, a, b) = two_instances(
            Fake {
                stream: vec![batch(0, 0..=2), batch(0, 3..=4)],
                ..Default::default()
            },
            Fake {
                stream: vec![batch(1, 0..=1)],
                ..Default::default()
            },
        )
        .await;
        let (tx, mut rx) = mpsc::unbounded_channel();
        client
            .get_metadata_async_all(
                "counts",
                MetadataOptions::bounded().in_order(true),
                move |result: Outcome| drop(tx.send(result)),
            )
            .join()
            .await;
        let mut seen: BTreeMap<u32, Vec<i64>> = BTreeMap::new();
        let mut callbacks = 0;
        while let Ok(outcome) = rx.try_recv() {
            callbacks += 1;
            for record in outcome.expect("a batch").records {
                seen.entry(record.partition).or_default().push(record.offset);
            }
        }
        assert_eq!(callbacks, 3, "one callback per streamed batch");
        assert_eq!(seen, BTreeMap::from([(0, vec![0, 1, 2, 3, 4]), (1, vec![0, 1])]));
        for (fake, partitions) in [(&a, vec![0]), (&b, vec![1])] {
            let request = fake.last_request.lock().expect("lock").clone().expect("a stream");
            assert_eq!(request.partitions, partitions);
            assert!(request.in_order);
        }

        // Coalesced: one callback with everything, in offset order per partition.
        let (tx, mut rx) = mpsc::unbounded_channel();
        client
            .get_metadata_async_all(
                "counts",
                MetadataOptions::bounded().in_order(true).coalesce(true),
                move |result: Outcome| drop(tx.send(result)),
            )
            .join()
            .await;
        let all = rx.try_recv().expect("one callback").expect("ok");
        assert!(rx.try_recv().is_err(), "exactly one callback");
        let keys: Vec<(u32, i64)> = all.records.iter().map(|r| (r.partition, r.offset)).collect();
        let expected: Vec<(u32, i64)> = (0..5).map(|o| (0, o)).chain((0..2).map(|o| (1, o))).collect();
        assert_eq!(keys, expected);
    }

    #[tokio::test]
    async fn one_instance_failing_is_the_one_final_error() {
        let (client, a, _) = two_instances(
            Fake {
                stream: vec![batch(0, 0..=1)],
                hold_open: true,
                ..Default::default()
            },
            Fake {
                stream: vec![Err(Status::unavailable("rebalancing"))],
                ..Default::default()
            },
        )
        .await;
        let (tx, mut rx) = mpsc::unbounded_channel();
        let handle = client.get_metadata_async_all(
            "counts",
            MetadataOptions::follow().follow_moves(None),
            move |result: Outcome| drop(tx.send(result)),
        );
        tokio::time::timeout(Duration::from_secs(5), handle.join())
            .await
            .expect("the merged stream ends with the error");
        let mut outcomes = Vec::new();
        while let Ok(outcome) = rx.try_recv() {
            outcomes.push(outcome);
        }
        let errors: Vec<&ClientError> = outcomes.iter().filter_map(|o| o.as_ref().err()).collect();
        assert_eq!(errors.len(), 1, "{outcomes:?}");
        assert!(
            matches!(errors[0], ClientError::NotAvailable { .. }),
            "{errors:?}"
        );
        assert!(
            matches!(outcomes.last(), Some(Err(_))),
            "the error is the last callback"
        );
        assert!(a.gone.wait().await, "the other instance's stream was closed");
    }

    /// Partition 0 starts on `a`, whose stream breaks after offsets 0..=4
    /// (and, asked again, sends them again and breaks again) until the
    /// metadata names `b`; answers what the subscriber saw and `b`'s request.
    async fn moved_to(b: Fake) -> (Vec<Outcome>, v1::GetMetadataAsyncRequest) {
        let (client, a, a_addr) = serve(Fake {
            stream: vec![
                batch(0, 0..=4),
                Err(Status::unavailable("partition 0 moved away")),
            ],
            ..Default::default()
        })
        .await;
        let (_, b, b_addr) = serve(b).await;
        *a.instances.lock().expect("lock") = vec![instance(a_addr, &[0])];
        let (tx, mut rx) = mpsc::unbounded_channel();
        let handle = client.get_metadata_async_all(
            "counts",
            MetadataOptions::follow().in_order(true),
            move |result: Outcome| drop(tx.send(result)),
        );
        let mut seen = Vec::new();
        let first = tokio::time::timeout(Duration::from_secs(5), rx.recv()).await;
        seen.push(first.expect("the first batch").expect("open"));
        // A few rounds on the stale owner before the metadata moves on.
        tokio::time::sleep(Duration::from_millis(400)).await;
        *a.instances.lock().expect("lock") = vec![instance(b_addr, &[0])];
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        // Until offset 9 (the new owner's last) arrived, or the deadline.
        while !delivered(&seen).contains(&9) {
            match tokio::time::timeout_at(deadline, rx.recv()).await {
                Ok(Some(outcome)) => seen.push(outcome),
                _ => break,
            }
        }
        handle.cancel();
        handle.join().await;
        let request = b.last_request.lock().expect("lock").clone().expect("b was asked");
        (seen, request)
    }

    fn delivered(seen: &[Outcome]) -> Vec<i64> {
        seen.iter()
            .filter_map(|o| o.as_ref().ok())
            .flat_map(|b| b.records.iter().map(|r| r.offset))
            .collect()
    }

    #[tokio::test]
    async fn a_moved_partition_resumes_on_its_new_owner_after_the_last_offset_without_repeats() {
        let (seen, request) = moved_to(Fake {
            // The new owner re-processed from its last commit, 3.
            stream: vec![batch(0, 3..=9)],
            hold_open: true,
            ..Default::default()
        })
        .await;
        assert_eq!(delivered(&seen), (0..=9).collect::<Vec<_>>(), "{seen:?}");
        assert!(
            seen.iter().all(Result::is_ok),
            "no error reaches the callback: {seen:?}"
        );
        assert_eq!(request.start_offsets, HashMap::from([(0, 5)]));
        assert_eq!(request.partitions, vec![0]);
        assert!(request.in_order);
    }

    #[tokio::test]
    async fn offsets_the_new_owner_no_longer_holds_are_one_in_band_lagged_notice() {
        let (seen, request) = moved_to(Fake {
            stream: vec![batch(0, 8..=9)],
            hold_open: true,
            earliest: Some(8),
            ..Default::default()
        })
        .await;
        assert_eq!(delivered(&seen), vec![0, 1, 2, 3, 4, 8, 9], "{seen:?}");
        let notices: Vec<&ClientError> = seen.iter().filter_map(|o| o.as_ref().err()).collect();
        assert_eq!(
            notices,
            vec![&ClientError::LaggedOffsets {
                partition: 0,
                first_offset: 5,
                last_offset: 7
            }]
        );
        assert!(
            matches!(seen.get(1), Some(Err(ClientError::LaggedOffsets { .. }))),
            "the notice comes before the resumed batches: {seen:?}"
        );
        assert_eq!(request.start_offsets, HashMap::from([(0, 8)]));
    }

    #[tokio::test]
    async fn a_partition_nobody_takes_over_ends_the_subscription_at_the_follow_deadline() {
        let (client, a, a_addr) = serve(Fake {
            stream: vec![batch(0, 0..=1), Err(Status::unavailable("moved"))],
            ..Default::default()
        })
        .await;
        *a.instances.lock().expect("lock") = vec![instance(a_addr, &[0])];
        // The stale owner refuses from now on.
        let (tx, mut rx) = mpsc::unbounded_channel();
        let handle = client.get_metadata_async_all(
            "counts",
            MetadataOptions::follow().follow_moves(Some(Duration::from_millis(600))),
            move |result: Outcome| drop(tx.send(result)),
        );
        let first = tokio::time::timeout(Duration::from_secs(5), rx.recv()).await;
        assert!(matches!(first, Ok(Some(Ok(_)))));
        *a.instances.lock().expect("lock") = Vec::new();
        tokio::time::timeout(Duration::from_secs(10), handle.join())
            .await
            .expect("the deadline ends it");
        let mut last = None;
        while let Ok(outcome) = rx.try_recv() {
            last = Some(outcome);
        }
        assert!(
            matches!(&last, Some(Err(ClientError::NotAvailable { message, .. })) if message.contains("deadline")),
            "{last:?}"
        );
    }
}
