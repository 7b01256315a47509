//! TLS end to end: a real server (in-process, port 0) with the test certificates of
//! tests/data/tls (made once with openssl, see its README), called through the Rust
//! client, grpcurl (`-cacert`, `-cert`/`-key`, `-H 'authorization: Bearer …'`) and the
//! CLI (`--ca-cert`, `--token`). A client that does not trust the server's CA, a plain-text
//! client, and (with `tls_client_ca`) a client without a certificate signed by that CA all
//! fail; with tokens as well, no token is UNAUTHENTICATED, a role too low PERMISSION_DENIED
//! and the right role is served. The server binary refuses unusable TLS settings (exit 2).
//! With `--metrics-tls` the binary's metrics listener serves HTTPS with the same
//! certificate (and client CA), and plain HTTP to it gets no metrics.

mod common;

use common::auth::TOKENS;
use common::tools::tools;
use common::{Output, Server, cli_binary, run, server_binary, temp_dir};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};
use taskstream_client::{ClientError, StreamsClient, keyed_record};
use taskstream_server::scratch::TempDir;
use tonic::Code;

/// Bound of one subprocess call, and of waiting for processing to catch up.
const WAIT: Duration = Duration::from_secs(90);

fn data(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/data/tls")
        .join(name)
}

fn pem(name: &str) -> Vec<u8> {
    std::fs::read(data(name)).unwrap_or_else(|e| panic!("cannot read tests/data/tls/{name}: {e}"))
}

/// A TLS server with the test certificate; `client_ca` requires client certificates,
/// `tokens` turns on bearer tokens. The returned dir holds the tokens file.
fn tls_server(name: &str, client_ca: bool, tokens: bool) -> (Server, TempDir) {
    let dir = temp_dir(name);
    let tokens_file = dir.path().join("tokens");
    std::fs::write(&tokens_file, TOKENS).expect("write the tokens file");
    let server = Server::start_with(name, |config| {
        config.tls_cert = Some(data("server.pem"));
        config.tls_key = Some(data("server.key"));
        config.tls_client_ca = client_ca.then(|| data("ca.pem"));
        config.auth_tokens = tokens.then_some(tokens_file);
    });
    (server, dir)
}

fn https(server: &Server) -> String {
    format!("https://{}", server.addr())
}

