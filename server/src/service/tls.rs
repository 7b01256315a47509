//! TLS (rustls) of everything the server speaks over the network, from one certificate:
//!
//! - the gRPC listener ([`server_tls_config`], through tonic): `tls_cert`, `tls_key` and,
//!   for mutual TLS, `tls_client_ca`;
//! - the metrics listener with `metrics_tls` ([`metrics_tls`]): HTTPS with the same
//!   certificate, the same client CA and the same handshake timeout, since it has no
//!   authentication of its own;
//! - queries forwarded to the other instances on Kafka ([`peer_tls_config`]): their
//!   certificates are checked against `tls_peer_ca`, and this instance offers its own
//!   certificate as its client identity, which peers with `tls_client_ca` require.
//!
//! Each file is read and checked at start, so that a missing, unreadable or malformed one
//! stops the server with an error naming the setting and the file instead of failing
//! every handshake later.

use crate::config::Config;
use rustls_pki_types::pem::{self, PemObject as _};
use rustls_pki_types::{CertificateDer, PrivateKeyDer};
use std::io;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;
use tokio::net::TcpStream;
use tokio_rustls::TlsAcceptor;
use tokio_rustls::rustls::server::WebPkiClientVerifier;
use tokio_rustls::rustls::{RootCertStore, ServerConfig};
use tokio_rustls::server::TlsStream;
use tonic::transport::server::ServerTlsConfig;
use tonic::transport::{Certificate, ClientTlsConfig, Endpoint, Identity, Server};

/// A TLS file that cannot be used: which setting, and what is wrong with its file.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid setting `{setting}`: {message}")]
pub struct TlsError {
    pub setting: &'static str,
    pub message: String,
}

impl TlsError {
    fn new(setting: &'static str, message: impl Into<String>) -> Self {
        TlsError {
            setting,
            message: message.into(),
        }
    }
}

/// How the gRPC listener is secured, for the log and the banner.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TlsMode {
    Plaintext,
    /// TLS with the server's certificate.
    Tls,
    /// TLS, and clients must present a certificate signed by `tls_client_ca`.
    Mutual,
}

impl TlsMode {
    pub fn of(config: &Config) -> TlsMode {
        match (&config.tls_cert, &config.tls_client_ca) {
            (None, _) => TlsMode::Plaintext,
            (Some(_), None) => TlsMode::Tls,
            (Some(_), Some(_)) => TlsMode::Mutual,
        }
    }
}

/// The PEM files of `tls_cert` and `tls_key`, read and checked; `None` without them.
struct OwnIdentity {
    cert: Vec<u8>,
    key: Vec<u8>,
}

impl OwnIdentity {
    fn read(config: &Config) -> Result<Option<OwnIdentity>, TlsError> {
        let (cert_path, key_path) = match (&config.tls_cert, &config.tls_key) {
            (None, None) => return Ok(None),
            (Some(cert), Some(key)) => (cert, key),
            // Config::validate says the same; repeated for callers that skipped it.
            (Some(_), None) => {
                return Err(TlsError::new(
                    "tls_cert",
                    "is set but tls_key is not: TLS needs both",
                ));
            }
            (None, Some(_)) => {
                return Err(TlsError::new(
                    "tls_key",
                    "is set but tls_cert is not: TLS needs both",
                ));
            }
        };
        let cert = read("tls_cert", cert_path)?;
        certificates("tls_cert", cert_path, &cert)?;
        let key = read("tls_key", key_path)?;
        private_key(key_path, &key)?;
        Ok(Some(OwnIdentity { cert, key }))
    }

