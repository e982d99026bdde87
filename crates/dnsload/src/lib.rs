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
//!
//! The rooms: [`args`] (the command line), `lookup` (one lookup, through the agent's probe
//! exchange), `counts` (by origin, the summary), `timeline` (a line per interval), [`run()`] (the
//! rate, the tasks, the drain). The binary (`src/main.rs`) only parses and runs.

#![forbid(unsafe_code)]

pub mod args;
pub mod counts;
mod lookup;
mod run;
mod timeline;

pub use args::Args;
pub use lookup::SYSTEM_LOOKUP_BUDGET;
pub use run::run;
