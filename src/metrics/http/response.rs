//! The response, as bytes: a status line, the few headers every answer carries (its length, no
//! caching, and `Connection: close`, since one request is served per connection), and the body.

/// The content type of every answer but `/metrics`.
pub(super) const PLAIN: &str = "text/plain; charset=utf-8";

/// The statuses the server answers with.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Status {
    Ok,
    BadRequest,
    NotFound,
    MethodNotAllowed,
    ServiceUnavailable,
}

impl Status {
    fn line(self) -> &'static str {
        match self {
            Status::Ok => "200 OK",
            Status::BadRequest => "400 Bad Request",
            Status::NotFound => "404 Not Found",
            Status::MethodNotAllowed => "405 Method Not Allowed",
            Status::ServiceUnavailable => "503 Service Unavailable",
        }
    }
}

/// A whole response, ready to write.
#[derive(Debug)]
pub(super) struct Response {
    pub(super) bytes: Vec<u8>,
    /// Where the body starts in `bytes`.
    body_at: usize,
}

impl Response {
    pub(super) fn new(status: Status, content_type: &str, body: String) -> Response {
        let allow = if status == Status::MethodNotAllowed { "Allow: GET, HEAD\r\n" } else { "" };
        let head = format!(
            "HTTP/1.1 {}\r\nContent-Type: {content_type}\r\nContent-Length: {}\r\n{allow}\
             Cache-Control: no-store\r\nConnection: close\r\n\r\n",
            status.line(),
            body.len(),
        );
        let body_at = head.len();
        let mut bytes = head.into_bytes();
        bytes.extend_from_slice(body.as_bytes());
        Response { bytes, body_at }
    }

    pub(super) fn bad_request(why: &str) -> Response {
        Response::new(Status::BadRequest, PLAIN, format!("bad request: {why}\n"))
    }

    /// The same head (its Content-Length included), no body: the answer to HEAD.
    pub(super) fn without_body(mut self) -> Response {
        self.bytes.truncate(self.body_at);
        self
    }
}
