//! Blocking calls made from the control loop: an apply (milliseconds, seconds at worst when the
//! xtables lock is held), a leftover backend's removal, a read of the cache's reply counters.
//!
//! [`blocking`] wraps the call itself, not the loop's turn that may lead to it: a probe report
//! or a tick that changes nothing (nearly all of them) then runs on the worker as it is, and only
//! a call that may block hands the worker over to another thread (`block_in_place`), which is a
//! wake-up of that thread each time.

use tokio::runtime::{Handle, RuntimeFlavor};
use tokio::task::block_in_place;

/// Runs `f`, which blocks: in `block_in_place` on a multi-threaded runtime, so that the probes
/// and the stall watch go on meanwhile; as it is elsewhere (outside a runtime, on a blocking
/// thread, or on a current-thread runtime, a paused clock's in tests, where `block_in_place`
/// panics).
pub(crate) fn blocking<T>(f: impl FnOnce() -> T) -> T {
    match Handle::try_current().map(|h| h.runtime_flavor()) {
        Ok(RuntimeFlavor::MultiThread) => block_in_place(f),
        _ => f(),
    }
}
