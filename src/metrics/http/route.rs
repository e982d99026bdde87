//! Routing: which endpoint a request names, whether its method is allowed there, and that
//! endpoint's answer from the metrics and the health the control loop reports.

use std::time::Instant;

use super::request::Request;
use super::response::{Response, Status, PLAIN};
use super::State;

/// The content type of an OpenMetrics text exposition.
pub(super) const OPENMETRICS: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// The content type of the Prometheus text format.
pub(super) const TEXT_FORMAT: &str = "text/plain; version=0.0.4; charset=utf-8";

/// The endpoints.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Endpoint {
    Metrics,
    Healthz,
    Readyz,
}

/// The answer to `request`, received at `now`; with `probes_only` (a place kept for health
/// checks), `/metrics` is not served.
pub(super) fn answer(
    request: Result<Request<'_>, &'static str>,
    state: &State,
    now: Instant,
    probes_only: bool,
) -> Response {
    let request = match request {
        Ok(request) => request,
        Err(why) => return Response::bad_request(why),
    };
    let endpoint = match request.path {
        "/metrics" => Endpoint::Metrics,
        "/healthz" => Endpoint::Healthz,
        "/readyz" => Endpoint::Readyz,
        _ => {
            let body = "not found: the paths are /metrics, /healthz and /readyz\n";
            return Response::new(Status::NotFound, PLAIN, body.into());
        }
    };
    if probes_only && endpoint == Endpoint::Metrics {
        let body = "busy: every place is taken; the few kept for /healthz and /readyz serve \
                    nothing else\n";
        return Response::new(Status::ServiceUnavailable, PLAIN, body.into());
    }
    let head_only = match request.method {
        "GET" => false,
        "HEAD" => true,
        _ => {
            let body = "method not allowed: use GET or HEAD\n";
            return Response::new(Status::MethodNotAllowed, PLAIN, body.into());
        }
    };
    let response = match endpoint {
        // Prometheus asks for OpenMetrics; curl, promtool and older collectors get text 0.0.4.
        Endpoint::Metrics if request.openmetrics => {
            Response::new(Status::Ok, OPENMETRICS, state.metrics.encode())
        }
        Endpoint::Metrics => Response::new(Status::Ok, TEXT_FORMAT, state.metrics.encode_text()),
        Endpoint::Healthz if state.health.live(now, state.max_silence) => {
            Response::new(Status::Ok, PLAIN, "ok\n".into())
        }
        Endpoint::Healthz => {
            let silence = state.health.silence(now);
            let body = format!(
                "not live: the control loop last turned {silence:.1?} ago (allowed: {:.1?})\n",
                state.max_silence
            );
            Response::new(Status::ServiceUnavailable, PLAIN, body)
        }
        Endpoint::Readyz => match state.health.not_ready() {
            None => Response::new(Status::Ok, PLAIN, "ok\n".into()),
            Some(why) => {
                Response::new(Status::ServiceUnavailable, PLAIN, format!("not ready: {why}\n"))
            }
        },
    };
    if head_only {
        response.without_body()
    } else {
        response
    }
}
