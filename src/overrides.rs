//! The manual override: a route forced by hand, as one record with one owner.
//!
//! An operator's `flip` or `drain` forces a route. Whoever forces it (the agent answering its
//! control socket, or `flip` when no agent runs) builds the record with [`Override::manual`] or
//! [`Override::drain`] and keeps it in `<state-dir>/override.json` ([`write`](fn@write):
//! atomically, mode 0600), so that it survives an agent restart; a starting agent [`read`]s it
//! back as the [`Forced`] route its state machine holds ([`Override::forced`]). It ends when
//! released ([`clear`]) or when its time runs out ([`Override::expired`]).
//!
//! The record keeps wall-clock times (milliseconds since the Unix epoch: they must mean the same
//! after a restart), while the agent decides on the monotonic clock. A [`Moment`] is one moment
//! read on both clocks, and the one place that converts between them.

use std::io;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant, SystemTime};

use serde::{Deserialize, Serialize};

use crate::atomic_file;
use crate::health::Forced;
use crate::ruleset::Route;
use crate::state;

/// The override file's name inside the state directory.
pub const FILE: &str = "override.json";
/// Format version of the override file.
pub const VERSION: u32 = 1;
/// The largest override file [`read`] reads; a real one is a few hundred bytes.
pub const MAX_BYTES: u64 = 64 * 1024;
/// How long a drain holds `Upstream` at most if the drained cache never goes away.
pub const DRAIN_HOLD_MAX: Duration = Duration::from_secs(600);

/// Who set an override: the state machine's own notion, persisted as is.
pub use crate::health::ForceKind as OverrideKind;

/// The manual override, as persisted.
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq)]
pub struct Override {
    /// [`VERSION`].
    pub version: u32,
    pub route: Route,
    /// When it ends by itself, if ever (milliseconds since the Unix epoch).
    pub until_unix_ms: Option<u64>,
    /// What the operator said.
    pub reason: String,
    /// Who set it, e.g. `uid 0 pid 1234`.
    pub set_by: String,
    pub set_unix_ms: u64,
    pub kind: OverrideKind,
    /// For a drain: the cookies of the sockets the drained cache served on when it began (see
    /// [`crate::health::Forced::waits_for`]); absent when unknown, and for a manual override.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub drained_sockets: Option<Vec<u64>>,
}

impl Override {
    /// `route` forced by hand: by `set_by` (a [`crate::control::Peer`], or the command line) at
    /// `set_unix_ms`, until `until_unix_ms` if given.
    pub fn manual(
        route: Route,
        until_unix_ms: Option<u64>,
        reason: String,
        set_by: String,
        set_unix_ms: u64,
    ) -> Override {
        Override {
            version: VERSION,
            route,
            until_unix_ms,
            reason,
            set_by,
            set_unix_ms,
            kind: OverrideKind::Manual,
            drained_sockets: None,
        }
    }

    /// A drain requested by `set_by` at `set_unix_ms`: `Upstream` until the cache that served on
    /// `drained_sockets` is gone, for [`DRAIN_HOLD_MAX`] at most.
    pub fn drain(
        reason: String,
        set_by: String,
        drained_sockets: Option<Vec<u64>>,
        set_unix_ms: u64,
    ) -> Override {
        let hold = u64::try_from(DRAIN_HOLD_MAX.as_millis()).unwrap_or(u64::MAX);
        Override {
            version: VERSION,
            route: Route::Upstream,
            until_unix_ms: Some(set_unix_ms.saturating_add(hold)),
            reason,
            set_by,
            set_unix_ms,
            kind: OverrideKind::Drain,
            drained_sockets,
        }
    }

    /// Whether its time has run out at `now_unix_ms` (never, without `until_unix_ms`).
    pub fn expired(&self, now_unix_ms: u64) -> bool {
        self.until_unix_ms.is_some_and(|until| now_unix_ms >= until)
    }

    /// The forced route this record describes at `now`, or `None` when it has expired.
    pub fn forced(&self, now: Moment) -> Option<Forced> {
        if self.expired(now.unix_ms()) {
            return None;
        }
        let until = self.until_unix_ms.map(|ms| now.instant_at(ms));
        let waits_for = self.drained_sockets.clone();
        Some(Forced {
            route: self.route,
            kind: self.kind,
            until,
            why: self.reason.clone(),
            waits_for,
        })
    }
}

