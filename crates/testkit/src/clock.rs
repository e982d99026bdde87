//! Waiting for conditions, and the wall clock other processes' times are compared with.

use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

/// Milliseconds since the Unix epoch.
pub fn now_ms() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64)
}

/// Waits until `f` returns `Some`, polling every 5 ms, or panics with `what` at the deadline.
pub fn wait_for<T>(what: &str, deadline: Duration, f: impl FnMut() -> Option<T>) -> T {
    poll(deadline, f).unwrap_or_else(|| panic!("timed out after {deadline:?} waiting for {what}"))
}

/// Polls `f` every 5 ms until it returns `Some` or `deadline` passes (then `None`), for a caller
/// that reports a condition that never came instead of panicking.
pub fn poll<T>(deadline: Duration, mut f: impl FnMut() -> Option<T>) -> Option<T> {
    let start = Instant::now();
    loop {
        if let Some(v) = f() {
            return Some(v);
        }
        if start.elapsed() >= deadline {
            return None;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// Sleeps until `at_unix_ms` (ms since the epoch); returns at once if it has passed.
pub fn sleep_until_ms(at_unix_ms: u64) {
    let now = now_ms();
    if at_unix_ms > now {
        std::thread::sleep(Duration::from_millis(at_unix_ms - now));
    }
}