/// Connecting or the first call fails: which of the two depends on when the TLS
/// handshake fails (with TLS 1.3 the server checks a client certificate after the
/// client already considers the handshake done). Returns the error.
async fn refused(connect: impl Future<Output = Result<StreamsClient, ClientError>>) -> ClientError {
    match connect.await {
        Err(error) => error,
        Ok(client) => match client.describe_runtime().await {
            Err(error) => error,
            Ok(_) => panic!("the call was served, but it should have been refused"),
        },
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rust_client_needs_the_servers_ca_and_plain_text_is_refused() {
    let (server, _dir) = tls_server("tls-basic", false, false);

    let client = StreamsClient::builder(https(&server))
        .ca_cert_pem(pem("ca.pem"))
        .connect()
        .await
        .expect("connect with the CA");
    client
        .produce("events", vec![keyed_record("k", "v")])
        .await
        .expect("produce over TLS");
    let described = client.describe_runtime().await.expect("describe over TLS");
    assert!(!described.threads.is_empty(), "{described:?}");
    // A bare host:port with a CA certificate is TLS too.
    let bare = StreamsClient::builder(server.addr())
        .ca_cert_pem(pem("ca.pem"))
        .connect()
        .await
        .expect("connect to host:port with the CA");
    bare.metadata_for_store("counts")
        .await
        .expect("metadata over TLS");

    // No CA: the client trusts none, and says so.
    let error = StreamsClient::builder(https(&server))
        .connect()
        .await
        .expect_err("no CA: the server's certificate is not trusted");
    assert!(matches!(error, ClientError::Transport { .. }), "{error:?}");
    assert!(error.to_string().contains("no CA certificate given"), "{error}");

    // Another CA did not sign the server's certificate.
    let error = refused(
        StreamsClient::builder(https(&server))
            .ca_cert_pem(pem("other-ca.pem"))
            .connect(),
    )
    .await;
    assert!(matches!(error, ClientError::Transport { .. }), "{error:?}");
    assert!(
        error.to_string().to_lowercase().contains("certificate"),
        "{error}"
    );

    // Plain HTTP/2 to the TLS port: no call is served.
    let error = refused(StreamsClient::connect(format!("http://{}", server.addr()))).await;
    assert!(matches!(error, ClientError::Transport { .. }), "{error:?}");

    // A CA certificate with an http:// address is a mistake, said before connecting.
    let error = StreamsClient::builder(format!("http://{}", server.addr()))
        .ca_cert_pem(pem("ca.pem"))
        .connect()
        .await
        .expect_err("http:// with a CA");
    assert!(matches!(error, ClientError::IllegalArgument { .. }), "{error:?}");

    // The server still serves TLS clients after the failed handshakes.
    client.describe_runtime().await.expect("still served");
    server.stop();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mutual_tls_requires_a_client_certificate_signed_by_the_client_ca() {
    let (server, _dir) = tls_server("tls-mutual", true, false);

    let client = StreamsClient::builder(https(&server))
        .ca_cert_pem(pem("ca.pem"))
        .client_identity(pem("client.pem"), pem("client.key"))
        .connect()
        .await
        .expect("connect with a client certificate");
    client
        .describe_runtime()
        .await
        .expect("served with a client certificate");

    let error = refused(
        StreamsClient::builder(https(&server))
            .ca_cert_pem(pem("ca.pem"))
            .connect(),
    )
    .await;
    assert!(matches!(error, ClientError::Transport { .. }), "{error:?}");

    // Signed by a CA the server does not trust for clients.
    let error = refused(
        StreamsClient::builder(https(&server))
            .ca_cert_pem(pem("ca.pem"))
            .client_identity(pem("other-client.pem"), pem("other-client.key"))
            .connect(),
    )
    .await;
    assert!(matches!(error, ClientError::Transport { .. }), "{error:?}");

    client.describe_runtime().await.expect("still served");
    server.stop();
}

/// Behind TLS the listener cannot read the HTTP/2 preface, so `handshake_timeout_ms`
/// bounds the TLS handshake: a client that connects and sends nothing is closed after it,
/// and TLS clients are still served.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_silent_connection_is_closed_after_the_handshake_timeout() {
    use tokio::io::AsyncReadExt as _;
    let handshake = Duration::from_millis(500);
    let server = Server::start_with("tls-handshake", |config| {
        config.tls_cert = Some(data("server.pem"));
        config.tls_key = Some(data("server.key"));
        config.handshake_timeout_ms = handshake.as_millis() as u64;
    });
    let started = Instant::now();
    let mut silent = tokio::net::TcpStream::connect(server.addr())
        .await
        .expect("connect");
    let mut buf = [0u8; 1024];
    let closed = tokio::time::timeout(WAIT, async {
        while let Ok(read) = silent.read(&mut buf).await
            && read > 0
        {}
    })
    .await;
    assert!(
        closed.is_ok(),
        "the silent connection is still open after {WAIT:?}"
    );
    let lasted = started.elapsed();
    assert!(
        lasted >= handshake,
        "closed after {lasted:?}, before the handshake timeout"
    );

    let client = StreamsClient::builder(https(&server))
        .ca_cert_pem(pem("ca.pem"))
        .connect()
        .await
        .expect("connect over TLS");
    client.describe_runtime().await.expect("served");
    server.stop();
}

fn assert_code(result: Result<impl std::fmt::Debug, ClientError>, code: Code, what: &str) -> String {
    match result {
        Err(ClientError::Unauthenticated { message }) if code == Code::Unauthenticated => message,
        Err(ClientError::PermissionDenied { message, role }) if code == Code::PermissionDenied => {
            assert!(role.is_some(), "{what}: ErrorInfo names the role needed");
            message
        }
        other => panic!("{what}: expected {code:?}, got {other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tls_with_tokens_through_the_rust_client() {
    let (server, _dir) = tls_server("tls-tokens", false, true);
    let connect = |token: Option<&'static str>| {
        let mut builder = StreamsClient::builder(https(&server)).ca_cert_pem(pem("ca.pem"));
        if let Some(token) = token {
            builder = builder.token(token);
        }
        builder.connect()
    };

    let anonymous = connect(None).await.expect("TLS connect without a token");
    assert_code(
        anonymous.metadata_for_store("counts").await,
        Code::Unauthenticated,
        "metadata without a token",
    );
    assert_code(
        anonymous.produce("events", vec![keyed_record("k", "v")]).await,
        Code::Unauthenticated,
        "produce without a token",
    );
    let wrong = connect(Some("no-such-token")).await.expect("connect");
    assert_code(
        wrong.describe_runtime().await,
        Code::Unauthenticated,
        "describe with an unknown token",
    );

    let reader = connect(Some("reader-token")).await.expect("connect");
    reader.metadata_for_store("counts").await.expect("read: metadata");
    reader.describe_runtime().await.expect("read: describe");
    let message = assert_code(
        reader.produce("events", vec![keyed_record("k", "v")]).await,
        Code::PermissionDenied,
        "produce as read",
    );
    assert!(message.contains("write"), "names the role needed: {message}");

    let writer = connect(Some("writer-token")).await.expect("connect");
    writer
        .produce("events", vec![keyed_record("k", "v")])
        .await
        .expect("write: produce");
    let message = assert_code(
        writer.add_stream_thread().await,
        Code::PermissionDenied,
        "add a thread as write",
    );
    assert!(message.contains("admin"), "names the role needed: {message}");

    let admin = connect(Some("admin-token")).await.expect("connect");
    let added = admin.add_stream_thread().await.expect("admin: add a thread");
    assert!(!added.thread_name.is_empty(), "{added:?}");

    // The token is not in the client's Debug output.
    assert!(!format!("{admin:?}").contains("admin-token"), "{admin:?}");
    server.stop();
}

/// `grpcurl -cacert ca.pem [ARGS…] ADDR METHOD…`, with `-d DATA` when given.
fn grpcurl(server: &Server, args: &[&str], data: Option<&str>, method: &[&str]) -> Output {
    let mut command = Command::new(&tools().grpcurl);
    command.args(["-connect-timeout", "10", "-max-time", "60", "-cacert"]);
    command.arg(data_arg("ca.pem")).args(args);
    if let Some(data) = data {
        command.args(["-d", data]);
    }
    command.arg(server.addr()).args(method);
    run(command, &format!("grpcurl {args:?} {method:?}"), WAIT)
}

fn data_arg(name: &str) -> String {
    data(name).display().to_string()
}

fn bearer(token: &str) -> String {
    format!("authorization: Bearer {token}")
}

const DESCRIBE: &str = "taskstream.v1.AdminService/DescribeRuntime";
const PRODUCE: &str = "taskstream.v1.StreamsService/Produce";
const ADD_THREAD: &str = "taskstream.v1.AdminService/AddStreamThread";
/// One record, key `k` and value `v` (protobuf JSON: bytes in base64).
const ONE_RECORD: &str = r#"{"topic":"events","records":[{"key":"aw==","value":"dg=="}]}"#;

fn assert_grpcurl(output: &Output, code: Option<&str>) {
    match code {
        None => assert!(output.status.success(), "grpcurl failed:\n{}", output.describe()),
        Some(code) => {
            assert!(
                !output.status.success(),
                "grpcurl succeeded:\n{}",
                output.describe()
            );
            assert!(
                output.stderr.contains(code),
                "expected {code}:\n{}",
                output.describe()
            );
        }
    }
}

#[test]
fn tls_with_tokens_through_grpcurl() {
    let (server, _dir) = tls_server("tls-grpcurl", false, true);
    let (reader, writer, admin) = (
        bearer("reader-token"),
        bearer("writer-token"),
        bearer("admin-token"),
    );

    // No token: reflection itself (what grpcurl needs to call anything) is refused.
    assert_grpcurl(&grpcurl(&server, &[], None, &["list"]), Some("Unauthenticated"));
    assert_grpcurl(
        &grpcurl(&server, &["-H", &bearer("nope")], None, &[DESCRIBE]),
        Some("Unauthenticated"),
    );

    let listed = grpcurl(&server, &["-H", &reader], None, &["list"]);
    assert_grpcurl(&listed, None);
    assert!(
        listed.stdout.contains("taskstream.v1.StreamsService"),
        "{}",
        listed.describe()
    );
    assert_grpcurl(&grpcurl(&server, &["-H", &reader], None, &[DESCRIBE]), None);
    assert_grpcurl(
        &grpcurl(&server, &["-H", &reader], Some(ONE_RECORD), &[PRODUCE]),
        Some("PermissionDenied"),
    );
    let produced = grpcurl(&server, &["-H", &writer], Some(ONE_RECORD), &[PRODUCE]);
    assert_grpcurl(&produced, None);
    assert!(
        produced.stdout.contains("\"recordCount\": \"1\""),
        "{}",
        produced.describe()
    );
    assert_grpcurl(
        &grpcurl(&server, &["-H", &writer], None, &[ADD_THREAD]),
        Some("PermissionDenied"),
    );
    assert_grpcurl(&grpcurl(&server, &["-H", &admin], None, &[ADD_THREAD]), None);

    // Without -cacert grpcurl does not trust the server; -plaintext is not served.
    let mut untrusted = Command::new(&tools().grpcurl);
    untrusted
        .args(["-connect-timeout", "10", "-H", &reader])
        .arg(server.addr())
        .arg("list");
    let untrusted = run(untrusted, "grpcurl without -cacert", WAIT);
    assert!(!untrusted.status.success(), "{}", untrusted.describe());
    assert!(
        untrusted.stderr.contains("certificate"),
        "{}",
        untrusted.describe()
    );
    let mut plain = Command::new(&tools().grpcurl);
    plain
        .args(["-plaintext", "-connect-timeout", "10", "-H", &reader])
        .arg(server.addr())
        .arg("list");
    let plain = run(plain, "grpcurl -plaintext", WAIT);
    assert!(!plain.status.success(), "{}", plain.describe());
    server.stop();
}

#[test]
fn mutual_tls_through_grpcurl() {
    let (server, _dir) = tls_server("tls-grpcurl-mutual", true, false);
    let (cert, key) = (data_arg("client.pem"), data_arg("client.key"));
    assert_grpcurl(
        &grpcurl(&server, &["-cert", &cert, "-key", &key], None, &[DESCRIBE]),
        None,
    );
    let without = grpcurl(&server, &[], None, &[DESCRIBE]);
    assert!(!without.status.success(), "{}", without.describe());
    let (other_cert, other_key) = (data_arg("other-client.pem"), data_arg("other-client.key"));
    let other = grpcurl(
        &server,
        &["-cert", &other_cert, "-key", &other_key],
        None,
        &[DESCRIBE],
    );
    assert!(!other.status.success(), "{}", other.describe());
    server.stop();
}

/// `taskstream ARGS…` with `env` set and no TASKSTREAM_* from the environment of the test.
fn taskstream(args: &[&str], env: &[(&str, &str)]) -> Output {
    let mut command = Command::new(cli_binary());
    for var in [
        "TASKSTREAM_ADDR",
        "TASKSTREAM_TOKEN",
        "TASKSTREAM_CA_CERT",
        "TASKSTREAM_CLIENT_CERT",
        "TASKSTREAM_CLIENT_KEY",
    ] {
        command.env_remove(var);
    }
    command.envs(env.iter().copied()).args(args);
    run(command, &format!("taskstream {}", args.join(" ")), WAIT)
}

#[test]
fn cli_with_token_and_ca_cert() {
    let (server, _dir) = tls_server("tls-cli", false, true);
    let addr = https(&server);
    let ca = data_arg("ca.pem");

    // Flags.
    let produced = taskstream(
        &[
            "--addr",
            &addr,
            "--ca-cert",
            &ca,
            "--token",
            "writer-token",
            "produce",
            "--topic",
            "events",
            "--key",
            "k1",
            "--no-progress",
            "a",
            "b",
        ],
        &[],
    );
    assert!(produced.status.success(), "{}", produced.describe());

    // The environment; the count arrives once the records are processed.
    let env = [
        ("TASKSTREAM_ADDR", addr.as_str()),
        ("TASKSTREAM_CA_CERT", ca.as_str()),
        ("TASKSTREAM_TOKEN", "reader-token"),
    ];
    let deadline = Instant::now() + WAIT;
    loop {
        let got = taskstream(&["get", "--store", "counts", "k1"], &env);
        if got.status.success() && got.stdout.trim() == "2" {
            break;
        }
        assert!(
            got.status.success() || got.status.code() == Some(1),
            "{}",
            got.describe()
        );
        assert!(
            Instant::now() < deadline,
            "the count never reached 2:\n{}",
            got.describe()
        );
        std::thread::sleep(Duration::from_millis(50));
    }

    // A role too low: refused, and the token is not printed.
    let refused = taskstream(&["produce", "--topic", "events", "--no-progress", "c"], &env);
    assert_eq!(refused.status.code(), Some(11), "{}", refused.describe());
    assert!(refused.stderr.contains("write"), "{}", refused.describe());
    assert!(!refused.stderr.contains("reader-token"), "{}", refused.describe());
    assert!(!refused.stdout.contains("reader-token"), "{}", refused.describe());

    // No token: UNAUTHENTICATED. No CA: the transport fails (exit 8).
    let anonymous = taskstream(&["--addr", &addr, "--ca-cert", &ca, "describe"], &[]);
    assert_eq!(anonymous.status.code(), Some(10), "{}", anonymous.describe());
    assert!(
        anonymous.stderr.contains("bearer token"),
        "{}",
        anonymous.describe()
    );
    let untrusted = taskstream(&["--addr", &addr, "--token", "reader-token", "describe"], &[]);
    assert_eq!(untrusted.status.code(), Some(8), "{}", untrusted.describe());
    // --help shows the variable, never its value.
    let help = taskstream(&["--help"], &[("TASKSTREAM_TOKEN", "secret-in-env")]);
    assert!(help.stdout.contains("TASKSTREAM_TOKEN"), "{}", help.describe());
    assert!(!help.stdout.contains("secret-in-env"), "{}", help.describe());
    server.stop();
}

/// The server binary with `args`; it must stop at once with exit 2 and `expect` in stderr.
fn assert_config_error(args: &[&str], expect: &[&str]) {
    let mut command = Command::new(server_binary());
    command
        .args(["--listen", "127.0.0.1:0", "--in-memory"])
        .args(args);
    for (var, _) in std::env::vars() {
        if var.starts_with("TASKSTREAM_") {
            command.env_remove(var);
        }
    }
    let output = run(command, &format!("taskstream-server {args:?}"), WAIT);
    assert_eq!(output.status.code(), Some(2), "{}", output.describe());
    for text in expect {
        assert!(
            output.stderr.contains(text),
            "no `{text}` in:\n{}",
            output.describe()
        );
    }
}

#[test]
fn the_binary_refuses_unusable_tls_settings() {
    let (cert, key, ca) = (data_arg("server.pem"), data_arg("server.key"), data_arg("ca.pem"));
    assert_config_error(&["--tls-cert", &cert], &["tls_cert", "tls_key"]);
    assert_config_error(&["--tls-key", &key], &["tls_key", "tls_cert"]);
    assert_config_error(&["--tls-client-ca", &ca], &["tls_client_ca", "tls_cert"]);
    assert_config_error(
        &["--tls-cert", &cert, "--tls-key", "/nonexistent/server.key"],
        &["tls_key", "cannot read", "/nonexistent/server.key"],
    );
    // A certificate where the key should be, and the other way round.
    assert_config_error(
        &["--tls-cert", &cert, "--tls-key", &cert],
        &["tls_key", "holds no private key"],
    );
    assert_config_error(
        &["--tls-cert", &key, "--tls-key", &key],
        &["tls_cert", "holds no certificate"],
    );
    // A key that is not the certificate's.
    assert_config_error(
        &["--tls-cert", &cert, "--tls-key", &data_arg("client.key")],
        &["tls_key", "rustls refused"],
    );
    // The environment sets them as the flags do.
    let mut command = Command::new(server_binary());
    command
        .args(["--listen", "127.0.0.1:0", "--in-memory"])
        .env("TASKSTREAM_TLS_CERT", &cert);
    command.env_remove("TASKSTREAM_TLS_KEY");
    let output = run(command, "taskstream-server with TASKSTREAM_TLS_CERT", WAIT);
    assert_eq!(output.status.code(), Some(2), "{}", output.describe());
    assert!(output.stderr.contains("tls_key"), "{}", output.describe());
}

/// The server binary on port 0, in memory, with the test certificate, `--metrics-listen
/// 127.0.0.1:0 --metrics-tls`, `args` and `env`; killed on drop.
struct MetricsServer {
    child: std::process::Child,
    /// The gRPC address, from the banner's last line.
    addr: String,
    /// The metrics address, from the banner's `metrics:` line.
    metrics: String,
    banner: Vec<String>,
}

impl MetricsServer {
    fn start(args: &[&str], env: &[(&str, &str)]) -> MetricsServer {
        use std::io::BufRead as _;
        let mut command = Command::new(server_binary());
        for (var, _) in std::env::vars() {
            if var.starts_with("TASKSTREAM_") {
                command.env_remove(var);
            }
        }
        command
            .args(["--listen", "127.0.0.1:0", "--in-memory"])
            .args(["--metrics-listen", "127.0.0.1:0", "--metrics-tls"])
            .arg("--tls-cert")
            .arg(data("server.pem"))
            .arg("--tls-key")
            .arg(data("server.key"))
            .args(args)
            .envs(env.iter().copied())
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::inherit());
        let mut child = command.spawn().expect("start the server binary");
        let stdout = child.stdout.take().expect("stdout");
        let (lines, received) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for line in std::io::BufReader::new(stdout).lines().map_while(Result::ok) {
                if lines.send(line).is_err() {
                    return;
                }
            }
        });
        // Killed on drop, a failed start included.
        let mut server = MetricsServer {
            child,
            addr: String::new(),
            metrics: String::new(),
            banner: Vec::new(),
        };
        let deadline = Instant::now() + WAIT;
        while let Ok(line) = received.recv_timeout(deadline.saturating_duration_since(Instant::now())) {
            let addr = line.strip_prefix("taskstream listening on ").map(str::to_owned);
            server.banner.push(line);
            if let Some(addr) = addr {
                server.addr = addr;
                server.metrics = server
                    .banner
                    .iter()
                    .find_map(|l| l.trim().strip_prefix("metrics:"))
                    .and_then(|rest| rest.trim().strip_prefix("https://"))
                    .and_then(|rest| rest.split('/').next())
                    .map(str::to_string)
                    .unwrap_or_else(|| panic!("no https:// metrics line in {:#?}", server.banner));
                return server;
            }
        }
        panic!("the server did not start: {:#?}", server.banner);
    }
}

