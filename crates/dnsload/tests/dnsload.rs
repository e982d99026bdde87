//! dnsload's own counts, which the end-to-end tests judge by: run against a server on loopback
//! of the test's own making.

#![forbid(unsafe_code)]

use std::net::UdpSocket;
use std::process::Command;

use serde_json::Value;

const LOAD: &str = env!("CARGO_BIN_EXE_dnsload");

/// Runs dnsload with `args`; its summary.
fn summary(args: &[&str]) -> Value {
    let out = Command::new(LOAD).args(args).output().expect("run dnsload");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "dnsload failed: {}\n{stdout}", out.status);
    let line = stdout.lines().find_map(|l| l.strip_prefix("SUMMARY ")).expect("a SUMMARY line");
    serde_json::from_str(line).expect("SUMMARY is JSON")
}

/// A lookup due while `--max-in-flight` are in flight is not started but counted as skipped:
/// a client that falls behind says so instead of sending less than it claims. The server reads
/// nothing (its socket stays open, so no port unreachable), and every lookup waits out its
/// timeout, long after the last one is due.
#[test]
fn lookups_beyond_the_in_flight_limit_are_skipped_and_counted() {
    let silent = UdpSocket::bind("127.0.0.1:0").expect("bind a silent server");
    let server = silent.local_addr().unwrap().to_string();
    let s = summary(&[
        "--server",
        &server,
        "--rate",
        "100",
        "--duration",
        "1s",
        "--timeout",
        "3s",
        "--attempts",
        "1",
        "--max-in-flight",
        "5",
        "--report-interval",
        "0",
    ]);
    println!("{s}");
    assert_eq!((s["sent"].as_u64(), s["skipped"].as_u64()), (Some(5), Some(95)), "{s}");
    assert_eq!((s["failed"].as_u64(), s["timeout_attempts"].as_u64()), (Some(5), Some(5)), "{s}");
    assert_eq!(s["unfinished"], 0, "{s}");
    drop(silent);
}
