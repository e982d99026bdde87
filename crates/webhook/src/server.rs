//! The webhook's two listeners: HTTPS for the API server (`POST /mutate`, and `/healthz`,
//! `/readyz`), and plain HTTP for the kubelet's probes and Prometheus (`/metrics`, `/healthz`,
//! `/readyz`). HTTP/2 and HTTP/1.1 on both, by hyper.
//!
//! Every connection is bounded in time (the TLS handshake, the request head, the body) and every
//! body in size, so a client that is slow or sends too much holds only its own connection. A
//! review is answered by [`review::answer`]; what cannot be read is answered with an HTTP error
//! (the API server then admits the pod unmutated, by the configuration's `failurePolicy:
//! Ignore`), logged once, and counted.

use std::convert::Infallible;
use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant};

use http_body_util::{BodyExt, Full, Limited};
use hyper::body::{Bytes, Incoming};
use hyper::header::{CONTENT_LENGTH, CONTENT_TYPE};
use hyper::service::service_fn;
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::TcpListener;
use tokio_rustls::TlsAcceptor;

use crate::metrics::Metrics;
use crate::mutate::Settings;
use crate::review::{self, Outcome};

/// The largest body taken: the API server refuses requests over 3 MiB, and a CREATE's review
/// carries the object once.
pub const MAX_BODY: usize = 4 * 1024 * 1024;
/// Time for the TLS handshake, the request head, and the body each.
const TIMEOUT: Duration = Duration::from_secs(10);

/// What the handlers share.
#[derive(Debug)]
pub struct Webhook {
    pub settings: Settings,
    pub metrics: Metrics,
}

/// Serves reviews over TLS on `listener` until accepting fails.
pub async fn serve_https(
    listener: TcpListener,
    tls: TlsAcceptor,
    hook: Arc<Webhook>,
) -> std::io::Error {
    accept(listener, hook, move |tcp| {
        let tls = tls.clone();
        async move {
            match tokio::time::timeout(TIMEOUT, tls.accept(tcp)).await {
                Ok(Ok(stream)) => Some(stream),
                Ok(Err(e)) => {
                    tracing::debug!(error = %e, "TLS handshake failed");
                    None
                }
                Err(_) => None,
            }
        }
    })
    .await
}

/// Serves `/metrics`, `/healthz` and `/readyz` over plain HTTP on `listener`.
pub async fn serve_http(listener: TcpListener, hook: Arc<Webhook>) -> std::io::Error {
    accept(listener, hook, |tcp| async move { Some(tcp) }).await
}

async fn accept<S, F, Fut>(listener: TcpListener, hook: Arc<Webhook>, wrap: F) -> std::io::Error
where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
    F: Fn(tokio::net::TcpStream) -> Fut,
    Fut: Future<Output = Option<S>> + Send + 'static,
{
    loop {
        let tcp = match listener.accept().await {
            Ok((tcp, _)) => tcp,
            // One client's connection failing, or a passing shortage: go on.
            Err(e) if is_transient(&e) => {
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
            Err(e) => return e,
        };
        let stream = wrap(tcp);
        let hook = hook.clone();
        tokio::spawn(async move {
            let Some(stream) = stream.await else { return };
            let service = service_fn(move |req| {
                let hook = hook.clone();
                async move { Ok::<_, Infallible>(handle(req, &hook).await) }
            });
            let mut server = auto::Builder::new(TokioExecutor::new());
            server.http1().timer(TokioTimer::new()).header_read_timeout(TIMEOUT);
            server.http2().timer(TokioTimer::new()).keep_alive_interval(Some(TIMEOUT));
            if let Err(e) = server.serve_connection(TokioIo::new(stream), service).await {
                tracing::debug!(error = %e, "connection ended");
            }
        });
    }
}

/// An accept error that ends one client's connection (it was reset while queued) or comes of a
/// passing shortage (ENFILE, EMFILE, ENOBUFS, ENOMEM), rather than of the listener.
fn is_transient(e: &std::io::Error) -> bool {
    use std::io::ErrorKind::{ConnectionAborted, ConnectionReset, Interrupted};
    matches!(e.kind(), ConnectionAborted | ConnectionReset | Interrupted)
        || matches!(e.raw_os_error(), Some(23 | 24 | 105 | 12))
}

async fn handle(req: Request<Incoming>, hook: &Webhook) -> Response<Full<Bytes>> {
    match (req.method(), req.uri().path()) {
        (&Method::POST, "/mutate") => mutate(req, hook).await,
        (&Method::GET, "/healthz" | "/readyz") => text(StatusCode::OK, "ok\n"),
        (&Method::GET, "/metrics") => {
            let mut response = Response::new(Full::from(hook.metrics.encode()));
            let kind = "application/openmetrics-text; version=1.0.0; charset=utf-8";
            response.headers_mut().insert(CONTENT_TYPE, kind.parse().expect("a header value"));
            response
        }
        (_, "/mutate" | "/healthz" | "/readyz" | "/metrics") => {
            text(StatusCode::METHOD_NOT_ALLOWED, "method not allowed\n")
        }
        _ => text(StatusCode::NOT_FOUND, "not found: /mutate, /healthz, /readyz, /metrics\n"),
    }
}

async fn mutate(req: Request<Incoming>, hook: &Webhook) -> Response<Full<Bytes>> {
    let started = Instant::now();
    let declared = req.headers().get(CONTENT_LENGTH).and_then(|v| v.to_str().ok()?.parse().ok());
    if declared.is_some_and(|n: usize| n > MAX_BODY) {
        return too_large(hook);
    }
    let body = match tokio::time::timeout(
        TIMEOUT,
        Limited::new(req.into_body(), MAX_BODY).collect(),
    )
    .await
    {
        Ok(Ok(body)) => body.to_bytes(),
        Ok(Err(e)) if e.downcast_ref::<http_body_util::LengthLimitError>().is_some() => {
            return too_large(hook)
        }
        Ok(Err(e)) => {
            tracing::warn!(error = %e, "a review's body could not be read");
            return text(StatusCode::BAD_REQUEST, "the body could not be read\n");
        }
        Err(_) => {
            tracing::warn!("a review's body did not arrive within {TIMEOUT:?}");
            return text(StatusCode::REQUEST_TIMEOUT, "the body did not arrive in time\n");
        }
    };
    let answer = review::answer(&body, &hook.settings);
    hook.metrics.review(&answer.outcome, started.elapsed());
    match &answer.outcome {
        Outcome::Mutated => tracing::info!("mutated a pod"),
        Outcome::Skipped(skip) => tracing::debug!(reason = skip.as_str(), "left a pod alone"),
        Outcome::Unexpected(what) => tracing::warn!(what, "allowed as it is, unpatched"),
        Outcome::Malformed(why) => tracing::warn!(why, "refused a request that is no review"),
    }
    let mut response = Response::new(Full::from(answer.body));
    *response.status_mut() = StatusCode::from_u16(answer.status).expect("a valid status");
    response
        .headers_mut()
        .insert(CONTENT_TYPE, "application/json".parse().expect("a header value"));
    response
}

fn too_large(hook: &Webhook) -> Response<Full<Bytes>> {
    hook.metrics.too_large();
    tracing::warn!(limit = MAX_BODY, "refused a review over the size limit");
    text(StatusCode::PAYLOAD_TOO_LARGE, "the body is over the size limit\n")
}

fn text(status: StatusCode, body: &'static str) -> Response<Full<Bytes>> {
    let mut response = Response::new(Full::from(body));
    *response.status_mut() = status;
    response
}
