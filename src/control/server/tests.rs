//! The server's tests: real sockets, a stand-in for the agent's loop, and [`call`] or raw
//! connections as clients.

use super::*;
use crate::control::call;
use crate::ruleset::Route;
use crate::testutil::TempDir;
use std::io::{Read, Write};
use std::os::unix::net::{UnixListener as StdUnixListener, UnixStream as StdUnixStream};
use std::process::Command;
use std::time::Instant;

/// Marks the child side of [`a_peer_that_is_not_root_is_refused`]: the socket to call.
const CHILD_ENV: &str = "NODELOCALDNS_HA_TEST_CONTROL_CHILD";

/// A stand-in for the agent's loop: answers every request with `Ok` naming it and the peer,
/// and hands what it received to the test.
fn fake_loop(mut rx: mpsc::Receiver<Incoming>) -> mpsc::UnboundedReceiver<(Request, Peer)> {
    let (seen_tx, seen) = mpsc::unbounded_channel();
    tokio::spawn(async move {
        while let Some(incoming) = rx.recv().await {
            let message = format!("{:?} from {}", incoming.request, incoming.peer);
            let _ = seen_tx.send((incoming.request, incoming.peer));
            let _ = incoming.reply.send(Response::ok(message));
        }
    });
    seen
}

/// Serves `dir` with a fake loop, once the socket is in place.
async fn serve_fake(dir: &Path) -> mpsc::UnboundedReceiver<(Request, Peer)> {
    let (tx, rx) = mpsc::channel(8);
    let (listener, socket_file) = listen(&socket_path(dir)).await.unwrap();
    tokio::spawn(async move {
        let _socket_file = socket_file;
        let mut waiting = Waiting::default();
        loop {
            let (stream, _) = listener.accept().await.unwrap();
            admit(&mut waiting, stream, tx.clone());
        }
    });
    fake_loop(rx)
}

/// [`call`] on a blocking thread.
async fn call_async(dir: &Path, request: Request) -> Result<Response, ControlError> {
    let dir = dir.to_owned();
    tokio::task::spawn_blocking(move || call(&dir, &request, Duration::from_secs(10)))
        .await
        .unwrap()
}

/// Sends `bytes` on a raw connection, closes its sending side, and returns the answer line.
async fn raw_exchange(dir: &Path, bytes: Vec<u8>) -> Response {
    let dir = dir.to_owned();
    tokio::task::spawn_blocking(move || {
        let mut stream = StdUnixStream::connect(socket_path(&dir)).unwrap();
        stream.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        // The agent may answer and close before reading everything.
        let _ = stream.write_all(&bytes);
        let _ = stream.shutdown(std::net::Shutdown::Write);
        let mut answer = String::new();
        let mut reader = io::BufReader::new(stream);
        io::BufRead::read_line(&mut reader, &mut answer).unwrap();
        serde_json::from_str(&answer).unwrap()
    })
    .await
    .unwrap()
}

fn error_message(response: Response) -> String {
    match response {
        Response::Error { message } => message,
        other => panic!("expected an error, got {other:?}"),
    }
}

