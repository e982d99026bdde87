//! The agent's state file: what `run` decided and why, for `status` and for humans.
//!
//! `run` rewrites `<state-dir>/state.json` on every route change and once a second (through a
//! [`Writer`], beside its loop), and `status` reads it, with the care the override file beside
//! it gets ([`crate::atomic_file`]): replaced whole and synced, mode 0644; read without
//! blocking, a regular file only, at most [`MAX_BYTES`]. The file is informational: the route itself is read back from the kernel on
//! restart, never trusted from here (but `flip` without an agent takes the backend from it).

use std::fs::File;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Condvar, Mutex};

use nix::errno::Errno;
use nix::fcntl::{Flock, FlockArg};
use std::time::{SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};
use tracing::warn;

use crate::atomic_file;
use crate::ruleset::Route;

/// Format version of the state file.
pub const VERSION: u32 = 1;
/// File name inside the state directory.
pub const FILE: &str = "state.json";

/// Counters and the last result of one probe stream.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct ProbeStats {
    /// Where the probes go, e.g. `169.254.20.10:53`.
    pub target: String,
    pub sent: u64,
    pub good: u64,
    pub bad: u64,
    /// Label of the last outcome (`answered`, `timeout`, `refused`, ...).
    pub last: Option<String>,
    pub last_latency_ms: Option<f64>,
    /// Current consecutive good / bad probes.
    pub streak_good: u32,
    pub streak_bad: u32,
}

/// Probe streams.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Probes {
    pub cache_udp: ProbeStats,
    pub cache_tcp: Option<ProbeStats>,
    pub upstream: ProbeStats,
}

/// What the link-local forwarder has done since the agent started: how much of the node's DNS
/// went around the cache.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Forwarded {
    /// UDP queries sent on to the upstream, and the answers sent back.
    pub udp_queries: u64,
    pub udp_answers: u64,
    /// TCP connections relayed.
    pub tcp_connections: u64,
    /// Queries the upstream did not answer in time, or connections it did not take.
    pub upstream_failures: u64,
    /// Queries dropped: at the forwarder's bound, malformed, or their answer unsendable.
    pub dropped: u64,
}

/// Others' rules for the cluster-DNS IP, at the agent's last look: node-cache's own (it runs
/// without `-setupiptables=false`), or anyone's NOTRACK.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Foreign {
    /// How many there are.
    pub rules: u64,
    /// Those that keep pods on the cache whatever the route: NOTRACKs of queries the agent's
    /// rules do not run before. The rest its rules make harmless.
    pub in_effect: u64,
}

/// The startup taint: the node's taint that keeps workloads off until its DNS works.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct StartupTaint {
    /// The taint's key.
    pub key: String,
    /// Why it stays on the node; `None`: it may go (the reports remove it).
    pub kept: Option<String>,
    /// Why it may go, when it may.
    #[serde(default)]
    pub goes: Option<String>,
    /// It goes for its bound alone (`--startup-taint-timeout`): the node has no DNS yet.
    #[serde(default)]
    pub overdue: bool,
}

/// What `status` shows.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct State {
    pub version: u32,
    /// The agent's process id.
    pub pid: u32,
    pub updated_unix_ms: u64,
    pub dataplane: String,
    /// Which queries the agent fails over: those for the cluster-DNS IP (the ClusterIP shape),
    /// those for the link-local IP (the link-local shape), or both.
    #[serde(default)]
    pub shape: String,
    /// Why `--dataplane auto` chose it, when it did.
    #[serde(default)]
    pub dataplane_why: Option<String>,
    /// Where the filter ACCEPTs are installed (the iptables flavours the node uses).
    #[serde(default)]
    pub accepts_in: Vec<String>,
    /// Problems on the node the agent cannot fix itself, e.g. node-cache's own NOTRACK rules.
    #[serde(default)]
    pub warnings: Vec<String>,
    /// The agent's rules found at start in backends it no longer uses (an agent with another
    /// `--dataplane`, or before kube-proxy changed modes), and what became of them.
    #[serde(default)]
    pub leftovers: Vec<String>,
    pub route: Route,
    pub since_unix_ms: u64,
    pub reason: String,
    /// The reason's kind, as the metrics label it (`cache_refused`, `manual`, …).
    #[serde(default)]
    pub reason_kind: String,
    /// The startup taint (`--startup-taint`), when one is configured.
    #[serde(default)]
    pub startup_taint: Option<StartupTaint>,
    /// Why the route stays where it is although its resolver fails (the cache and the upstream
    /// both fail), if it does.
    pub held: Option<String>,
    pub transitions: u64,
    /// Times the installed ruleset was found changed by someone else and restored.
    pub repairs: u64,
    /// The last dataplane error, until an apply succeeds again.
    pub last_error: Option<String>,
    /// Whether the current route's ruleset is in the kernel (its last apply succeeded): the
    /// agent is ready (`/readyz`) from the first time it is.
    #[serde(default)]
    pub ruleset_in: bool,
    pub probes: Probes,
    /// Where the upstream's address (`probes.upstream.target`) came from: `--upstream-ip`, the
    /// environment, or its Service followed through the API server ([`crate::upstream`]).
    #[serde(default)]
    pub upstream_from: String,
    /// The link-local forwarder's counts, where it runs.
    #[serde(default)]
    pub forwarded: Option<Forwarded>,
    /// Others' rules for the cluster-DNS IP, counted (each is named in `warnings`).
    #[serde(default)]
    pub foreign: Foreign,
}

