//! dnsload: a glibc-like DNS load client that counts answers by who gave them.
//!
//! Each lookup behaves like glibc's `res_send` with a single nameserver: a new UDP socket
//! `connect()`ed to the server per attempt, a random query id, replies with the wrong id or
//! question ignored, ICMP port unreachable (`ECONNREFUSED`) failing the attempt at once, and up
//! to `--attempts` attempts. Lookups start at a steady rate as independent tasks. The address in
//! the answer tells who answered (`--origin 1.1.1.1=cache`), so a test can see which path a
//! query took. Output: an optional timeline (one line per interval, for lookups *started* in
//! it) and one final `SUMMARY {json}` line.
//!
//! With `--system-resolver` each lookup is instead one `getaddrinfo()` of the C library (in a
//! blocking thread), which follows `/etc/resolv.conf` — its nameservers, timeouts and attempts —
//! as a pod's application does; `--server`, `--timeout`, `--attempts` and `--tcp` then do not
//! apply, and a lookup's attempts are not visible (only its result and its latency).

#![forbid(unsafe_code)]

use std::collections::{HashMap, VecDeque};
use std::io::{BufWriter, ErrorKind, Write};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use clap::Parser;
use hickory_proto::op::{Message, MessageType, Query, ResponseCode};
use hickory_proto::rr::{Name, RecordType};
use serde_json::json;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpStream, UdpSocket};
use tokio::signal::unix::{signal, SignalKind};
use tokio::task::{Id, JoinSet};
use tokio::time::{interval_at, Instant, MissedTickBehavior};

/// How many failure/loss start times the summary lists at most.
const MAX_LISTED: usize = 1000;

/// A glibc-like DNS load client that counts answers by origin.
#[derive(Parser, Debug)]
#[command(name = "dnsload", version)]
struct Args {
    /// DNS server: IP or IP:port ([IPv6]:port); port 53 by default
    #[arg(long, value_parser = parse_server, required_unless_present = "system_resolver")]
    server: Option<SocketAddr>,

    /// Look names up with the C library's getaddrinfo() (A: AF_INET, AAAA: AF_INET6), which
    /// follows /etc/resolv.conf, instead of sending queries to --server
    #[arg(long, conflicts_with_all = ["server", "tcp"])]
    system_resolver: bool,

    /// Write one line per lookup to PATH: start (ms since the run's start), latency (ms),
    /// origin label or "failed", failed attempts
    #[arg(long, value_name = "PATH")]
    lookups_out: Option<PathBuf>,

    /// Name to look up
    #[arg(long, default_value = "who.test", value_parser = parse_name)]
    name: Name,

    /// Query type: A or AAAA
    #[arg(long, default_value = "A", value_parser = parse_qtype)]
    qtype: RecordType,

    /// Lookups started per second
    #[arg(long, default_value_t = 500, value_parser = clap::value_parser!(u32).range(1..=100_000))]
    rate: u32,

    /// How long to keep starting lookups (e.g. 500ms, 10s, 2m)
    #[arg(long, default_value = "10s", value_parser = parse_duration)]
    duration: Duration,

    /// Timeout of one attempt
    #[arg(long, default_value = "1s", value_parser = parse_positive_duration)]
    timeout: Duration,

    /// Attempts per lookup (glibc's `options attempts:N`)
    #[arg(long, default_value_t = 2, value_parser = clap::value_parser!(u32).range(1..=10))]
    attempts: u32,

    /// Label answers by address, ADDR=LABEL (repeatable); other addresses count as "other"
    #[arg(
        long = "origin",
        value_name = "ADDR=LABEL",
        value_parser = parse_origin,
        default_values = ["1.1.1.1=cache", "fd00::1:1:1:1=cache", "2.2.2.2=coredns", "fd00::2:2:2:2=coredns"]
    )]
    origins: Vec<Origin>,

    /// Print a timeline line per interval (0 = no timeline)
    #[arg(long, default_value = "500ms", value_parser = parse_duration)]
    report_interval: Duration,

    /// JSON file with a top-level string field "route", shown in each timeline line
    #[arg(long, value_name = "PATH")]
    route_file: Option<PathBuf>,

    /// Use TCP (a new connection per attempt) instead of UDP
    #[arg(long)]
    tcp: bool,

    /// Lookups in flight at most: a lookup due while this many are is not started, and counted
    /// as `skipped` [default: rate × the longest a lookup can take, + 100]
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u32).range(1..))]
    max_in_flight: Option<u32>,
}