    /// The error of rustls refusing this certificate and key (with `ca`, a CA used beside them).
    fn refused(
        config: &Config,
        ca: Option<(&str, &Path)>,
        error: &(dyn std::error::Error + 'static),
    ) -> TlsError {
        let path = |p: &Option<std::path::PathBuf>| p.as_deref().map(Path::display).map(|d| d.to_string());
        TlsError::new(
            "tls_key",
            format!(
                "rustls refused the certificate `{}` with the key `{}`{}: {}",
                path(&config.tls_cert).unwrap_or_default(),
                path(&config.tls_key).unwrap_or_default(),
                match ca {
                    Some((what, ca)) => format!(" and {what} `{}`", ca.display()),
                    None => String::new(),
                },
                error_chain(error)
            ),
        )
    }
}

/// The TLS configuration of `config`'s gRPC listener, `None` when it serves plain text
/// (no `tls_cert`). Reads and checks every file, and lets rustls build its acceptor once,
/// so a key that does not belong to the certificate is found here too.
pub fn server_tls_config(config: &Config) -> Result<Option<ServerTlsConfig>, TlsError> {
    let Some(identity) = OwnIdentity::read(config)? else {
        if config.tls_client_ca.is_some() {
            return Err(TlsError::new(
                "tls_client_ca",
                "is set but tls_cert is not: client certificates are checked only over TLS; \
                 set tls_cert and tls_key too",
            ));
        }
        return Ok(None);
    };
    let mut tls = ServerTlsConfig::new().identity(Identity::from_pem(&identity.cert, &identity.key));
    // A TLS handshake not done by then is dropped, so a client that opens a connection and
    // sends nothing (or a byte a second) does not hold a handshake task forever. Behind TLS
    // the listener cannot see the HTTP/2 preface, so this is `handshake_timeout_ms` there.
    if let Some(timeout) = handshake_timeout(config) {
        tls = tls.timeout(timeout);
    }
    if let Some(ca) = client_ca(config)? {
        tls = tls.client_ca_root(Certificate::from_pem(ca));
    }
    // rustls checks the rest (the key matches the certificate, a CA it can use) when it
    // builds its configuration; the builder is thrown away, the checked config kept.
    if let Err(error) = Server::builder().tls_config(tls.clone()) {
        let ca = config.tls_client_ca.as_deref().map(|ca| ("client CA", ca));
        return Err(OwnIdentity::refused(config, ca, &error));
    }
    Ok(Some(tls))
}

fn handshake_timeout(config: &Config) -> Option<Duration> {
    (config.handshake_timeout_ms > 0).then(|| Duration::from_millis(config.handshake_timeout_ms))
}

/// The PEM file of `tls_client_ca`, read and checked; `None` without it.
fn client_ca(config: &Config) -> Result<Option<Vec<u8>>, TlsError> {
    let Some(path) = &config.tls_client_ca else {
        return Ok(None);
    };
    let ca = read("tls_client_ca", path)?;
    certificates("tls_client_ca", path, &ca)?;
    Ok(Some(ca))
}

/// TLS of the metrics listener (`metrics_tls`): the gRPC listener's certificate, client CA
/// and handshake timeout, over HTTP/1.1.
#[derive(Clone)]
pub struct MetricsTls {
    acceptor: TlsAcceptor,
    handshake_timeout: Option<Duration>,
}

impl std::fmt::Debug for MetricsTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MetricsTls")
            .field("handshake_timeout", &self.handshake_timeout)
            .finish_non_exhaustive()
    }
}

impl MetricsTls {
    /// The TLS handshake on an accepted connection, within the handshake timeout (a client
    /// that sends nothing, or plain HTTP, fails here and is dropped).
    pub async fn accept(&self, socket: TcpStream) -> io::Result<TlsStream<TcpStream>> {
        let handshake = self.acceptor.accept(socket);
        match self.handshake_timeout {
            Some(timeout) => tokio::time::timeout(timeout, handshake)
                .await
                .unwrap_or_else(|_| {
                    Err(io::Error::new(
                        io::ErrorKind::TimedOut,
                        "the TLS handshake did not finish within handshake_timeout_ms",
                    ))
                }),
            None => handshake.await,
        }
    }
}

/// The metrics listener's TLS: `None` unless `metrics_tls`, which needs `tls_cert` and
/// `tls_key`. With `tls_client_ca`, scrapers must present a certificate that CA signed,
/// as gRPC clients must: the metrics port has no tokens, and a client CA is the operator
/// saying that only holders of its certificates may talk to this server.
pub fn metrics_tls(config: &Config) -> Result<Option<MetricsTls>, TlsError> {
    if !config.metrics_tls {
        return Ok(None);
    }
    let Some(identity) = OwnIdentity::read(config)? else {
        return Err(TlsError::new(
            "metrics_tls",
            "is true but tls_cert and tls_key are not set: the metrics listener serves HTTPS \
             with the gRPC certificate; set tls_cert and tls_key too",
        ));
    };
    let certs = CertificateDer::pem_slice_iter(&identity.cert)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| TlsError::new("tls_cert", format!("is not valid PEM: {}", pem_problem(&e))))?;
    let key = PrivateKeyDer::from_pem_slice(&identity.key).map_err(|e| {
        TlsError::new(
            "tls_key",
            format!("is not a valid PEM private key: {}", pem_problem(&e)),
        )
    })?;
    let builder = ServerConfig::builder();
    let builder = match (&config.tls_client_ca, client_ca(config)?) {
        (Some(path), Some(ca)) => builder.with_client_cert_verifier(client_verifier(path, &ca)?),
        _ => builder.with_no_client_auth(),
    };
    let mut server = builder
        .with_single_cert(certs, key)
        .map_err(|e| OwnIdentity::refused(config, None, &e))?;
    // Prometheus scrapes over HTTP/1.1, all the metrics listener speaks.
    server.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(Some(MetricsTls {
        acceptor: TlsAcceptor::from(Arc::new(server)),
        handshake_timeout: handshake_timeout(config),
    }))
}

