//! Per-RPC telemetry as a tower layer on the gRPC server (every service: ours, health,
//! reflection): a `rpc` span per call at debug level with its method, status code and duration,
//! and two Prometheus series by method and status code, `taskstream_rpc_requests_total` and
//! `taskstream_rpc_duration_seconds`. A call ends when its response body ends, so a stream is
//! measured to its last message, and its code is the one in its trailers.

use crate::metrics::{RPC_DURATION, RPC_REQUESTS};
use http_body::{Body, Frame, SizeHint};
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Instant;
use tonic::Code;
use tonic::codegen::http::{HeaderMap, Request, Response};
use tower::{Layer, Service};
use tracing::Instrument as _;

/// Wraps a service in [`RpcTelemetry`].
#[derive(Debug, Clone, Copy, Default)]
pub struct RpcTelemetryLayer;

impl<S> Layer<S> for RpcTelemetryLayer {
    type Service = RpcTelemetry<S>;

    fn layer(&self, inner: S) -> RpcTelemetry<S> {
        RpcTelemetry { inner }
    }
}

/// See the module doc.
#[derive(Debug, Clone)]
pub struct RpcTelemetry<S> {
    inner: S,
}

impl<S, ReqBody, ResBody> Service<Request<ReqBody>> for RpcTelemetry<S>
where
    S: Service<Request<ReqBody>, Response = Response<ResBody>>,
    S::Future: Send + 'static,
    ResBody: Body + Unpin,
{
    type Response = Response<TelemetryBody<ResBody>>;
    type Error = S::Error;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, S::Error>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: Request<ReqBody>) -> Self::Future {
        // "/package.Service/Method" → "package.Service/Method".
        let method = request.uri().path().trim_start_matches('/').to_string();
        let span = tracing::debug_span!(
            "rpc",
            method = %method,
            code = tracing::field::Empty,
            duration_ms = tracing::field::Empty
        );
        let call = Call {
            method,
            span: span.clone(),
            started: Instant::now(),
        };
        let response = self.inner.call(request).instrument(span);
        Box::pin(async move {
            match response.await {
                Ok(response) => {
                    // A call that fails at once answers "trailers-only": the code is in the headers.
                    let code = code_in(response.headers());
                    let (parts, body) = response.into_parts();
                    // Such a body is empty and may never be polled: dropping it records the call.
                    let body = TelemetryBody {
                        inner: body,
                        call: Some(call),
                        code,
                    };
                    Ok(Response::from_parts(parts, body))
                }
                Err(error) => {
                    // The transport failed the call: no gRPC status was sent.
                    call.finish(Code::Unknown);
                    Err(error)
                }
            }
        })
    }
}

/// The `grpc-status` in `headers`, if any.
fn code_in(headers: &HeaderMap) -> Option<Code> {
    let value = headers.get("grpc-status")?.to_str().ok()?.parse::<i32>().ok()?;
    Some(Code::from_i32(value))
}

/// A call being measured, recorded once when its response ends.
struct Call {
    method: String,
    span: tracing::Span,
    started: Instant,
}

impl Call {
    fn finish(self, code: Code) {
        let elapsed = self.started.elapsed();
        let code = code_name(code);
        // An unknown method answers UNIMPLEMENTED; its name, which a client chooses, is not
        // made a label (the span keeps it).
        let method = match code {
            "UNIMPLEMENTED" => "unknown".to_string(),
            _ => self.method,
        };
        self.span.record("code", code);
        self.span.record("duration_ms", elapsed.as_secs_f64() * 1e3);
        self.span.in_scope(|| tracing::debug!("rpc finished"));
        metrics::counter!(RPC_REQUESTS, "method" => method.clone(), "code" => code).increment(1);
        metrics::histogram!(RPC_DURATION, "method" => method, "code" => code).record(elapsed.as_secs_f64());
    }
}

/// A response body that records its call when it ends: with the code of its trailers (or of
/// its headers, for a trailers-only answer), or CANCELLED if it is dropped before its end (the
/// client went away).
pub struct TelemetryBody<B> {
    inner: B,
    call: Option<Call>,
    /// The code the headers carried.
    code: Option<Code>,
}

impl<B> TelemetryBody<B> {
    fn finish(&mut self, trailers: Option<&HeaderMap>) {
        if let Some(call) = self.call.take() {
            let code = trailers.and_then(code_in).or(self.code).unwrap_or(Code::Unknown);
            call.finish(code);
        }
    }
}

impl<B> Drop for TelemetryBody<B> {
    fn drop(&mut self) {
        if let Some(call) = self.call.take() {
            call.finish(self.code.unwrap_or(Code::Cancelled));
        }
    }
}