#[derive(Clone, Debug)]
struct Origin {
    addr: IpAddr,
    label: String,
}

fn parse_server(s: &str) -> Result<SocketAddr, String> {
    s.parse::<SocketAddr>()
        .or_else(|_| s.parse::<IpAddr>().map(|ip| SocketAddr::new(ip, 53)))
        .map_err(|_| format!("expected IP, IP:port or [IPv6]:port, got {s:?}"))
}

fn parse_name(s: &str) -> Result<Name, String> {
    let mut name = Name::from_ascii(s).map_err(|e| format!("bad name {s:?}: {e}"))?;
    name.set_fqdn(true);
    Ok(name)
}

fn parse_qtype(s: &str) -> Result<RecordType, String> {
    match s.to_ascii_uppercase().as_str() {
        "A" => Ok(RecordType::A),
        "AAAA" => Ok(RecordType::AAAA),
        _ => Err(format!("expected A or AAAA, got {s:?}")),
    }
}

/// Parses `0`, or a number with a unit: `500ms`, `1.5s`, `2m`.
fn parse_duration(s: &str) -> Result<Duration, String> {
    let bad = || format!("expected a duration like 500ms, 10s or 2m, got {s:?}");
    if s == "0" {
        return Ok(Duration::ZERO);
    }
    let split = s.find(|c: char| c.is_ascii_alphabetic()).ok_or_else(bad)?;
    let (number, unit) = s.split_at(split);
    let value: f64 = number.parse().map_err(|_| bad())?;
    let seconds = match unit {
        "ms" => value / 1000.0,
        "s" => value,
        "m" => value * 60.0,
        _ => return Err(bad()),
    };
    Duration::try_from_secs_f64(seconds).map_err(|_| bad())
}

fn parse_positive_duration(s: &str) -> Result<Duration, String> {
    match parse_duration(s)? {
        d if d.is_zero() => Err("must be greater than 0".to_string()),
        d => Ok(d),
    }
}

fn parse_origin(s: &str) -> Result<Origin, String> {
    let (addr, label) =
        s.split_once('=').ok_or_else(|| format!("expected ADDR=LABEL, got {s:?}"))?;
    let addr = addr.parse().map_err(|_| format!("bad address {addr:?} in {s:?}"))?;
    if label.is_empty() || label == "other" {
        return Err(format!("bad label {label:?} in {s:?} (\"other\" is reserved)"));
    }
    Ok(Origin { addr, label: label.to_string() })
}

// ---------------------------------------------------------------------------------------------
// One lookup.

/// Why an attempt failed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum AttemptError {
    /// No matching reply within the attempt's timeout.
    Timeout,
    /// ECONNREFUSED: ICMP port unreachable (UDP) or a reset (TCP).
    Refused,
    /// The server answered SERVFAIL.
    ServFail,
    /// Any other rcode, or NOERROR without an address for the question.
    BadReply,
    /// Any other socket error (e.g. no route).
    Io,
}

impl From<std::io::Error> for AttemptError {
    fn from(e: std::io::Error) -> Self {
        match e.kind() {
            ErrorKind::ConnectionRefused | ErrorKind::ConnectionReset => AttemptError::Refused,
            _ => AttemptError::Io,
        }
    }
}

#[derive(Clone, Copy)]
struct LookupSpec {
    /// None: the C library's resolver.
    server: Option<SocketAddr>,
    qtype: RecordType,
    timeout: Duration,
    attempts: u32,
    tcp: bool,
}

/// How long a `--system-resolver` lookup may take at most, for the in-flight bound and the
/// drain: glibc's worst case with 3 nameservers, `timeout:5` and `attempts:2` is 30 s.
const SYSTEM_LOOKUP_BUDGET: Duration = Duration::from_secs(31);

/// What one lookup did.
struct LookupResult {
    /// When the lookup started, since the start of the run.
    started: Duration,
    /// The address answered, if an attempt succeeded.
    answer: Option<IpAddr>,
    /// Failed attempts, in order.
    errors: Vec<AttemptError>,
    /// From start to the final answer or failure.
    latency: Duration,
}

