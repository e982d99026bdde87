//! One connection's bounds, on a paused clock: a silent one is closed after [`IDLE`] (and a
//! silent TLS handshake within it), an evicted one at once, a body that does not come is
//! answered 408 after [`REQUEST_TIME`] and its connection closed [`IDLE`] later.

use tokio::io::{AsyncReadExt, AsyncWriteExt, DuplexStream};

use super::*;

fn hook() -> Arc<Webhook> {
    Arc::new(Webhook::new(Settings::ack(&["169.254.20.10", "10.96.0.10"]), Metrics::default()))
}

/// Serves the server end of a pipe whose client end is returned, with the handle that evicts
/// it, until `serve` returns: when, from the start.
fn serving(hook: &Arc<Webhook>) -> (DuplexStream, oneshot::Sender<()>, JoinHandle) {
    let (client, server) = tokio::io::duplex(64 * 1024);
    let (evict, evicted) = oneshot::channel();
    let (hook, activity) = (hook.clone(), Activity::new());
    let started = Instant::now();
    let task = tokio::spawn(async move {
        let stream = async move { Some(server) };
        serve(stream, Port::Reviews, hook, http_builder(), activity, evicted).await;
        started.elapsed()
    });
    (client, evict, task)
}

type JoinHandle = tokio::task::JoinHandle<Duration>;

/// The `nodelocaldns_ha_webhook_connections_cut_total` of `reason`.
fn cut(hook: &Webhook, reason: &str) -> String {
    let text = hook.metrics.encode();
    let series = format!("nodelocaldns_ha_webhook_connections_cut_total{{reason=\"{reason}\"}} ");
    text.lines().find_map(|l| l.strip_prefix(&series)).unwrap_or("none").to_owned()
}

#[tokio::test(start_paused = true)]
async fn a_connection_that_sends_nothing_is_closed_after_the_idle_bound() {
    let hook = hook();
    let (mut client, _evict, task) = serving(&hook);
    let mut buf = [0; 64];
    assert_eq!(client.read(&mut buf).await.unwrap(), 0, "closed");
    let took = task.await.unwrap();
    assert!(took >= IDLE && took < IDLE + Duration::from_secs(1), "{took:?}");
    assert_eq!(cut(&hook, "idle"), "1");
}

#[tokio::test(start_paused = true)]
async fn a_handshake_that_does_not_end_is_cut_within_the_idle_bound() {
    let hook = hook();
    let (evict, evicted) = oneshot::channel::<()>();
    let started = Instant::now();
    // A TLS handshake (or anything before hyper) that never ends.
    let stream = std::future::pending::<Option<DuplexStream>>();
    serve(stream, Port::Reviews, hook.clone(), http_builder(), Activity::new(), evicted).await;
    assert_eq!(started.elapsed(), IDLE);
    assert_eq!(cut(&hook, "idle"), "1");
    drop(evict);
}

#[tokio::test(start_paused = true)]
async fn an_evicted_connection_ends_at_once() {
    let (mut client, evict, task) = serving(&hook());
    client.write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\n").await.unwrap();
    evict.send(()).unwrap();
    assert_eq!(task.await.unwrap(), Duration::ZERO);
}

#[tokio::test(start_paused = true)]
async fn a_body_that_does_not_come_is_answered_408_and_its_connection_closed_when_idle() {
    let hook = hook();
    let (mut client, _evict, task) = serving(&hook);
    let head = "POST /mutate HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{\"apiVersion\"";
    client.write_all(head.as_bytes()).await.unwrap();
    let mut answer = Vec::new();
    client.read_to_end(&mut answer).await.unwrap();
    let took = task.await.unwrap();
    let answer = String::from_utf8_lossy(&answer);
    assert!(answer.starts_with("HTTP/1.1 408 "), "{answer}");
    // Answered at the request's bound; the connection, its body unread, closed then or once
    // idle for as long again.
    assert!(took >= REQUEST_TIME && took <= REQUEST_TIME + IDLE + GRACE, "{took:?}");
    assert!(hook.metrics.encode().contains("reviews_total{result=\"timeout\",reason=\"\"} 1"));
}

#[tokio::test(start_paused = true)]
async fn a_review_is_answered_and_the_connection_kept_until_idle() {
    let hook = hook();
    let (mut client, _evict, task) = serving(&hook);
    let review = serde_json::json!({
        "apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
        "request": {"uid": "u", "kind": {"group": "", "version": "v1", "kind": "Pod"},
                    "resource": {"group": "", "version": "v1", "resource": "pods"},
                    "namespace": "shop", "operation": "CREATE", "userInfo": {},
                    "object": {"spec": {"containers": []}}},
    })
    .to_string();
    let head =
        format!("POST /mutate HTTP/1.1\r\nHost: x\r\nContent-Length: {}\r\n\r\n", review.len());
    client.write_all(head.as_bytes()).await.unwrap();
    client.write_all(review.as_bytes()).await.unwrap();
    let mut answer = vec![0; 4096];
    let n = client.read(&mut answer).await.unwrap();
    let answer = String::from_utf8_lossy(&answer[..n]);
    assert!(answer.starts_with("HTTP/1.1 200 ") && answer.contains("JSONPatch"), "{answer}");
    let took = task.await.unwrap();
    assert!(took >= IDLE && took < IDLE + Duration::from_secs(1), "{took:?}");
}