/// The check of client certificates against `tls_client_ca` (file `path`, content `ca`,
/// read and checked by `client_ca`), as tonic makes it for the gRPC listener.
fn client_verifier(
    path: &Path,
    ca: &[u8],
) -> Result<Arc<dyn tokio_rustls::rustls::server::danger::ClientCertVerifier>, TlsError> {
    let unusable = |what: String| TlsError::new("tls_client_ca", format!("`{}` {what}", path.display()));
    let mut roots = RootCertStore::empty();
    for cert in CertificateDer::pem_slice_iter(ca) {
        let cert = cert.map_err(|e| unusable(format!("is not valid PEM: {}", pem_problem(&e))))?;
        roots
            .add(cert)
            .map_err(|e| unusable(format!("holds a certificate rustls cannot use as a CA: {e}")))?;
    }
    WebPkiClientVerifier::builder(Arc::new(roots))
        .build()
        .map_err(|e| unusable(format!("cannot check client certificates: {e}")))
}

/// How this instance reaches the others when it forwards a query (Kafka): `None`, over
/// plain HTTP/2, while it serves plain text; with `tls_cert`, over TLS, trusting only the
/// CAs of `tls_peer_ca` (no system roots: the instances' certificates are the operator's),
/// the peer's advertised host checked against its certificate, and offering this
/// instance's certificate as client identity. It is offered always, not only with
/// `tls_client_ca`: a peer asks for it only when it requires one, and instances whose
/// `tls_client_ca` is rolled out one by one still reach each other.
///
/// `None` too with `tls_cert` but no `tls_peer_ca`, which `Config::validate` allows only
/// where nothing is forwarded (not on Kafka, or `forward_queries = false`).
pub fn peer_tls_config(config: &Config) -> Result<Option<ClientTlsConfig>, TlsError> {
    let Some(identity) = OwnIdentity::read(config)? else {
        if config.tls_peer_ca.is_some() {
            return Err(TlsError::new(
                "tls_peer_ca",
                "is set but tls_cert is not: queries go to the other instances over TLS only \
                 when this one serves TLS; set tls_cert and tls_key too",
            ));
        }
        return Ok(None);
    };
    let Some(ca_path) = &config.tls_peer_ca else {
        return Ok(None);
    };
    let ca = read("tls_peer_ca", ca_path)?;
    certificates("tls_peer_ca", ca_path, &ca)?;
    let tls = ClientTlsConfig::new()
        .ca_certificate(Certificate::from_pem(ca))
        .identity(Identity::from_pem(identity.cert, identity.key));
    // tonic builds the rustls client configuration (CA, key and certificate) when an
    // endpoint takes it; done once here on a placeholder address so that a CA or key rustls
    // cannot use stops the start. The host is checked per peer when it connects.
    if let Err(error) = Endpoint::from_static("https://localhost").tls_config(tls.clone()) {
        return Err(OwnIdentity::refused(config, Some(("peer CA", ca_path)), &error));
    }
    Ok(Some(tls))
}

fn read(setting: &'static str, path: &Path) -> Result<Vec<u8>, TlsError> {
    std::fs::read(path).map_err(|e| TlsError::new(setting, format!("cannot read `{}`: {e}", path.display())))
}

/// The certificates of a PEM file; at least one.
fn certificates(setting: &'static str, path: &Path, pem: &[u8]) -> Result<usize, TlsError> {
    let certs = CertificateDer::pem_slice_iter(pem)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| {
            TlsError::new(
                setting,
                format!("`{}` is not valid PEM: {}", path.display(), pem_problem(&e)),
            )
        })?;
    if certs.is_empty() {
        return Err(TlsError::new(
            setting,
            format!(
                "`{}` holds no certificate (a PEM block `-----BEGIN CERTIFICATE-----`)",
                path.display()
            ),
        ));
    }
    Ok(certs.len())
}