impl LookupResult {
    /// A lookup that never reported back (it did not finish in time, or its task failed).
    fn lost(started: Duration) -> Self {
        LookupResult { started, answer: None, errors: Vec::new(), latency: Duration::ZERO }
    }

    fn first_attempt_lost(&self) -> bool {
        self.answer.is_none() || !self.errors.is_empty()
    }
}

async fn lookup(spec: LookupSpec, name: Name, started: Duration) -> LookupResult {
    let t0 = Instant::now();
    let Some(server) = spec.server else {
        let qtype = spec.qtype;
        let result = tokio::task::spawn_blocking(move || system_lookup(&name, qtype))
            .await
            .unwrap_or(Err(AttemptError::Io));
        let (answer, errors) = match result {
            Ok(addr) => (Some(addr), Vec::new()),
            Err(e) => (None, vec![e]),
        };
        return LookupResult { started, answer, errors, latency: t0.elapsed() };
    };
    let query = Query::query(name, spec.qtype);
    let mut errors = Vec::new();
    let mut answer = None;
    for _ in 0..spec.attempts {
        let attempt = async {
            if spec.tcp {
                tcp_attempt(server, &query).await
            } else {
                udp_attempt(server, &query).await
            }
        };
        match tokio::time::timeout(spec.timeout, attempt).await {
            Ok(Ok(addr)) => {
                answer = Some(addr);
                break;
            }
            Ok(Err(e)) => errors.push(e),
            Err(_elapsed) => errors.push(AttemptError::Timeout),
        }
    }
    LookupResult { started, answer, errors, latency: t0.elapsed() }
}

/// One `getaddrinfo()` of `name` (A: AF_INET, AAAA: AF_INET6); the first address returned.
fn system_lookup(name: &Name, qtype: RecordType) -> Result<IpAddr, AttemptError> {
    use dns_lookup::{AddrInfoHints, LookupErrorKind};
    let family = if qtype == RecordType::AAAA { libc::AF_INET6 } else { libc::AF_INET };
    let hints = AddrInfoHints { address: family, socktype: libc::SOCK_DGRAM, ..Default::default() };
    let list = dns_lookup::getaddrinfo(Some(&name.to_ascii()), None, Some(hints)).map_err(|e| {
        match e.kind() {
            // Timeouts, SERVFAIL, refused servers: glibc says "try again".
            LookupErrorKind::Again => AttemptError::Timeout,
            LookupErrorKind::NoName | LookupErrorKind::NoData => AttemptError::BadReply,
            _ => AttemptError::Io,
        }
    })?;
    list.filter_map(Result::ok).map(|ai| ai.sockaddr.ip()).next().ok_or(AttemptError::BadReply)
}

/// A new query with a random id and RD set, as (id, wire bytes).
fn encode_query(query: &Query) -> Result<(u16, Vec<u8>), AttemptError> {
    let mut msg = Message::query();
    msg.metadata.recursion_desired = true;
    msg.add_query(query.clone());
    let bytes = msg.to_vec().map_err(|_| AttemptError::Io)?;
    Ok((msg.metadata.id, bytes))
}

async fn udp_attempt(server: SocketAddr, query: &Query) -> Result<IpAddr, AttemptError> {
    let (id, bytes) = encode_query(query)?;
    let local: IpAddr = match server {
        SocketAddr::V4(_) => Ipv4Addr::UNSPECIFIED.into(),
        SocketAddr::V6(_) => Ipv6Addr::UNSPECIFIED.into(),
    };
    let socket = UdpSocket::bind((local, 0)).await?;
    socket.connect(server).await?;
    socket.send(&bytes).await?;
    // Without EDNS, replies fit in 512 bytes; a longer one would be truncated and ignored.
    let mut buf = vec![0u8; 4096];
    loop {
        let n = socket.recv(&mut buf).await?;
        if let Some(result) = check_reply(&buf[..n], id, query) {
            return result;
        }
    }
}

