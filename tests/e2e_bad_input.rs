//! Bad input reaching the real agent on the simulated node: a broken override file in its state
//! directory, garbage and crowds on its control socket, a "cache" that answers garbage, a flood
//! of silent clients on its metrics endpoint, and a pod's flood of connections there that never
//! read or send slowly. Each time the agent must go on doing its job — switch the route on the
//! probes' word, answer the kubelet — never panic, and say what was wrong.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream, UdpSocket};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use hickory_proto::op::{Message, OpCode, Query, ResponseCode};
use hickory_proto::rr::{Name, RecordType};
use nix::sys::signal::Signal;
use serde_json::Value;
use testkit::*;

/// The control socket of `agent`.
fn socket(agent: &Agent) -> PathBuf {
    agent.state_dir.join("control.sock")
}

/// Waits until the agent serves its control socket (it starts that after its first state).
fn wait_socket(agent: &Agent) -> PathBuf {
    let sock = socket(agent);
    wait_for("the control socket", Duration::from_secs(5), || UnixStream::connect(&sock).ok());
    sock
}

/// Sends `bytes` on a new control connection, optionally closes the sending side, and returns
/// the answer line (parsed), or `None` if the agent closed the connection without one.
fn exchange(socket: &Path, bytes: &[u8], close: bool) -> Option<Value> {
    let mut stream = UnixStream::connect(socket).expect("connect to the control socket");
    stream.set_read_timeout(Some(Duration::from_secs(15))).unwrap();
    // The agent may answer and close before reading all of it.
    let _ = stream.write_all(bytes);
    if close {
        let _ = stream.shutdown(std::net::Shutdown::Write);
    }
    let mut line = String::new();
    BufReader::new(stream).read_line(&mut line).expect("an answer or a close");
    (!line.is_empty()).then(|| serde_json::from_str(&line).expect("the answer is JSON"))
}

/// An answer's `message`, asserting its `result`.
fn message(answer: Option<Value>, result: &str) -> String {
    let answer = answer.expect("an answer");
    assert_eq!(answer["result"], result, "{answer}");
    answer["message"].as_str().expect("a message").to_owned()
}

/// Lines of the agent's log containing every one of `words`.
fn log_lines(agent: &Agent, words: &[&str]) -> usize {
    agent.log_text().lines().filter(|l| words.iter().all(|w| l.contains(w))).count()
}

fn assert_no_panic(agent: &Agent) {
    let log = agent.log_text();
    assert!(!log.contains("panicked"), "the agent panicked:\n{log}");
}

/// Probes the agent has sent to the cache over UDP, by its state file.
fn cache_probes(agent: &Agent) -> u64 {
    agent.state().and_then(|s| s["probes"]["cache_udp"]["sent"].as_u64()).unwrap_or(0)
}

/// Waits until the agent has sent `n` more cache probes: its loop has turned that often (once
/// a second at the quiet pace, on a healthy idle node).
fn wait_probes(agent: &Agent, n: u64) {
    let from = cache_probes(agent);
    wait_for("more probes", Duration::from_secs(30), || {
        (cache_probes(agent) >= from + n).then_some(())
    });
}