/// Checks that a PEM file holds a private key. The error never quotes the file: it is a secret.
fn private_key(path: &Path, pem: &[u8]) -> Result<(), TlsError> {
    match PrivateKeyDer::from_pem_slice(pem) {
        Ok(_) => Ok(()),
        Err(pem::Error::NoItemsFound) => Err(TlsError::new(
            "tls_key",
            format!(
                "`{}` holds no private key (a PEM block `-----BEGIN PRIVATE KEY-----`, \
                 `RSA PRIVATE KEY` or `EC PRIVATE KEY`)",
                path.display()
            ),
        )),
        Err(e) => Err(TlsError::new(
            "tls_key",
            format!(
                "`{}` is not a valid PEM private key: {}",
                path.display(),
                pem_problem(&e)
            ),
        )),
    }
}

/// What is wrong with a PEM file, in words that do not repeat its content.
fn pem_problem(error: &pem::Error) -> String {
    match error {
        pem::Error::MissingSectionEnd { .. } => "a block has no `-----END …-----` line".into(),
        pem::Error::IllegalSectionStart { .. } => "a `-----BEGIN` line is malformed".into(),
        pem::Error::Base64Decode(_) => "a block is not valid base64".into(),
        pem::Error::NoItemsFound => "it holds no PEM block".into(),
        other => other.to_string(),
    }
}

fn error_chain(error: &(dyn std::error::Error + 'static)) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        text.push_str(": ");
        text.push_str(&cause.to_string());
        source = cause.source();
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::scratch::scratch_dir;

    const NOT_PEM: &str = "this is not a certificate\n";
    const BROKEN: &str = "-----BEGIN CERTIFICATE-----\nnot base64 at all!\n-----END CERTIFICATE-----\n";

    fn config(cert: Option<&Path>, key: Option<&Path>, ca: Option<&Path>) -> Config {
        Config {
            tls_cert: cert.map(Path::to_path_buf),
            tls_key: key.map(Path::to_path_buf),
            tls_client_ca: ca.map(Path::to_path_buf),
            ..Config::embedded_default()
        }
    }

    #[test]
    fn plaintext_without_settings_and_unusable_files_named() {
        assert!(matches!(server_tls_config(&config(None, None, None)), Ok(None)));
        assert_eq!(TlsMode::of(&config(None, None, None)), TlsMode::Plaintext);

        let dir = scratch_dir("tls-unit").unwrap();
        let missing = dir.path().join("missing.pem");
        let not_pem = dir.path().join("not.pem");
        let broken = dir.path().join("broken.pem");
        std::fs::write(&not_pem, NOT_PEM).unwrap();
        std::fs::write(&broken, BROKEN).unwrap();

        let err = server_tls_config(&config(Some(&missing), Some(&not_pem), None)).unwrap_err();
        assert_eq!(err.setting, "tls_cert", "{err}");
        assert!(
            err.message.contains("cannot read") && err.message.contains("missing.pem"),
            "{err}"
        );

        let err = server_tls_config(&config(Some(&not_pem), Some(&not_pem), None)).unwrap_err();
        assert_eq!(err.setting, "tls_cert", "{err}");
        assert!(err.message.contains("holds no certificate"), "{err}");

        let err = server_tls_config(&config(Some(&broken), Some(&not_pem), None)).unwrap_err();
        assert_eq!(err.setting, "tls_cert", "{err}");
        assert!(err.message.contains("not valid PEM"), "{err}");
        assert!(!err.message.contains("not base64 at all"), "{err}");

        let err = server_tls_config(&config(None, None, Some(&not_pem))).unwrap_err();
        assert_eq!(err.setting, "tls_client_ca", "{err}");
    }

    /// A file that is PEM but holds only a certificate is not a key; the message says so
    /// without quoting the file.
    #[test]
    fn a_certificate_is_not_a_key() {
        let dir = scratch_dir("tls-unit-key").unwrap();
        let cert = dir.path().join("cert.pem");
        let secret = "-----BEGIN CERTIFICATE-----\nc2VjcmV0\n-----END CERTIFICATE-----\n";
        std::fs::write(&cert, secret).unwrap();
        let err = private_key(&cert, secret.as_bytes()).unwrap_err();
        assert_eq!(err.setting, "tls_key");
        assert!(err.message.contains("holds no private key"), "{err}");
        assert!(!err.message.contains("c2VjcmV0"), "{err}");
    }
}
