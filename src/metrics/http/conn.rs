//! One connection's I/O: read the request head within the size and time limits, write one
//! answer, then linger so that closing does not reset the connection under that answer. (Giving
//! way to a newcomer is the accept loop's: it drops this.)

use std::io;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::time::timeout;
use tracing::debug;

use super::accept::Place;
use super::request::{head_end, parse};
use super::response::Response;
use super::route::answer;
use super::{Limits, State};

/// Serves one connection: one request, one answer, then close.
pub(super) async fn handle(
    mut stream: TcpStream,
    state: &State,
    limits: Limits,
    place: &Place,
) -> io::Result<()> {
    let mut buf = vec![0; limits.max_head];
    place.reading();
    let head = timeout(limits.head_timeout, read_head(&mut stream, &mut buf)).await;
    place.answering();
    let response = match head {
        // Too slow, or silent: not worth an answer.
        Err(_elapsed) => return Ok(()),
        Ok(head) => match head? {
            Head::Closed => return Ok(()),
            Head::Complete(len) => {
                answer(parse(&buf[..len]), state, (state.clock)(), place.probes_only)
            }
            Head::Truncated => Response::bad_request("the connection closed mid-request"),
            Head::TooLarge => Response::bad_request("the request head is larger than 8 KiB"),
        },
    };
    // Until the whole answer is the kernel's, closing resets: cut for not reading (its write
    // timeout, or giving way), a client leaves no unsent answer behind, which a zero window
    // would keep alive as an orphan for minutes.
    reset_on_close(&stream, true);
    let write = async {
        stream.write_all(&response.bytes).await?;
        stream.shutdown().await
    };
    timeout(limits.write_timeout, write).await.map_err(|_| io::ErrorKind::TimedOut)??;
    reset_on_close(&stream, false);
    // Lingering close: a client whose request was not read to the end would otherwise get a
    // reset, which may destroy the answer before it reads it.
    let mut scratch = [0; 4096];
    let mut discarded = 0;
    let drain = async {
        while discarded < limits.linger_bytes {
            match stream.read(&mut scratch).await {
                Ok(0) | Err(_) => break,
                Ok(n) => discarded += n,
            }
        }
    };
    let _ = timeout(limits.linger, drain).await;
    Ok(())
}

/// Whether closing `stream` resets it (SO_LINGER 0) or closes it in order, its unsent data
/// still delivered.
fn reset_on_close(stream: &TcpStream, reset: bool) {
    let linger = reset.then_some(Duration::ZERO);
    if let Err(e) = socket2::SockRef::from(stream).set_linger(linger) {
        debug!(error = %e, "setting SO_LINGER on an HTTP connection failed");
    }
}

/// How reading a request head ended.
#[derive(Debug, PartialEq, Eq)]
enum Head {
    /// The head is the first `usize` bytes of the buffer (its blank line included).
    Complete(usize),
    /// The client closed before sending anything.
    Closed,
    /// The client closed in the middle of the head.
    Truncated,
    /// The buffer filled without the head ending.
    TooLarge,
}

async fn read_head(stream: &mut TcpStream, buf: &mut [u8]) -> io::Result<Head> {
    let mut filled = 0;
    loop {
        if filled == buf.len() {
            return Ok(Head::TooLarge);
        }
        let n = stream.read(&mut buf[filled..]).await?;
        if n == 0 {
            return Ok(if filled == 0 { Head::Closed } else { Head::Truncated });
        }
        // The blank line may straddle two reads.
        let from = filled.saturating_sub(3);
        filled += n;
        if let Some(end) = head_end(&buf[from..filled]) {
            return Ok(Head::Complete(from + end));
        }
    }
}
