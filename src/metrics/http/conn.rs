//! One connection's I/O: read the request head within the size and time limits (or give way
//! when evicted to make room), write one answer, then linger so that closing does not reset the
//! connection under that answer.

use std::io;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::time::timeout;

use super::request::{head_end, parse};
use super::response::Response;
use super::route::answer;
use super::{Limits, State};
use crate::waiting::Reading;

/// Serves one connection: one request, one answer, then close.
pub(super) async fn handle(
    mut stream: TcpStream,
    state: &State,
    limits: Limits,
    reading: Reading,
) -> io::Result<()> {
    let mut buf = vec![0; limits.max_head];
    let head = tokio::select! {
        head = timeout(limits.head_timeout, read_head(&mut stream, &mut buf)) => head,
        // Closed to make room: it had said nothing useful yet.
        () = reading.evicted() => return Ok(()),
    };
    drop(reading);
    let response = match head {
        // Too slow, or silent: not worth an answer.
        Err(_elapsed) => return Ok(()),
        Ok(head) => match head? {
            Head::Closed => return Ok(()),
            Head::Complete(len) => answer(parse(&buf[..len]), state, (state.clock)()),
            Head::Truncated => Response::bad_request("the connection closed mid-request"),
            Head::TooLarge => Response::bad_request("the request head is larger than 8 KiB"),
        },
    };
    let write = async {
        stream.write_all(&response.bytes).await?;
        stream.shutdown().await
    };
    timeout(limits.write_timeout, write).await.map_err(|_| io::ErrorKind::TimedOut)??;
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
