//! The control socket: operators flip the route by hand while the agent runs.
//!
//! `nodelocaldns-ha flip|release|drain` talk to the running agent over `<state-dir>/control.sock`,
//! one JSON line each way. A file a job:
//!
//! * [`protocol`]: the lines ([`Request`], [`Response`]), who sent one ([`Peer`]), a request as
//!   the agent's loop receives it ([`Incoming`]), and the size and time limits;
//! * `server`: [`serve`], in the agent: from root only, one bounded line with a deadline, handed
//!   to the agent's loop, whose answer goes back; silent clients hold nothing up;
//! * `client`: [`call`], the blocking client side, for the command line.
//!
//! This module only moves requests: what a request does to the route is the loop's business
//! ([`crate::maintenance`]), and the override it records is [`crate::overrides`]'.

use std::io;
use std::path::PathBuf;
use std::time::Duration;

mod client;
pub mod protocol;
mod server;

pub use client::call;
pub use protocol::{
    reply_timeout, socket_path, Incoming, Peer, Request, Response, MAX_REQUEST_BYTES, READ_TIMEOUT,
    REPLY_TIMEOUT, SOCKET,
};
pub use server::{serve, MAX_WAITING};

/// What went wrong on the control socket, serving or calling.
#[derive(Debug, thiserror::Error)]
pub enum ControlError {
    /// Nothing listens on the socket: no socket file, or one left by an agent that is gone.
    #[error("no agent is serving {}: is `nodelocaldns-ha run` running with this --state-dir?", .path.display())]
    NoAgent { path: PathBuf },
    /// A live agent already serves the socket.
    #[error("another agent is serving {}: stop it, or give this one its own --state-dir", .path.display())]
    AlreadyServing { path: PathBuf },
    /// Something other than a socket sits where the socket belongs.
    #[error("{} exists and is not a socket: remove it", .path.display())]
    NotASocket { path: PathBuf },
    /// The path does not fit in a Unix socket address.
    #[error("{} is too long for a Unix socket (at most 107 bytes): use a shorter --state-dir", .path.display())]
    PathTooLong { path: PathBuf },
    /// The socket cannot be created, made private or put in place.
    #[error("cannot listen on {}: {source} (is --state-dir a writable directory?)", .path.display())]
    Listen {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    /// The agent listens but takes no more connections (its backlog is full).
    #[error("the agent on {} is not accepting connections: try again, or check its log", .path.display())]
    Busy { path: PathBuf },
    /// Connecting failed for another reason, e.g. permission denied for a user who is not root.
    #[error("cannot connect to {}: {source} (the control socket is for root only)", .path.display())]
    Connect {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    /// Sending the request or reading the answer failed.
    #[error("talking to the agent on {} failed: {source}", .path.display())]
    Io {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    /// No (complete) answer in time.
    #[error("the agent on {} did not answer within {after:?}: check its log (`nodelocaldns-ha status`)", .path.display())]
    Timeout { path: PathBuf, after: Duration },
    /// The answer is not one this client understands.
    #[error("the agent on {} answered something this command does not understand: {detail} (are the agent and this command the same version?)", .path.display())]
    BadResponse { path: PathBuf, detail: String },
}