/// What is put where a record (the override or the state file) belongs.
enum Broken {
    File(Vec<u8>),
    Directory,
    Fifo,
    Link(&'static str),
}

impl Broken {
    /// Puts it at `path`, in place of whatever was there.
    fn put(self, path: &Path) {
        if path.is_dir() {
            std::fs::remove_dir(path).unwrap();
        }
        let _ = std::fs::remove_file(path);
        match self {
            Broken::File(bytes) => std::fs::write(path, bytes).unwrap(),
            Broken::Directory => std::fs::create_dir(path).unwrap(),
            Broken::Fifo => {
                nix::unistd::mkfifo(path, nix::sys::stat::Mode::from_bits_truncate(0o600)).unwrap()
            }
            Broken::Link(target) => std::os::unix::fs::symlink(target, path).unwrap(),
        }
    }
}

/// Issue 6, item 5: a broken override file never keeps the agent from starting or from
/// failing over. The agent warns once, naming the file and what to do, ignores it (the probes
/// decide the route) and removes it as the stale record it is, or, if it cannot (a directory),
/// says so once, not on every turn of its loop.
#[test]
fn a_broken_override_file_is_ignored_and_the_probes_decide() {
    let node = SimNode::up();
    let dir = node.dir.join("agent-state");
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("override.json");
    // A valid record would force Upstream; none of the broken ones may.
    let valid = br#"{"version":1,"route":"upstream","until_unix_ms":null,"reason":"x","set_by":"uid 0","set_unix_ms":1,"kind":"manual"}"#;
    let mut huge = valid.to_vec();
    huge.resize(1 << 20, b' ');
    let cases = [
        (
            "truncated",
            Broken::File(valid[..valid.len() / 2].to_vec()),
            "not a valid route override",
        ),
        ("garbage", Broken::File(b"\x00\xffnot json".to_vec()), "not a valid route override"),
        ("empty", Broken::File(Vec::new()), "not a valid route override"),
        (
            "another version",
            Broken::File(br#"{"version":2,"route":"upstream"}"#.to_vec()),
            "format version 2",
        ),
        ("huge", Broken::File(huge), "larger than 65536 bytes"),
        ("a directory", Broken::Directory, "a directory"),
        ("a FIFO nobody writes", Broken::Fifo, "not a regular file"),
        ("a link to /dev/zero", Broken::Link("/dev/zero"), "not a regular file"),
    ];
    let mut last = None;
    for (case, broken, says) in cases {
        // The last agent first: running, it would remove what is put there.
        drop(last.take());
        broken.put(&file);
        // Starts (a FIFO would hang a blocking read here), and the cache's health decides.
        let agent = node.agent_starting(&[]);
        let st = agent.wait_route("local", Duration::from_secs(5));
        assert!(!st["reason"].as_str().unwrap().contains("forced"), "{case}: {st}");
        wait_for(&format!("{case}: the warning"), Duration::from_secs(5), || {
            let name = file.display().to_string();
            let words = ["ignoring the recorded override", &name, says, "nodelocaldns-ha release"];
            (log_lines(&agent, &words) == 1).then_some(())
        });
        if case == "a directory" {
            // Ten turns of the loop at least, each of which would have warned.
            wait_probes(&agent, 10);
            assert!(file.is_dir());
            let words = ["removing the record of an override not in force failed"];
            assert_eq!(log_lines(&agent, &words), 1, "{case}: said more than once");
        } else {
            wait_for(&format!("{case}: the stale record removed"), Duration::from_secs(5), || {
                file.symlink_metadata().is_err().then_some(())
            });
        }
        assert_eq!(agent.state().unwrap()["route"], "local");
        assert_no_panic(&agent);
        last = Some(agent);
    }
    // The last one still fails over: the probes decide, whatever the file said.
    let agent = last.unwrap();
    node.signal("cache-kill");
    agent.wait_route("upstream", Duration::from_secs(5));

    // While running: garbage written over the record of an override not in force is removed,
    // quietly; the route does not move.
    node.script(&["cache-start"]);
    agent.wait_route("local", Duration::from_secs(10));
    std::fs::write(&file, b"{\"version\":").unwrap();
    wait_for("the garbage removed", Duration::from_secs(5), || (!file.exists()).then_some(()));
    assert_eq!(agent.state().unwrap()["route"], "local");
    assert_no_panic(&agent);
}

/// A broken state file: `status` says at once what is wrong with it, naming it, and exits 1 —
/// where it used to wait forever on a FIFO, and read a link to `/dev/zero` until memory ran out.
/// (A running agent replaces any of them but the directory within a second.)
#[test]
fn a_broken_state_file_is_refused_by_status_at_once() {
    let dir = std::env::temp_dir().join(format!("nlha-bad-state-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("state.json");
    let mut huge = br#"{"version":1,"pid":1}"#.to_vec();
    huge.resize(2 << 20, b' ');
    let cases = [
        ("a FIFO nobody writes", Broken::Fifo, "not a regular file"),
        ("a link to /dev/zero", Broken::Link("/dev/zero"), "not a regular file"),
        ("a directory", Broken::Directory, "a directory"),
        ("huge", Broken::File(huge), "larger than 1048576 bytes"),
        ("garbage", Broken::File(b"\x00\xffnot json".to_vec()), "not a valid state file"),
    ];
    for (case, broken, says) in cases {
        broken.put(&file);
        for json in [false, true] {
            let stderr = dir.join("stderr");
            let mut status = Command::new(agent_exe());
            status.args(["status", "--state-dir"]).arg(&dir);
            if json {
                status.arg("--json");
            }
            status.stdout(Stdio::null()).stderr(std::fs::File::create(&stderr).unwrap());
            let mut status = Proc::spawn(&mut status);
            let what = format!("{case}: status to exit");
            let exit = wait_for(&what, Duration::from_secs(10), || status.try_wait());
            let said = std::fs::read_to_string(&stderr).unwrap();
            assert_eq!(exit.code(), Some(1), "{case} (json: {json}): {said}");
            let name = file.display().to_string();
            assert!(said.contains(&name) && said.contains(says), "{case} (json: {json}): {said}");
        }
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A crowd of control clients that connect and say nothing.
fn silent_crowd(socket: &Path, n: usize) -> Vec<UnixStream> {
    (0..n).map(|_| UnixStream::connect(socket).expect("connect")).collect()
}

/// Issue 6, item 5: garbage, oversized, half-written and silent clients on the control socket
/// of the real agent are answered with what was wrong (or closed); a crowd of silent clients
/// does not keep a real `flip` out, nor the agent from failing over; the largest numbers the
/// protocol carries do not upset it.
#[test]
fn the_control_socket_survives_bad_clients_and_keeps_serving() {
    let node = SimNode::up();
    let agent = node.agent(&["--min-hold", "500ms"]);
    let sock = wait_socket(&agent);
    let dir = agent.state_dir.display().to_string();

    let bad: [(&[u8], bool, &str); 5] = [
        (b"hello\n", false, "cannot parse the request"),
        (b"{\"op\":\"reboot\"}\n", false, "unknown variant `reboot`"),
        (b"{\"op\":\"flip\",\"rou", true, "EOF while parsing"),
        (b"\xff\xfe\x00\n", false, "cannot parse the request"),
        (&[b'x'; 64 * 1024], false, "longer than 4096 bytes"),
    ];
    for (bytes, close, says) in bad {
        let text = message(exchange(&sock, bytes, close), "error");
        assert!(
            text.contains(says),
            "{:?}: {text}",
            String::from_utf8_lossy(&bytes[..bytes.len().min(20)])
        );
    }
    // Half a line, then nothing: answered at the read deadline.
    let text = message(exchange(&sock, br#"{"op":"release""#, false), "error");
    assert!(text.contains("no complete request line within 2s"), "{text}");

    // A crowd of silent clients, and a real flip through it.
    let crowd = silent_crowd(&sock, 200);
    let out = node.cli(&["flip", "upstream", "--reason", "through the crowd", "--state-dir", &dir]);
    assert!(out.status.success(), "{}", describe(&out));
    agent.wait_route("upstream", Duration::from_secs(2));
    let out = node.cli(&["release", "--state-dir", &dir]);
    assert!(out.status.success(), "{}", describe(&out));
    agent.wait_route("local", Duration::from_secs(5));
    drop(crowd);

    // A crowd again, and the cache dies: the route follows.
    let _crowd = silent_crowd(&sock, 200);
    node.signal("cache-kill");
    agent.wait_route("upstream", Duration::from_secs(5));
    node.script(&["cache-start"]);
    agent.wait_route("local", Duration::from_secs(10));

    // The largest durations the wire format carries: taken, nothing overflows.
    let forever =
        br#"{"op":"flip","route":"upstream","for_ms":18446744073709551615,"reason":"forever"}"#;
    let text = message(exchange(&sock, &[&forever[..], b"\n"].concat(), false), "ok");
    assert!(text.contains("route forced to upstream"), "{text}");
    agent.wait_route("upstream", Duration::from_secs(2));
    let status = node.cli(&["status", "--state-dir", &dir]);
    assert!(status.status.success(), "{}", describe(&status));
    assert!(
        String::from_utf8_lossy(&status.stdout).contains("override:    upstream"),
        "{}",
        describe(&status)
    );
    let drain = br#"{"op":"drain","timeout_ms":18446744073709551615}"#;
    let text = message(exchange(&sock, &[&drain[..], b"\n"].concat(), false), "ok");
    assert!(text.contains("route is upstream"), "{text}");
    let out = node.cli(&["release", "--state-dir", &dir]);
    assert!(out.status.success(), "{}", describe(&out));
    agent.wait_route("local", Duration::from_secs(5));
    assert_no_panic(&agent);
    assert_eq!(node.http_get("/healthz").0, 200);

    // And after all that, SIGTERM stops it as usual, its ruleset left in place.
    let mut agent = agent;
    let status = agent.stop(Signal::SIGTERM);
    assert!(status.success(), "{status}");
    assert_eq!(node.agent_table(), Some(node.expected_table("local")));
}

/// Marks the child process that plays the misbehaving cache in the node's namespace.
const BAD_CACHE_ENV: &str = "NODELOCALDNS_HA_TEST_BAD_CACHE";

/// A DNS "cache" on the cache's addresses that never answers a query properly. Over UDP, each
/// query gets, in turn: a reply with another id, a reply for another question, 4 bytes of
/// garbage, the right reply from another port, an empty datagram. Over TCP: another id, another
/// question, a length prefix promising more than comes. Runs until killed.
fn bad_cache() -> ! {
    let queries = Arc::new(AtomicUsize::new(0));
    let connections = Arc::new(AtomicUsize::new(0));
    for ip in [LOCAL_IP, CLUSTER_DNS_IP] {
        let udp = UdpSocket::bind((ip, 53)).expect("bind udp 53");
        let elsewhere = UdpSocket::bind((ip, 0)).expect("bind another udp port");
        let n = queries.clone();
        std::thread::spawn(move || {
            let mut buf = [0u8; 4096];
            loop {
                let Ok((len, peer)) = udp.recv_from(&mut buf) else { continue };
                let Ok(query) = Message::from_vec(&buf[..len]) else { continue };
                let _ = match n.fetch_add(1, Ordering::Relaxed) % 5 {
                    0 => udp.send_to(&reply(&query, 1, None), peer),
                    1 => udp.send_to(&reply(&query, 0, Some("other.example.")), peer),
                    2 => udp.send_to(&[0xde, 0xad, 0xbe, 0xef], peer),
                    3 => elsewhere.send_to(&reply(&query, 0, None), peer),
                    _ => udp.send_to(&[], peer),
                };
            }
        });
        let tcp = TcpListener::bind((ip, 53)).expect("bind tcp 53");
        let n = connections.clone();
        std::thread::spawn(move || {
            for stream in tcp.incoming().flatten() {
                let n = n.clone();
                std::thread::spawn(move || tcp_bad_answer(stream, &n));
            }
        });
    }
    println!("BAD-CACHE READY");
    loop {
        std::thread::park();
    }
}

fn tcp_bad_answer(mut stream: TcpStream, n: &AtomicUsize) {
    let mut len = [0u8; 2];
    if stream.read_exact(&mut len).is_err() {
        return;
    }
    let mut buf = vec![0u8; usize::from(u16::from_be_bytes(len))];
    let Ok(query) = stream.read_exact(&mut buf).map(|()| Message::from_vec(&buf)) else { return };
    let Ok(query) = query else { return };
    let wire = match n.fetch_add(1, Ordering::Relaxed) % 3 {
        0 => reply(&query, 1, None),
        1 => reply(&query, 0, Some("other.example.")),
        _ => {
            let _ = stream.write_all(&[&1000u16.to_be_bytes()[..], &[0xab; 10]].concat());
            let _ = stream.read(&mut [0u8; 1]);
            return;
        }
    };
    let _ = stream.write_all(&[&(wire.len() as u16).to_be_bytes()[..], &wire].concat());
    let _ = stream.read(&mut [0u8; 1]);
}

/// A NOERROR reply to `query`, its id shifted by `shift`, for `question` instead if given.
fn reply(query: &Message, shift: u16, question: Option<&str>) -> Vec<u8> {
    let id = query.metadata.id.wrapping_add(shift);
    let mut message = Message::error_msg(id, OpCode::Query, ResponseCode::NoError);
    match question {
        Some(name) => {
            message.add_query(Query::query(Name::from_ascii(name).unwrap(), RecordType::A));
        }
        None => {
            message.add_query(query.queries[0].clone());
        }
    }
    message.to_vec().unwrap()
}

/// A child process, killed on drop.
struct Killed(Child);

impl Drop for Killed {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Issue 6, item 5: a cache that answers, but never with the reply to the query (other ids,
/// other questions, garbage, from another port): the agent treats it as failing, switches to
/// the upstream after `--fall` probes, says what was wrong, and comes back when a real cache
/// does.
#[test]
fn a_cache_that_answers_garbage_is_failed_over_and_named() {
    if std::env::var_os(BAD_CACHE_ENV).is_some() {
        bad_cache();
    }
    let node = SimNode::up();
    node.signal("cache-kill");
    // This test binary again, in the node's namespace, as the bad cache.
    let mut child = Command::new("ip")
        .args(["netns", "exec", &node.ns("node")])
        .arg(std::env::current_exe().unwrap())
        .args(["a_cache_that_answers_garbage_is_failed_over_and_named", "--exact", "--nocapture"])
        .env(BAD_CACHE_ENV, "1")
        .stdout(Stdio::piped())
        .spawn()
        .expect("start the bad cache");
    let stdout = child.stdout.take().unwrap();
    let bad = Killed(child);
    let (ready_tx, ready) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            if line.contains("BAD-CACHE READY") {
                let _ = ready_tx.send(());
            }
        }
    });
    ready.recv_timeout(Duration::from_secs(10)).expect("the bad cache is listening");

    let agent = node.agent_starting(&["--min-hold", "500ms"]);
    let st = agent.wait_route("upstream", Duration::from_secs(5));
    let reason = st["reason"].as_str().unwrap();
    assert!(reason.contains("consecutive cache") && reason.contains("probes failed"), "{st}");
    // Pods are answered by CoreDNS now, not by the garbage.
    let answer =
        node.run("pod1", "dig", &["+short", "+time=1", "+tries=1", "@10.96.0.10", "who.test"]);
    assert_eq!(String::from_utf8_lossy(&answer.stdout).trim(), COREDNS_ANSWER);
    // The log names what was wrong with each kind of answer.
    for wrong in [
        "a response with id",
        "a response for another question: other.example.",
        "4 bytes that are not a DNS message",
        "0 bytes that are not a DNS message",
    ] {
        wait_for(&format!("the log to name {wrong:?}"), Duration::from_secs(10), || {
            (log_lines(&agent, &["probe failed", wrong]) > 0).then_some(())
        });
    }
    // The first failure of a streak is said at the default level (info), with its reason.
    let log = agent.log_text();
    for line in log.lines().filter(|l| l.contains("route changed") || l.contains(" INFO ")) {
        println!("agent: {line}");
    }
    let mut said = log.lines().filter(|l| l.contains(" INFO ") && l.contains("probe failed"));
    assert!(said.any(|l| l.contains("did not answer it")), "{log}");
    // Garbage never counted as an answer, by the agent's own counts: every probe it sent to this
    // cache failed, over UDP and TCP. (The route never coming back proves less: with `rise 5`, a
    // kind of garbage taken for an answer is followed by another kind before 5 are in a row.)
    // Judged once every kind has come twice over UDP (5 kinds) and once over TCP (3 kinds).
    let st = wait_for("every kind of garbage probed", Duration::from_secs(10), || {
        agent.state().filter(|s| {
            let sent = |stream: &str| s["probes"][stream]["sent"].as_u64().unwrap_or(0);
            sent("cache_udp") >= 10 && sent("cache_tcp") >= 3
        })
    });
    for stream in ["cache_udp", "cache_tcp"] {
        assert_eq!(st["probes"][stream]["good"], 0, "{stream}: garbage taken for an answer: {st}");
    }
    assert_eq!(st["route"], "upstream", "{st}");
    assert_eq!(st["transitions"], 1, "{st}");
    assert_no_panic(&agent);

    drop(bad);
    node.script(&["cache-start"]);
    agent.wait_route("local", Duration::from_secs(10));
}

/// Issue 6, item 5: on the real agent's metrics endpoint, a crowd of silent connections
/// (more than it serves at once) does not starve `/healthz` (the kubelet would restart a healthy
/// agent), and garbage or an oversized request head gets a 400.
#[test]
fn metrics_endpoint_answers_healthz_through_a_crowd_and_refuses_garbage() {
    let node = SimNode::up();
    let agent = node.agent(&[]);
    // 100 silent connections held open by one shell, then one real request.
    let script =
        "for fd in $(seq 10 109); do eval \"exec $fd<>/dev/tcp/127.0.0.1/9254\" || exit 3; done
        exec 3<>/dev/tcp/127.0.0.1/9254
        printf 'GET /healthz HTTP/1.1\\r\\nHost: x\\r\\n\\r\\n' >&3
        timeout 5 head -c 12 <&3";
    let out = node.run("node", "bash", &["-c", script]);
    assert_eq!(String::from_utf8_lossy(&out.stdout), "HTTP/1.1 200", "{}", describe(&out));
    let send = |request: String| {
        let script =
            "exec 3<>/dev/tcp/127.0.0.1/9254 && printf '%s' \"$REQ\" >&3 && timeout 5 cat <&3";
        let out =
            node.cmd("node", "bash").args(["-c", script]).env("REQ", request).output().unwrap();
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    let garbage = send("\u{1}\u{2} garbage\r\n\r\n".to_owned());
    assert!(garbage.starts_with("HTTP/1.1 400"), "{garbage}");
    let huge = send(format!("GET /metrics HTTP/1.1\r\nX-Pad: {}\r\n\r\n", "a".repeat(9000)));
    assert!(huge.starts_with("HTTP/1.1 400") && huge.contains("larger than 8 KiB"), "{huge}");
    assert_eq!(node.http_get("/healthz").0, 200);
    assert_no_panic(&agent);
}

/// Marks a child process of the metrics flood test and names its part: `flood` (a pod's
/// connections that never read or send slowly) or `poll PATH EVERY_MS` (the kubelet's probe,
/// or a Prometheus scrape).
const METRICS_ROLE_ENV: &str = "NODELOCALDNS_HA_TEST_METRICS_ROLE";

/// Where the DaemonSet serves the agent's HTTP endpoints, `[$(HOST_IP)]:9254`, on the simulated
/// node: 10.244.0.1 is the node's address on every pod's veth. Pods reach it there, and so does
/// the kubelet, from the node: its probes go to the pod IP, which under hostNetwork is the node's.
const NODE_METRICS_ADDR: &str = "10.244.0.1:9254";

/// The flooding pod's address.
const POD1: &str = "10.244.0.2";

/// How long the kubelet-side check polls while the flood goes on.
const FLOOD_FOR: Duration = Duration::from_secs(30);

/// The pod's connections in flight at once.
const FLOOD_CONNECTIONS: usize = 200;

/// The kubelet's `timeoutSeconds` in the DaemonSet's probes.
const PROBE_TIMEOUT: Duration = Duration::from_secs(2);

/// One of the flood's connections: either it sent a whole request and never reads (its receive
/// buffer a few KiB, so the answer fills it and the agent's write blocks), or it sent half a
/// request and stalls.
struct Lane {
    socket: Option<socket2::Socket>,
    never_reads: bool,
    opened: Instant,
}

impl Lane {
    fn open(addr: SocketAddr, never_reads: bool) -> Lane {
        let opened = Instant::now();
        let socket = socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None)
            .expect("a TCP socket");
        if never_reads {
            socket.set_recv_buffer_size(2048).expect("SO_RCVBUF");
        }
        let connected = socket.connect_timeout(&addr.into(), Duration::from_secs(1));
        let socket = connected.ok().map(|()| {
            let request: &[u8] = if never_reads {
                b"GET /metrics HTTP/1.1\r\nHost: node\r\n\r\n"
            } else {
                b"GET /metrics HTTP/1.1\r\nHost:"
            };
            // Refused at once: the agent may have closed it already.
            let _ = socket.send(request);
            socket.set_nonblocking(true).expect("O_NONBLOCK");
            socket
        });
        Lane { socket, never_reads, opened }
    }

    /// Whether to open it again: 8 s old (longer than the agent keeps any connection), or at
    /// least a second old and closed by the agent (a reset says so without reading; a slow
    /// sender may look for the end of the stream).
    fn spent(&self) -> bool {
        let age = self.opened.elapsed();
        let Some(socket) = &self.socket else { return age >= Duration::from_secs(1) };
        if age >= Duration::from_secs(8) {
            return true;
        }
        if age < Duration::from_secs(1) {
            return false;
        }
        let reset = !matches!(socket.take_error(), Ok(None));
        let ended = !self.never_reads && {
            let mut byte = [std::mem::MaybeUninit::uninit(); 1];
            !matches!(socket.peek(&mut byte), Err(e) if e.kind() == std::io::ErrorKind::WouldBlock)
        };
        reset || ended
    }
}

/// A pod flooding the agent's HTTP server: [`FLOOD_CONNECTIONS`] connections kept open, every
/// other one reading never (or, with `all_never_read`, every one), the rest sending slowly;
/// each one the agent closes is opened again. Runs until killed.
fn metrics_flood(addr: SocketAddr, all_never_read: bool) -> ! {
    let mut lanes: Vec<Lane> =
        (0..FLOOD_CONNECTIONS).map(|i| Lane::open(addr, all_never_read || i % 2 == 0)).collect();
    println!("FLOOD READY");
    loop {
        for lane in &mut lanes {
            if lane.spent() {
                *lane = Lane::open(addr, lane.never_reads);
            }
        }
        // Pacing only: what to reopen is read from the sockets.
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// `GET path` as the kubelet's httpGet probe does it: an answer within [`PROBE_TIMEOUT`], status
/// 200 (the kubelet takes 2xx and 3xx; the agent answers 200 or 503).
fn probe(addr: SocketAddr, path: &str) -> Result<(), String> {
    let start = Instant::now();
    let mut stream =
        TcpStream::connect_timeout(&addr, PROBE_TIMEOUT).map_err(|e| format!("connect: {e}"))?;
    stream.set_read_timeout(Some(PROBE_TIMEOUT)).unwrap();
    stream.set_write_timeout(Some(PROBE_TIMEOUT)).unwrap();
    let request = format!("GET {path} HTTP/1.1\r\nHost: node\r\nConnection: close\r\n\r\n");
    stream.write_all(request.as_bytes()).map_err(|e| format!("send: {e}"))?;
    let mut reply = Vec::new();
    stream.read_to_end(&mut reply).map_err(|e| format!("read: {e} ({} bytes)", reply.len()))?;
    if start.elapsed() > PROBE_TIMEOUT {
        return Err(format!("answered after {:.1?}", start.elapsed()));
    }
    if !reply.starts_with(b"HTTP/1.1 200 ") {
        let head = String::from_utf8_lossy(&reply[..reply.len().min(40)]).into_owned();
        return Err(format!("answered {head:?}"));
    }
    Ok(())
}

/// Probes `GET path` every `every` for [`FLOOD_FOR`], then prints how many probes there were and
/// each failure, and exits.
fn metrics_poll(addr: SocketAddr, path: &str, every: Duration) -> ! {
    let start = Instant::now();
    let (mut polls, mut failures) = (0, Vec::new());
    while start.elapsed() < FLOOD_FOR {
        let at = start.elapsed();
        polls += 1;
        if let Err(e) = probe(addr, path) {
            failures.push(format!("at {at:.1?}: {e}"));
        }
        // Pacing only: the next probe is due `every` after this one began.
        std::thread::sleep((at + every).saturating_sub(start.elapsed()));
    }
    println!("POLLS {polls} FAILED {}", failures.len());
    for failure in failures {
        println!("FAILURE {failure}");
    }
    std::process::exit(0)
}

/// Plays the part [`METRICS_ROLE_ENV`] names, if it names one: `flood`, `flood never-reads` or
/// `poll PATH EVERY_MS`, against the agent's HTTP server at `addr`; never returns then.
fn play_metrics_part(addr: SocketAddr) {
    let Ok(part) = std::env::var(METRICS_ROLE_ENV) else { return };
    match part.split(' ').collect::<Vec<_>>()[..] {
        ["flood"] => metrics_flood(addr, false),
        ["flood", "never-reads"] => metrics_flood(addr, true),
        ["poll", path, every_ms] => {
            metrics_poll(addr, path, Duration::from_millis(every_ms.parse().unwrap()))
        }
        _ => panic!("{METRICS_ROLE_ENV}={part:?}"),
    }
}

/// This test binary again, running `test` alone in `role`'s namespace, playing `part`
/// ([`METRICS_ROLE_ENV`]).
fn metrics_part(node: &SimNode, test: &str, role: &str, part: &str) -> Child {
    node.cmd(role, std::env::current_exe().unwrap().to_str().unwrap())
        .args([test, "--exact", "--nocapture"])
        .env(METRICS_ROLE_ENV, part)
        .stdout(Stdio::piped())
        .spawn()
        .expect("start a part of the metrics flood test")
}

/// The agent's connections to `peer` holding data not yet sent: (open, as when its write to a
/// client that does not read blocks; closed or shut down, their rest left for the kernel to
/// deliver or give up on).
fn unsent(node: &SimNode, peer: &str) -> (usize, usize) {
    let out = node.run("node", "ss", &["-Htan", "( sport = :9254 )"]);
    let text = String::from_utf8_lossy(&out.stdout);
    let (mut open, mut closed) = (0, 0);
    for line in text.lines() {
        let fields: Vec<&str> = line.split_whitespace().collect();
        let [state, _, send_q, _, remote, ..] = fields[..] else { continue };
        // A FIN not yet acknowledged counts one.
        let data = send_q.parse::<u64>().is_ok_and(|q| q > 1);
        if remote.starts_with(&format!("{peer}:")) && data {
            *if state == "ESTAB" { &mut open } else { &mut closed } += 1;
        }
    }
    (open, closed)
}

/// The `POLLS n FAILED m` summary and the failures a poller printed.
fn poll_report(child: Child, who: &str) -> (u64, Vec<String>) {
    let out = child.wait_with_output().expect("the poller ends");
    let text = String::from_utf8_lossy(&out.stdout);
    let summary = text.lines().find_map(|l| l.strip_prefix("POLLS "));
    let summary = summary.unwrap_or_else(|| panic!("{who} printed no summary: {}", describe(&out)));
    let polls = summary.split_whitespace().next().and_then(|n| n.parse().ok()).unwrap();
    let failures = text.lines().filter_map(|l| l.strip_prefix("FAILURE ")).map(str::to_owned);
    (polls, failures.collect())
}

/// Issue 30, 3 (acceptance 4). A pod opens [`FLOOD_CONNECTIONS`] connections to the agent's
/// HTTP server where the DaemonSet puts it, half of them sending a request and never reading
/// the answer (the agent's writes to them block: checked), half sending half a request and
/// stalling, each opened again as soon as the agent closes it. Meanwhile the kubelet's health
/// check, from the node to the same address, polled every 100 ms for 30 s, fails not once, and
/// another pod's scrape of `/metrics` every second neither.
#[test]
fn a_pods_flood_of_metrics_connections_never_fails_the_kubelets_health_check() {
    const TEST: &str = "a_pods_flood_of_metrics_connections_never_fails_the_kubelets_health_check";
    let addr: SocketAddr = NODE_METRICS_ADDR.parse().unwrap();
    play_metrics_part(addr);
    let node = SimNode::up();
    // The node's TCP send buffers capped at 8 KiB: the kernel otherwise gives a new connection
    // room for ten full segments, more than the agent's answer to /metrics (13 KiB here), and its
    // write to a client that never reads would end at once. With the cap it blocks, as it would
    // for a larger answer.
    let out = node.run("node", "sysctl", &["-qw", "net.ipv4.tcp_wmem=4096 4096 8192"]);
    assert!(out.status.success(), "{}", describe(&out));
    let agent = node.agent(&["--metrics-addr", NODE_METRICS_ADDR]);

    let flood = metrics_part(&node, TEST, "pod1", "flood");
    let flood = flood_ready(flood);
    wait_for("the agent's writes to the pod to block", Duration::from_secs(10), || {
        (unsent(&node, POD1).0 >= 16).then_some(())
    });

    let mut kubelet = metrics_part(&node, TEST, "node", "poll /healthz 100");
    let mut prometheus = metrics_part(&node, TEST, "pod2", "poll /metrics 1000");
    // What the agent could not send to the flooding pod, while the pollers run.
    let mut samples = Vec::new();
    while kubelet.try_wait().unwrap().is_none() || prometheus.try_wait().unwrap().is_none() {
        samples.push(unsent(&node, POD1));
        // Pacing only: the loop ends when the pollers do.
        std::thread::sleep(Duration::from_secs(1));
    }
    let (probes, kubelet_failed) = poll_report(kubelet, "the kubelet");
    let (scrapes, scrapes_failed) = poll_report(prometheus, "the scraper");
    drop(flood);
    let blocked = samples.iter().map(|s| s.0);
    let (fewest, most) = (blocked.clone().min().unwrap(), blocked.max().unwrap());
    let closed = samples.iter().map(|s| s.1).max().unwrap();
    eprintln!(
        "kubelet: {} of {probes} probes failed; pod2's scrapes: {} of {scrapes} failed; the \
         agent's connections to pod1 with unsent data, every second: open {fewest}..{most}, \
         closed at most {closed}",
        kubelet_failed.len(),
        scrapes_failed.len()
    );
    assert!(kubelet_failed.is_empty(), "the kubelet's health check failed: {kubelet_failed:#?}");
    assert!(probes >= 250, "the kubelet probed only {probes} times in {FLOOD_FOR:?}");
    assert!(scrapes_failed.is_empty(), "pod2's scrapes failed: {scrapes_failed:#?}");
    assert!(fewest >= 16, "the agent's writes to pod1 blocked on only {fewest} connections");
    assert!(agent.state().is_some_and(|s| s["route"] == "local"));
    assert_no_panic(&agent);
}

/// The flood `child` once it says its connections are open; killed when dropped.
fn flood_ready(mut child: Child) -> Killed {
    let stdout = BufReader::new(child.stdout.take().unwrap());
    let flood = Killed(child);
    let (ready_tx, ready) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in stdout.lines().map_while(Result::ok) {
            if line.contains("FLOOD READY") {
                let _ = ready_tx.send(());
            }
        }
    });
    ready.recv_timeout(Duration::from_secs(30)).expect("the flood's connections are open");
    flood
}

/// A host-network tenant shares the node's address with the kubelet: its connections and the
/// kubelet's probes are one client to the agent, and no share per address can set them apart.
/// It holds every place of the agent's HTTP server with [`FLOOD_CONNECTIONS`] connections that
/// each send `GET /metrics` and never read the answer (the agent's writes to them block:
/// checked), each opened again as soon as the agent closes it. The kubelet's liveness and
/// readiness probes, from the node to the same address every 100 ms for 30 s, fail not once:
/// a few places are kept for `/healthz` and `/readyz` alone.
#[test]
fn a_host_network_flood_of_metrics_connections_never_fails_the_kubelets_probes() {
    const TEST: &str =
        "a_host_network_flood_of_metrics_connections_never_fails_the_kubelets_probes";
    let addr: SocketAddr = NODE_METRICS_ADDR.parse().unwrap();
    play_metrics_part(addr);
    let node = SimNode::up();
    // Small send buffers, so that the agent's writes of /metrics block (see the pod's flood).
    let out = node.run("node", "sysctl", &["-qw", "net.ipv4.tcp_wmem=4096 4096 8192"]);
    assert!(out.status.success(), "{}", describe(&out));
    let agent = node.agent(&["--metrics-addr", NODE_METRICS_ADDR]);
    let node_ip = NODE_METRICS_ADDR.split(':').next().unwrap();

    let flood = flood_ready(metrics_part(&node, TEST, "node", "flood never-reads"));
    wait_for("the agent's writes to the tenant to block", Duration::from_secs(10), || {
        (unsent(&node, node_ip).0 >= 16).then_some(())
    });
    let liveness = metrics_part(&node, TEST, "node", "poll /healthz 100");
    let readiness = metrics_part(&node, TEST, "node", "poll /readyz 100");
    let (live_probes, live_failed) = poll_report(liveness, "the liveness probe");
    let (ready_probes, ready_failed) = poll_report(readiness, "the readiness probe");
    let blocked = unsent(&node, node_ip).0;
    drop(flood);
    eprintln!(
        "liveness: {} of {live_probes} failed; readiness: {} of {ready_probes} failed; the \
         agent's connections to the tenant with unsent data at the end: {blocked}",
        live_failed.len(),
        ready_failed.len()
    );
    assert!(live_failed.is_empty(), "the kubelet's liveness probe failed: {live_failed:#?}");
    assert!(ready_failed.is_empty(), "the kubelet's readiness probe failed: {ready_failed:#?}");
    assert!(live_probes >= 250 && ready_probes >= 250, "{live_probes}, {ready_probes} probes");
    assert!(blocked >= 16, "the agent's writes to the tenant blocked on only {blocked}");
    assert!(agent.state().is_some_and(|s| s["route"] == "local"));
    assert_no_panic(&agent);
}