async fn tcp_attempt(server: SocketAddr, query: &Query) -> Result<IpAddr, AttemptError> {
    let (id, bytes) = encode_query(query)?;
    let len = u16::try_from(bytes.len()).map_err(|_| AttemptError::Io)?;
    let mut stream = TcpStream::connect(server).await?;
    let mut framed = len.to_be_bytes().to_vec();
    framed.extend_from_slice(&bytes);
    stream.write_all(&framed).await?;
    loop {
        let len = stream.read_u16().await?;
        let mut buf = vec![0u8; usize::from(len)];
        stream.read_exact(&mut buf).await?;
        if let Some(result) = check_reply(&buf, id, query) {
            return result;
        }
    }
}

/// None if the datagram is not the reply to this query (keep waiting), else the attempt's result.
fn check_reply(buf: &[u8], id: u16, query: &Query) -> Option<Result<IpAddr, AttemptError>> {
    let msg = Message::from_vec(buf).ok()?;
    let ours = msg.metadata.id == id
        && msg.metadata.message_type == MessageType::Response
        && msg.queries.len() == 1
        && msg.queries[0].name == query.name
        && msg.queries[0].query_type == query.query_type;
    if !ours {
        return None;
    }
    Some(match msg.metadata.response_code {
        ResponseCode::NoError => msg
            .answers
            .iter()
            .filter(|r| r.record_type() == query.query_type)
            .find_map(|r| r.data.ip_addr())
            .ok_or(AttemptError::BadReply),
        ResponseCode::ServFail => Err(AttemptError::ServFail),
        _ => Err(AttemptError::BadReply),
    })
}

// ---------------------------------------------------------------------------------------------
// Counting.

/// Maps answer addresses to origin labels; the last index is "other".
struct Origins {
    labels: Vec<String>,
    by_addr: HashMap<IpAddr, usize>,
}

impl Origins {
    fn new(origins: &[Origin]) -> Self {
        let mut labels: Vec<String> = Vec::new();
        let mut by_addr = HashMap::new();
        for o in origins {
            let index = match labels.iter().position(|l| *l == o.label) {
                Some(i) => i,
                None => {
                    labels.push(o.label.clone());
                    labels.len() - 1
                }
            };
            by_addr.insert(o.addr, index);
        }
        labels.push("other".to_string());
        Origins { labels, by_addr }
    }

    fn index(&self, addr: IpAddr) -> usize {
        self.by_addr.get(&addr).copied().unwrap_or(self.labels.len() - 1)
    }
}

/// Counts over a set of lookups (one timeline interval, or the whole run).
#[derive(Default)]
struct Counts {
    by_origin: Vec<u64>,
    failed: u64,
    first_attempt_lost: u64,
    /// Latencies of successful lookups, in ms.
    latencies_ms: Vec<f64>,
}

impl Counts {
    fn new(origins: &Origins) -> Self {
        Counts { by_origin: vec![0; origins.labels.len()], ..Counts::default() }
    }

    fn add(&mut self, origins: &Origins, r: &LookupResult) {
        match r.answer {
            Some(addr) => {
                self.by_origin[origins.index(addr)] += 1;
                self.latencies_ms.push(r.latency.as_secs_f64() * 1000.0);
            }
            None => self.failed += 1,
        }
        if r.first_attempt_lost() {
            self.first_attempt_lost += 1;
        }
    }
}

