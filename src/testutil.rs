//! Helpers shared by the unit tests: commands, golden files, temporary directories, and the
//! real-kernel harness that runs one test again inside a fresh network namespace.
//!
//! The harness: [`in_netns`] creates a namespace ([`Netns`]) and re-runs the calling test (its
//! path from [`test_path!`]) under `ip netns exec`, with [`NETNS_ENV`] naming the namespace and
//! `XTABLES_LOCKFILE` pointing at a lock file of its own. So no thread of the calling process ever
//! changes namespace, and nothing a test does there can touch the host's netfilter, sockets or
//! xtables lock. In the re-run, [`inside_netns`] checks that it really is in that namespace
//! before the test body touches anything.

use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicUsize, Ordering};

/// Names the namespace a test runs in, for the test binary re-run inside it.
pub(crate) const NETNS_ENV: &str = "NODELOCALDNS_HA_TEST_NETNS";
/// The lock file iptables-legacy takes (its default is the host's /run/xtables.lock).
pub(crate) const LOCKFILE_ENV: &str = "XTABLES_LOCKFILE";

/// Runs `program` with `args`, panics unless it succeeds; returns its standard output.
pub(crate) fn run(program: &str, args: &[&str]) -> String {
    let output = Command::new(program).args(args).output().unwrap();
    assert!(
        output.status.success(),
        "{program} {args:?} failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    String::from_utf8(output.stdout).unwrap()
}

/// Compares with a file under testdata/golden; `UPDATE_GOLDEN=1` rewrites it.
pub(crate) fn golden(name: &str, actual: &str) {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("testdata/golden").join(name);
    if std::env::var_os("UPDATE_GOLDEN").is_some() {
        std::fs::write(&path, actual).unwrap();
    }
    let expected = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("{}: {e} (UPDATE_GOLDEN=1 creates it)", path.display()));
    assert_eq!(actual, expected, "{name} differs from the golden file");
}

/// Log lines written by the code under test on the calling thread, kept for the test to read:
/// [`Logs::capture`] installs them for as long as its guard lives.
#[derive(Clone, Default)]
pub(crate) struct Logs(std::sync::Arc<std::sync::Mutex<Vec<u8>>>);

impl Logs {
    /// Captures this thread's log lines (every level) until the guard is dropped.
    pub(crate) fn capture(&self) -> tracing::subscriber::DefaultGuard {
        let writer = self.clone();
        let subscriber =
            tracing_subscriber::fmt().with_writer(move || writer.clone()).with_ansi(false).finish();
        tracing::subscriber::set_default(subscriber)
    }

    /// What was logged so far.
    pub(crate) fn text(&self) -> String {
        String::from_utf8_lossy(&self.0.lock().unwrap()).into_owned()
    }
}

impl std::io::Write for Logs {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// A fresh, empty directory under the system's temporary directory, removed on drop.
pub(crate) struct TempDir(pub(crate) PathBuf);

impl TempDir {
    pub(crate) fn new() -> TempDir {
        static NEXT: AtomicUsize = AtomicUsize::new(0);
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        let dir = std::env::temp_dir().join(format!("nlha-test-{}-{n}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        TempDir(dir)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// The path of the test function this is written in, as the test harness names it (without the
/// crate's name), e.g. `sockdiag::watch::tests::kernel_announces_closes_in_own_namespace_only`. Write
/// it directly in the `#[test]` function, not in a closure or a helper it calls. Should the
/// compiler ever spell the path differently, the re-run finds no test and [`Netns::run_test`]
/// fails loudly.
macro_rules! test_path {
    () => {{
        fn here() {}
        $crate::testutil::test_path_of(::std::any::type_name_of_val(&here))
    }};
}
pub(crate) use test_path;

/// [`test_path!`]'s work: `crate::path::to::test::here` to `path::to::test`.
pub(crate) fn test_path_of(here: &'static str) -> &'static str {
    let function = here.strip_suffix("::here").unwrap_or_else(|| panic!("{here}: not a fn path"));
    assert!(!function.contains('{'), "{here}: test_path! must be written in the test function");
    function.split_once("::").map_or(function, |(_, path)| path)
}

/// A network namespace and its xtables lock file, both deleted on drop (also when the test
/// fails).
pub(crate) struct Netns {
    name: String,
    lockfile: PathBuf,
}

impl Netns {
    /// Creates `<prefix>-<pid>-<n>`: each module passes a prefix of its own, so parallel tests
    /// (and test binaries) never collide.
    pub(crate) fn create(prefix: &str) -> Netns {
        static NEXT: AtomicUsize = AtomicUsize::new(0);
        assert!(
            nix::unistd::geteuid().is_root(),
            "the kernel tests need root (to create network namespaces and use netfilter and \
             sockets in them); run them as root"
        );
        let name =
            format!("{prefix}-{}-{}", std::process::id(), NEXT.fetch_add(1, Ordering::Relaxed));
        run("ip", &["netns", "add", &name]);
        let lockfile = std::env::temp_dir().join(format!("nodelocaldns-ha-{name}.xtables.lock"));
        Netns { name, lockfile }
    }

    pub(crate) fn name(&self) -> &str {
        &self.name
    }

    /// Runs the one test at `path` (see [`test_path!`]) again inside this namespace, with
    /// [`NETNS_ENV`] and [`LOCKFILE_ENV`] set; panics unless exactly that test ran and passed.
    /// Returns what it printed, standard output then standard error.
    pub(crate) fn run_test(&self, path: &str) -> String {
        let output = Command::new("ip")
            .args(["netns", "exec", &self.name])
            .arg(std::env::current_exe().unwrap())
            .args([path, "--exact", "--nocapture", "--test-threads=1"])
            .env(NETNS_ENV, &self.name)
            .env(LOCKFILE_ENV, &self.lockfile)
            .output()
            .unwrap();
        let stdout = String::from_utf8_lossy(&output.stdout);
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(
            output.status.success() && stdout.contains("1 passed"),
            "{path} failed in network namespace {}:\n{stdout}\n{stderr}",
            self.name
        );
        format!("{stdout}{stderr}")
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        let _ = Command::new("ip").args(["netns", "delete", &self.name]).status();
        let _ = std::fs::remove_file(&self.lockfile);
    }
}

/// In a test re-run by [`Netns::run_test`]: the namespace's name, once this process is verified
/// to be inside it and to have that namespace's own xtables lock file (else it panics, before
/// the test touches anything). `None` in an ordinary test run.
pub(crate) fn inside_netns() -> Option<String> {
    let ns = std::env::var(NETNS_ENV).ok()?;
    let here = std::fs::metadata("/proc/self/ns/net").unwrap();
    let there = std::fs::metadata(format!("/run/netns/{ns}")).unwrap();
    assert_eq!(
        (here.dev(), here.ino()),
        (there.dev(), there.ino()),
        "not inside network namespace {ns}: refusing to touch netfilter"
    );
    let lockfile = std::env::var(LOCKFILE_ENV).expect("XTABLES_LOCKFILE is set");
    assert!(lockfile.contains(&ns), "{lockfile} is not this test's lock file");
    Some(ns)
}

/// Runs `body` with the name of a fresh network namespace it runs in: called by the test at
/// `test_path` (always [`test_path!`]`()`), this re-runs that test inside a new namespace named
/// after `prefix`, where the same call runs `body`.
pub(crate) fn in_netns(prefix: &str, test_path: &str, body: impl FnOnce(&str)) {
    match inside_netns() {
        Some(ns) => body(&ns),
        None => {
            Netns::create(prefix).run_test(test_path);
        }
    }
}