#[tokio::test]
async fn serve_and_call_round_trip_through_the_loop() {
    let dir = TempDir::new();
    let (tx, rx) = mpsc::channel(8);
    let server = tokio::spawn({
        let dir = dir.0.clone();
        async move { serve(&dir, tx).await }
    });
    let mut seen = fake_loop(rx);
    // `serve` is ready once the socket is in place (renamed there after being bound).
    while !socket_path(&dir.0).exists() {
        tokio::task::yield_now().await;
    }
    let flip = Request::Flip {
        route: Route::Upstream,
        for_ms: Some(30 * 60_000),
        reason: "cache upgrade".into(),
    };
    let response = call_async(&dir.0, flip.clone()).await.unwrap();
    let me = std::process::id();
    let Response::Ok { message } = response else { panic!("{response:?}") };
    assert!(message.contains(&format!("uid 0 pid {me}")), "{message}");
    let (request, peer) = seen.recv().await.unwrap();
    assert_eq!(request, flip);
    assert_eq!(peer.uid, 0);
    assert_eq!(peer.pid, Some(me as i32));
    for request in [Request::Release, Request::Drain { timeout_ms: 100 }, Request::Status] {
        assert!(matches!(call_async(&dir.0, request.clone()).await, Ok(Response::Ok { .. })));
        assert_eq!(seen.recv().await.unwrap().0, request);
    }
    // Stopping the server removes its socket: the next call finds no agent.
    server.abort();
    assert!(server.await.unwrap_err().is_cancelled());
    assert!(!socket_path(&dir.0).exists());
    let err = call_async(&dir.0, Request::Status).await.unwrap_err();
    assert!(matches!(err, ControlError::NoAgent { .. }), "{err:?}");
}

#[tokio::test]
async fn the_socket_is_private() {
    let dir = TempDir::new();
    let _seen = serve_fake(&dir.0).await;
    let meta = std::fs::metadata(socket_path(&dir.0)).unwrap();
    assert_eq!(meta.permissions().mode() & 0o777, 0o600);
    let names: Vec<_> =
        std::fs::read_dir(&dir.0).unwrap().map(|e| e.unwrap().file_name()).collect();
    assert_eq!(names, [SOCKET], "only the socket is left in the directory");
}

#[tokio::test]
async fn garbage_is_answered_with_the_problem() {
    let dir = TempDir::new();
    let mut seen = serve_fake(&dir.0).await;
    let message = error_message(raw_exchange(&dir.0, b"hello\n".to_vec()).await);
    assert!(message.contains("cannot parse the request"), "{message}");
    let message = error_message(raw_exchange(&dir.0, b"{\"op\":\"reboot\"}\n".to_vec()).await);
    assert!(message.contains("unknown variant `reboot`"), "{message}");
    let message =
        error_message(raw_exchange(&dir.0, b"{\"op\":\"flip\",\"route\":\"x\"}\n".to_vec()).await);
    assert!(message.contains("unknown variant `x`"), "{message}");
    // None of it reached the loop; a good request after it does, even without a newline
    // when the client closes its side.
    assert!(matches!(
        raw_exchange(&dir.0, b"{\"op\":\"status\"}".to_vec()).await,
        Response::Ok { .. }
    ));
    assert_eq!(seen.recv().await.unwrap().0, Request::Status);
    assert!(seen.try_recv().is_err());
}

#[tokio::test]
async fn an_oversized_line_is_refused() {
    let dir = TempDir::new();
    let mut seen = serve_fake(&dir.0).await;
    let mut huge = br#"{"op":"flip","route":"local","reason":""#.to_vec();
    huge.resize(64 * 1024, b'x');
    huge.extend_from_slice(b"\"}\n");
    let message = error_message(raw_exchange(&dir.0, huge.clone()).await);
    assert!(message.contains("longer than 4096 bytes"), "{message}");
    // Through the client as well: it reads the answer although the agent stopped reading.
    let reason = String::from_utf8(vec![b'x'; 8 * 1024]).unwrap();
    let flip = Request::Flip { route: Route::Local, for_ms: None, reason };
    let message = error_message(call_async(&dir.0, flip).await.unwrap());
    assert!(message.contains("longer than 4096 bytes"), "{message}");
    assert!(seen.try_recv().is_err());
}

/// Reads the one answer line on `stream` (waiting at most 10 s) as a [`Response`].
fn read_answer(stream: StdUnixStream) -> Response {
    stream.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let mut answer = String::new();
    io::BufRead::read_line(&mut io::BufReader::new(stream), &mut answer).unwrap();
    serde_json::from_str(&answer).unwrap_or_else(|e| panic!("{answer:?}: {e}"))
}

