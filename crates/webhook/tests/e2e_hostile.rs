//! The webhook against a hostile pod, on the simulated node with the real kube-apiserver (as
//! `e2e_apiserver.rs` runs it): from the node's pod1 namespace, a pod holds 1,000 connections
//! that send nothing (a tenth after finishing TLS, a tenth on the metrics port), sends 100
//! adversarial reviews of 4 MiB at once (deeply nested, millions of tiny elements, hundreds of
//! thousands of annotations or DNS options, inside the pod) over HTTP/1.1 and HTTP/2, and
//! trickles request heads and bodies a byte at a time; each attack alone, then all at once, each
//! connection opened again as soon as the webhook closes it.
//!
//! Throughout, the kubelet's probes (`/healthz` and `/readyz` on the metrics port, from the
//! node) are all answered (what they took is printed, not asserted: the machine is shared);
//! pods created through the API server in a labelled namespace are mutated, which the API
//! server does only with an answer that came within the configuration's `timeoutSeconds` (2 s:
//! it skips the webhook after that, by `failurePolicy: Ignore`): that bound is the API
//! server's; and the webhook's peak RSS (VmHWM) stays under the Deployment's memory limit,
//! 64 MiB.

mod common;

use std::collections::BTreeMap;
use std::convert::Infallible;
use std::io::{Read, Write};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use common::{configuration, kubectl, namespace, publish, Ca, Webhook, WEBHOOK_ADDR, WEBHOOK_IP};
use http_body_util::{BodyExt, Full};
use hyper::body::Bytes;
use hyper_util::rt::{TokioExecutor, TokioIo};
use rcgen::SanType;
use rustls::pki_types::ServerName;
use serde_json::{json, Value};
use testkit::{poll, require_root, wait_for, SimNode};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::task::JoinSet;

/// The Deployment's memory limit, KiB.
const LIMIT_KIB: u64 = 64 * 1024;
/// The address space the webhook may map (`prlimit --as`): far above what it needs, so that a
/// webhook whose memory runs away aborts on a failed allocation, and the test fails, before it
/// takes the machine's memory.
const ADDRESS_SPACE: u64 = 2 << 30;
/// Where the webhook's metrics port is: on the node's address, as a pod's port is on its IP,
/// where every pod reaches it.
const METRICS_ADDR: &str = "10.240.0.1:19254";
/// Each attack lasts this long: past the webhook's 10 s bounds, so that what it closes is opened
/// again.
const PHASE: Duration = Duration::from_secs(15);
/// A probe not answered within this failed: the webhook did not answer it at all. How long the
/// probes took is printed, not asserted: the machine is shared, and its load is not the
/// webhook's.
const PROBE_DEADLINE: Duration = Duration::from_secs(10);
/// An adversarial review's size: under the webhook's limit (4 MiB), so that it is read whole.
const BODY: usize = 4_000_000;

/// What the pod does to the webhook.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Attack {
    /// 1,000 connections that send nothing: 800 plain TCP and 100 that finish TLS on the HTTPS
    /// port, 100 on the metrics port.
    Idle,
    /// 100 adversarial reviews of 4 MiB in flight at once: 50 over HTTP/1.1, 50 as HTTP/2
    /// streams of 2 connections.
    Bodies,
    /// Request heads (100 connections) and bodies (100 connections, and 60 HTTP/2 streams of 2
    /// connections) trickled a byte every 100 ms; 20 heads on the metrics port.
    Slow,
    /// All of them at once.
    All,
}

impl Attack {
    /// How many clients it has: it is in effect once they have all connected.
    fn clients(self) -> u64 {
        match self {
            Attack::Idle => 1000,
            Attack::Bodies => 100,
            Attack::Slow => 280,
            Attack::All => 1380,
        }
    }
}