/// One moment read on both clocks: the monotonic one the agent decides with, and the wall clock
/// its records keep. Converts a time on one into the other.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Moment {
    pub now: Instant,
    pub wall: SystemTime,
}

impl Moment {
    /// This moment.
    pub fn now() -> Moment {
        Moment { now: Instant::now(), wall: SystemTime::now() }
    }

    /// This moment in milliseconds since the Unix epoch.
    pub fn unix_ms(self) -> u64 {
        state::unix_ms(self.wall)
    }

    /// Instant `at` on the wall clock, in milliseconds since the Unix epoch (0 before it).
    pub fn unix_ms_at(self, at: Instant) -> u64 {
        let wall_at = if at >= self.now {
            self.wall.checked_add(at - self.now)
        } else {
            self.wall.checked_sub(self.now - at)
        };
        wall_at.map_or(if at >= self.now { u64::MAX } else { 0 }, state::unix_ms)
    }

    /// The instant that is `unix_ms` (milliseconds since the Unix epoch) on the wall clock;
    /// `now` for a time before the monotonic clock began.
    pub fn instant_at(self, unix_ms: u64) -> Instant {
        let now_ms = self.unix_ms();
        match unix_ms.checked_sub(now_ms) {
            Some(ahead) => self.now + Duration::from_millis(ahead),
            None => {
                self.now.checked_sub(Duration::from_millis(now_ms - unix_ms)).unwrap_or(self.now)
            }
        }
    }
}

/// Path of the override file in `dir`.
pub fn path(dir: &Path) -> PathBuf {
    dir.join(FILE)
}