#[tokio::test]
async fn half_lines_trailing_lines_and_odd_bytes_are_answered_not_obeyed() {
    let dir = TempDir::new();
    let mut seen = serve_fake(&dir.0).await;
    let cases: [(&[u8], &str); 7] = [
        // Half a request, then the client closes its side.
        (br#"{"op":"fl"#, "EOF while parsing"),
        (b"\n", "EOF while parsing"),
        (b"\xff\xfe\x00\n", "cannot parse the request"),
        (br#"{"op":"flip","route":"upstream","for_ms":1e30}"#, "cannot parse the request"),
        (br#"{"op":"drain","timeout_ms":-1}"#, "cannot parse the request"),
        (br#"{"op":"flip","route":"upstream","for_ms":18446744073709551616}"#, "cannot parse"),
        (br#"[{"op":"status"}]"#, "cannot parse the request"),
    ];
    for (bytes, says) in cases {
        let message = error_message(raw_exchange(&dir.0, bytes.to_vec()).await);
        assert!(message.contains(says), "{:?}: {message}", String::from_utf8_lossy(bytes));
    }
    assert!(seen.try_recv().is_err(), "a bad request reached the loop");
    // Two requests on one line's connection: only the first is read.
    let two = b"{\"op\":\"status\"}\n{\"op\":\"release\"}\n".to_vec();
    assert!(matches!(raw_exchange(&dir.0, two).await, Response::Ok { .. }));
    assert_eq!(seen.recv().await.unwrap().0, Request::Status);
    // The largest number the protocol has is taken as it is (the loop must cope).
    let max = br#"{"op":"flip","route":"upstream","for_ms":18446744073709551615}"#;
    assert!(matches!(raw_exchange(&dir.0, max.to_vec()).await, Response::Ok { .. }));
    let (request, _) = seen.recv().await.unwrap();
    assert_eq!(
        request,
        Request::Flip { route: Route::Upstream, for_ms: Some(u64::MAX), reason: String::new() }
    );
    assert!(seen.try_recv().is_err());
}

#[tokio::test]
async fn a_client_that_stalls_or_trickles_is_cut_off_at_the_read_timeout() {
    let dir = TempDir::new();
    let mut seen = serve_fake(&dir.0).await;
    let path = socket_path(&dir.0);
    let started = Instant::now();
    // Half a line, then nothing (the connection stays open).
    let stalled = {
        let path = path.clone();
        tokio::task::spawn_blocking(move || {
            let mut stream = StdUnixStream::connect(path).unwrap();
            stream.write_all(br#"{"op":"release""#).unwrap();
            read_answer(stream)
        })
    };
    // One byte every 50 ms of a line that never ends: each byte is on time, the line is not.
    let trickling = tokio::task::spawn_blocking(move || {
        let mut stream = StdUnixStream::connect(&path).unwrap();
        stream.set_nonblocking(true).unwrap();
        let mut answer = Vec::new();
        for _ in 0..200 {
            if stream.write_all(b" ").is_err() {
                // Cut off between two bytes: the answer is already there to read.
                stream.set_nonblocking(false).unwrap();
                let _ = stream.read_to_end(&mut answer);
                break;
            }
            std::thread::sleep(Duration::from_millis(50));
            let mut buf = [0u8; 512];
            match stream.read(&mut buf) {
                Ok(0) => break,
                Ok(n) => answer.extend_from_slice(&buf[..n]),
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                Err(_) => break,
            }
        }
        String::from_utf8(answer).unwrap()
    });
    let message = error_message(stalled.await.unwrap());
    assert!(message.contains("no complete request line within 2s"), "{message}");
    let answer = trickling.await.unwrap();
    assert!(answer.contains("no complete request line within 2s"), "{answer:?}");
    // Both cut off at the deadline, not after the trickle's 10 s.
    assert!(started.elapsed() < READ_TIMEOUT * 3, "{:?}", started.elapsed());
    assert!(seen.try_recv().is_err());
}

#[tokio::test]
async fn a_crowd_of_silent_clients_neither_piles_up_nor_locks_out_a_flip() {
    let dir = TempDir::new();
    let mut seen = serve_fake(&dir.0).await;
    let path = socket_path(&dir.0);
    // Three times as many silent clients as may wait; the first ones are closed to make
    // room, each with an answer saying why.
    let mut silent = Vec::new();
    for _ in 0..3 * MAX_WAITING {
        silent.push(StdUnixStream::connect(&path).unwrap());
    }
    let started = Instant::now();
    let flip = Request::Flip { route: Route::Upstream, for_ms: None, reason: "crowd".into() };
    let response = call_async(&dir.0, flip.clone()).await.unwrap();
    assert!(matches!(response, Response::Ok { .. }), "{response:?}");
    assert!(started.elapsed() < READ_TIMEOUT, "the flip waited for the crowd");
    assert_eq!(seen.recv().await.unwrap().0, flip);
    let answers = tokio::task::spawn_blocking(move || {
        silent.into_iter().map(read_answer).map(error_message).collect::<Vec<_>>()
    })
    .await
    .unwrap();
    let evicted = answers.iter().filter(|m| m.contains("newer control connections")).count();
    let timed_out = answers.iter().filter(|m| m.contains("no complete request line")).count();
    // The flip took one place among the last MAX_WAITING: all but those were closed early.
    assert_eq!(evicted, 2 * MAX_WAITING + 1, "{answers:?}");
    assert_eq!(timed_out, MAX_WAITING - 1, "{answers:?}");
}

#[tokio::test]
async fn a_silent_client_holds_up_nobody_and_is_told_off() {
    let dir = TempDir::new();
    let _seen = serve_fake(&dir.0).await;
    let silent = StdUnixStream::connect(socket_path(&dir.0)).unwrap();
    let started = Instant::now();
    let response = call_async(&dir.0, Request::Status).await.unwrap();
    assert!(matches!(response, Response::Ok { .. }), "{response:?}");
    assert!(started.elapsed() < READ_TIMEOUT, "the second client waited for the first");
    // The silent one is answered (and closed) after the read timeout.
    let answer = tokio::task::spawn_blocking(move || {
        silent.set_read_timeout(Some(READ_TIMEOUT * 5)).unwrap();
        let mut answer = String::new();
        io::BufRead::read_line(&mut io::BufReader::new(silent), &mut answer).unwrap();
        answer
    })
    .await
    .unwrap();
    let message = error_message(serde_json::from_str(&answer).unwrap());
    assert!(message.contains("no complete request line within 2s"), "{message}");
}

#[tokio::test]
async fn a_loop_that_drops_or_stops_is_an_error_not_a_hang() {
    let dir = TempDir::new();
    let (tx, mut rx) = mpsc::channel::<Incoming>(1);
    let server = tokio::spawn({
        let dir = dir.0.clone();
        async move { serve(&dir, tx).await }
    });
    while !socket_path(&dir.0).exists() {
        tokio::task::yield_now().await;
    }
    // The loop drops the reply without answering.
    let dropper = tokio::spawn(async move {
        drop(rx.recv().await);
        rx
    });
    let message = error_message(call_async(&dir.0, Request::Status).await.unwrap());
    assert!(message.contains("dropped the request"), "{message}");
    // The loop is gone.
    drop(dropper.await.unwrap());
    let message = error_message(call_async(&dir.0, Request::Release).await.unwrap());
    assert!(message.contains("shutting down"), "{message}");
    server.abort();
}

#[tokio::test]
async fn a_stale_socket_is_replaced_and_a_live_one_is_not() {
    let dir = TempDir::new();
    let path = socket_path(&dir.0);
    // An agent that died: its socket file stays, nothing listens.
    drop(StdUnixListener::bind(&path).unwrap());
    let err = call_async(&dir.0, Request::Status).await.unwrap_err();
    assert!(matches!(err, ControlError::NoAgent { .. }), "{err:?}");
    let _seen = serve_fake(&dir.0).await;
    assert!(matches!(call_async(&dir.0, Request::Status).await, Ok(Response::Ok { .. })));

    // A second agent on the same directory is refused and leaves the first one alone.
    let (tx, _rx) = mpsc::channel(1);
    let err = serve(&dir.0, tx).await.unwrap_err();
    assert!(matches!(err, ControlError::AlreadyServing { .. }), "{err:?}");
    let text = err.to_string();
    assert!(text.contains("another agent is serving") && text.contains(SOCKET), "{text}");
    assert!(matches!(call_async(&dir.0, Request::Status).await, Ok(Response::Ok { .. })));
}

#[tokio::test]
async fn something_else_in_the_sockets_place_is_left_alone() {
    let dir = TempDir::new();
    let path = socket_path(&dir.0);
    std::fs::write(&path, b"precious").unwrap();
    let (tx, _rx) = mpsc::channel(1);
    let err = serve(&dir.0, tx).await.unwrap_err();
    assert!(matches!(err, ControlError::NotASocket { .. }), "{err:?}");
    assert!(err.to_string().contains("remove it"), "{err}");
    assert_eq!(std::fs::read(&path).unwrap(), b"precious");
}

/// The client side of [`a_peer_that_is_not_root_is_refused`], run by the test binary as
/// another user: calls the socket and prints the outcome.
fn child_client(dir: &str) {
    let outcome = call(Path::new(dir), &Request::Status, Duration::from_secs(10));
    let text = match outcome {
        Ok(response) => format!("{response:?}"),
        Err(err) => format!("{err}"),
    };
    println!("CHILD-OUTCOME: {text}");
}

/// Runs the test at `test_path` (this test binary's [`a_peer_that_is_not_root_is_refused`])
/// as uid/gid 65534 against `dir`; returns the child's outcome line.
fn call_as_nobody(test_path: &str, dir: &Path) -> String {
    let output = Command::new("setpriv")
        .args(["--reuid", "65534", "--regid", "65534", "--clear-groups"])
        .arg(std::env::current_exe().unwrap())
        .args([test_path, "--exact", "--nocapture"])
        .env(CHILD_ENV, dir)
        .output()
        .expect("setpriv (util-linux) runs");
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(
        output.status.success(),
        "child failed: {stdout}\n{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let line = stdout.lines().find(|l| l.starts_with("CHILD-OUTCOME: "));
    line.unwrap_or_else(|| panic!("the child printed no outcome: {stdout}")).to_owned()
}

#[test]
fn a_peer_that_is_not_root_is_refused() {
    let test_path = crate::testutil::test_path!();
    if let Ok(dir) = std::env::var(CHILD_ENV) {
        return child_client(&dir);
    }
    assert!(nix::unistd::geteuid().is_root(), "this test needs root, to run a child as nobody");
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let dir = TempDir::new();
    // The child, as uid 65534, must be able to reach the directory.
    std::fs::set_permissions(&dir.0, Permissions::from_mode(0o755)).unwrap();
    let mut seen = runtime.block_on(serve_fake(&dir.0));

    // First line of defence: the socket's mode.
    let outcome = call_as_nobody(test_path, &dir.0);
    assert!(
        outcome.contains("cannot connect") && outcome.contains("ermission denied"),
        "{outcome}"
    );

    // Second: the peer's credentials, should the mode ever be looser.
    std::fs::set_permissions(socket_path(&dir.0), Permissions::from_mode(0o666)).unwrap();
    let outcome = call_as_nobody(test_path, &dir.0);
    assert!(outcome.contains(ONLY_ROOT), "{outcome}");
    assert!(seen.try_recv().is_err(), "a refused request reached the loop");
}
