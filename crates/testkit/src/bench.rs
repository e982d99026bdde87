//! What the benchmarks (benches/failover.rs, benches/soak.rs) share: their settings, statistics,
//! CPU time from /proc, and the machine a report was made on.

use std::process::Command;

/// The nearest-rank percentile of sorted values (0 if none), as dnsload reports its own.
pub use dnsload::counts::percentile;

/// A setting from the environment, `default` when unset; an unparsable value stops the run
/// before anything starts.
pub fn setting<T: std::str::FromStr>(name: &str, default: T) -> T {
    match std::env::var(name) {
        Err(_) => default,
        Ok(v) => v.trim().parse().unwrap_or_else(|_| panic!("{name}={v:?} is not a valid value")),
    }
}

/// The median (nearest rank) of `values`, which it sorts.
pub fn median(values: &mut [f64]) -> f64 {
    values.sort_by(f64::total_cmp);
    percentile(values, 50.0)
}

/// `pid`'s utime, stime, cutime and cstime from /proc (fields 14 to 17, after the command
/// name's closing parenthesis), in clock ticks. `None` once it is gone.
fn stat_times(pid: u32) -> Option<[u64; 4]> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let rest = stat.get(stat.rfind(')')? + 2..)?;
    let f: Vec<u64> =
        rest.split_whitespace().skip(11).take(4).map_while(|v| v.parse().ok()).collect();
    f.try_into().ok()
}

/// CPU time of `pid` in clock ticks (user + system): its own, and its children's it has waited
/// for. `None` once it is gone.
pub fn cpu_ticks(pid: u32) -> Option<(u64, u64)> {
    let [utime, stime, cutime, cstime] = stat_times(pid)?;
    Some((utime + stime, cutime + cstime))
}

/// The share of `pid`'s own CPU time (not its children's) it spent in the kernel (system
/// time): `(system, user + system)` in clock ticks. `None` once it is gone.
pub fn kernel_ticks(pid: u32) -> Option<(u64, u64)> {
    let [utime, stime, ..] = stat_times(pid)?;
    Some((stime, utime + stime))
}

/// Clock ticks per second, the unit of [`cpu_ticks`].
pub fn clock_ticks_per_s() -> f64 {
    let ticks = nix::unistd::sysconf(nix::unistd::SysconfVar::CLK_TCK).ok().flatten();
    ticks.expect("sysconf(CLK_TCK)") as f64
}

/// What a benchmark's report says of where it ran.
pub struct Machine {
    /// Today, `YYYY-MM-DD` (UTC).
    pub date: String,
    pub cores: usize,
    /// `uname -r`.
    pub kernel: String,
}

impl Machine {
    /// This machine, today.
    pub fn this() -> Machine {
        let kernel = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default();
        let cores = std::thread::available_parallelism().map_or(0, |n| n.get());
        let date = Command::new("date").args(["-u", "+%Y-%m-%d"]).output();
        let date = date.map(|o| String::from_utf8_lossy(&o.stdout).trim().to_owned());
        Machine { date: date.unwrap_or_default(), cores, kernel: kernel.trim().to_owned() }
    }
}
