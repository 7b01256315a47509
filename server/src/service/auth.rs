//! Bearer tokens with roles, checked by one tower layer before any handler runs: the
//! tokens file (`auth_tokens`: one `TOKEN ROLE` per line), the role each RPC needs, and the
//! layer that answers UNAUTHENTICATED (no or unknown token) or PERMISSION_DENIED (naming the
//! role needed) and hands the caller's role to the handlers in the request's extensions.
//! Tokens are compared in constant time and never logged. Health is open to everyone.

use super::status::{ServiceError, to_status};
use std::fmt;
use std::path::Path;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use tonic::body::Body;
use tonic::codegen::http::{Request, Response};
use tower::{Layer, Service};

/// What a caller may do; each role may do everything the one before it may.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Role {
    /// Queries, metadata, outcome streams, ReadTopic of topics that are not internal,
    /// DescribeRuntime, reflection.
    Read,
    /// Read, and Produce.
    Write,
    /// Write, and stream-thread changes, dead-letter redrive, internal topics.
    Admin,
}

impl Role {
    pub fn as_str(self) -> &'static str {
        match self {
            Role::Read => "read",
            Role::Write => "write",
            Role::Admin => "admin",
        }
    }

    fn parse(text: &str) -> Option<Role> {
        match text {
            "read" => Some(Role::Read),
            "write" => Some(Role::Write),
            "admin" => Some(Role::Admin),
            _ => None,
        }
    }
}

impl fmt::Display for Role {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The caller of a request, as the auth layer found it (in the request's extensions).
/// Without an `auth_tokens` file there is no such extension: every caller may do everything.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Caller {
    pub role: Role,
}

/// The role of the caller of `request`: theirs, or `Admin` on a server without tokens.
pub fn role_of<T>(request: &tonic::Request<T>) -> Role {
    request
        .extensions()
        .get::<Caller>()
        .map_or(Role::Admin, |caller| caller.role)
}

/// Why the tokens file cannot be used. Never holds a token.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TokensError {
    #[error("cannot read the auth tokens file `{path}`: {message}")]
    Read { path: String, message: String },

    #[error(
        "auth tokens file `{path}`, line {line}: {problem}; write one `TOKEN ROLE` per line \
         (ROLE is read, write or admin; `#` starts a comment)"
    )]
    Line {
        path: String,
        line: usize,
        problem: String,
    },

    #[error("auth tokens file `{path}` holds no token; add a `TOKEN ROLE` line or leave auth_tokens unset")]
    Empty { path: String },
}

/// The tokens file, read once at start. Invariant: no token is empty or listed twice.
pub struct Tokens {
    entries: Vec<(Vec<u8>, Role)>,
}

impl fmt::Debug for Tokens {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // Tokens are secrets: only how many there are.
        f.debug_struct("Tokens")
            .field("count", &self.entries.len())
            .finish()
    }
}

impl Tokens {
    pub fn load(path: &Path) -> Result<Tokens, TokensError> {
        let shown = path.display().to_string();
        let text = std::fs::read_to_string(path).map_err(|e| TokensError::Read {
            path: shown.clone(),
            message: e.to_string(),
        })?;
        Tokens::parse(&text, &shown)
    }

    pub fn parse(text: &str, path: &str) -> Result<Tokens, TokensError> {
        let mut entries: Vec<(Vec<u8>, Role)> = Vec::new();
        for (index, line) in text.lines().enumerate() {
            let line_error = |problem: &str| TokensError::Line {
                path: path.to_string(),
                line: index + 1,
                problem: problem.to_string(),
            };
            let line = line.trim();
            if line.is_empty() || line.starts_with('#') {
                continue;
            }
            let mut words = line.split_whitespace();
            let (Some(token), Some(role), None) = (words.next(), words.next(), words.next()) else {
                return Err(line_error("expected two words, a token and a role"));
            };
            let role = Role::parse(role).ok_or_else(|| line_error("the role is not read, write or admin"))?;
            if entries.iter().any(|(known, _)| known == token.as_bytes()) {
                return Err(line_error("this token is already listed"));
            }
            entries.push((token.as_bytes().to_vec(), role));
        }
        if entries.is_empty() {
            return Err(TokensError::Empty {
                path: path.to_string(),
            });
        }
        Ok(Tokens { entries })
    }

    /// The role of `token`. Every entry is compared, each in constant time, so the time
    /// taken says nothing of which token (or how much of one) matched.
    fn role_of(&self, token: &[u8]) -> Option<Role> {
        let mut found = None;
        for (known, role) in &self.entries {
            if constant_time_eq(known, token) {
                found = Some(*role);
            }
        }
        found
    }
}

/// Equal bytes, in a time that depends only on the lengths.
fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    let mut difference = a.len() ^ b.len();
    for i in 0..a.len().max(b.len()) {
        let x = a.get(i).copied().unwrap_or(0);
        let y = b.get(i).copied().unwrap_or(0);
        difference |= usize::from(x ^ y);
    }
    difference == 0
}

/// The role an RPC needs, by its path; `None`: open to everyone (health).
pub fn required_role(path: &str) -> Option<Role> {
    let (service, method) = path.trim_start_matches('/').split_once('/').unwrap_or((path, ""));
    match (service, method) {
        ("grpc.health.v1.Health", _) => None,
        ("taskstream.v1.StreamsService", "Produce" | "ProduceStream") => Some(Role::Write),
        ("taskstream.v1.AdminService", "DescribeRuntime") => Some(Role::Read),
        ("taskstream.v1.AdminService", _) => Some(Role::Admin),
        // Everything else reads (unknown methods too: they answer UNIMPLEMENTED once known).
        _ => Some(Role::Read),
    }
}

