//! A tower layer that restates the statuses tonic answers by itself — a request it could not
//! decode (INTERNAL with prost's type names), a message over the size limit (OUT_OF_RANGE) —
//! in the API's terms, through `status::from_transport`. It reads the `grpc-status` of
//! trailers-only answers (the headers) and of the trailers at the end of a response body;
//! every other answer passes untouched.

use super::status::from_transport;
use http_body::{Body, Frame, SizeHint};
use std::pin::Pin;
use std::task::{Context, Poll};
use tonic::Status;
use tonic::codegen::http::{HeaderMap, HeaderValue, Request, Response};
use tower::{Layer, Service};

/// Wraps a service in [`WireStatus`].
#[derive(Debug, Clone, Copy, Default)]
pub struct WireStatusLayer;

impl<S> Layer<S> for WireStatusLayer {
    type Service = WireStatus<S>;

    fn layer(&self, inner: S) -> WireStatus<S> {
        WireStatus { inner }
    }
}

/// See the module doc.
#[derive(Debug, Clone)]
pub struct WireStatus<S> {
    inner: S,
}

impl<S, ReqBody, ResBody> Service<Request<ReqBody>> for WireStatus<S>
where
    S: Service<Request<ReqBody>, Response = Response<ResBody>>,
    S::Future: Send + 'static,
    ResBody: Body + Unpin,
{
    type Response = Response<WireBody<ResBody>>;
    type Error = S::Error;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, S::Error>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: Request<ReqBody>) -> Self::Future {
        let response = self.inner.call(request);
        Box::pin(async move {
            let mut response = response.await?;
            restate(response.headers_mut());
            Ok(response.map(|inner| WireBody { inner }))
        })
    }
}

/// Replaces a status tonic made by itself with the API's, in place.
fn restate(headers: &mut HeaderMap) {
    // Only INTERNAL (13) and OUT_OF_RANGE (11) can be tonic's own: a cheap look first.
    match headers.get(Status::GRPC_STATUS).map(|value| value.as_bytes()) {
        Some(b"13" | b"11") => {}
        _ => return,
    }
    let Some(status) = Status::from_header_map(headers) else {
        return;
    };
    let Some(restated) = from_transport(&status) else {
        return;
    };
    headers.remove(Status::GRPC_STATUS);
    headers.remove(Status::GRPC_MESSAGE);
    headers.remove(Status::GRPC_STATUS_DETAILS);
    if restated.add_header(headers).is_err() {
        // Our messages are plain text and always encode; keep a status in any case.
        headers.insert(Status::GRPC_STATUS, HeaderValue::from(restated.code() as i32));
    }
}

/// A response body whose trailers pass through [`restate`].
pub struct WireBody<B> {
    inner: B,
}

impl<B: Body + Unpin> Body for WireBody<B> {
    type Data = B::Data;
    type Error = B::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Self::Data>, Self::Error>>> {
        let mut polled = Pin::new(&mut self.inner).poll_frame(cx);
        if let Poll::Ready(Some(Ok(frame))) = &mut polled
            && let Some(trailers) = frame.trailers_mut()
        {
            restate(trailers);
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tonic::Code;

    #[test]
    fn tonic_statuses_are_restated_and_others_stand() {
        let mut headers = HeaderMap::new();
        Status::internal("failed to decode Protobuf message: ProcessMetadataForStoreRequest.store: invalid string value: data is not UTF-8 encoded")
            .add_header(&mut headers)
            .unwrap();
        restate(&mut headers);
        let status = Status::from_header_map(&headers).unwrap();
        assert_eq!(status.code(), Code::InvalidArgument);
        assert_eq!(status.message(), "invalid store: is not valid UTF-8");

        let mut headers = HeaderMap::new();
        Status::out_of_range("offset 3 of partition 0 is no longer retained; the earliest is 9")
            .add_header(&mut headers)
            .unwrap();
        let before = headers.clone();
        restate(&mut headers);
        assert_eq!(headers, before);
    }
}