impl Drop for MetricsServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// `GET /metrics` over TLS to `addr`, trusting `ca` and presenting `client` (certificate,
/// key) if given: the whole response, or why there is none.
async fn scrape_https(addr: &str, ca: &str, client: Option<(&str, &str)>) -> Result<String, String> {
    use rustls_pki_types::pem::PemObject as _;
    use rustls_pki_types::{CertificateDer, PrivateKeyDer, ServerName};
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    use tokio_rustls::rustls::{ClientConfig, RootCertStore};

    let mut roots = RootCertStore::empty();
    for cert in CertificateDer::pem_slice_iter(&pem(ca)) {
        roots
            .add(cert.expect("a PEM certificate"))
            .expect("a usable CA certificate");
    }
    let builder = ClientConfig::builder().with_root_certificates(roots);
    let config = match client {
        None => builder.with_no_client_auth(),
        Some((cert, key)) => {
            let certs = CertificateDer::pem_slice_iter(&pem(cert))
                .collect::<Result<Vec<_>, _>>()
                .expect("PEM certificates");
            let key = PrivateKeyDer::from_pem_slice(&pem(key)).expect("a PEM key");
            builder
                .with_client_auth_cert(certs, key)
                .expect("a usable client certificate")
        }
    };
    let connector = tokio_rustls::TlsConnector::from(std::sync::Arc::new(config));
    let exchange = async {
        let tcp = tokio::net::TcpStream::connect(addr)
            .await
            .map_err(|e| format!("connect: {e}"))?;
        let name = ServerName::try_from("127.0.0.1").map_err(|e| e.to_string())?;
        let mut tls = connector
            .connect(name, tcp)
            .await
            .map_err(|e| format!("handshake: {e}"))?;
        tls.write_all(b"GET /metrics HTTP/1.1\r\nhost: localhost\r\n\r\n")
            .await
            .map_err(|e| format!("write: {e}"))?;
        let mut response = String::new();
        tls.read_to_string(&mut response)
            .await
            .map_err(|e| format!("read: {e}"))?;
        Ok(response)
    };
    tokio::time::timeout(WAIT, exchange)
        .await
        .unwrap_or_else(|_| Err(format!("no answer within {WAIT:?}")))
}