/// Wraps a service in [`Auth`]; without tokens it lets everything through.
#[derive(Debug, Clone, Default)]
pub struct AuthLayer {
    tokens: Option<Arc<Tokens>>,
}

impl AuthLayer {
    pub fn new(tokens: Option<Tokens>) -> Self {
        AuthLayer {
            tokens: tokens.map(Arc::new),
        }
    }
}

impl<S> Layer<S> for AuthLayer {
    type Service = Auth<S>;

    fn layer(&self, inner: S) -> Auth<S> {
        Auth {
            inner,
            tokens: self.tokens.clone(),
        }
    }
}

/// See the module doc.
#[derive(Debug, Clone)]
pub struct Auth<S> {
    inner: S,
    tokens: Option<Arc<Tokens>>,
}

impl<S, ReqBody> Service<Request<ReqBody>> for Auth<S>
where
    S: Service<Request<ReqBody>, Response = Response<Body>>,
    S::Future: Send + 'static,
{
    type Response = Response<Body>;
    type Error = S::Error;
    type Future = Pin<Box<dyn Future<Output = Result<Response<Body>, S::Error>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, mut request: Request<ReqBody>) -> Self::Future {
        if let Some(tokens) = &self.tokens {
            match check(tokens, &request) {
                Ok(Some(caller)) => {
                    request.extensions_mut().insert(caller);
                }
                Ok(None) => {}
                Err(error) => {
                    let response = to_status(error).into_http::<Body>();
                    return Box::pin(async move { Ok(response) });
                }
            }
        }
        let response = self.inner.call(request);
        Box::pin(response)
    }
}

/// The caller of `request` if it may make it (`None` for an open RPC), else why not.
fn check<B>(tokens: &Tokens, request: &Request<B>) -> Result<Option<Caller>, ServiceError> {
    let Some(needed) = required_role(request.uri().path()) else {
        return Ok(None);
    };
    let token = request
        .headers()
        .get("authorization")
        .and_then(|value| value.as_bytes().strip_prefix(b"Bearer "))
        .ok_or(ServiceError::Unauthenticated)?;
    let role = tokens.role_of(token).ok_or(ServiceError::Unauthenticated)?;
    if role < needed {
        return Err(ServiceError::PermissionDenied {
            needed: needed.as_str(),
            what: request.uri().path().trim_start_matches('/').to_string(),
        });
    }
    Ok(Some(Caller { role }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_tokens_file_has_a_token_and_a_role_per_line() {
        let tokens = Tokens::parse("# ops\nr0 read\n\n  w0   write \na0 admin\n", "t").unwrap();
        assert_eq!(tokens.role_of(b"r0"), Some(Role::Read));
        assert_eq!(tokens.role_of(b"w0"), Some(Role::Write));
        assert_eq!(tokens.role_of(b"a0"), Some(Role::Admin));
        assert_eq!(tokens.role_of(b"a"), None);
        assert_eq!(tokens.role_of(b"a00"), None);
        assert_eq!(tokens.role_of(b""), None);
        assert!(!format!("{tokens:?}").contains("a0"));

        for (text, line) in [
            ("x read\ny root\n", 2),
            ("only\n", 1),
            ("a read\na admin\n", 2),
            ("a b c\n", 1),
        ] {
            match Tokens::parse(text, "t") {
                Err(TokensError::Line {
                    line: at, problem, ..
                }) => {
                    assert_eq!(at, line, "{text:?}");
                    // The message never repeats a token.
                    assert!(!problem.contains('a') || !problem.contains("a read"), "{problem}");
                }
                other => panic!("{text:?}: {other:?}"),
            }
        }
        assert!(matches!(
            Tokens::parse("# nothing\n", "t"),
            Err(TokensError::Empty { .. })
        ));
    }

    #[test]
    fn each_rpc_needs_its_role_and_health_is_open() {
        assert_eq!(required_role("/grpc.health.v1.Health/Check"), None);
        assert_eq!(required_role("/grpc.health.v1.Health/Watch"), None);
        for (path, role) in [
            ("/taskstream.v1.StreamsService/Query", Role::Read),
            ("/taskstream.v1.StreamsService/GetMetadataAsync", Role::Read),
            ("/taskstream.v1.StreamsService/ReadTopic", Role::Read),
            ("/taskstream.v1.StreamsService/Produce", Role::Write),
            ("/taskstream.v1.StreamsService/ProduceStream", Role::Write),
            ("/taskstream.v1.AdminService/DescribeRuntime", Role::Read),
            ("/taskstream.v1.AdminService/AddStreamThread", Role::Admin),
            ("/taskstream.v1.AdminService/RedriveDeadLetters", Role::Admin),
            (
                "/grpc.reflection.v1.ServerReflection/ServerReflectionInfo",
                Role::Read,
            ),
            ("/no.Such/Method", Role::Read),
        ] {
            assert_eq!(required_role(path), Some(role), "{path}");
        }
        assert!(Role::Read < Role::Write && Role::Write < Role::Admin);
    }

    #[test]
    fn constant_time_eq_is_equality() {
        assert!(constant_time_eq(b"abc", b"abc"));
        assert!(!constant_time_eq(b"abc", b"abd"));
        assert!(!constant_time_eq(b"abc", b"ab"));
        assert!(!constant_time_eq(b"", b"a"));
        assert!(constant_time_eq(b"", b""));
    }
}
