//! Bad input reaching the real agent on the simulated node: a broken override file in its state
//! directory, garbage and crowds on its control socket, a "cache" that answers garbage, and a
//! flood of silent clients on its metrics endpoint. Each time the agent must go on doing its job
//! — switch the route on the probes' word — never panic, and say what was wrong.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream, UdpSocket};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

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

/// Waits until the agent has sent `n` more cache probes: its loop has turned that often.
fn wait_probes(agent: &Agent, n: u64) {
    let from = cache_probes(agent);
    wait_for("more probes", Duration::from_secs(10), || {
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