/// Nearest-rank percentile of sorted values (0 if empty).
fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let rank = (p / 100.0 * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

fn sorted(values: &[f64]) -> Vec<f64> {
    let mut v = values.to_vec();
    v.sort_by(f64::total_cmp);
    v
}

/// The whole run.
struct Totals {
    sent: u64,
    skipped: u64,
    unfinished: u64,
    counts: Counts,
    attempt_errors: HashMap<&'static str, u64>,
    failures_at_ms: Vec<u64>,
    first_attempt_lost_at_ms: Vec<u64>,
}

impl Totals {
    fn add(&mut self, origins: &Origins, r: &LookupResult) {
        self.counts.add(origins, r);
        for e in &r.errors {
            let key = match e {
                AttemptError::Timeout => "timeout_attempts",
                AttemptError::Refused => "refused_attempts",
                AttemptError::ServFail => "servfail_attempts",
                AttemptError::BadReply => "bad_reply_attempts",
                AttemptError::Io => "io_error_attempts",
            };
            *self.attempt_errors.entry(key).or_default() += 1;
        }
        let at_ms = r.started.as_millis() as u64;
        if r.answer.is_none() && self.failures_at_ms.len() < MAX_LISTED {
            self.failures_at_ms.push(at_ms);
        }
        if r.first_attempt_lost() && self.first_attempt_lost_at_ms.len() < MAX_LISTED {
            self.first_attempt_lost_at_ms.push(at_ms);
        }
    }

    fn summary(&mut self, origins: &Origins) -> serde_json::Value {
        let by_origin: serde_json::Map<String, serde_json::Value> = origins
            .labels
            .iter()
            .zip(&self.counts.by_origin)
            .map(|(label, n)| (label.clone(), json!(n)))
            .collect();
        let latencies = sorted(&self.counts.latencies_ms);
        self.failures_at_ms.sort_unstable();
        self.first_attempt_lost_at_ms.sort_unstable();
        let errors = |key| self.attempt_errors.get(key).copied().unwrap_or(0);
        json!({
            "sent": self.sent,
            "ok": self.counts.by_origin.iter().sum::<u64>(),
            "failed": self.counts.failed,
            "first_attempt_lost": self.counts.first_attempt_lost,
            "by_origin": by_origin,
            "refused_attempts": errors("refused_attempts"),
            "timeout_attempts": errors("timeout_attempts"),
            "servfail_attempts": errors("servfail_attempts"),
            "bad_reply_attempts": errors("bad_reply_attempts"),
            "io_error_attempts": errors("io_error_attempts"),
            "skipped": self.skipped,
            "unfinished": self.unfinished,
            "latency_ms": {
                "p50": round2(percentile(&latencies, 50.0)),
                "p99": round2(percentile(&latencies, 99.0)),
                "max": round2(latencies.last().copied().unwrap_or(0.0)),
            },
            "failures_at_ms": self.failures_at_ms,
            "first_attempt_lost_at_ms": self.first_attempt_lost_at_ms,
        })
    }
}

fn round2(x: f64) -> f64 {
    (x * 100.0).round() / 100.0
}

// ---------------------------------------------------------------------------------------------
// Timeline: one line per interval, for the lookups started in it, printed once they all ended.

struct Bucket {
    started: u64,
    finished: u64,
    counts: Counts,
    /// The route when the interval ended (None while it is open).
    route: Option<String>,
}

struct Timeline {
    interval: Duration,
    route_file: Option<PathBuf>,
    /// Buckets not printed yet; `buckets[0]` is interval number `first`.
    buckets: VecDeque<Bucket>,
    first: usize,
}

impl Timeline {
    fn index_of(&self, at: Duration) -> usize {
        (at.as_nanos() / self.interval.as_nanos()) as usize
    }

    fn bucket(&mut self, index: usize, origins: &Origins) -> &mut Bucket {
        // A lookup whose task failed is reported with start 0; count it in the oldest open
        // interval rather than index before the start of the deque.
        let index = index.max(self.first);
        while self.first + self.buckets.len() <= index {
            self.buckets.push_back(Bucket {
                started: 0,
                finished: 0,
                counts: Counts::new(origins),
                route: None,
            });
        }
        &mut self.buckets[index - self.first]
    }

    fn started(&mut self, at: Duration, origins: &Origins) {
        let index = self.index_of(at);
        self.bucket(index, origins).started += 1;
    }

    fn finished(&mut self, origins: &Origins, r: &LookupResult) {
        let index = self.index_of(r.started);
        let bucket = self.bucket(index, origins);
        bucket.finished += 1;
        bucket.counts.add(origins, r);
    }

    /// Closes the intervals that ended before `now` (all of them if `all`), noting the route.
    fn close(&mut self, now: Duration, all: bool, origins: &Origins) {
        let open_from = if all { self.first + self.buckets.len() } else { self.index_of(now) };
        if open_from > self.first {
            self.bucket(open_from - 1, origins); // intervals without lookups get a line too
        }
        let mut route = None;
        for (i, b) in self.buckets.iter_mut().enumerate() {
            if self.first + i < open_from && b.route.is_none() {
                b.route = Some(route.get_or_insert_with(|| read_route(&self.route_file)).clone());
            }
        }
    }

    /// Prints the closed intervals whose lookups have all finished (all closed ones if `force`).
    fn flush(&mut self, force: bool, end: Duration, origins: &Origins) {
        while let Some(b) = self.buckets.front() {
            if b.route.is_none() || (!force && b.finished < b.started) {
                break;
            }
            let b = self.buckets.pop_front().expect("front exists");
            let t = self.interval * (self.first as u32 + 1);
            self.first += 1;
            print_line(t.min(end), &b, self.route_file.is_some(), origins);
        }
    }
}

fn print_line(t: Duration, b: &Bucket, show_route: bool, origins: &Origins) {
    let mut line = format!("t={:6.2}s", t.as_secs_f64());
    if show_route {
        line += &format!(" route={:<7}", b.route.as_deref().unwrap_or("?"));
    }
    for (label, n) in origins.labels.iter().zip(&b.counts.by_origin) {
        line += &format!(" {label}={n}");
    }
    let unfinished = b.started - b.finished;
    line += &format!(
        " failed={} first_attempt_lost={}",
        b.counts.failed + unfinished,
        b.counts.first_attempt_lost
    );
    match b.counts.latencies_ms.is_empty() {
        true => line += " p99_ms=-",
        false => {
            let p99 = percentile(&sorted(&b.counts.latencies_ms), 99.0);
            line += &format!(" p99_ms={p99:.1}");
        }
    }
    println!("{line}");
}

/// The "route" field of the route file, or "?" if it cannot be read right now.
fn read_route(path: &Option<PathBuf>) -> String {
    let Some(path) = path else {
        return String::new();
    };
    std::fs::read_to_string(path)
        .ok()
        .and_then(|text| serde_json::from_str::<serde_json::Value>(&text).ok())
        .and_then(|v| v.get("route")?.as_str().map(str::to_string))
        .unwrap_or_else(|| "?".to_string())
}

// ---------------------------------------------------------------------------------------------

async fn run(args: Args) -> std::io::Result<serde_json::Value> {
    let origins = Origins::new(&args.origins);
    let spec = LookupSpec {
        server: args.server,
        qtype: args.qtype,
        timeout: args.timeout,
        attempts: args.attempts,
        tcp: args.tcp,
    };
    let lookup_budget = match spec.server {
        Some(_) => args.timeout * args.attempts,
        None => SYSTEM_LOOKUP_BUDGET,
    };
    let mut lookups_out = match &args.lookups_out {
        Some(path) => Some(BufWriter::new(std::fs::File::create(path)?)),
        None => None,
    };
    let planned = (f64::from(args.rate) * args.duration.as_secs_f64()).round() as u64;
    let max_in_flight = args.max_in_flight.map_or_else(
        || (f64::from(args.rate) * lookup_budget.as_secs_f64()).ceil() as usize + 100,
        |n| n as usize,
    );

    let mut sigint = signal(SignalKind::interrupt())?;
    let mut sigterm = signal(SignalKind::terminate())?;

    let mut totals = Totals {
        sent: 0,
        skipped: 0,
        unfinished: 0,
        counts: Counts::new(&origins),
        attempt_errors: HashMap::new(),
        failures_at_ms: Vec::new(),
        first_attempt_lost_at_ms: Vec::new(),
    };
    let mut timeline = (!args.report_interval.is_zero()).then(|| Timeline {
        interval: args.report_interval,
        route_file: args.route_file.clone(),
        buckets: VecDeque::new(),
        first: 0,
    });

    let start = Instant::now();
    let start_unix_ms =
        SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64);
    let mut send_tick = interval_at(start, Duration::from_secs(1) / args.rate);
    send_tick.set_missed_tick_behavior(MissedTickBehavior::Burst);
    let report_every = args.report_interval.max(Duration::from_millis(1));
    let mut report_tick = interval_at(start + report_every, report_every);
    report_tick.set_missed_tick_behavior(MissedTickBehavior::Delay);
    let drain = tokio::time::sleep(Duration::ZERO);
    tokio::pin!(drain);

    let mut tasks = JoinSet::new();
    let mut in_flight: HashMap<Id, Duration> = HashMap::new();
    let mut sending = planned > 0;
    // Where the last timeline interval ends: the planned duration, or when a signal came.
    let mut end = args.duration;

    loop {
        let mut stop = false;
        let mut signalled = false;
        tokio::select! {
            _ = send_tick.tick(), if sending => {
                // When the lookup really starts (not when it was scheduled): it lines up with
                // other processes' events, and it never falls into an interval already closed.
                let at = start.elapsed();
                if tasks.len() < max_in_flight {
                    let handle = tasks.spawn(lookup(spec, args.name.clone(), at));
                    in_flight.insert(handle.id(), at);
                    totals.sent += 1;
                    if let Some(tl) = timeline.as_mut() {
                        tl.started(at, &origins);
                    }
                } else {
                    totals.skipped += 1;
                }
                stop = totals.sent + totals.skipped >= planned;
            }
            _ = report_tick.tick(), if timeline.is_some() && sending => {
                if let Some(tl) = timeline.as_mut() {
                    tl.close(start.elapsed(), false, &origins);
                    tl.flush(false, end, &origins);
                }
            }
            Some(joined) = tasks.join_next_with_id() => {
                let (id, result) = match joined {
                    Ok((id, result)) => (id, result),
                    // A lookup task cannot panic short of a bug; count it as a failure.
                    Err(e) => {
                        let started = in_flight.get(&e.id()).copied().unwrap_or_default();
                        (e.id(), LookupResult::lost(started))
                    }
                };
                in_flight.remove(&id);
                if let Some(out) = lookups_out.as_mut() {
                    write_lookup(out, &origins, &result)?;
                }
                totals.add(&origins, &result);
                if let Some(tl) = timeline.as_mut() {
                    tl.finished(&origins, &result);
                    tl.flush(false, end, &origins);
                }
            }
            _ = sigint.recv() => signalled = true,
            _ = sigterm.recv() => signalled = true,
            () = &mut drain, if !sending => break,
        }
        if signalled {
            if !sending {
                break; // a second signal: report now
            }
            end = start.elapsed().min(end);
        }
        if stop || signalled {
            sending = false;
            // Each lookup ends within its attempts' timeouts; the deadline is a safety net.
            drain.as_mut().reset(Instant::now() + lookup_budget + Duration::from_millis(500));
            if let Some(tl) = timeline.as_mut() {
                tl.close(end, true, &origins);
            }
        }
        if !sending && tasks.is_empty() {
            break;
        }
    }

    tasks.abort_all();
    for (_, started) in in_flight.drain() {
        totals.unfinished += 1;
        let lost = LookupResult::lost(started);
        if let Some(out) = lookups_out.as_mut() {
            write_lookup(out, &origins, &lost)?;
        }
        totals.add(&origins, &lost);
    }
    if let Some(mut out) = lookups_out.take() {
        out.flush()?;
    }
    if let Some(tl) = timeline.as_mut() {
        tl.close(end, true, &origins);
        tl.flush(true, end, &origins);
    }
    let mut summary = totals.summary(&origins);
    // The wall-clock start, so that `*_at_ms` can be lined up with other processes' events.
    summary["start_unix_ms"] = json!(start_unix_ms);
    Ok(summary)
}

