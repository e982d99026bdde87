//! The request, from bytes: where the head ends, the two things the endpoints look at in its
//! request line (the method and the path), and whether an `Accept` header asks for OpenMetrics.
//! No other header is read.

/// Where the head ends (after its blank line: CRLF CRLF, or a lenient LF LF), if it does.
pub(super) fn head_end(bytes: &[u8]) -> Option<usize> {
    (0..bytes.len()).find_map(|i| {
        let rest = &bytes[i..];
        if rest.starts_with(b"\r\n\r\n") {
            Some(i + 4)
        } else if rest.starts_with(b"\n\n") {
            Some(i + 2)
        } else {
            None
        }
    })
}

/// The parts of a request the endpoints look at.
#[derive(Debug, PartialEq, Eq)]
pub(super) struct Request<'a> {
    pub(super) method: &'a str,
    /// The target less its query.
    pub(super) path: &'a str,
    /// An `Accept` header names OpenMetrics (as Prometheus's scrapes do).
    pub(super) openmetrics: bool,
}

/// Parses the request line and looks for an `Accept` header naming OpenMetrics; no other
/// header is needed. The error says what is wrong.
pub(super) fn parse(head: &[u8]) -> Result<Request<'_>, &'static str> {
    let line_end = head.iter().position(|&b| b == b'\n').unwrap_or(head.len());
    let line =
        std::str::from_utf8(&head[..line_end]).map_err(|_| "the request line is not UTF-8")?;
    let line = line.strip_suffix('\r').unwrap_or(line);
    let mut parts = line.split(' ');
    let (Some(method), Some(target), Some(version), None) =
        (parts.next(), parts.next(), parts.next(), parts.next())
    else {
        return Err("the request line is not METHOD /PATH HTTP/1.1");
    };
    if method.is_empty() || !method.bytes().all(is_token) {
        return Err("the method is not a token");
    }
    if !target.starts_with('/') {
        return Err("the target is not an absolute path");
    }
    if !matches!(version, "HTTP/1.0" | "HTTP/1.1") {
        return Err("the version is not HTTP/1.0 or HTTP/1.1");
    }
    let path = target.split_once('?').map_or(target, |(path, _query)| path);
    let openmetrics = head[line_end..].split(|&b| b == b'\n').any(|header| {
        let header = String::from_utf8_lossy(header).to_ascii_lowercase();
        header.strip_prefix("accept:").is_some_and(|v| v.contains("application/openmetrics-text"))
    });
    Ok(Request { method, path, openmetrics })
}

/// RFC 9110's `tchar`.
fn is_token(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_head_ends_at_the_first_blank_line() {
        assert_eq!(head_end(b"GET / HTTP/1.1\r\nA: b\r\n\r\nbody"), Some(24));
        assert_eq!(head_end(b"GET / HTTP/1.1\n\n"), Some(16));
        assert_eq!(head_end(b"GET / HTTP/1.1\r\nA: b\r\n"), None);
    }

    #[test]
    fn the_request_line_is_parsed() {
        let req = parse(b"GET /metrics?a=b HTTP/1.1\r\nHost: x\r\n\r\n").unwrap();
        assert_eq!(req, Request { method: "GET", path: "/metrics", openmetrics: false });
        let prometheus = b"GET /metrics HTTP/1.1\r\nACCEPT: application/openmetrics-text;\
                           version=1.0.0,text/plain;version=0.0.4;q=0.5\r\n\r\n";
        assert!(parse(prometheus).unwrap().openmetrics);
        assert_eq!(parse(b"\r\n\r\n"), Err("the request line is not METHOD /PATH HTTP/1.1"));
    }
}
