//! Queries forwarded to the instance that holds their partitions (Kafka
//! mode): one lazily connected channel per peer, reused by every call, each
//! call bounded by `FORWARD_TIMEOUT`. A forwarded request always carries
//! `local_only = true`, so an instance whose view is out of date answers
//! PARTITION_NOT_HOSTED instead of forwarding again (no loops). Failures are
//! `ServiceError`s; `status` turns them into what the client sees.
//! [`merge_pages`] joins the range pages of several instances into one.

use super::request;
use super::status::ServiceError;
use crate::metadata::HostInfo;
use crate::runtime::RangeResume;
use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Duration;
use taskstream::v1 as pb;
use taskstream::v1::streams_service_client::StreamsServiceClient;
use tonic::Code;
use tonic::transport::{Channel, Endpoint};

/// Longest wait for a peer's answer to one forwarded query.
const FORWARD_TIMEOUT: Duration = Duration::from_secs(10);

/// Longest wait to connect to a peer.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);

/// Largest answer accepted from a peer (a range over a big store), as the client's.
const MAX_MESSAGE_BYTES: usize = 64 * 1024 * 1024;

/// The other instances of the application, as gRPC clients.
#[derive(Default)]
pub struct Peers {
    /// By `host:port`. A channel reconnects by itself, so entries are kept.
    clients: Mutex<HashMap<String, StreamsServiceClient<Channel>>>,
}

impl Peers {
    /// Sends `request` to `owner` with `local_only` set, and the caller's
    /// `authorization` (its bearer token, which the owner checks as this
    /// instance did); answers its page (each result naming the host that answered).
    pub async fn query(
        &self,
        owner: &HostInfo,
        mut request: pb::QueryRequest,
        authorization: Option<tonic::metadata::MetadataValue<tonic::metadata::Ascii>>,
    ) -> Result<Page, ServiceError> {
        request.local_only = true;
        let host = owner.to_string();
        let mut client = self.client(&host)?;
        let mut request = tonic::Request::new(request);
        if let Some(authorization) = authorization {
            request.metadata_mut().insert("authorization", authorization);
        }
        match client.query(request).await {
            Ok(response) => {
                let response = response.into_inner();
                let next = request::parse_page_token(&response.next_page_token).map_err(|e| {
                    ServiceError::PeerUnreachable {
                        host: host.clone(),
                        reason: format!("answered a page token this instance cannot read: {e}"),
                    }
                })?;
                Ok(Page {
                    results: response.results,
                    next,
                })
            }
            Err(status) if is_transport(&status) => Err(ServiceError::PeerUnreachable {
                host,
                reason: status.message().to_string(),
            }),
            Err(status) => Err(ServiceError::Peer {
                host,
                code: status.code(),
                message: status.message().to_string(),
                details: status.details().to_vec().into(),
            }),
        }
    }

    fn client(&self, host: &str) -> Result<StreamsServiceClient<Channel>, ServiceError> {
        let mut clients = self.clients.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(client) = clients.get(host) {
            return Ok(client.clone());
        }
        let channel = Endpoint::from_shared(format!("http://{host}"))
            .map_err(|e| ServiceError::PeerUnreachable {
                host: host.to_string(),
                reason: format!("not a usable address: {e}"),
            })?
            .connect_timeout(CONNECT_TIMEOUT)
            .timeout(FORWARD_TIMEOUT)
            .tcp_nodelay(true)
            .connect_lazy();
        let client = StreamsServiceClient::new(channel)
            .max_decoding_message_size(MAX_MESSAGE_BYTES)
            .max_encoding_message_size(MAX_MESSAGE_BYTES);
        clients.insert(host.to_string(), client.clone());
        Ok(client)
    }
}

/// One instance's answer to a query: results by partition, and where its
/// range goes on (`None`: it is done with its partitions).
#[derive(Debug, Clone, PartialEq)]
pub struct Page {
    pub results: Vec<pb::PartitionResult>,
    pub next: Option<RangeResume>,
}

/// The pages of instances holding disjoint partitions, as one page of the
/// whole range: partitions ascending, cut where the first of them was cut
/// (what lies after it is asked again for the next page, with that token),
/// and at `max_bytes` of keys and values (at least one entry when any is
/// there), as one instance's page is.
pub fn merge_pages(pages: Vec<Page>, max_bytes: usize) -> Page {
    let cut = pages
        .iter()
        .filter_map(|page| page.next.as_ref())
        .min_by(|a, b| (a.partition, &a.key).cmp(&(b.partition, &b.key)))
        .cloned();
    let mut results: Vec<pb::PartitionResult> = pages.into_iter().flat_map(|page| page.results).collect();
    results.sort_by_key(|result| result.partition);
    let mut merged = Vec::with_capacity(results.len());
    let mut bytes = 0usize;
    let mut taken_any = false;
    for mut result in results {
        if let Some(cut) = &cut {
            if result.partition > cut.partition {
                break;
            }
            if result.partition == cut.partition {
                result.entries.retain(|entry| entry.key < cut.key);
            }
        }
        let mut over = None;
        for (index, entry) in result.entries.iter().enumerate() {
            let size = entry.key.len() + entry.value.len();
            if taken_any && bytes.saturating_add(size) > max_bytes {
                over = Some(index);
                break;
            }
            bytes += size;
            taken_any = true;
        }
        if let Some(index) = over {
            let next = RangeResume {
                partition: result.partition,
                key: result.entries[index].key.clone(),
            };
            result.entries.truncate(index);
            merged.push(result);
            return Page {
                results: merged,
                next: Some(next),
            };
        }
        merged.push(result);
    }
    Page {
        results: merged,
        next: cut,
    }
}