#[test]
fn a_hostile_pod_exhausts_neither_the_webhooks_memory_nor_its_answers() {
    require_root();
    raise_open_files();
    let node = SimNode::up_with(&["--kube-proxy", "real-iptables"]);
    let tls = node.dir.join("webhook-tls");
    std::fs::create_dir_all(&tls).unwrap();
    let ca = Ca::new();
    let (cert, _, key) = ca.leaf(SanType::IpAddress(WEBHOOK_IP.parse().unwrap()));
    publish(&tls, 1, &cert, &key);
    let hook = Webhook::start_with(
        &node,
        &tls,
        "169.254.20.10,10.96.0.10",
        METRICS_ADDR,
        Some(ADDRESS_SPACE),
    );
    let url = format!("https://{WEBHOOK_ADDR}/mutate");
    kubectl(&node, &["apply", "-f", "-"], &configuration(&url, &ca.pem()).to_string());
    namespace(&node, "injected", json!({"nodelocaldns-ha.io/dns-injection": "enabled"}));
    // The API server calls a webhook only once its configuration is in its informer.
    wait_for("the API server calling the webhook", Duration::from_secs(30), || {
        create_pod(&node).1.then_some(())
    });
    let calm = memory(hook.pid());
    eprintln!("before the attacks: {calm}");

    let probes = Probes::start(&node, METRICS_ADDR.parse().unwrap());
    let bodies = adversarial_bodies();
    let mut phases = Vec::new();
    for attack in [Attack::Idle, Attack::Bodies, Attack::Slow, Attack::All] {
        let hostile = Hostile::start(&node, attack, ca.client(), bodies.clone());
        let begun = hostile.wait_in_effect();
        let pods = pods_for(&node, PHASE);
        let tally = hostile.stop();
        let memory = memory(hook.pid());
        eprintln!(
            "{attack:?}: {begun} of {} clients begun, {}; pods: {}; webhook: {memory}",
            attack.clients(),
            tally.summary(),
            pods_summary(&pods)
        );
        phases.push((attack, begun, pods, memory));
    }
    let (mut took, failed) = probes.stop();
    let probed = took.len();
    took.sort_unstable();
    let at =
        |share: f64| took.get((took.len() as f64 * share) as usize).copied().unwrap_or_default();
    let counters = counters(&node, METRICS_ADDR.parse().unwrap());
    eprintln!("the webhook's counters: {counters}");
    let peak = phases.iter().map(|(.., m)| m.hwm_kib.unwrap_or(u64::MAX)).max().unwrap();
    eprintln!(
        "the kubelet's probes: {} of {probed} failed, answered in {:.1?} (median), {:.1?} (p99), \
         {:.1?} at most; the webhook's peak RSS {peak} KiB ({:.1} MiB), its limit {LIMIT_KIB} KiB",
        failed.len(),
        at(0.5),
        at(0.99),
        took.last().copied().unwrap_or_default(),
        peak as f64 / 1024.0
    );

    for (attack, begun, pods, _) in &phases {
        assert_eq!(*begun, attack.clients(), "{attack:?}: not every client began");
        assert!(pods.len() >= 3, "{attack:?}: only {} pods created", pods.len());
        let unmutated: Vec<_> = pods.iter().filter(|(_, mutated)| !mutated).collect();
        assert!(
            unmutated.is_empty(),
            "{attack:?}: {} of {} pods created through the API server were not mutated (the \
             webhook did not answer within the configuration's 2 s): {}",
            unmutated.len(),
            pods.len(),
            pods_summary(pods)
        );
    }
    assert!(failed.is_empty(), "the kubelet's probes failed: {failed:#?}");
    assert!(probed >= 200, "only {probed} probes in {} phases", phases.len());
    assert!(
        peak < LIMIT_KIB,
        "the webhook's peak RSS was {peak} KiB, over the Deployment's limit of {LIMIT_KIB} KiB"
    );
    let log = std::fs::read_to_string(&hook.log).unwrap();
    assert!(!log.contains("panicked"), "the webhook panicked:\n{log}");
    let longest = log.lines().map(str::len).max().unwrap_or(0);
    assert!(longest < 2048, "a log line of {longest} bytes: attacker text was not cut short");
    hook.stop();
}

/// The soft limit on open files raised to the hard one: the attacks hold over 1,300 sockets
/// (the webhook inherits it).
fn raise_open_files() {
    use nix::sys::resource::{getrlimit, setrlimit, Resource};
    let (_, hard) = getrlimit(Resource::RLIMIT_NOFILE).unwrap();
    setrlimit(Resource::RLIMIT_NOFILE, hard, hard).unwrap();
    assert!(hard >= 4096, "RLIMIT_NOFILE's hard limit is {hard}: the attacks need 4096");
}

