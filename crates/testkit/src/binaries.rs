//! Where the binaries under test are.
//!
//! A test or benchmark runs from `target/<profile>/deps/`; cargo builds the workspace's binaries
//! into `target/<profile>/`, so the kit finds them next to the running executable.
//! `env!("CARGO_BIN_EXE_<name>")` cannot serve: it names only the binaries of the package whose
//! tests are being compiled, and only to those tests (not to a library like this one), and
//! dnsload is a package of its own. The VM guest of `tests/e2e_vm.rs` runs the test binary from
//! the same path, so it finds them the same way.
//!
//! Cargo builds the agent for its own package's tests and benches, but dnsload only with the
//! workspace: `cargo build` (`--release` for the benchmarks, as `ci/bench.sh` does) or a plain
//! `cargo test` in the root, every crate being a default member. `cargo test --test NAME` and
//! `cargo bench --bench NAME` use dnsload as it was last built.
//!
//! `NLHA_AGENT_EXE` names another agent binary: `ci/bench.sh` measures the agent as it ships,
//! built on its own (`cargo build -p nodelocaldns-ha`, as the Dockerfile builds it). Built for
//! a bench, it shares the features cargo unifies over the package's dev-dependencies (the
//! webhook's HTTP/2 server in hyper), which the shipped binary lacks.

use std::sync::OnceLock;

/// The agent's binary.
pub fn agent_exe() -> &'static str {
    static PATH: OnceLock<String> = OnceLock::new();
    PATH.get_or_init(|| {
        std::env::var("NLHA_AGENT_EXE").unwrap_or_else(|_| built("nodelocaldns-ha"))
    })
}

/// The load client's binary (crates/dnsload).
pub fn dnsload_exe() -> &'static str {
    static PATH: OnceLock<String> = OnceLock::new();
    PATH.get_or_init(|| built("dnsload"))
}

/// The path of the workspace's binary `name` (see the module's documentation).
fn built(name: &str) -> String {
    let exe = std::env::current_exe().expect("the running test's path");
    let deps = exe.parent().expect("the test's directory");
    let path = deps.parent().expect("the profile's directory").join(name);
    assert!(
        path.is_file(),
        "{} is not built: build the workspace's binaries with `cargo build` in the repository's \
         root (`cargo build --release` for the benchmarks)",
        path.display()
    );
    path.into_os_string().into_string().expect("a UTF-8 path")
}

/// The musl client (`testdata/resolver-load.c`: musl's getaddrinfo at a fixed rate), built with
/// `musl-gcc` next to the running test on first use (ci/deps.sh installs musl-tools).
pub fn musl_client() -> &'static str {
    static PATH: OnceLock<String> = OnceLock::new();
    PATH.get_or_init(|| {
        let repo = std::path::Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/../.."));
        let exe = std::env::current_exe().expect("the running test's path");
        let dir = exe.parent().expect("the test's directory");
        let out = dir.join("resolver-load-musl");
        // Built under a name of this process's, then renamed: tests running at once each see a
        // whole binary.
        let tmp = dir.join(format!("resolver-load-musl.{}", std::process::id()));
        let status = std::process::Command::new("musl-gcc")
            .args(["-static", "-O2", "-pthread", "-Wall", "-o"])
            .arg(&tmp)
            .arg(repo.join("testdata/resolver-load.c"))
            .status()
            .unwrap_or_else(|e| panic!("musl-gcc (Debian's musl-tools; ci/deps.sh): {e}"));
        assert!(status.success(), "musl-gcc testdata/resolver-load.c: {status}");
        std::fs::rename(&tmp, &out).expect("rename the musl client");
        out.display().to_string()
    })
}