/// Why the override file could not be read.
#[derive(Debug, thiserror::Error)]
pub enum ReadError {
    /// The file exists but cannot be read (or is not a file).
    #[error("cannot read the route override {}: {source} (remove it, or run `nodelocaldns-ha release`)", .path.display())]
    Io {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    /// The file is truncated or not an override file at all.
    #[error("{} is not a valid route override file: {detail} (remove it, or run `nodelocaldns-ha release`)", .path.display())]
    Invalid { path: PathBuf, detail: String },
    /// The file was written by another version of the agent.
    #[error("{} is a route override of format version {found}, this agent reads version {VERSION} (remove it, or run `nodelocaldns-ha release`)", .path.display())]
    Version { path: PathBuf, found: String },
}

/// Reads the override in `dir`: `None` when there is none.
///
/// Whatever sits at the path, this returns at once with bounded memory
/// ([`atomic_file::read`]): a FIFO there would otherwise hold the agent's start up until someone
/// writes to it, and a device such as `/dev/zero` linked there never ends.
pub fn read(dir: &Path) -> Result<Option<Override>, ReadError> {
    let path = path(dir);
    match atomic_file::read(&path, MAX_BYTES) {
        Ok(Some(bytes)) => parse(&path, &bytes).map(Some),
        Ok(None) => Ok(None),
        Err(atomic_file::ReadError::Io(source)) => Err(ReadError::Io { path, source }),
        Err(e @ atomic_file::ReadError::TooLarge { .. }) => {
            Err(ReadError::Invalid { path, detail: e.to_string() })
        }
    }
}

/// Parses the bytes of the override file at `path` (named in errors).
pub fn parse(path: &Path, bytes: &[u8]) -> Result<Override, ReadError> {
    let path = path.to_owned();
    // The version first: a file of another version may not have this version's fields.
    let value: serde_json::Value = serde_json::from_slice(bytes)
        .map_err(|e| ReadError::Invalid { path: path.clone(), detail: e.to_string() })?;
    match value.get("version") {
        Some(v) if v.as_u64() == Some(u64::from(VERSION)) => {}
        Some(v) => return Err(ReadError::Version { path, found: v.to_string() }),
        None => {
            let detail = "no \"version\" field".to_owned();
            return Err(ReadError::Invalid { path, detail });
        }
    }
    serde_json::from_value(value).map_err(|e| ReadError::Invalid { path, detail: e.to_string() })
}

/// Writes `o` to `dir` atomically ([`atomic_file::replace`]), mode 0600: an override is root's
/// to set and to read, like the control socket beside it.
pub fn write(dir: &Path, o: &Override) -> io::Result<()> {
    let json = serde_json::to_vec_pretty(o).map_err(io::Error::other)?;
    atomic_file::replace(&path(dir), &json, 0o600)
}

/// Removes the override in `dir`; `Ok` when there is none.
pub fn clear(dir: &Path) -> io::Result<()> {
    match std::fs::remove_file(path(dir)) {
        Err(e) if e.kind() != io::ErrorKind::NotFound => Err(e),
        _ => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::control::Peer;
    use crate::health::ForceKind;
    use crate::testutil::TempDir;
    use std::os::unix::fs::PermissionsExt;

    fn root() -> Peer {
        Peer { uid: 0, gid: 0, pid: Some(1234) }
    }

    fn sample() -> Override {
        let until = Some(1_000 + 30 * 60_000);
        Override::manual(Route::Upstream, until, "cache upgrade".into(), root().to_string(), 1_000)
    }

    #[test]
    fn override_round_trips_privately_and_clears() {
        let dir = TempDir::new();
        assert_eq!(read(&dir.0).unwrap(), None);
        write(&dir.0, &sample()).unwrap();
        assert_eq!(read(&dir.0).unwrap(), Some(sample()));
        let mode = std::fs::metadata(path(&dir.0)).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o600);
        let drain = Override::drain("node maintenance".into(), root().to_string(), None, 5_000);
        write(&dir.0, &drain).unwrap();
        assert_eq!(read(&dir.0).unwrap(), Some(drain));
        clear(&dir.0).unwrap();
        assert_eq!(read(&dir.0).unwrap(), None);
        clear(&dir.0).unwrap();
        let names: Vec<_> = std::fs::read_dir(&dir.0).unwrap().collect();
        assert!(names.is_empty(), "left behind: {names:?}");
    }

    #[test]
    fn override_file_format_is_stable() {
        let json = serde_json::to_value(sample()).unwrap();
        let expected = serde_json::json!({
            "version": 1, "route": "upstream", "until_unix_ms": 1_801_000,
            "reason": "cache upgrade", "set_by": "uid 0 pid 1234", "set_unix_ms": 1_000,
            "kind": "manual",
        });
        assert_eq!(json, expected);
    }

    /// Records as the previous version wrote them, byte for byte: read as what the constructors
    /// build, and written again the same.
    #[test]
    fn a_record_of_the_previous_version_is_read_and_written_alike() {
        let flip = r#"{
  "version": 1,
  "route": "local",
  "until_unix_ms": null,
  "reason": "",
  "set_by": "nodelocaldns-ha flip (no agent running)",
  "set_unix_ms": 1700000000000,
  "kind": "manual"
}"#;
        let timed = r#"{
  "version": 1,
  "route": "upstream",
  "until_unix_ms": 1801000,
  "reason": "cache upgrade",
  "set_by": "uid 0 pid 1234",
  "set_unix_ms": 1000,
  "kind": "manual"
}"#;
        let drain = r#"{
  "version": 1,
  "route": "upstream",
  "until_unix_ms": 605000,
  "reason": "drain requested by uid 0 pid 7",
  "set_by": "uid 0 pid 7",
  "set_unix_ms": 5000,
  "kind": "drain",
  "drained_sockets": [
    7,
    9
  ]
}"#;
        let set_by = "nodelocaldns-ha flip (no agent running)".to_owned();
        let cases = [
            (flip, Override::manual(Route::Local, None, "".into(), set_by, 1_700_000_000_000)),
            (timed, sample()),
            (
                drain,
                Override::drain(
                    "drain requested by uid 0 pid 7".into(),
                    "uid 0 pid 7".into(),
                    Some(vec![7, 9]),
                    5_000,
                ),
            ),
        ];
        for (text, built) in cases {
            assert_eq!(parse(Path::new(FILE), text.as_bytes()).unwrap(), built, "{text}");
            assert_eq!(
                String::from_utf8(serde_json::to_vec_pretty(&built).unwrap()).unwrap(),
                text
            );
        }
        // An absent list of sockets reads as unknown.
        let without = drain.replace(",\n  \"drained_sockets\": [\n    7,\n    9\n  ]", "");
        let read = parse(Path::new(FILE), without.as_bytes()).unwrap();
        assert_eq!((read.kind, read.drained_sockets), (ForceKind::Drain, None));
    }

    #[test]
    fn an_override_expires_at_its_time_and_never_without_one() {
        let timed = sample();
        assert!(!timed.expired(1_000));
        assert!(!timed.expired(1_800_999));
        assert!(timed.expired(1_801_000));
        assert!(timed.expired(u64::MAX));
        let forever = Override { until_unix_ms: None, ..sample() };
        assert!(!forever.expired(u64::MAX));
    }

    #[test]
    fn a_drain_holds_upstream_for_at_most_the_drain_hold() {
        let drain = Override::drain("drain".into(), root().to_string(), Some(vec![3]), 5_000);
        assert_eq!((drain.route, drain.kind), (Route::Upstream, ForceKind::Drain));
        assert_eq!(drain.until_unix_ms, Some(605_000));
        assert!(!drain.expired(604_999));
        assert!(drain.expired(605_000));
        assert_eq!(drain.drained_sockets, Some(vec![3]));
    }

    #[test]
    fn a_record_read_back_at_once_forces_what_was_forced() {
        let at =
            Moment { now: Instant::now(), wall: SystemTime::UNIX_EPOCH + Duration::from_secs(5) };
        let drain = Override::drain("drain".into(), "uid 0".into(), Some(vec![7]), at.unix_ms());
        let forced = drain.forced(at).expect("in force");
        assert_eq!((forced.route, forced.kind), (Route::Upstream, ForceKind::Drain));
        assert_eq!(forced.until, Some(at.now + DRAIN_HOLD_MAX));
        assert_eq!((forced.why.as_str(), forced.waits_for), ("drain", Some(vec![7])));
        let until = at.unix_ms_at(at.now + Duration::from_millis(2000));
        let flip =
            Override::manual(Route::Local, Some(until), "x".into(), "me".into(), at.unix_ms());
        let forced = flip.forced(at).expect("in force");
        assert_eq!((forced.route, forced.kind), (Route::Local, ForceKind::Manual));
        assert_eq!(forced.until, Some(at.now + Duration::from_millis(2000)));
        assert_eq!((forced.why.as_str(), forced.waits_for), ("x", None));
    }

    #[test]
    fn wall_clock_times_either_side_of_now() {
        let t0 = Instant::now();
        let now = t0 + Duration::from_secs(10);
        let wall = SystemTime::UNIX_EPOCH + Duration::from_secs(100);
        let moment = Moment { now, wall };
        assert_eq!(moment.unix_ms_at(now + Duration::from_millis(1500)), 101_500);
        assert_eq!(moment.unix_ms_at(t0), 90_000);
        assert_eq!(moment.unix_ms_at(now), 100_000);
        assert_eq!(moment.unix_ms(), 100_000);
        // Before the epoch reads as the epoch.
        assert_eq!(Moment { now, wall: SystemTime::UNIX_EPOCH }.unix_ms_at(t0), 0);
    }

    #[test]
    fn monotonic_times_either_side_of_now() {
        let t0 = Instant::now();
        let now = t0 + Duration::from_secs(10);
        let moment = Moment { now, wall: SystemTime::UNIX_EPOCH + Duration::from_secs(100) };
        assert_eq!(moment.instant_at(101_500), now + Duration::from_millis(1500));
        assert_eq!(moment.instant_at(100_000), now);
        assert_eq!(moment.instant_at(90_000), t0);
        // Both ways: back where it started, to the millisecond.
        for at in [t0, now, now + Duration::from_millis(1500), now + DRAIN_HOLD_MAX] {
            assert_eq!(moment.instant_at(moment.unix_ms_at(at)), at);
        }
        for ms in [90_000, 100_000, 101_500, u64::from(u32::MAX)] {
            assert_eq!(moment.unix_ms_at(moment.instant_at(ms)), ms);
        }
    }

    #[test]
    fn a_recorded_override_is_forced_until_its_time_or_not_at_all() {
        let now = Instant::now();
        let wall = SystemTime::UNIX_EPOCH + Duration::from_secs(100);
        let o = Override {
            version: VERSION,
            route: Route::Upstream,
            until_unix_ms: Some(102_500),
            reason: "drain requested".into(),
            set_by: "uid 0".into(),
            set_unix_ms: 99_000,
            kind: ForceKind::Drain,
            drained_sockets: Some(vec![7, 9]),
        };
        let forced = o.forced(Moment { now, wall }).expect("in force");
        assert_eq!(forced.route, Route::Upstream);
        assert_eq!(forced.kind, ForceKind::Drain);
        assert_eq!(forced.until, Some(now + Duration::from_millis(2500)));
        assert_eq!(forced.why, "drain requested");
        assert_eq!(forced.waits_for, Some(vec![7, 9]));
        let forever = Override { until_unix_ms: None, ..o.clone() };
        assert_eq!(forever.forced(Moment { now, wall }).expect("in force").until, None);
        for past in [100_000, 90_000] {
            let expired = Override { until_unix_ms: Some(past), ..o.clone() };
            assert!(expired.forced(Moment { now, wall }).is_none(), "{past}");
        }
    }

    #[test]
    fn a_broken_override_file_is_named_with_what_to_do() {
        let dir = TempDir::new();
        let file = path(&dir.0);
        let full = serde_json::to_string(&sample()).unwrap();
        let cases: [(&str, &[u8], &str); 5] = [
            ("truncated", &full.as_bytes()[..full.len() / 2], "not a valid route override"),
            ("garbage", b"\x00\xffnot json", "not a valid route override"),
            ("empty", b"", "not a valid route override"),
            ("no version", br#"{"route":"local"}"#, "no \"version\" field"),
            ("future", br#"{"version":2,"route":"local","new":true}"#, "format version 2"),
        ];
        for (case, content, says) in cases {
            std::fs::write(&file, content).unwrap();
            let err = read(&dir.0).unwrap_err();
            let text = err.to_string();
            assert!(text.contains(says), "{case}: {text}");
            assert!(text.contains(&file.display().to_string()), "{case}: {text}");
            assert!(text.contains("nodelocaldns-ha release"), "{case}: {text}");
        }
        // Huge: refused without reading it all.
        let mut huge = full.clone().into_bytes();
        huge.resize(MAX_BYTES as usize + 1, b' ');
        std::fs::write(&file, &huge).unwrap();
        let text = read(&dir.0).unwrap_err().to_string();
        assert!(text.contains("larger than 65536 bytes"), "{text}");
        // Just under the limit (padded with white space) is still an override.
        huge.truncate(MAX_BYTES as usize);
        std::fs::write(&file, &huge).unwrap();
        assert_eq!(read(&dir.0).unwrap(), Some(sample()));
        std::fs::remove_file(&file).unwrap();

        // Unreadable: chmod 000 does not stop root, a directory in its place does.
        std::fs::create_dir(&file).unwrap();
        let err = read(&dir.0).unwrap_err();
        assert!(matches!(err, ReadError::Io { .. }), "{err:?}");
        let text = err.to_string();
        assert!(text.contains(&file.display().to_string()) && text.contains("directory"), "{text}");
        // And `clear` does not pretend it removed it.
        assert!(clear(&dir.0).is_err());
        std::fs::remove_dir(&file).unwrap();

        // A FIFO with no writer, and an endless device: refused at once, not read.
        nix::unistd::mkfifo(&file, nix::sys::stat::Mode::from_bits_truncate(0o600)).unwrap();
        let started = Instant::now();
        let text = read(&dir.0).unwrap_err().to_string();
        assert!(text.contains("not a regular file"), "{text}");
        assert!(started.elapsed() < Duration::from_secs(1), "{:?}", started.elapsed());
        clear(&dir.0).unwrap();
        std::os::unix::fs::symlink("/dev/zero", &file).unwrap();
        let text = read(&dir.0).unwrap_err().to_string();
        assert!(text.contains("not a regular file"), "{text}");
        // A link to nowhere is no override.
        clear(&dir.0).unwrap();
        std::os::unix::fs::symlink(dir.0.join("gone"), &file).unwrap();
        assert_eq!(read(&dir.0).unwrap(), None);
    }
}