/// One `--lookups-out` line: start ms, latency ms, origin label or "failed", failed attempts.
fn write_lookup(out: &mut impl Write, origins: &Origins, r: &LookupResult) -> std::io::Result<()> {
    let origin = match r.answer {
        Some(addr) => origins.labels[origins.index(addr)].as_str(),
        None => "failed",
    };
    writeln!(
        out,
        "{:.3} {:.3} {origin} {}",
        r.started.as_secs_f64() * 1000.0,
        r.latency.as_secs_f64() * 1000.0,
        r.errors.len()
    )
}

fn main() -> ExitCode {
    let args = Args::parse();
    let mut builder = tokio::runtime::Builder::new_current_thread();
    if args.system_resolver {
        // One blocking thread per lookup in flight: a lookup never waits for a free thread.
        let most = f64::from(args.rate) * SYSTEM_LOOKUP_BUDGET.as_secs_f64();
        builder.max_blocking_threads((most as usize + 100).min(50_000));
    }
    let runtime = match builder.enable_all().build() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("dnsload: cannot start the runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(run(args)) {
        Ok(summary) => {
            println!("SUMMARY {summary}");
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("dnsload: {e}");
            ExitCode::FAILURE
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations() {
        assert_eq!(parse_duration("500ms"), Ok(Duration::from_millis(500)));
        assert_eq!(parse_duration("10s"), Ok(Duration::from_secs(10)));
        assert_eq!(parse_duration("1.5s"), Ok(Duration::from_millis(1500)));
        assert_eq!(parse_duration("2m"), Ok(Duration::from_secs(120)));
        assert_eq!(parse_duration("0"), Ok(Duration::ZERO));
        for bad in ["", "10", "s", "-1s", "10x", "1e400s"] {
            assert!(parse_duration(bad).is_err(), "{bad:?}");
        }
        assert!(parse_positive_duration("0ms").is_err());
    }

    #[test]
    fn servers_and_origins() {
        assert_eq!(parse_server("10.96.0.10"), Ok("10.96.0.10:53".parse().unwrap()));
        assert_eq!(parse_server("[fd00::10]:5353"), Ok("[fd00::10]:5353".parse().unwrap()));
        assert_eq!(parse_server("fd00::10"), Ok("[fd00::10]:53".parse().unwrap()));
        assert!(parse_server("nope").is_err());
        let o = Origins::new(&[
            parse_origin("1.1.1.1=cache").unwrap(),
            parse_origin("fd00::1=cache").unwrap(),
            parse_origin("2.2.2.2=coredns").unwrap(),
        ]);
        assert_eq!(o.labels, ["cache", "coredns", "other"]);
        assert_eq!(o.index("fd00::1".parse().unwrap()), 0);
        assert_eq!(o.index("9.9.9.9".parse().unwrap()), 2);
        assert!(parse_origin("1.1.1.1=other").is_err());
    }

    #[test]
    fn percentiles() {
        let v = sorted(&(1..=100).map(f64::from).collect::<Vec<_>>());
        assert_eq!(percentile(&v, 50.0), 50.0);
        assert_eq!(percentile(&v, 99.0), 99.0);
        assert_eq!(percentile(&[], 99.0), 0.0);
    }

    #[test]
    fn lookups_out_lines() {
        let o = Origins::new(&[parse_origin("1.1.1.1=cache").unwrap()]);
        let answered = LookupResult {
            started: Duration::from_micros(1500),
            answer: Some([1, 1, 1, 1].into()),
            errors: vec![AttemptError::Timeout],
            latency: Duration::from_millis(1000),
        };
        let mut out = Vec::new();
        write_lookup(&mut out, &o, &answered).unwrap();
        write_lookup(&mut out, &o, &LookupResult::lost(Duration::from_millis(2))).unwrap();
        assert_eq!(
            String::from_utf8(out).unwrap(),
            "1.500 1000.000 cache 1\n2.000 0.000 failed 0\n"
        );
    }

    #[test]
    fn system_resolver_and_server_are_exclusive() {
        assert!(Args::try_parse_from(["dnsload", "--system-resolver"]).is_ok());
        assert!(Args::try_parse_from(["dnsload"]).is_err());
        let both = ["dnsload", "--system-resolver", "--server", "10.96.0.10"];
        assert!(Args::try_parse_from(both).is_err());
    }

    #[test]
    fn replies_are_matched_and_classified() {
        use hickory_proto::rr::{rdata::A, RData, Record};
        let query = Query::query(parse_name("who.test").unwrap(), RecordType::A);
        let mut reply = Message::response(7, hickory_proto::op::OpCode::Query);
        reply.add_query(query.clone());
        reply.add_answer(Record::from_rdata(query.name.clone(), 30, RData::A(A::new(1, 1, 1, 1))));
        let bytes = reply.to_vec().unwrap();
        assert_eq!(check_reply(&bytes, 8, &query), None);
        assert_eq!(check_reply(&bytes, 7, &query), Some(Ok([1, 1, 1, 1].into())));
        reply.metadata.response_code = ResponseCode::ServFail;
        let bytes = reply.to_vec().unwrap();
        assert_eq!(check_reply(&bytes, 7, &query), Some(Err(AttemptError::ServFail)));
    }
}