/// Runs `f` on a thread of its own in `role`'s network namespace: every socket it opens is
/// there. A namespace that cannot be entered panics the thread before `f` runs.
fn in_namespace<T: Send + 'static>(
    node: &SimNode,
    role: &str,
    f: impl FnOnce() -> T + Send + 'static,
) -> JoinHandle<T> {
    let path = format!("/run/netns/{}", node.ns(role));
    std::thread::spawn(move || {
        let file = std::fs::File::open(&path).unwrap_or_else(|e| panic!("{path}: {e}"));
        nix::sched::setns(&file, nix::sched::CloneFlags::CLONE_NEWNET)
            .unwrap_or_else(|e| panic!("setns {path}: {e}"));
        f()
    })
}

/// Creates a pod in the labelled namespace through the API server: how long kubectl took, and
/// whether the stored pod was mutated.
fn create_pod(node: &SimNode) -> (Duration, bool) {
    let pod = common::pod("injected", json!({"app": "web"}), json!({}));
    let started = Instant::now();
    let out = kubectl(node, &["create", "-f", "-", "-o", "json"], &pod.to_string());
    let took = started.elapsed();
    let pod: Value = serde_json::from_slice(&out.stdout).unwrap();
    let mutated = pod["spec"]["dnsPolicy"] == "None"
        && pod["metadata"]["annotations"]["nodelocaldns-ha.io/dns"] == "injected";
    (took, mutated)
}

/// Pods created one a second for `phase`.
fn pods_for(node: &SimNode, phase: Duration) -> Vec<(Duration, bool)> {
    let end = Instant::now() + phase;
    let mut pods = Vec::new();
    while Instant::now() < end {
        let pod = create_pod(node);
        // Pacing only: one creation a second.
        std::thread::sleep(Duration::from_secs(1).saturating_sub(pod.0));
        pods.push(pod);
    }
    pods
}

fn pods_summary(pods: &[(Duration, bool)]) -> String {
    let mutated = pods.iter().filter(|(_, m)| *m).count();
    let max = pods.iter().map(|(t, _)| *t).max().unwrap_or_default();
    let mut times: Vec<_> = pods.iter().map(|(t, _)| t.as_millis()).collect();
    times.sort_unstable();
    let median = times.get(times.len() / 2).copied().unwrap_or(0);
    format!(
        "{mutated} of {} mutated, kubectl create took {median} ms (median), {} ms at most",
        pods.len(),
        max.as_millis()
    )
}

/// The webhook's counters of reviews and of connections it cut, from its `/metrics` (asked
/// from the node).
fn counters(node: &SimNode, addr: SocketAddr) -> String {
    let text = in_namespace(node, "node", move || {
        let mut tcp = std::net::TcpStream::connect_timeout(&addr, PROBE_DEADLINE).ok()?;
        let request = format!("GET /metrics HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n");
        tcp.write_all(request.as_bytes()).ok()?;
        let mut answer = String::new();
        tcp.read_to_string(&mut answer).ok()?;
        Some(answer)
    });
    let text = text.join().expect("the metrics reader").unwrap_or_default();
    let series = text.lines().filter(|l| {
        l.starts_with("nodelocaldns_ha_webhook_reviews_total")
            || l.starts_with("nodelocaldns_ha_webhook_connections_cut_total")
    });
    series.map(|l| l.trim_start_matches("nodelocaldns_ha_webhook_")).collect::<Vec<_>>().join(", ")
}

/// The webhook's resident memory, from /proc/PID/status.
struct Memory {
    rss_kib: Option<u64>,
    hwm_kib: Option<u64>,
}

impl std::fmt::Display for Memory {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match (self.rss_kib, self.hwm_kib) {
            (Some(rss), Some(hwm)) => write!(f, "VmRSS {rss} KiB, VmHWM {hwm} KiB"),
            _ => write!(f, "gone"),
        }
    }
}

fn memory(pid: u32) -> Memory {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    let field = |name: &str| {
        let line = status.lines().find(|l| l.starts_with(name))?;
        line[name.len()..].trim().trim_end_matches("kB").trim().parse().ok()
    };
    let zombie = status.lines().any(|l| l.starts_with("State:") && l.contains("zombie"));
    if zombie {
        return Memory { rss_kib: None, hwm_kib: None };
    }
    Memory { rss_kib: field("VmRSS:"), hwm_kib: field("VmHWM:") }
}