impl<B: Body + Unpin> Body for TelemetryBody<B> {
    type Data = B::Data;
    type Error = B::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Self::Data>, Self::Error>>> {
        let polled = Pin::new(&mut self.inner).poll_frame(cx);
        match &polled {
            Poll::Ready(Some(Ok(frame))) if frame.is_trailers() => {
                let trailers = frame.trailers_ref().cloned();
                self.finish(trailers.as_ref());
            }
            Poll::Ready(None) => self.finish(None),
            // A body that fails mid-stream: the client sees a reset, not a status.
            Poll::Ready(Some(Err(_))) => {
                if let Some(call) = self.call.take() {
                    call.finish(Code::Unknown);
                }
            }
            _ => {}
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

/// The canonical name of a gRPC status code, as grpc-go and the gRPC docs spell it.
pub fn code_name(code: Code) -> &'static str {
    match code {
        Code::Ok => "OK",
        Code::Cancelled => "CANCELLED",
        Code::Unknown => "UNKNOWN",
        Code::InvalidArgument => "INVALID_ARGUMENT",
        Code::DeadlineExceeded => "DEADLINE_EXCEEDED",
        Code::NotFound => "NOT_FOUND",
        Code::AlreadyExists => "ALREADY_EXISTS",
        Code::PermissionDenied => "PERMISSION_DENIED",
        Code::ResourceExhausted => "RESOURCE_EXHAUSTED",
        Code::FailedPrecondition => "FAILED_PRECONDITION",
        Code::Aborted => "ABORTED",
        Code::OutOfRange => "OUT_OF_RANGE",
        Code::Unimplemented => "UNIMPLEMENTED",
        Code::Internal => "INTERNAL",
        Code::Unavailable => "UNAVAILABLE",
        Code::DataLoss => "DATA_LOSS",
        Code::Unauthenticated => "UNAUTHENTICATED",
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::VecDeque;
    use std::convert::Infallible;
    use tonic::codegen::Bytes;
    use tonic::codegen::http::HeaderValue;

    /// A body of ready frames.
    struct Frames(VecDeque<Frame<Bytes>>);

    impl Body for Frames {
        type Data = Bytes;
        type Error = Infallible;

        fn poll_frame(
            mut self: Pin<&mut Self>,
            _: &mut Context<'_>,
        ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
            Poll::Ready(self.0.pop_front().map(Ok))
        }
    }

    fn trailers(code: i32) -> HeaderMap {
        let mut map = HeaderMap::new();
        map.insert("grpc-status", HeaderValue::from(code));
        map
    }

    #[test]
    fn every_code_has_its_canonical_name() {
        assert_eq!(code_name(Code::from_i32(14)), "UNAVAILABLE");
        assert_eq!(code_name(Code::from_i32(3)), "INVALID_ARGUMENT");
        assert_eq!(code_in(&trailers(5)), Some(Code::NotFound));
        assert_eq!(code_in(&HeaderMap::new()), None);
    }

    #[test]
    fn the_call_ends_with_its_trailers_or_headers_or_when_dropped_unfinished() {
        let recorder = metrics_exporter_prometheus::PrometheusBuilder::new().build_recorder();
        let handle = recorder.handle();
        metrics::with_local_recorder(&recorder, || {
            let waker = std::task::Waker::noop();
            let mut cx = Context::from_waker(waker);
            let call = |method: &str| Call {
                method: method.to_string(),
                span: tracing::Span::none(),
                started: Instant::now(),
            };
            let mut body = TelemetryBody {
                inner: Frames(VecDeque::from([
                    Frame::data(Bytes::from_static(b"x")),
                    Frame::trailers(trailers(0)),
                ])),
                call: Some(call("a/Stream")),
                code: None,
            };
            assert!(matches!(
                Pin::new(&mut body).poll_frame(&mut cx),
                Poll::Ready(Some(Ok(_)))
            ));
            assert!(body.call.is_some(), "not over after a message");
            assert!(matches!(
                Pin::new(&mut body).poll_frame(&mut cx),
                Poll::Ready(Some(Ok(_)))
            ));
            assert!(body.call.is_none(), "over with the trailers");
            drop(body);
            // Trailers-only: the code came with the headers; the body is dropped unpolled.
            drop(TelemetryBody {
                inner: Frames(VecDeque::new()),
                call: Some(call("a/Fails")),
                code: Some(Code::NotFound),
            });
            // The client went away mid-stream.
            drop(TelemetryBody {
                inner: Frames(VecDeque::from([Frame::data(Bytes::from_static(b"x"))])),
                call: Some(call("a/Left")),
                code: None,
            });
            drop(TelemetryBody {
                inner: Frames(VecDeque::new()),
                call: Some(call("a/Nonsense")),
                code: Some(Code::Unimplemented),
            });
        });
        let text = handle.render();
        for series in [
            r#"taskstream_rpc_requests_total{method="a/Stream",code="OK"} 1"#,
            r#"taskstream_rpc_requests_total{method="a/Fails",code="NOT_FOUND"} 1"#,
            r#"taskstream_rpc_requests_total{method="a/Left",code="CANCELLED"} 1"#,
            r#"taskstream_rpc_requests_total{method="unknown",code="UNIMPLEMENTED"} 1"#,
        ] {
            assert!(text.contains(series), "{series} missing from\n{text}");
        }
        assert!(!text.contains("a/Nonsense"), "{text}");
    }
}
