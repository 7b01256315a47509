//! Queries forwarded to the instance that holds their partitions (Kafka
//! mode): one lazily connected channel per peer, reused by every call, each
//! call bounded by `FORWARD_TIMEOUT`; over TLS when this instance serves TLS
//! (`tls::peer_tls_config`: the peer's certificate checked against
//! `tls_peer_ca` for its advertised host, this instance's certificate offered). A forwarded request always carries
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
use tonic::transport::{Channel, ClientTlsConfig, Endpoint};

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
    /// `None`: plain HTTP/2 (this instance, like its peers, serves plain text).
    tls: Option<ClientTlsConfig>,
}

impl Peers {
    /// Peers reached over TLS with `tls`, or over plain HTTP/2 without.
    pub fn new(tls: Option<ClientTlsConfig>) -> Peers {
        Peers {
            clients: Mutex::default(),
            tls,
        }
    }

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
        let unusable = |e: tonic::transport::Error| ServiceError::PeerUnreachable {
            host: host.to_string(),
            reason: format!("not a usable address: {e}"),
        };
        let scheme = if self.tls.is_some() { "https" } else { "http" };
        let mut endpoint = Endpoint::from_shared(format!("{scheme}://{host}")).map_err(unusable)?;
        if let Some(tls) = &self.tls {
            // The server name checked against the peer's certificate is the host it
            // advertises (`application_server`), taken from the address.
            endpoint = endpoint.tls_config(tls.clone()).map_err(unusable)?;
        }
        let channel = endpoint
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

    /// A file of the test certificates in tests/data/tls (see its make.sh).
    fn test_cert(name: &str) -> std::path::PathBuf {
        std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../tests/data/tls")
            .join(name)
    }

    fn tls_config(client_ca: Option<&str>, peer_ca: Option<&str>) -> crate::config::Config {
        crate::config::Config {
            tls_cert: Some(test_cert("server.pem")),
            tls_key: Some(test_cert("server.key")),
            tls_client_ca: client_ca.map(test_cert),
            tls_peer_ca: peer_ca.map(test_cert),
            ..crate::config::Config::embedded_default()
        }
    }

    /// A peer that serves only health over TLS with the test certificate, on every
    /// address, requiring client certificates that `client_ca` signed: a Query that gets
    /// through TLS is answered UNIMPLEMENTED by it. Answers its port.
    async fn tls_peer(client_ca: &str) -> u16 {
        let tls = super::super::tls::server_tls_config(&tls_config(Some(client_ca), None))
            .expect("the test certificates")
            .expect("TLS");
        let listener = tokio::net::TcpListener::bind("0.0.0.0:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let (_, health) = tonic_health::server::health_reporter();
        let server = tonic::transport::Server::builder()
            .tls_config(tls)
            .expect("a TLS server")
            .add_service(health)
            .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener));
        tokio::spawn(server);
        port
    }

    fn tls_peers(peer_ca: &str) -> Peers {
        let tls = super::super::tls::peer_tls_config(&tls_config(None, Some(peer_ca)))
            .expect("the test certificates");
        assert!(tls.is_some(), "TLS to peers with tls_cert and tls_peer_ca");
        Peers::new(tls)
    }

    async fn ask(peers: &Peers, host: &str, port: u16) -> ServiceError {
        let owner = HostInfo {
            host: host.into(),
            port,
        };
        peers
            .query(&owner, pb::QueryRequest::default(), None)
            .await
            .expect_err("the peer serves no StreamsService")
    }

    /// `error` is PeerUnreachable, its reason holding `says` (rustls' words, passed on).
    fn assert_unreachable(error: ServiceError, what: &str, says: &str) {
        match error {
            ServiceError::PeerUnreachable { reason, .. } => {
                assert!(reason.contains(says), "{what}: `{says}` not in `{reason}`");
            }
            other => panic!("{what}: expected PeerUnreachable, got {other:?}"),
        }
    }

    /// Forwarding over TLS reaches a peer that requires client certificates (this
    /// instance's own is offered) and whose certificate `tls_peer_ca` signed for the host
    /// asked; a peer signed by another CA, a host its certificate does not name, plain
    /// HTTP/2, and a peer that trusts another client CA are all unreachable.
    #[tokio::test]
    async fn forwarding_over_tls_checks_the_peer_and_presents_this_instances_certificate() {
        let port = tls_peer("ca.pem").await;
        match ask(&tls_peers("ca.pem"), "127.0.0.1", port).await {
            ServiceError::Peer { code, .. } => assert_eq!(code, Code::Unimplemented),
            other => panic!("expected the peer's own answer, got {other:?}"),
        }
        // The name in the certificate is checked too: `localhost` is in it.
        match ask(&tls_peers("ca.pem"), "localhost", port).await {
            ServiceError::Peer { code, .. } => assert_eq!(code, Code::Unimplemented),
            other => panic!("expected the peer's own answer, got {other:?}"),
        }
        assert_unreachable(
            ask(&tls_peers("other-ca.pem"), "127.0.0.1", port).await,
            "a peer CA that did not sign the peer's certificate",
            "UnknownIssuer",
        );
        // The same listener on another loopback address, which the certificate does not name.
        assert_unreachable(
            ask(&tls_peers("ca.pem"), "127.0.0.2", port).await,
            "a host the peer's certificate does not name",
            "not valid for name \"127.0.0.2\"",
        );
        assert_unreachable(
            ask(&Peers::default(), "127.0.0.1", port).await,
            "plain HTTP/2 to a TLS peer",
            "transport error",
        );
        let strict = tls_peer("other-ca.pem").await;
        assert_unreachable(
            ask(&tls_peers("ca.pem"), "127.0.0.1", strict).await,
            "a peer whose client CA did not sign this instance's certificate",
            "transport error",
        );
    }
}
