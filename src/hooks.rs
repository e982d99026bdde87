//! The transition hook: an external program (a CNI agent, say) told about every route change,
//! one at a time and in order, without ever holding the switch up.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use tracing::warn;

use crate::health::Transition;
use crate::metrics::Metrics;

/// Runs the transition hook for each change from `changes`, one at a time and in order, each
/// bounded by `timeout`; never ends (the agent treats a task that ends as dead).
pub async fn run_hooks(
    path: PathBuf,
    mut changes: tokio::sync::mpsc::Receiver<(Transition, u64)>,
    timeout: Duration,
    metrics: Arc<Metrics>,
) {
    while let Some((t, at_unix_ms)) = changes.recv().await {
        let result = run_hook(&path, &t, at_unix_ms, timeout).await;
        metrics.hook(result);
    }
    std::future::pending().await
}

/// Runs the hook once; `ok`, `failed` or `timeout`. The program gets the change in its
/// environment: `NODELOCALDNS_HA_FROM`, `_TO`, `_REASON`, `_REASON_KIND`, `_UNIX_MS` (when the
/// route changed). It runs in its own process group, all of which is killed on timeout; its
/// output is discarded (the agent's log stays one event per line).
async fn run_hook(path: &Path, t: &Transition, at_unix_ms: u64, timeout: Duration) -> &'static str {
    let mut command = tokio::process::Command::new(path);
    command
        .env("NODELOCALDNS_HA_FROM", t.from.as_str())
        .env("NODELOCALDNS_HA_TO", t.to.as_str())
        .env("NODELOCALDNS_HA_REASON", t.reason.to_string())
        .env("NODELOCALDNS_HA_REASON_KIND", t.reason.kind())
        .env("NODELOCALDNS_HA_UNIX_MS", at_unix_ms.to_string())
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .process_group(0)
        .kill_on_drop(true);
    let mut child = match command.spawn() {
        Ok(child) => child,
        Err(e) => {
            warn!(hook = %path.display(), error = %e, "transition hook could not start");
            return "failed";
        }
    };
    match tokio::time::timeout(timeout, child.wait()).await {
        Ok(Ok(status)) if status.success() => "ok",
        Ok(Ok(status)) => {
            warn!(hook = %path.display(), %status, "transition hook failed");
            "failed"
        }
        Ok(Err(e)) => {
            warn!(hook = %path.display(), error = %e, "transition hook failed");
            "failed"
        }
        Err(_) => {
            warn!(hook = %path.display(), timeout = ?timeout, "transition hook timed out; killed");
            if let Some(pid) = child.id().and_then(|id| i32::try_from(id).ok()) {
                let group = nix::unistd::Pid::from_raw(pid);
                let _ = nix::sys::signal::killpg(group, nix::sys::signal::Signal::SIGKILL);
            }
            let _ = child.kill().await;
            "timeout"
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ruleset::Route;
    use nix::sys::signal::Signal;

    /// A directory of the test's own.
    fn dir(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("nlha-hooks-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    /// A shell script at `path` (run as the hook).
    fn script(path: &Path, body: &str) {
        use std::os::unix::fs::PermissionsExt;
        std::fs::write(path, format!("#!/bin/sh\n{body}\n")).unwrap();
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o755)).unwrap();
    }

    #[tokio::test]
    async fn the_hook_gets_the_change_and_is_bounded() {
        let dir = dir("hook");
        let t = Transition {
            from: Route::Local,
            to: Route::Upstream,
            reason: crate::health::Reason::CacheRefused(crate::health::Stream::CacheUdp),
        };
        let hook = dir.join("hook");
        let seen = dir.join("seen");
        script(&hook, &format!("env | grep ^NODELOCALDNS_HA_ | sort >{}", seen.display()));
        let patience = Duration::from_secs(10);
        assert_eq!(run_hook(&hook, &t, 1234, patience).await, "ok");
        let env = std::fs::read_to_string(&seen).unwrap();
        let expected = format!(
            "NODELOCALDNS_HA_FROM=local\nNODELOCALDNS_HA_REASON={}\nNODELOCALDNS_HA_REASON_KIND={}\n\
             NODELOCALDNS_HA_TO=upstream\nNODELOCALDNS_HA_UNIX_MS=1234\n",
            t.reason,
            t.reason.kind()
        );
        assert_eq!(env, expected);
        script(&hook, "exit 3");
        assert_eq!(run_hook(&hook, &t, 1234, patience).await, "failed");
        assert_eq!(run_hook(&dir.join("missing"), &t, 1234, patience).await, "failed");
        // Killed with its whole process group at the timeout: the background child too.
        // (A timeout long enough for a busy machine to start the script and its child.)
        let pid = dir.join("pid");
        script(&hook, &format!("sleep 600 & echo $! >{}; wait", pid.display()));
        assert_eq!(run_hook(&hook, &t, 1234, Duration::from_secs(2)).await, "timeout");
        let child: i32 = std::fs::read_to_string(&pid).unwrap().trim().parse().unwrap();
        let child = nix::unistd::Pid::from_raw(child);
        // SIGKILL is sent when the hook times out; the child is gone (or a zombie) once the
        // kernel has run its exit, a moment later on a busy machine.
        let gone = || {
            nix::sys::signal::kill(child, None).is_err()
                || std::fs::read_to_string(format!("/proc/{child}/stat"))
                    .is_ok_and(|s| s.split(") ").nth(1).is_some_and(|rest| rest.starts_with('Z')))
        };
        let deadline = std::time::Instant::now() + Duration::from_secs(5);
        while !gone() && std::time::Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        let gone = gone();
        if !gone {
            let _ = nix::sys::signal::kill(child, Signal::SIGKILL);
        }
        assert!(gone, "the hook's child {child} outlived the timeout");
        let _ = std::fs::remove_dir_all(&dir);
    }
}
