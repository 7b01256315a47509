//! The tests' bearer tokens: one per role, the file the server reads them
//! from, and an interceptor that sends a role's token with every call.

use tonic::Status;

/// The `--auth-tokens` file of the tests: a comment line, then a token per role.
pub const TOKENS: &str = "# test tokens\nreader-token read\nwriter-token write\nadmin-token admin\n";

/// Adds a bearer token (if any) to every call.
#[derive(Clone)]
pub struct Bearer(pub Option<&'static str>);

impl tonic::service::Interceptor for Bearer {
    fn call(&mut self, mut request: tonic::Request<()>) -> Result<tonic::Request<()>, Status> {
        if let Some(token) = self.0 {
            let value = format!("Bearer {token}").parse().expect("a header value");
            request.metadata_mut().insert("authorization", value);
        }
        Ok(request)
    }
}