/// How old a state file may be before its agent counts as wedged (it is rewritten every second).
pub const STALE_AFTER_MS: u64 = 5_000;
/// The lock file a running agent holds in its state directory.
pub const LOCK_FILE: &str = "agent.lock";

impl State {
    /// Whether the state was written more than [`STALE_AFTER_MS`] before `now`.
    pub fn is_stale(&self, now: SystemTime) -> bool {
        unix_ms(now).saturating_sub(self.updated_unix_ms) > STALE_AFTER_MS
    }
}

/// An exclusive `flock` on `<state-dir>/agent.lock`, held by a running agent for its lifetime.
///
/// A lock rather than the pid in the state file: the agent runs in a container's pid namespace
/// while `status` and `teardown` may run on the host, where that pid means nothing; a lock on a
/// hostPath file means the same everywhere, and the kernel drops it when the agent dies.
#[derive(Debug)]
pub struct Lock(#[allow(dead_code)] Flock<File>);

/// Why the lock could not be taken.
#[derive(Debug, thiserror::Error)]
pub enum LockError {
    /// Another agent holds it (or a command standing in for one: `flip` with no agent running);
    /// the holder's note, when it left one.
    #[error("another agent is running with --state-dir {}{}: stop it, or give this one its own state directory", .0.display(), holder(.1))]
    Held(PathBuf, Option<String>),
    /// The lock file cannot be opened or locked.
    #[error("cannot open or lock {}: {source} (give this command read access to its state directory, or check --state-dir)", .path.display())]
    Io {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
}

/// ` (held by …)` for a holder's note, if there is one.
fn holder(note: &Option<String>) -> String {
    note.as_ref().map_or(String::new(), |note| format!(" (held by {note})"))
}

/// The longest holder's note read back from the lock file.
const MAX_NOTE_BYTES: u64 = 256;

impl Lock {
    /// Takes the lock in `dir` without waiting.
    pub fn acquire(dir: &Path) -> Result<Lock, LockError> {
        Lock::take(dir, None)
    }

    /// Takes the lock in `dir` without waiting, for a command that stands in for the agent
    /// meanwhile (`flip` with no agent running): `note` is left in the lock file, so that an
    /// agent starting meanwhile names who holds it.
    pub fn acquire_for(dir: &Path, note: &str) -> Result<Lock, LockError> {
        Lock::take(dir, Some(note))
    }

    fn take(dir: &Path, note: Option<&str>) -> Result<Lock, LockError> {
        use std::io::{Read, Seek, Write};
        let path = dir.join(LOCK_FILE);
        let io_err = |source| LockError::Io { path: path.clone(), source };
        let file = File::options()
            .create(true)
            .truncate(false)
            .read(true)
            .write(true)
            .open(&path)
            .map_err(io_err)?;
        let mut lock = match Flock::lock(file, FlockArg::LockExclusiveNonblock) {
            Ok(lock) => lock,
            Err((mut file, Errno::EWOULDBLOCK)) => {
                let mut note = String::new();
                let _ = (&mut file).take(MAX_NOTE_BYTES).read_to_string(&mut note);
                let note = Some(note.trim().to_owned()).filter(|n| !n.is_empty());
                return Err(LockError::Held(dir.to_owned(), note));
            }
            Err((_, errno)) => return Err(io_err(errno.into())),
        };
        // The holder's note: this one's, or none (an agent's lock needs no explanation).
        lock.set_len(0).map_err(io_err)?;
        if let Some(note) = note {
            lock.rewind().and_then(|()| lock.write_all(note.as_bytes())).map_err(io_err)?;
        }
        Ok(Lock(lock))
    }
}

/// Whether an agent holds the lock in `dir`: `Ok(false)` when there is no lock file (no agent
/// ever ran there) or nobody holds it, `Ok(true)` when an agent does, and an error when it cannot
/// be told — the file cannot be opened or locked — which a caller must never read as "no agent".
///
/// Reads only: the file is opened read-only, without creating it, and tried with a shared lock
/// (which an agent's exclusive one excludes), so the answer is the same on a read-only mount of
/// the state directory (node-cache's preStop `drain` in the node-local-dns overlay) as on the
/// host. `O_NONBLOCK`: a FIFO in the lock's place must not hang the command.
pub fn agent_running(dir: &Path) -> Result<bool, LockError> {
    use std::os::unix::fs::OpenOptionsExt;
    let path = dir.join(LOCK_FILE);
    let file = match File::options()
        .read(true)
        .custom_flags(libc::O_NONBLOCK | libc::O_CLOEXEC)
        .open(&path)
    {
        Ok(file) => file,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(false),
        Err(source) => return Err(LockError::Io { path, source }),
    };
    match Flock::lock(file, FlockArg::LockSharedNonblock) {
        Ok(_released_on_drop) => Ok(false),
        Err((_, Errno::EWOULDBLOCK)) => Ok(true),
        Err((_, errno)) => Err(LockError::Io { path, source: errno.into() }),
    }
}

/// Removes the state and lock files in `dir`, and `dir` itself when that leaves it empty. `Ok` when there
/// is nothing to remove.
pub fn remove(dir: &Path) -> io::Result<()> {
    for file in [path(dir), dir.join(LOCK_FILE)] {
        match std::fs::remove_file(file) {
            Err(e) if e.kind() != io::ErrorKind::NotFound => return Err(e),
            _ => {}
        }
    }
    // Fails harmlessly when the directory holds something else or is already gone.
    let _ = std::fs::remove_dir(dir);
    Ok(())
}

/// Milliseconds since the Unix epoch of `t`.
pub fn unix_ms(t: SystemTime) -> u64 {
    t.duration_since(UNIX_EPOCH).map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

/// Path of the state file in `dir`.
pub fn path(dir: &Path) -> PathBuf {
    dir.join(FILE)
}

/// The state file's mode. Readable by everyone: `status` needs no privilege and may run as
/// another user than the agent (a monitoring account on the host, say), and nothing in it is
/// secret. Writable by its owner only: `flip` without an agent trusts the backend it names.
/// Set explicitly, so that neither a strict umask in the agent's container (which would lock
/// `status` out) nor a loose one changes it.
pub const MODE: u32 = 0o644;

/// The largest state file [`read`] reads. A real one is a few KiB (its lists of warnings and
/// leftovers are short); anything much larger is not one.
pub const MAX_BYTES: u64 = 1 << 20;

/// Writes `state` to `dir` atomically, synced, mode [`MODE`].
pub fn write(dir: &Path, state: &State) -> io::Result<()> {
    let json = serde_json::to_vec_pretty(state).map_err(io::Error::other)?;
    atomic_file::replace(&path(dir), &json, MODE)
}

/// Writes the state file beside the control loop, which hands each new [`State`] over and goes
/// on: a thread of its own writes the latest one, skipping any it was too slow for. The loop
/// writes once a second, and a synced write costs milliseconds (5 ms as a rule on a VM's ext4,
/// 35 ms at worst, measured), which a decision must never wait behind.
#[derive(Debug)]
pub struct Writer {
    next: Arc<(Mutex<Pending>, Condvar)>,
    thread: Option<std::thread::JoinHandle<()>>,
}

/// What the writer thread has still to do.
#[derive(Debug, Default)]
struct Pending {
    state: Option<State>,
    /// No more states come: write what is pending, then stop.
    closed: bool,
}

impl Writer {
    /// Starts the writer for the state file in `dir`; a failed write is logged, and the next
    /// state tried as usual.
    pub fn start(dir: PathBuf) -> Writer {
        let next = Arc::new((Mutex::new(Pending::default()), Condvar::new()));
        let shared = next.clone();
        // As for tokio's own threads, a system that cannot start one more is past running on.
        let thread = std::thread::Builder::new()
            .name("state writer".into())
            .spawn(move || write_each(&dir, &shared))
            .expect("starting the state writer thread");
        Writer { next, thread: Some(thread) }
    }

    /// Hands `state` over to be written, in place of any not written yet. Never waits for I/O.
    pub fn submit(&self, state: State) {
        let (pending, wake) = &*self.next;
        lock(pending).state = Some(state);
        wake.notify_one();
    }

    /// Writes the last state handed over, and stops: for the agent's exit.
    pub fn finish(self) {
        drop(self);
    }
}

impl Drop for Writer {
    fn drop(&mut self) {
        let (pending, wake) = &*self.next;
        lock(pending).closed = true;
        wake.notify_one();
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// The pending work, even if a writer panicked holding it (it holds no invariant to break).
fn lock(pending: &Mutex<Pending>) -> std::sync::MutexGuard<'_, Pending> {
    pending.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// The writer thread: writes each state handed over, until closed and done.
fn write_each(dir: &Path, next: &(Mutex<Pending>, Condvar)) {
    let (pending, wake) = next;
    loop {
        let state = {
            let mut guard = lock(pending);
            while guard.state.is_none() && !guard.closed {
                guard = wake.wait(guard).unwrap_or_else(std::sync::PoisonError::into_inner);
            }
            match guard.state.take() {
                Some(state) => state,
                None => return,
            }
        };
        if let Err(e) = write(dir, &state) {
            warn!(dir = %dir.display(), error = %e, "writing the state file failed");
        }
    }
}

/// Why a state file could not be read.
#[derive(Debug, thiserror::Error)]
pub enum ReadError {
    /// No file: the agent has not run with this state directory.
    #[error("no state in {}: is the agent running with --state-dir {}?", .0.display(), .0.display())]
    Missing(PathBuf),
    /// Something is there but cannot be read, or is not a regular file (a FIFO, a directory, a
    /// link to a device).
    #[error("cannot read {}: {source}", .path.display())]
    Io {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    /// The file is not a state file of this version.
    #[error("{} is not a valid state file (version {VERSION} expected): {detail}", .path.display())]
    Invalid { path: PathBuf, detail: String },
}

/// Reads the state file in `dir`: at once and with bounded memory whatever is there (a FIFO,
/// a directory, a link to a device), which is refused with what it is.
pub fn read(dir: &Path) -> Result<State, ReadError> {
    let file = path(dir);
    let bytes = match atomic_file::read(&file, MAX_BYTES) {
        Ok(Some(bytes)) => bytes,
        Ok(None) => return Err(ReadError::Missing(dir.to_owned())),
        Err(atomic_file::ReadError::Io(source)) => {
            return Err(ReadError::Io { path: file, source })
        }
        Err(e @ atomic_file::ReadError::TooLarge { .. }) => {
            return Err(ReadError::Invalid { path: file, detail: e.to_string() })
        }
    };
    let state: State = serde_json::from_slice(&bytes)
        .map_err(|e| ReadError::Invalid { path: file.clone(), detail: e.to_string() })?;
    if state.version != VERSION {
        return Err(ReadError::Invalid {
            path: file,
            detail: format!("version {}", state.version),
        });
    }
    Ok(state)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> State {
        State {
            version: VERSION,
            pid: 42,
            updated_unix_ms: 1_000,
            dataplane: "nftables".into(),
            shape: String::new(),
            dataplane_why: None,
            accepts_in: Vec::new(),
            leftovers: Vec::new(),
            warnings: Vec::new(),
            route: Route::Upstream,
            since_unix_ms: 900,
            reason_kind: "cache_failing".into(),
            startup_taint: None,
            reason: "3 consecutive cache udp probes failed (last: timeout)".into(),
            held: None,
            transitions: 1,
            repairs: 0,
            last_error: None,
            ruleset_in: true,
            probes: Probes::default(),
            upstream_from: "--upstream-ip".into(),
            forwarded: None,
            foreign: Foreign::default(),
        }
    }

    #[test]
    fn the_lock_is_exclusive_and_dropped_with_its_holder() {
        let dir = std::env::temp_dir().join(format!("nlha-lock-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        assert!(!agent_running(&dir).unwrap());
        let held = Lock::acquire(&dir).unwrap();
        assert!(agent_running(&dir).unwrap());
        assert!(matches!(Lock::acquire(&dir), Err(LockError::Held(_, None))));
        drop(held);
        assert!(!agent_running(&dir).unwrap());
        // A command standing in for the agent says so to whoever finds the lock held.
        let flip = Lock::acquire_for(&dir, "nodelocaldns-ha flip").unwrap();
        let err = Lock::acquire(&dir).unwrap_err();
        assert!(err.to_string().contains("held by nodelocaldns-ha flip"), "{err}");
        drop(flip);
        drop(Lock::acquire(&dir).unwrap());
        assert!(Lock::acquire(&dir).is_ok());
        remove(&dir).unwrap();
        assert!(!dir.exists());
    }

    #[test]
    fn a_lock_that_cannot_be_opened_is_not_taken_for_no_agent() {
        let dir = std::env::temp_dir().join(format!("nlha-lock-odd-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        // A socket in the lock file's place: opening it fails (ENXIO), so nobody can tell.
        let _socket = std::os::unix::net::UnixListener::bind(dir.join(LOCK_FILE)).unwrap();
        let err = agent_running(&dir).unwrap_err().to_string();
        assert!(err.contains(LOCK_FILE) && err.contains("read access"), "{err}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn round_trips_and_rejects_garbage() {
        let dir = std::env::temp_dir().join(format!("nlha-state-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        assert!(matches!(read(&dir), Err(ReadError::Missing(_))));
        write(&dir, &sample()).unwrap();
        assert_eq!(read(&dir).unwrap(), sample());
        std::fs::write(path(&dir), b"{\"version\": 1, \"pid\": ").unwrap();
        assert!(matches!(read(&dir), Err(ReadError::Invalid { .. })));
        let mut future = sample();
        future.version = 99;
        write(&dir, &future).unwrap();
        let err = read(&dir).unwrap_err().to_string();
        assert!(err.contains("version 99"), "{err}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn the_written_file_is_readable_by_all_and_writable_by_the_agent_only() {
        use std::os::unix::fs::PermissionsExt;
        let dir = std::env::temp_dir().join(format!("nlha-state-mode-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        // A file left by an older agent, of another mode: the next write sets the mode.
        std::fs::write(path(&dir), b"{}").unwrap();
        std::fs::set_permissions(path(&dir), std::fs::Permissions::from_mode(0o600)).unwrap();
        write(&dir, &sample()).unwrap();
        let mode = std::fs::metadata(path(&dir)).unwrap().permissions().mode() & 0o7777;
        assert_eq!(mode, MODE);
        assert_eq!(MODE, 0o644);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn the_writer_leaves_the_last_state_handed_over() {
        let dir = std::env::temp_dir().join(format!("nlha-state-writer-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let writer = Writer::start(dir.clone());
        for transitions in 1..=100 {
            writer.submit(State { transitions, ..sample() });
        }
        writer.finish();
        assert_eq!(read(&dir).unwrap(), State { transitions: 100, ..sample() });
        // One that cannot write goes on, and stops when asked.
        let gone = dir.join("gone");
        let writer = Writer::start(gone.clone());
        writer.submit(sample());
        writer.finish();
        assert!(!gone.exists());
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn what_is_no_state_file_is_refused_at_once_saying_what_it_is() {
        let dir = std::env::temp_dir().join(format!("nlha-state-odd-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let file = path(&dir);
        let says = |needle: &str| {
            let err = read(&dir).unwrap_err();
            let text = err.to_string();
            assert!(text.contains(&file.display().to_string()) && text.contains(needle), "{text}");
            err
        };
        // A plain read would wait for a writer forever.
        nix::unistd::mkfifo(&file, nix::sys::stat::Mode::from_bits_truncate(0o600)).unwrap();
        assert!(matches!(says("not a regular file"), ReadError::Io { .. }));
        std::fs::remove_file(&file).unwrap();
        // A plain read would never end.
        std::os::unix::fs::symlink("/dev/zero", &file).unwrap();
        assert!(matches!(says("not a regular file"), ReadError::Io { .. }));
        std::fs::remove_file(&file).unwrap();
        std::fs::create_dir(&file).unwrap();
        assert!(matches!(says("a directory"), ReadError::Io { .. }));
        std::fs::remove_dir(&file).unwrap();
        // Valid JSON up to the limit and beyond: not read past it.
        let mut huge = serde_json::to_vec(&sample()).unwrap();
        huge.resize(usize::try_from(MAX_BYTES).unwrap() + 1, b' ');
        std::fs::write(&file, &huge).unwrap();
        let err = says(&format!("larger than {MAX_BYTES} bytes"));
        assert!(matches!(err, ReadError::Invalid { .. }), "{err:?}");
        huge.truncate(usize::try_from(MAX_BYTES).unwrap());
        std::fs::write(&file, &huge).unwrap();
        assert_eq!(read(&dir).unwrap(), sample());
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