/// A status the transport made up (refused connection, timeout, reset), not
/// one the peer answered: this server puts details on every error it
/// answers except INTERNAL.
fn is_transport(status: &tonic::Status) -> bool {
    status.details().is_empty()
        && matches!(
            status.code(),
            Code::Unavailable | Code::Unknown | Code::Cancelled | Code::DeadlineExceeded
        )
}

#[cfg(test)]
mod tests {
    use super::*;
    use bytes::Bytes;

    fn result(partition: u32, keys: &[&'static str]) -> pb::PartitionResult {
        pb::PartitionResult {
            partition,
            entries: keys
                .iter()
                .map(|k| pb::KeyValue {
                    key: Bytes::from_static(k.as_bytes()),
                    value: Bytes::from_static(b"1"),
                })
                .collect(),
            ..Default::default()
        }
    }

    fn resume(partition: u32, key: &'static str) -> Option<RangeResume> {
        Some(RangeResume {
            partition,
            key: Bytes::from_static(key.as_bytes()),
        })
    }

    fn keys(page: &Page) -> Vec<(u32, String)> {
        page.results
            .iter()
            .flat_map(|r| {
                r.entries
                    .iter()
                    .map(move |e| (r.partition, String::from_utf8_lossy(&e.key).into_owned()))
            })
            .collect()
    }

    #[test]
    fn whole_pages_merge_by_partition() {
        let a = Page {
            results: vec![result(0, &["a", "b"]), result(2, &["c"])],
            next: None,
        };
        let b = Page {
            results: vec![result(1, &["x"]), result(3, &[])],
            next: None,
        };
        let page = merge_pages(vec![a, b], 1000);
        let partitions: Vec<u32> = page.results.iter().map(|r| r.partition).collect();
        assert_eq!(partitions, vec![0, 1, 2, 3]);
        assert_eq!(page.next, None);
    }

    #[test]
    fn a_cut_page_cuts_the_merge_and_others_are_asked_again() {
        // a stopped inside partition 2 at "m": b's partition 3 waits for the next page.
        let a = Page {
            results: vec![result(0, &["a"]), result(2, &["c", "k"])],
            next: resume(2, "m"),
        };
        let b = Page {
            results: vec![result(1, &["x"]), result(3, &["y"])],
            next: None,
        };
        let page = merge_pages(vec![a, b], 1000);
        assert_eq!(
            keys(&page),
            vec![(0, "a".into()), (1, "x".into()), (2, "c".into()), (2, "k".into())]
        );
        assert_eq!(page.next, resume(2, "m"));
    }

    #[test]
    fn the_merged_page_keeps_the_byte_budget() {
        // Each entry weighs 2 bytes: 3 entries fit in 6.
        let a = Page {
            results: vec![result(0, &["a", "b"])],
            next: None,
        };
        let b = Page {
            results: vec![result(1, &["c", "d"])],
            next: None,
        };
        let page = merge_pages(vec![a.clone(), b.clone()], 6);
        assert_eq!(
            keys(&page),
            vec![(0, "a".into()), (0, "b".into()), (1, "c".into())]
        );
        assert_eq!(page.next, resume(1, "d"));
        // One entry over the budget still makes progress.
        let page = merge_pages(vec![a, b], 1);
        assert_eq!(keys(&page), vec![(0, "a".into())]);
        assert_eq!(page.next, resume(0, "b"));
    }

    #[tokio::test]
    async fn an_instance_that_is_gone_is_unreachable() {
        // Bound, then closed: nothing listens on the port.
        let port = {
            let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
            listener.local_addr().unwrap().port()
        };
        let peers = Peers::default();
        let owner = HostInfo {
            host: "127.0.0.1".into(),
            port,
        };
        let error = peers
            .query(&owner, pb::QueryRequest::default(), None)
            .await
            .unwrap_err();
        match error {
            ServiceError::PeerUnreachable { host, .. } => assert_eq!(host, format!("127.0.0.1:{port}")),
            other => panic!("expected PeerUnreachable, got {other:?}"),
        }
        assert_eq!(
            peers.clients.lock().unwrap().len(),
            1,
            "the channel is kept for later calls"
        );
    }
}