/// The kubelet's liveness and readiness probes from the node, ten times a second each.
struct Probes {
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<(Vec<Duration>, Vec<String>)>>,
}

impl Probes {
    fn start(node: &SimNode, addr: SocketAddr) -> Probes {
        let stop = Arc::new(AtomicBool::new(false));
        let stopped = stop.clone();
        let thread = in_namespace(node, "node", move || {
            let start = Instant::now();
            let (mut took, mut failed) = (Vec::new(), Vec::new());
            while !stopped.load(Relaxed) {
                let at = start.elapsed();
                for path in ["/healthz", "/readyz"] {
                    match probe(addr, path) {
                        Ok(answered) => took.push(answered),
                        Err(e) => failed.push(format!("{path} at {at:.1?}: {e}")),
                    }
                }
                // Pacing only: the next probes are due 100 ms after these began.
                std::thread::sleep(
                    (at + Duration::from_millis(100)).saturating_sub(start.elapsed()),
                );
            }
            (took, failed)
        });
        Probes { stop, thread: Some(thread) }
    }

    /// How long each answered probe took, and each failure.
    fn stop(mut self) -> (Vec<Duration>, Vec<String>) {
        self.stop.store(true, Relaxed);
        self.thread.take().unwrap().join().expect("the prober")
    }
}

