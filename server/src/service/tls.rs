//! TLS of the gRPC listener (rustls through tonic): reads `tls_cert`, `tls_key` and
//! `tls_client_ca` (PEM files) into a `ServerTlsConfig`, checking each file at start so
//! that a missing, unreadable or malformed one stops the server with an error naming the
//! setting and the file instead of failing every handshake later. With `tls_client_ca`
//! every client must present a certificate signed by one of those CAs (mutual TLS).

use crate::config::Config;
use rustls_pki_types::pem::{self, PemObject as _};
use rustls_pki_types::{CertificateDer, PrivateKeyDer};
use std::path::Path;
use std::time::Duration;
use tonic::transport::server::ServerTlsConfig;
use tonic::transport::{Certificate, Identity, Server};

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

/// The TLS configuration of `config`'s gRPC listener, `None` when it serves plain text
/// (no `tls_cert`). Reads and checks every file, and lets rustls build its acceptor once,
/// so a key that does not belong to the certificate is found here too.
pub fn server_tls_config(config: &Config) -> Result<Option<ServerTlsConfig>, TlsError> {
    let (cert_path, key_path) = match (&config.tls_cert, &config.tls_key) {
        (None, None) => {
            if config.tls_client_ca.is_some() {
                return Err(TlsError::new(
                    "tls_client_ca",
                    "is set but tls_cert is not: client certificates are checked only over TLS; \
                     set tls_cert and tls_key too",
                ));
            }
            return Ok(None);
        }
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
    let mut tls = ServerTlsConfig::new().identity(Identity::from_pem(&cert, &key));
    // A TLS handshake not done by then is dropped, so a client that opens a connection and
    // sends nothing (or a byte a second) does not hold a handshake task forever. Behind TLS
    // the listener cannot see the HTTP/2 preface, so this is `handshake_timeout_ms` there.
    if config.handshake_timeout_ms > 0 {
        tls = tls.timeout(Duration::from_millis(config.handshake_timeout_ms));
    }
    if let Some(ca_path) = &config.tls_client_ca {
        let ca = read("tls_client_ca", ca_path)?;
        certificates("tls_client_ca", ca_path, &ca)?;
        tls = tls.client_ca_root(Certificate::from_pem(ca));
    }
    // rustls checks the rest (the key matches the certificate, a CA it can use) when it
    // builds its configuration; the builder is thrown away, the checked config kept.
    if let Err(error) = Server::builder().tls_config(tls.clone()) {
        return Err(TlsError::new(
            "tls_key",
            format!(
                "rustls refused the certificate `{}` with the key `{}`{}: {}",
                cert_path.display(),
                key_path.display(),
                match &config.tls_client_ca {
                    Some(ca) => format!(" and client CA `{}`", ca.display()),
                    None => String::new(),
                },
                error_chain(&error)
            ),
        ));
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
