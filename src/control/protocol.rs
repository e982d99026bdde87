//! The control socket's wire protocol: one JSON line each way, a [`Request`] from the command
//! line and the agent's [`Response`], with the limits both ends keep. [`Incoming`] is a request
//! as the agent's loop receives it, with the [`Peer`] that sent it and where to answer.

use std::fmt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::{Deserialize, Serialize};
use tokio::sync::oneshot;

use crate::ruleset::Route;

/// The control socket's file name inside the state directory.
pub const SOCKET: &str = "control.sock";

/// The longest request line the agent reads, newline included.
pub const MAX_REQUEST_BYTES: usize = 4096;
/// How long a client has to send its whole request line.
pub const READ_TIMEOUT: Duration = Duration::from_secs(2);
/// How long the agent's loop has to answer a request (a drain gets its own timeout on top).
pub const REPLY_TIMEOUT: Duration = Duration::from_secs(5);
/// How long a client has to take the answer.
pub(super) const WRITE_TIMEOUT: Duration = Duration::from_secs(2);
/// The longest answer [`super::call`] reads.
pub(super) const MAX_RESPONSE_BYTES: usize = 1 << 20;

/// One request, one JSON line each way.
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum Request {
    /// Force `route`, for `for_ms` milliseconds or until released.
    Flip {
        route: Route,
        #[serde(default)]
        for_ms: Option<u64>,
        #[serde(default)]
        reason: String,
    },
    /// Back to the automatic decision.
    Release,
    /// `Upstream` until the cache restarts; answered once the cache went quiet, or after
    /// `timeout_ms`.
    Drain { timeout_ms: u64 },
    /// What the agent is doing.
    Status,
}

/// The agent's answer.
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq)]
#[serde(tag = "result", rename_all = "snake_case")]
pub enum Response {
    /// Done; `message` says what happened.
    Ok { message: String },
    /// Not done; `message` says why and what to do.
    Error { message: String },
}

impl Response {
    pub fn ok(message: impl Into<String>) -> Response {
        Response::Ok { message: message.into() }
    }

    pub fn error(message: impl Into<String>) -> Response {
        Response::Error { message: message.into() }
    }
}

/// Who is on the other end of a connection, as the kernel says (`SO_PEERCRED`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Peer {
    pub uid: u32,
    pub gid: u32,
    /// In the agent's pid namespace; `None` when the kernel does not say.
    pub pid: Option<i32>,
}

impl fmt::Display for Peer {
    /// `uid 0 pid 1234`, as recorded in [`crate::overrides::Override::set_by`].
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "uid {}", self.uid)?;
        match self.pid {
            Some(pid) => write!(f, " pid {pid}"),
            None => Ok(()),
        }
    }
}

/// A peer's request as the agent's loop receives it: the request, who sent it, and where to
/// answer. Dropping `reply` answers with an error.
#[derive(Debug)]
pub struct Incoming {
    pub request: Request,
    pub peer: Peer,
    pub reply: oneshot::Sender<Response>,
}

/// Path of the control socket in `dir`.
pub fn socket_path(dir: &Path) -> PathBuf {
    dir.join(SOCKET)
}

/// How long [`super::serve`] waits for the loop's answer to `request`: a drain carries its own timeout.
pub fn reply_timeout(request: &Request) -> Duration {
    match request {
        Request::Drain { timeout_ms } => {
            Duration::from_millis(*timeout_ms).saturating_add(REPLY_TIMEOUT)
        }
        _ => REPLY_TIMEOUT,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_wire_format_is_one_tagged_json_object() {
        let flip = Request::Flip { route: Route::Local, for_ms: Some(60_000), reason: "x".into() };
        let cases = [
            (flip, r#"{"op":"flip","route":"local","for_ms":60000,"reason":"x"}"#),
            (Request::Release, r#"{"op":"release"}"#),
            (Request::Drain { timeout_ms: 10_000 }, r#"{"op":"drain","timeout_ms":10000}"#),
            (Request::Status, r#"{"op":"status"}"#),
        ];
        for (request, json) in cases {
            assert_eq!(serde_json::to_string(&request).unwrap(), json);
            assert_eq!(serde_json::from_str::<Request>(json).unwrap(), request);
        }
        // Written by hand (socat): duration and reason may be left out.
        let short: Request = serde_json::from_str(r#"{"op":"flip","route":"upstream"}"#).unwrap();
        assert_eq!(
            short,
            Request::Flip { route: Route::Upstream, for_ms: None, reason: "".into() }
        );
        assert_eq!(
            serde_json::to_string(&Response::ok("done")).unwrap(),
            r#"{"result":"ok","message":"done"}"#
        );
        assert_eq!(
            serde_json::to_string(&Response::error("no")).unwrap(),
            r#"{"result":"error","message":"no"}"#
        );
    }

    #[test]
    fn a_drain_waits_for_its_own_timeout_and_more() {
        assert_eq!(reply_timeout(&Request::Status), REPLY_TIMEOUT);
        assert_eq!(reply_timeout(&Request::Release), REPLY_TIMEOUT);
        let drain = Request::Drain { timeout_ms: 10_000 };
        assert_eq!(reply_timeout(&drain), Duration::from_secs(15));
        assert!(reply_timeout(&Request::Drain { timeout_ms: u64::MAX }) > REPLY_TIMEOUT);
    }
}
