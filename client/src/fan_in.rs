//! `GetMetadataAsync` on every instance of an application (Kafka mode): the
//! instances `ProcessMetadataForStore` lists, one stream to each for the
//! partitions it holds, merged into one [`RecordCallback`] sequence with the
//! contract of a single stream (one `Ok` per batch or one coalesced, one
//! `Err` that ends it all, `Err(Lagged)` per notice). A partition lives on one
//! instance, so each partition's batches keep their offset order.

use std::collections::BTreeMap;

use taskstream::v1::{self, get_metadata_async_response::Event};
use tokio_stream::{StreamExt, StreamMap};

use crate::{
    ClientError, StreamsClient,
    callback::{CancelState, Guarded},
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
        let address = if host.host.contains(':') {
            format!("http://[{}]:{}", host.host, host.port)
        } else {
            format!("http://{}:{}", host.host, host.port)
        };
        streams.push(InstanceStream { address, options });
    }
    streams
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
    let cancel: std::sync::Arc<CancelState> = callback.cancel.clone();
    let opened = tokio::select! {
        biased;
        () = cancel.cancelled() => return,
        opened = open_all(&client, &store, &options) => opened,
    };
    let mut streams = match opened {
        Ok(streams) => streams,
        Err(error) => {
            callback.call(Err(error));
            return;
        }
    };
    let mut coalescer = options.coalesce.then(|| Coalescer::new(&store, options.in_order));
    loop {
        // Returning drops every stream, which tells each server the
        // subscriber is gone.
        let next = tokio::select! {
            biased;
            () = cancel.cancelled() => return,
            next = streams.next() => next,
        };
        match next {
            Some((
                _,
                Ok(v1::GetMetadataAsyncResponse {
                    event: Some(Event::Batch(batch)),
                }),
            )) => match &mut coalescer {
                Some(coalescer) => coalescer.push(batch),
                None => callback.call(Ok(MetadataBatch::from(batch))),
            },
            Some((
                _,
                Ok(v1::GetMetadataAsyncResponse {
                    event: Some(Event::Lagged(lagged)),
                }),
            )) => {
                callback.call(Err(ClientError::Lagged {
                    missed_batches: lagged.missed_batches,
                }));
                if coalescer.is_some() {
                    return;
                }
            }
            Some((_, Ok(v1::GetMetadataAsyncResponse { event: None }))) => {}
            Some((_, Err(status))) => {
                callback.call(Err(ClientError::from_status(&status)));
                return;
            }
            // Every stream completed.
            None => {
                if let Some(coalescer) = coalescer {
                    callback.call(Ok(coalescer.finish()));
                }
                return;
            }
        }
    }
}

type Streams = StreamMap<usize, tonic::Streaming<v1::GetMetadataAsyncResponse>>;

/// Asks `client` which instances hold `store` and opens a stream to each.
/// The first refusal (of the metadata or of a stream) is the answer.
async fn open_all(
    client: &StreamsClient,
    store: &str,
    options: &MetadataOptions,
) -> Result<Streams, ClientError> {
    let metadata = client.process_metadata_for_store(store, options.in_order).await?;
    let mut streams = StreamMap::new();
    for (index, instance) in plan(&metadata, options).into_iter().enumerate() {
        let peer = client.connect_peer(&instance.address).await?;
        let stream = peer
            .streams()
            .get_metadata_async(instance.options.to_request(store))
            .await?
            .into_inner();
        streams.insert(index, stream);
    }
    Ok(streams)
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

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
        let handle =
            client.get_metadata_async_all("counts", MetadataOptions::follow(), move |result: Outcome| {
                drop(tx.send(result))
            });
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
}
