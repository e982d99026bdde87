//! The C allocator's two settings that keep an idle agent's memory to what it uses (an idle
//! agent's RSS, API client on, stays under 12 MiB: docs/operating.md), for glibc (elsewhere they do nothing):
//!
//! * **One arena.** glibc gives each thread that allocates while another holds the lock an arena
//!   of its own, up to eight per core, and each keeps the pages it once used. The agent's
//!   threads (the loop's worker, the blocking pool's, the forwarders', the state writer) sleep
//!   nearly all the time, and their hot paths' small blocks come from each thread's cache
//!   (tcache) without the arena's lock: one arena saved about 750 KiB resident with the API
//!   client on, its idle CPU within the run-to-run spread (`ci/bench.sh`, footprint part, one
//!   round).
//! * **Trimmed now and then.** glibc returns freed memory at the top of the heap only; what a
//!   burst frees below live blocks (a failover's reports and logs, the API client's start) stays
//!   resident. [`trim`] gives every free page back (`malloc_trim`, a walk of the free chunks of
//!   a heap of well under a MiB here).
//!
//! This module may use `unsafe`, in two calls into the C library that take and return plain
//! integers: `mallopt` and `malloc_trim`.

/// Limits glibc's allocator to one arena. Call before the second thread starts: arenas are made
/// when threads first allocate.
pub fn one_arena() {
    #[cfg(target_env = "gnu")]
    // SAFETY: mallopt takes two integers and changes a setting of the allocator, which glibc
    // guards itself; it returns 1 on success and 0 for a value it refuses, which leaves the
    // default (nothing to do then).
    unsafe {
        libc::mallopt(libc::M_ARENA_MAX, 1);
    }
}

/// Returns the allocator's free pages to the kernel.
pub fn trim() {
    #[cfg(target_env = "gnu")]
    // SAFETY: malloc_trim takes the padding to keep (0) and walks the arenas under their locks;
    // it returns whether memory was released, which nothing here needs.
    unsafe {
        libc::malloc_trim(0);
    }
}

/// How often the running agent trims ([`trim`]): a wake-up that costs nothing beside the
/// probes' ten a second.
pub const TRIM_EVERY: std::time::Duration = std::time::Duration::from_secs(10);
