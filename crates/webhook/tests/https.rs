//! The webhook's binary over HTTPS on loopback, as the API server and the kubelet meet it: a
//! review mutated; bad input answered without a patch, logged once and counted;
//! the certificate rotated under it and picked up without a restart; bad flags refused.

mod common;

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

use common::{publish, Ca};
use rcgen::SanType;
use rustls::pki_types::{CertificateDer, ServerName};
use serde_json::{json, Value};

const NAME: &str = "webhook.test";

/// A serving certificate for [`NAME`].
fn leaf(ca: &Ca) -> (String, CertificateDer<'static>, String) {
    ca.leaf(SanType::DnsName(NAME.try_into().unwrap()))
}

/// A scratch directory, removed on drop.
struct Dir(PathBuf);

impl Dir {
    fn new(tag: &str) -> Self {
        let path = std::env::temp_dir().join(format!("nlha-webhook-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&path);
        std::fs::create_dir_all(&path).unwrap();
        Dir(path)
    }
}

impl Drop for Dir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// The running binary, its addresses and its log.
struct Webhook {
    child: Child,
    https: String,
    http: String,
    log: mpsc::Receiver<String>,
    seen: Vec<String>,
}

impl Webhook {
    fn start(dir: &Path) -> Self {
        let mut child = Command::new(env!("CARGO_BIN_EXE_nodelocaldns-ha-webhook"))
            .args(["--listen", "127.0.0.1:0", "--metrics-listen", "127.0.0.1:0"])
            .arg("--tls-cert-file")
            .arg(dir.join("tls.crt"))
            .arg("--tls-key-file")
            .arg(dir.join("tls.key"))
            .env("NO_COLOR", "1")
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let (tx, log) = mpsc::channel();
        let stderr = child.stderr.take().unwrap();
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                println!("webhook: {line}");
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        let mut hook =
            Webhook { child, https: String::new(), http: String::new(), log, seen: vec![] };
        let serving = hook.wait_log("serving", Duration::from_secs(10));
        let field = |key: &str| {
            let rest = &serving[serving.find(&format!("{key}=")).unwrap() + key.len() + 1..];
            rest.split_whitespace().next().unwrap().to_owned()
        };
        hook.https = field("listen");
        hook.http = field("metrics");
        hook
    }

    /// Waits for a log line containing `text`; returns it.
    fn wait_log(&mut self, text: &str, deadline: Duration) -> String {
        let end = Instant::now() + deadline;
        loop {
            let left = end.saturating_duration_since(Instant::now());
            match self.log.recv_timeout(left) {
                Ok(line) => {
                    self.seen.push(line.clone());
                    if line.contains(text) {
                        return line;
                    }
                }
                Err(e) => {
                    panic!("no log line with {text:?} within {deadline:?} ({e}): {:?}", self.seen)
                }
            }
        }
    }

    /// Every log line so far.
    fn lines(&mut self) -> &[String] {
        while let Ok(line) = self.log.try_recv() {
            self.seen.push(line);
        }
        &self.seen
    }

    fn metrics(&self) -> String {
        let mut tcp = TcpStream::connect(&self.http).unwrap();
        write!(tcp, "GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").unwrap();
        let mut text = String::new();
        tcp.read_to_string(&mut text).unwrap();
        text
    }

    fn stop(mut self) -> std::process::ExitStatus {
        let pid = nix::unistd::Pid::from_raw(self.child.id() as i32);
        nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM).unwrap();
        self.child.wait().unwrap()
    }
}

impl Drop for Webhook {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// One HTTP/1.1 request over TLS: the status, the body, and the certificate the server showed.
/// The body is written while the answer is read, as a client does that meets an early answer.
fn request(
    hook: &Webhook,
    client: &Arc<rustls::ClientConfig>,
    head: &str,
    body: &[u8],
) -> (u16, Vec<u8>, CertificateDer<'static>) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    let (head, body) = (head.as_bytes().to_vec(), body.to_vec());
    runtime.block_on(async {
        let tcp = tokio::net::TcpStream::connect(&hook.https).await.unwrap();
        let name = ServerName::try_from(NAME).unwrap();
        let tls =
            tokio_rustls::TlsConnector::from(client.clone()).connect(name, tcp).await.unwrap();
        let shown = tls.get_ref().1.peer_certificates().unwrap()[0].clone().into_owned();
        let (mut rx, mut tx) = tokio::io::split(tls);
        let writer = tokio::spawn(async move {
            // The server may answer and close before the whole body is in.
            let _ = tx.write_all(&head).await;
            let _ = tx.write_all(&body).await;
            let _ = tx.flush().await;
            tx
        });
        let mut answer = Vec::new();
        let read = rx.read_to_end(&mut answer);
        let _ = tokio::time::timeout(Duration::from_secs(20), read).await;
        writer.abort();
        let text = String::from_utf8_lossy(&answer);
        let status = text.split_whitespace().nth(1).and_then(|s| s.parse().ok()).unwrap_or(0);
        let start =
            answer.windows(4).position(|w| w == b"\r\n\r\n").map_or(answer.len(), |p| p + 4);
        (status, answer[start..].to_vec(), shown)
    })
}

fn post(hook: &Webhook, client: &Arc<rustls::ClientConfig>, body: &[u8]) -> (u16, Value) {
    let head = format!(
        "POST /mutate?timeout=5s HTTP/1.1\r\nHost: {NAME}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    );
    let (status, body, _) = request(hook, client, &head, body);
    (status, serde_json::from_slice(&body).unwrap_or(Value::Null))
}

fn review(object: Option<Value>, kind: &str) -> Vec<u8> {
    let review = json!({
        "apiVersion": "admission.k8s.io/v1",
        "kind": "AdmissionReview",
        "request": {
            "uid": "b1c2",
            "kind": {"group": "", "version": "v1", "kind": kind},
            "resource": {"group": "", "version": "v1", "resource": "pods"},
            "namespace": "shop",
            "operation": "CREATE",
            "userInfo": {"username": "system:serviceaccount:kube-system:replicaset-controller"},
            "object": object,
            "oldObject": null,
        }
    });
    serde_json::to_vec(&review).unwrap()
}

fn pod() -> Value {
    json!({"apiVersion": "v1", "kind": "Pod", "metadata": {"generateName": "web-"},
           "spec": {"containers": [{"name": "web", "image": "nginx"}]}})
}

/// The value of the series `series` (name and labels, as written) in an OpenMetrics text.
fn metric(text: &str, series: &str) -> f64 {
    text.lines()
        .find_map(|l| l.strip_prefix(series)?.strip_prefix(' ')?.parse().ok())
        .unwrap_or_else(|| panic!("no {series} in {text}"))
}

#[test]
fn a_pod_is_mutated_and_bad_input_is_answered_without_a_patch() {
    let dir = Dir::new("input");
    let ca = Ca::new();
    let (cert, _, key) = leaf(&ca);
    publish(&dir.0, 1, &cert, &key);
    let mut hook = Webhook::start(&dir.0);
    let client = ca.client();

    let (status, body) = post(&hook, &client, &review(Some(pod()), "Pod"));
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["response"]["uid"], "b1c2");
    assert_eq!(body["response"]["patchType"], "JSONPatch", "{body}");

    // Malformed JSON: refused with 400, nothing to patch.
    let (status, body) = post(&hook, &client, b"{\"apiVersion\": \"admission.k8s.io/v1\",");
    assert_eq!(status, 400, "{body}");
    assert!(body["response"].get("patch").is_none(), "{body}");
    // Over the size limit, declared or sent in chunks: 413 before the body is read.
    let big = vec![b' '; 5 * 1024 * 1024];
    let (status, _) = post(&hook, &client, &big);
    assert_eq!(status, 413);
    let chunked = "POST /mutate HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n";
    let mut body = Vec::new();
    for _ in 0..5 {
        body.extend_from_slice(format!("{:x}\r\n", 1024 * 1024).as_bytes());
        body.extend_from_slice(&vec![b' '; 1024 * 1024]);
        body.extend_from_slice(b"\r\n");
    }
    body.extend_from_slice(b"0\r\n\r\n");
    let (status, _, _) = request(&hook, &client, chunked, &body);
    assert_eq!(status, 413);
    // Another kind, and no object: allowed as they are.
    let service = json!({"apiVersion": "v1", "kind": "Service", "metadata": {"name": "web"}});
    for (review, what) in
        [(review(Some(service), "Service"), "Service"), (review(None, "Pod"), "no object")]
    {
        let (status, body) = post(&hook, &client, &review);
        assert_eq!(status, 200, "{body}");
        assert_eq!(body["response"]["allowed"], true, "{body}");
        assert!(body["response"].get("patch").is_none(), "{what}: {body}");
    }

    let text = hook.metrics();
    let count = |result: &str| {
        metric(
            &text,
            &format!("nodelocaldns_ha_webhook_reviews_total{{result=\"{result}\",reason=\"\"}}"),
        )
    };
    assert_eq!(count("mutated"), 1.0, "{text}");
    assert_eq!(count("malformed"), 1.0, "{text}");
    assert_eq!(count("too_large"), 2.0, "{text}");
    assert_eq!(count("unexpected"), 2.0, "{text}");
    // Each bad input logged once: five warnings, one a request.
    hook.wait_log("a review with no object", Duration::from_secs(5));
    let warnings = hook.lines().iter().filter(|l| l.contains("WARN")).count();
    assert_eq!(warnings, 5, "{:?}", hook.lines());
    assert!(hook.stop().success());
}

#[test]
fn a_rotated_certificate_is_served_without_a_restart() {
    let dir = Dir::new("rotate");
    let ca = Ca::new();
    let (cert, first, key) = leaf(&ca);
    publish(&dir.0, 1, &cert, &key);
    let mut hook = Webhook::start(&dir.0);
    let client = ca.client();
    let head = format!("GET /healthz HTTP/1.1\r\nHost: {NAME}\r\nConnection: close\r\n\r\n");
    let (status, _, shown) = request(&hook, &client, &head, b"");
    assert_eq!((status, &shown), (200, &first));

    // Caught between the two files: a new certificate beside the old key does not load, and the
    // old pair is still served.
    let (cert, second, key) = leaf(&ca);
    let data = dir.0.join("..data");
    let old_key = std::fs::read_to_string(data.join("tls.key")).unwrap();
    publish(&dir.0, 2, &cert, &old_key);
    hook.wait_log("does not load", Duration::from_secs(5));
    let (_, _, shown) = request(&hook, &client, &head, b"");
    assert_eq!(shown, first);

    publish(&dir.0, 3, &cert, &key);
    hook.wait_log("reloaded", Duration::from_secs(5));
    let (status, _, shown) = request(&hook, &client, &head, b"");
    assert_eq!((status, &shown), (200, &second));
    let text = hook.metrics();
    let reloads = |r: &str| {
        metric(
            &text,
            &format!("nodelocaldns_ha_webhook_certificate_reloads_total{{result=\"{r}\"}}"),
        )
    };
    assert_eq!((reloads("loaded"), reloads("failed")), (1.0, 1.0), "{text}");
    assert!(hook.stop().success());
}

#[test]
fn bad_flags_are_refused_and_nothing_is_served() {
    let dir = Dir::new("flags");
    let missing = dir.0.join("missing.crt");
    let run = |args: &[&str]| {
        let out = Command::new(env!("CARGO_BIN_EXE_nodelocaldns-ha-webhook"))
            .args(["--listen", "127.0.0.1:0", "--metrics-listen", "127.0.0.1:0"])
            .args(args)
            .output()
            .unwrap();
        (out.status.code(), String::from_utf8_lossy(&out.stderr).into_owned())
    };
    let missing = missing.to_str().unwrap();
    let (code, err) = run(&["--tls-cert-file", missing, "--tls-key-file", missing]);
    assert_eq!(code, Some(2), "{err}");
    assert!(err.contains("the serving certificate") && err.contains(missing), "{err}");

    let ca = Ca::new();
    let (cert, _, key) = leaf(&ca);
    publish(&dir.0, 1, &cert, &key);
    let (crt, key) = (dir.0.join("tls.crt"), dir.0.join("tls.key"));
    let files = ["--tls-cert-file", crt.to_str().unwrap(), "--tls-key-file", key.to_str().unwrap()];
    let (code, err) =
        run(&[&files[..], &["--nameserver", "169.254.20.10,10.96.0.10,fd00::a,10.0.0.1"]].concat());
    assert_eq!(code, Some(2), "{err}");
    assert!(err.contains("--nameserver: 4 given"), "{err}");
    let (code, err) = run(&[&files[..], &["--nameserver", "kube-dns"]].concat());
    assert_eq!(code, Some(2), "{err}");
    assert!(err.contains("--nameserver"), "{err}");
}
