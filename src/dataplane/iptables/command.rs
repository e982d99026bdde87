//! Runs a child process with a time bound: past it, the child is killed by its pid.

use std::io::Write;
use std::path::Path;
use std::process::{Command, ExitStatus, Stdio};
use std::sync::mpsc;
use std::time::Duration;

use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;

/// How long to wait for the reaper thread after a kill (a grandchild, e.g. a `modprobe` that
/// iptables-legacy started, may hold the output pipes a moment longer).
const AFTER_KILL: Duration = Duration::from_secs(1);

/// A child process that exited.
#[derive(Debug)]
pub(super) struct Finished {
    pub status: ExitStatus,
    pub stdout: String,
    pub stderr: String,
}

/// Why no [`Finished`].
#[derive(Debug)]
pub(super) enum RunError {
    /// Starting or waiting for the child failed.
    Io(std::io::Error),
    /// The child outlived its bound and was killed.
    TimedOut,
}

/// Runs `program` with `args`, `input` on its stdin (or none), its environment inherited (so
/// `XTABLES_LOCKFILE` passes through); kills it if it runs longer than `limit`.
pub(super) fn run(
    program: &Path,
    args: &[&str],
    input: Option<&str>,
    limit: Duration,
) -> Result<Finished, RunError> {
    let mut child = Command::new(program)
        .args(args)
        .stdin(if input.is_some() { Stdio::piped() } else { Stdio::null() })
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(RunError::Io)?;
    let pid = child.id();
    let input = input.map(str::to_owned);
    let (done_tx, done_rx) = mpsc::channel();
    // The thread feeds stdin and collects the output; this one keeps the clock.
    std::thread::spawn(move || {
        if let (Some(input), Some(mut stdin)) = (input, child.stdin.take()) {
            // A child that exits without reading reports its own error; EPIPE here says less.
            let _ = stdin.write_all(input.as_bytes());
        }
        let _ = done_tx.send(child.wait_with_output());
    });
    match done_rx.recv_timeout(limit) {
        Ok(output) => {
            let output = output.map_err(RunError::Io)?;
            Ok(Finished {
                status: output.status,
                stdout: String::from_utf8_lossy(&output.stdout).into_owned(),
                stderr: String::from_utf8_lossy(&output.stderr).into_owned(),
            })
        }
        Err(_) => {
            // The thread reaps the child only when it exits, and the kernel hands out pids in
            // sequence, so even if it exited just now its pid cannot have been reused yet.
            if let Ok(pid) = i32::try_from(pid) {
                let _ = kill(Pid::from_raw(pid), Signal::SIGKILL);
            }
            let _ = done_rx.recv_timeout(AFTER_KILL);
            Err(RunError::TimedOut)
        }
    }
}