/// `GET /metrics` in plain HTTP: what came back before the server closed (or reset) the
/// connection.
fn scrape_plain(addr: &str) -> String {
    use std::io::{Read as _, Write as _};
    let mut socket = std::net::TcpStream::connect(addr).expect("connect to the metrics address");
    socket.set_read_timeout(Some(WAIT)).expect("a read timeout");
    socket
        .write_all(b"GET /metrics HTTP/1.1\r\nhost: localhost\r\n\r\n")
        .expect("send the request");
    let mut response = Vec::new();
    let _ = socket.read_to_end(&mut response);
    String::from_utf8_lossy(&response).into_owned()
}

/// Scrapes until the metrics show a gRPC call (a scrape right after one may come first).
async fn scrape_until_a_call_is_counted(server: &MetricsServer, client: Option<(&str, &str)>) -> String {
    let deadline = Instant::now() + WAIT;
    loop {
        let response = scrape_https(&server.metrics, "ca.pem", client)
            .await
            .expect("an HTTPS scrape");
        assert!(response.starts_with("HTTP/1.1 200 OK"), "{response}");
        if response.contains("taskstream_rpc_requests_total{") {
            return response;
        }
        assert!(Instant::now() < deadline, "no call counted in {response}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// `--metrics-tls`: the metrics port serves HTTPS with the gRPC certificate; plain HTTP, a
/// client that trusts another CA and a client that never starts its handshake get nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_over_https_with_the_servers_certificate() {
    use tokio::io::AsyncReadExt as _;
    let handshake = Duration::from_millis(1500);
    let server = MetricsServer::start(
        &[],
        &[(
            "TASKSTREAM_HANDSHAKE_TIMEOUT_MS",
            &handshake.as_millis().to_string(),
        )],
    );
    assert!(
        server.banner.iter().any(|l| l.contains("tls:         on")),
        "{:#?}",
        server.banner
    );
    let client = StreamsClient::builder(format!("https://{}", server.addr))
        .ca_cert_pem(pem("ca.pem"))
        .connect()
        .await
        .expect("connect over TLS");
    client.describe_runtime().await.expect("a call to count");

    let response = scrape_until_a_call_is_counted(&server, None).await;
    assert!(
        response.contains("method=\"taskstream.v1.AdminService/DescribeRuntime\""),
        "{response}"
    );

    // Plain HTTP: no metrics, no HTTP answer at all.
    let plain = scrape_plain(&server.metrics);
    assert!(!plain.starts_with("HTTP/"), "plain HTTP was answered: {plain}");
    assert!(!plain.contains("taskstream_"), "plain HTTP got metrics: {plain}");
    // Another CA did not sign the server's certificate.
    let error = scrape_https(&server.metrics, "other-ca.pem", None)
        .await
        .expect_err("a CA that did not sign the certificate");
    assert!(error.contains("UnknownIssuer"), "{error}");

    // A connection that never starts its TLS handshake is closed after the timeout.
    let started = Instant::now();
    let mut silent = tokio::net::TcpStream::connect(&server.metrics)
        .await
        .expect("connect");
    let mut buf = [0u8; 64];
    let closed = tokio::time::timeout(WAIT, async {
        while let Ok(read) = silent.read(&mut buf).await
            && read > 0
        {}
    })
    .await;
    assert!(closed.is_ok(), "the silent connection is open after {WAIT:?}");
    assert!(
        started.elapsed() >= handshake,
        "closed after {:?}, before the handshake timeout",
        started.elapsed()
    );

    // Still serving after all of that.
    scrape_until_a_call_is_counted(&server, None).await;
}

/// With `--tls-client-ca` the metrics port, like the gRPC port, serves only clients that
/// present a certificate that CA signed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn https_metrics_require_a_client_certificate_with_a_client_ca() {
    let ca = data_arg("ca.pem");
    let server = MetricsServer::start(&["--tls-client-ca", &ca], &[]);
    assert!(
        server
            .banner
            .iter()
            .any(|l| l.contains("client certificate required")),
        "{:#?}",
        server.banner
    );
    let client = StreamsClient::builder(format!("https://{}", server.addr))
        .ca_cert_pem(pem("ca.pem"))
        .client_identity(pem("client.pem"), pem("client.key"))
        .connect()
        .await
        .expect("connect over mutual TLS");
    client.describe_runtime().await.expect("a call to count");

    scrape_until_a_call_is_counted(&server, Some(("client.pem", "client.key"))).await;
    let without = scrape_https(&server.metrics, "ca.pem", None).await;
    assert!(
        !matches!(&without, Ok(response) if response.contains("taskstream_")),
        "metrics without a client certificate: {without:?}"
    );
    let other = scrape_https(
        &server.metrics,
        "ca.pem",
        Some(("other-client.pem", "other-client.key")),
    )
    .await;
    assert!(
        !matches!(&other, Ok(response) if response.contains("taskstream_")),
        "metrics with another CA's client certificate: {other:?}"
    );
    scrape_until_a_call_is_counted(&server, Some(("client.pem", "client.key"))).await;
}

/// `--metrics-tls` without the certificate, and peer CAs that cannot be used, stop the
/// binary with exit code 2 naming the settings; so does TLS on Kafka with forwarding on
/// but no `tls_peer_ca`.
#[test]
fn the_binary_refuses_metrics_tls_and_peer_tls_without_what_they_need() {
    let (cert, key, ca) = (data_arg("server.pem"), data_arg("server.key"), data_arg("ca.pem"));
    let settings = ["metrics_tls", "tls_cert", "tls_key"];
    assert_config_error(&["--metrics-tls"], &settings);
    assert_config_error(&["--metrics-tls", "--metrics-listen", "127.0.0.1:0"], &settings);
    let mut command = Command::new(server_binary());
    command
        .args(["--listen", "127.0.0.1:0", "--in-memory"])
        .env("TASKSTREAM_METRICS_TLS", "true");
    for var in ["TASKSTREAM_TLS_CERT", "TASKSTREAM_TLS_KEY"] {
        command.env_remove(var);
    }
    let output = run(command, "taskstream-server with TASKSTREAM_METRICS_TLS", WAIT);
    assert_eq!(output.status.code(), Some(2), "{}", output.describe());
    for setting in settings {
        assert!(output.stderr.contains(setting), "{}", output.describe());
    }

    assert_config_error(&["--tls-peer-ca", &ca], &["tls_peer_ca", "tls_cert"]);
    // On Kafka (nothing connects before the settings are checked).
    let kafka = [
        "--bootstrap-servers",
        "127.0.0.1:9",
        "--tls-cert",
        &cert,
        "--tls-key",
        &key,
    ];
    assert_config_error(&kafka, &["tls_peer_ca", "forward_queries = false"]);
    assert_config_error(
        &[&kafka[..], &["--tls-peer-ca", "/nonexistent/peers.pem"]].concat(),
        &["tls_peer_ca", "cannot read", "/nonexistent/peers.pem"],
    );
    assert_config_error(
        &[&kafka[..], &["--tls-peer-ca", &key]].concat(),
        &["tls_peer_ca", "holds no certificate"],
    );
}