impl Drop for Probes {
    fn drop(&mut self) {
        self.stop.store(true, Relaxed);
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// One probe as the kubelet sends it: how long it took to be answered 200, or why it was not.
fn probe(addr: SocketAddr, path: &str) -> Result<Duration, String> {
    let start = Instant::now();
    let mut tcp = std::net::TcpStream::connect_timeout(&addr, PROBE_DEADLINE)
        .map_err(|e| format!("connect: {e}"))?;
    tcp.set_read_timeout(Some(PROBE_DEADLINE)).unwrap();
    tcp.set_write_timeout(Some(PROBE_DEADLINE)).unwrap();
    let request = format!("GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n");
    tcp.write_all(request.as_bytes()).map_err(|e| format!("send: {e}"))?;
    let mut answer = Vec::new();
    tcp.read_to_end(&mut answer).map_err(|e| format!("read: {e} ({} bytes)", answer.len()))?;
    if !answer.starts_with(b"HTTP/1.1 200 ") {
        let head = String::from_utf8_lossy(&answer[..answer.len().min(40)]).into_owned();
        return Err(format!("answered {head:?}"));
    }
    Ok(start.elapsed())
}

/// What the hostile clients did.
#[derive(Default)]
struct Tally {
    /// Clients that began: their first connection open (an HTTP/2 connection's streams each).
    started: AtomicU64,
    connected: AtomicU64,
    handshakes: AtomicU64,
    /// Connections and streams the webhook ended, or answered.
    ended: AtomicU64,
    /// What the requests got: `h1 200`, `h2 408`, `cut`, ….
    outcomes: Mutex<BTreeMap<String, u64>>,
}

impl Tally {
    fn outcome(&self, what: impl Into<String>) {
        *self.outcomes.lock().unwrap().entry(what.into()).or_default() += 1;
    }

    fn summary(&self) -> String {
        format!(
            "{} connections opened ({} TLS handshakes finished), {} ended by the webhook; \
             requests: {:?}",
            self.connected.load(Relaxed),
            self.handshakes.load(Relaxed),
            self.ended.load(Relaxed),
            self.outcomes.lock().unwrap()
        )
    }
}

/// A hostile pod's clients, running in its namespace until stopped.
struct Hostile {
    stop: tokio::sync::watch::Sender<bool>,
    thread: Option<JoinHandle<()>>,
    tally: Arc<Tally>,
    attack: Attack,
}

impl Hostile {
    fn start(
        node: &SimNode,
        attack: Attack,
        tls: Arc<rustls::ClientConfig>,
        bodies: Vec<Bytes>,
    ) -> Hostile {
        let (stop, mut stopped) = tokio::sync::watch::channel(false);
        let tally = Arc::new(Tally::default());
        let clients = Clients {
            https: WEBHOOK_ADDR.parse().unwrap(),
            metrics: METRICS_ADDR.parse().unwrap(),
            tls,
            tally: tally.clone(),
        };
        let thread = in_namespace(node, "pod1", move || {
            // One thread: every socket is opened on it, in the pod's namespace.
            let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build();
            runtime.unwrap().block_on(async move {
                let mut tasks = JoinSet::new();
                clients.spawn(attack, &bodies, &mut tasks);
                let _ = stopped.wait_for(|stop| *stop).await;
                tasks.abort_all();
            });
        });
        Hostile { stop, thread: Some(thread), tally, attack }
    }

    /// Waits until every client has begun, for a minute at most: how many have.
    fn wait_in_effect(&self) -> u64 {
        let all = self.attack.clients();
        poll(Duration::from_secs(60), || (self.tally.started.load(Relaxed) >= all).then_some(()));
        self.tally.started.load(Relaxed)
    }

    fn stop(mut self) -> Arc<Tally> {
        let _ = self.stop.send(true);
        self.thread.take().unwrap().join().expect("the hostile pod's thread");
        self.tally.clone()
    }
}

impl Drop for Hostile {
    fn drop(&mut self) {
        let _ = self.stop.send(true);
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// The hostile clients' common ground.
#[derive(Clone)]
struct Clients {
    https: SocketAddr,
    metrics: SocketAddr,
    tls: Arc<rustls::ClientConfig>,
    tally: Arc<Tally>,
}

/// How a trickling client trickles.
#[derive(Clone, Copy)]
enum Trickle {
    /// The request head a byte at a time, then the body.
    Head,
    /// The head at once, then the body a byte at a time.
    Body,
}

impl Clients {
    fn spawn(&self, attack: Attack, bodies: &[Bytes], tasks: &mut JoinSet<()>) {
        if matches!(attack, Attack::Idle | Attack::All) {
            for i in 0..1000 {
                let (me, port, tls) = match i % 10 {
                    0 => (self.clone(), self.https, true),
                    1 => (self.clone(), self.metrics, false),
                    _ => (self.clone(), self.https, false),
                };
                tasks.spawn(async move { me.idle(port, tls).await });
            }
        }
        if matches!(attack, Attack::Bodies | Attack::All) {
            for i in 0..50 {
                let (me, body) = (self.clone(), bodies[i % bodies.len()].clone());
                tasks.spawn(async move { me.post_h1(body).await });
            }
            for i in 0..2 {
                let (me, bodies) = (self.clone(), bodies.to_vec());
                tasks.spawn(async move { me.post_h2(25, bodies, i).await });
            }
        }
        if matches!(attack, Attack::Slow | Attack::All) {
            for i in 0..200 {
                let me = self.clone();
                let trickle = if i % 2 == 0 { Trickle::Head } else { Trickle::Body };
                tasks.spawn(async move { me.slow_h1(trickle).await });
            }
            for _ in 0..20 {
                let me = self.clone();
                tasks.spawn(async move { me.slow_metrics().await });
            }
            for _ in 0..2 {
                let me = self.clone();
                tasks.spawn(async move { me.slow_h2(30).await });
            }
        }
    }

    /// A TCP connection to `addr`, or `None` after a short pause (a refused connection is
    /// retried, not spun on). The first one a client opens has it begin (`clients` of them: an
    /// HTTP/2 connection's streams).
    async fn connect(&self, addr: SocketAddr, clients: &mut u64) -> Option<TcpStream> {
        match TcpStream::connect(addr).await {
            Ok(tcp) => {
                self.tally.connected.fetch_add(1, Relaxed);
                self.tally.started.fetch_add(std::mem::take(clients), Relaxed);
                Some(tcp)
            }
            Err(e) => {
                self.tally.outcome(format!("connect: {:?}", e.kind()));
                // Pacing only: a refused connection is tried again 10 ms later.
                tokio::time::sleep(Duration::from_millis(10)).await;
                None
            }
        }
    }

    /// TLS over `tcp`, offering `alpn`.
    async fn handshake(
        &self,
        tcp: TcpStream,
        alpn: Option<&[u8]>,
    ) -> Option<tokio_rustls::client::TlsStream<TcpStream>> {
        let mut config = (*self.tls).clone();
        config.alpn_protocols = alpn.into_iter().map(<[u8]>::to_vec).collect();
        let name = ServerName::IpAddress(WEBHOOK_IP.parse::<std::net::IpAddr>().unwrap().into());
        let connector = tokio_rustls::TlsConnector::from(Arc::new(config));
        match connector.connect(name, tcp).await {
            Ok(tls) => {
                self.tally.handshakes.fetch_add(1, Relaxed);
                Some(tls)
            }
            Err(_) => {
                self.tally.ended.fetch_add(1, Relaxed);
                None
            }
        }
    }

    /// Connections to `addr` that send nothing (after TLS, with `tls`), each opened again as
    /// soon as the webhook closes it.
    async fn idle(self, addr: SocketAddr, tls: bool) {
        let mut begun = 1;
        loop {
            let Some(tcp) = self.connect(addr, &mut begun).await else { continue };
            if !tls {
                until_closed(tcp).await;
            } else if let Some(tls) = self.handshake(tcp, None).await {
                until_closed(tls).await;
            } else {
                continue;
            }
            self.tally.ended.fetch_add(1, Relaxed);
        }
    }

    /// `body` posted over HTTP/1.1 as fast as the webhook takes it, again and again.
    async fn post_h1(self, body: Bytes) {
        let mut begun = 1;
        loop {
            let Some(tcp) = self.connect(self.https, &mut begun).await else { continue };
            let Some(tls) = self.handshake(tcp, None).await else { continue };
            let head = format!(
                "POST /mutate?timeout=2s HTTP/1.1\r\nHost: {WEBHOOK_IP}\r\nContent-Type: \
                 application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
                body.len()
            );
            let (mut rx, mut tx) = tokio::io::split(tls);
            let body = body.clone();
            // The answer may come before the whole body is in (a refusal): read while writing.
            let write = async move {
                let _ = tx.write_all(head.as_bytes()).await;
                let _ = tx.write_all(&body).await;
                let _ = tx.flush().await;
                tx
            };
            let read = async {
                let mut answer = Vec::new();
                let _ = rx.read_to_end(&mut answer).await;
                answer
            };
            let (_tx, answer) = tokio::join!(write, read);
            self.tally.outcome(status_of("h1", &answer));
            self.tally.ended.fetch_add(1, Relaxed);
        }
    }

    /// HTTP/2 connections (the `n`th), each with `streams` streams posting `bodies` as fast as
    /// the webhook takes them; a connection the webhook ends is opened again.
    async fn post_h2(self, streams: usize, bodies: Vec<Bytes>, n: usize) {
        let mut begun = streams as u64;
        loop {
            let Some(sender) = self.h2(&mut begun).await else { continue };
            let mut tasks = JoinSet::new();
            for i in 0..streams {
                let (me, sender) = (self.clone(), sender.clone());
                let body = bodies[(n * streams + i) % bodies.len()].clone();
                tasks.spawn(async move { me.stream_h2(sender, body).await });
            }
            while tasks.join_next().await.is_some() {}
            self.tally.ended.fetch_add(1, Relaxed);
        }
    }

    /// An HTTP/2 connection: its request sender, the connection driven by a task of its own.
    async fn h2(
        &self,
        begun: &mut u64,
    ) -> Option<hyper::client::conn::http2::SendRequest<Full<Bytes>>> {
        let tcp = self.connect(self.https, begun).await?;
        let tls = self.handshake(tcp, Some(b"h2")).await?;
        let builder = hyper::client::conn::http2::Builder::new(TokioExecutor::new());
        let (sender, conn) = builder.handshake(TokioIo::new(tls)).await.ok()?;
        tokio::spawn(conn);
        Some(sender)
    }

    /// One stream after the other on `sender`, each posting `body`, until the connection ends.
    async fn stream_h2(
        self,
        mut sender: hyper::client::conn::http2::SendRequest<Full<Bytes>>,
        body: Bytes,
    ) {
        loop {
            if sender.ready().await.is_err() {
                return;
            }
            let request = hyper::Request::post(format!("https://{WEBHOOK_ADDR}/mutate?timeout=2s"))
                .header("content-type", "application/json")
                .body(Full::new(body.clone()))
                .unwrap();
            match sender.send_request(request).await {
                Ok(response) => {
                    let status = response.status().as_u16();
                    let _ = response.into_body().collect().await;
                    self.tally.outcome(format!("h2 {status}"));
                }
                Err(_) => {
                    self.tally.outcome("h2 cut");
                    return;
                }
            }
        }
    }

    /// Requests trickled a byte every 100 ms over TLS, as `trickle` says; a connection the
    /// webhook ends is opened again.
    async fn slow_h1(self, trickle: Trickle) {
        let head = format!(
            "POST /mutate?timeout=2s HTTP/1.1\r\nHost: {WEBHOOK_IP}\r\nContent-Type: \
             application/json\r\nContent-Length: {BODY}\r\n\r\n"
        );
        let mut begun = 1;
        loop {
            let Some(tcp) = self.connect(self.https, &mut begun).await else { continue };
            let Some(mut tls) = self.handshake(tcp, None).await else { continue };
            let mut ended = false;
            if let Trickle::Body = trickle {
                ended = tls.write_all(head.as_bytes()).await.is_err() || tls.flush().await.is_err();
            }
            let skip = match trickle {
                Trickle::Head => 0,
                Trickle::Body => head.len(),
            };
            let bytes = head.bytes().chain(std::iter::repeat(b' ')).take(head.len() + BODY);
            ended = ended || trickled(&mut tls, bytes.skip(skip)).await;
            self.tally.outcome(if ended { "h1 slow, cut" } else { "h1 slow, sent whole" });
            self.tally.ended.fetch_add(1, Relaxed);
        }
    }

    /// `GET /healthz` trickled a byte every 100 ms to the metrics port.
    async fn slow_metrics(self) {
        let head =
            "GET /healthz HTTP/1.1\r\nHost: x\r\nX-Padding: 0000000000000000000000000\r\n\r\n";
        let mut begun = 1;
        loop {
            let Some(mut tcp) = self.connect(self.metrics, &mut begun).await else { continue };
            let ended = trickled(&mut tcp, head.bytes()).await;
            self.tally.outcome(if ended {
                "metrics slow, cut"
            } else {
                "metrics slow, sent whole"
            });
            self.tally.ended.fetch_add(1, Relaxed);
        }
    }

    /// HTTP/2 connections with `streams` streams each, each stream's body trickled a byte every
    /// 100 ms; a stream or connection the webhook ends is opened again.
    async fn slow_h2(self, streams: usize) {
        let mut begun = streams as u64;
        loop {
            let Some(tcp) = self.connect(self.https, &mut begun).await else { continue };
            let Some(tls) = self.handshake(tcp, Some(b"h2")).await else { continue };
            let builder = hyper::client::conn::http2::Builder::new(TokioExecutor::new());
            let Ok((sender, conn)) = builder.handshake(TokioIo::new(tls)).await else { continue };
            tokio::spawn(conn);
            let mut tasks = JoinSet::new();
            for _ in 0..streams {
                let (me, mut sender) = (self.clone(), sender.clone());
                tasks.spawn(async move {
                    while sender.ready().await.is_ok() {
                        let (mut tx, body) =
                            http_body_util::channel::Channel::<Bytes, Infallible>::new(1);
                        let request =
                            hyper::Request::post(format!("https://{WEBHOOK_ADDR}/mutate"))
                                .header("content-type", "application/json")
                                .header("content-length", BODY.to_string())
                                .body(body)
                                .unwrap();
                        let answer = sender.send_request(request);
                        tokio::pin!(answer);
                        // A byte every 100 ms until the webhook answers or ends the stream.
                        let trickle = async {
                            let mut every = tokio::time::interval(Duration::from_millis(100));
                            loop {
                                every.tick().await;
                                if tx.send_data(Bytes::from_static(b" ")).await.is_err() {
                                    break;
                                }
                            }
                        };
                        let answer = tokio::select! {
                            answer = &mut answer => answer,
                            () = trickle => answer.await,
                        };
                        let outcome = match answer {
                            Ok(response) => format!("h2 slow, {}", response.status().as_u16()),
                            Err(_) => "h2 slow, cut".to_owned(),
                        };
                        me.tally.outcome(outcome);
                        me.tally.ended.fetch_add(1, Relaxed);
                    }
                });
            }
            while tasks.join_next().await.is_some() {}
        }
    }
}

/// Writes `bytes` one every 100 ms; whether the webhook ended the connection before they were
/// all written.
async fn trickled(io: &mut (impl AsyncWrite + Unpin), bytes: impl Iterator<Item = u8>) -> bool {
    let mut every = tokio::time::interval(Duration::from_millis(100));
    for byte in bytes {
        every.tick().await;
        if io.write_all(&[byte]).await.is_err() || io.flush().await.is_err() {
            return true;
        }
    }
    false
}

/// Reads until the webhook closes the connection (or resets it).
async fn until_closed(mut io: impl AsyncRead + Unpin) {
    let mut buf = [0; 512];
    while matches!(io.read(&mut buf).await, Ok(n) if n > 0) {}
}

/// `proto` and the status of an HTTP/1.1 answer, or `cut` when there was none.
fn status_of(proto: &str, answer: &[u8]) -> String {
    let text = String::from_utf8_lossy(&answer[..answer.len().min(16)]);
    match text.split_whitespace().nth(1) {
        Some(status) => format!("{proto} {status}"),
        None => format!("{proto} cut"),
    }
}

/// Reviews of a pod in the labelled namespace, each of [`BODY`] bytes, whose pod carries what
/// costs a parser the most: arrays nested two million deep, two million tiny array elements,
/// hundreds of thousands of annotations, of DNS options, or a million search domains.
fn adversarial_bodies() -> Vec<Bytes> {
    let container = r#""containers":[{"name":"c","image":"i"}]"#;
    let bodies = [
        review(r#""spec":{"containers":[{"name":"c","image":"i","args":"#, "}]}", |text, room| {
            let depth = room / 2;
            text.extend(std::iter::repeat_n('[', depth));
            text.extend(std::iter::repeat_n(']', depth));
        }),
        review(
            r#""spec":{"containers":[{"name":"c","image":"i","args":["#,
            "]}]}",
            |text, room| list(text, room, |_| "0".to_owned()),
        ),
        review(r#""metadata":{"generateName":"x-","annotations":{"#, "}}", |text, room| {
            list(text, room, |i| format!("\"a{i}\":\"\""))
        }),
        review(
            &format!(r#""spec":{{{container},"dnsConfig":{{"options":["#),
            "]}}",
            |text, room| list(text, room, |i| format!("{{\"name\":\"o{i}\"}}")),
        ),
        review(
            &format!(r#""spec":{{{container},"dnsConfig":{{"searches":["#),
            "]}}",
            |text, room| list(text, room, |_| "\"a\"".to_owned()),
        ),
    ];
    for body in &bodies {
        let parsed: Result<serde::de::IgnoredAny, _> = serde_json::from_slice(body);
        assert!(parsed.is_ok() && body.len() <= BODY, "an adversarial body is no JSON of its size");
    }
    bodies.to_vec()
}

/// A review of a pod whose JSON opens with `open`, has what `fill` writes in at most the room it
/// is given, and closes with `close`: [`BODY`] bytes in all.
fn review(open: &str, close: &str, fill: impl FnOnce(&mut String, usize)) -> Bytes {
    let mut text = format!(
        r#"{{"apiVersion":"admission.k8s.io/v1","kind":"AdmissionReview","request":{{"uid":"hostile","kind":{{"group":"","version":"v1","kind":"Pod"}},"resource":{{"group":"","version":"v1","resource":"pods"}},"namespace":"injected","operation":"CREATE","userInfo":{{"username":"pod1"}},"object":{{"apiVersion":"v1","kind":"Pod",{open}"#
    );
    let tail = format!(r#"{close}}},"oldObject":null}}}}"#);
    let room = BODY - text.len() - tail.len();
    fill(&mut text, room);
    text.push_str(&tail);
    Bytes::from(text)
}

/// Items `item(0)`, `item(1)`, … separated by commas, in at most `room` bytes.
fn list(text: &mut String, room: usize, item: impl Fn(usize) -> String) {
    let end = text.len() + room;
    for i in 0.. {
        let next = item(i);
        if text.len() + next.len() + 1 > end {
            break;
        }
        if i > 0 {
            text.push(',');
        }
        text.push_str(&next);
    }
}
