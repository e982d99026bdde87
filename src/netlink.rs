//! The netlink wire format, shared by every conversation the agent has with the kernel: the
//! nftables backend ([`crate::dataplane::nftables`]), the socket watch ([`crate::sockdiag`]) and
//! the copies of the link-local IPs ([`crate::addresses`]).
//!
//! A buffer received from a netlink socket holds messages, each a 16-byte `nlmsghdr` (length,
//! type, flags, sequence number, sender's port id) and a payload, padded to 4 bytes. A multipart
//! answer (a dump) spans any number of buffers and ends with an [`NLMSG_DONE`] message; a refusal
//! is an [`NLMSG_ERROR`] message, which with code 0 is an acknowledgement. Payloads carry
//! attributes, each a 4-byte `nlattr` (length, type) and a value padded likewise; the value of a
//! nested attribute is attributes again. Headers are host-endian (`linux/netlink.h`).
//!
//! This module walks messages and attributes, every read bounds-checked: whatever the kernel, or
//! a process that can send to the socket, puts in a buffer becomes a value or a [`ParseError`],
//! never a panic. It also writes them, for requests. What a payload means is the business of the
//! protocol's own module. [`socket`] opens netlink sockets and hands them to tokio.

#[allow(unsafe_code)]
pub mod socket;

/// `NLMSG_ERROR`: an error message, or an acknowledgement when its code is 0.
pub const NLMSG_ERROR: u16 = 2;
/// `NLMSG_DONE`: the end of a multipart answer (a dump).
pub const NLMSG_DONE: u16 = 3;
/// `NLM_F_REQUEST`: the message is a request.
pub const NLM_F_REQUEST: u16 = 0x1;
/// `NLM_F_ACK`: answer with an acknowledgement (an [`NLMSG_ERROR`] with code 0) on success.
pub const NLM_F_ACK: u16 = 0x4;
/// `NLM_F_DUMP_INTR`: the kernel's objects changed while this dump was being built: it may be
/// inconsistent.
pub const NLM_F_DUMP_INTR: u16 = 0x10;
/// `NLM_F_DUMP` (`NLM_F_ROOT | NLM_F_MATCH`): list every object.
pub const NLM_F_DUMP: u16 = 0x300;
/// `NLM_F_EXCL` (on a new object): refuse with `EEXIST` if it exists already.
pub const NLM_F_EXCL: u16 = 0x200;
/// `NLM_F_CREATE` (on a new object): create it if it does not exist.
pub const NLM_F_CREATE: u16 = 0x400;
/// `sizeof(struct nlmsghdr)`.
pub const NLMSG_HDRLEN: usize = 16;
/// `sizeof(struct nlattr)`.
const NLA_HDRLEN: usize = 4;
/// `NLA_TYPE_MASK`: an attribute's type without the `NLA_F_NESTED` and `NLA_F_NET_BYTEORDER`
/// flags.
const NLA_TYPE_MASK: u16 = 0x3fff;

/// Why a message or an attribute could not be read.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ParseError {
    /// Fewer bytes than a header or a length field says.
    #[error("{what} truncated: {have} bytes, need {need}")]
    Truncated {
        /// The header or value being read.
        what: &'static str,
        /// Bytes available.
        have: usize,
        /// Bytes needed.
        need: usize,
    },
    /// A fixed-size value of the wrong size.
    #[error("{what} has {have} bytes, want {want}")]
    Size {
        /// The value being read.
        what: &'static str,
        /// Its size.
        have: usize,
        /// The size it must have.
        want: usize,
    },
    /// A mandatory attribute is absent.
    #[error("{0} is missing")]
    Missing(&'static str),
}

/// The result of reading from a buffer.
pub type Result<T> = std::result::Result<T, ParseError>;

/// `NLMSG_ALIGN` and `NLA_ALIGN`: both pad to 4 bytes.
pub fn align(len: usize) -> usize {
    len.saturating_add(3) & !3
}

/// The host-endian `u16` at `at`, if the buffer holds it.
pub fn ne_u16(bytes: &[u8], at: usize) -> Option<u16> {
    Some(u16::from_ne_bytes(bytes.get(at..at.checked_add(2)?)?.try_into().ok()?))
}

/// The host-endian `u32` at `at`, if the buffer holds it.
pub fn ne_u32(bytes: &[u8], at: usize) -> Option<u32> {
    Some(u32::from_ne_bytes(bytes.get(at..at.checked_add(4)?)?.try_into().ok()?))
}

/// One netlink message.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Message<'a> {
    /// `nlmsg_type`: `NLMSG_*`, or the protocol's own type.
    pub kind: u16,
    /// `NLM_F_*`.
    pub flags: u16,
    /// The sequence number of the request this answers.
    pub seq: u32,
    /// The sender's port id: 0 for the kernel, the requester's on the kernel's replies to it,
    /// the port of the socket that made a change on nf_tables' change announcements.
    pub portid: u32,
    /// Everything after the header, without padding.
    pub payload: &'a [u8],
}

impl Message<'_> {
    /// The errno of an [`NLMSG_ERROR`] message, positive; 0 for an acknowledgement.
    pub fn error_code(&self) -> Result<i32> {
        let code = ne_u32(self.payload, 0).ok_or(ParseError::Truncated {
            what: "netlink error message",
            have: self.payload.len(),
            need: 4,
        })?;
        Ok((code as i32).saturating_neg())
    }

    /// The message as it goes on the wire: header, payload, padding. Payloads are the few
    /// hundred bytes of a request.
    pub fn encode(&self) -> Vec<u8> {
        let len = NLMSG_HDRLEN + self.payload.len();
        let mut out = Vec::with_capacity(align(len));
        out.extend_from_slice(&(len as u32).to_ne_bytes());
        out.extend_from_slice(&self.kind.to_ne_bytes());
        out.extend_from_slice(&self.flags.to_ne_bytes());
        out.extend_from_slice(&self.seq.to_ne_bytes());
        out.extend_from_slice(&self.portid.to_ne_bytes());
        out.extend_from_slice(self.payload);
        out.resize(align(len), 0);
        out
    }
}

/// The messages in a buffer received from a netlink socket, in order. A header shorter than a
/// header or whose length runs past the buffer is an error, and the last item.
pub fn messages(buf: &[u8]) -> impl Iterator<Item = Result<Message<'_>>> {
    let mut rest = buf;
    std::iter::from_fn(move || {
        if rest.is_empty() {
            return None;
        }
        let parsed = parse_message(rest);
        rest = match &parsed {
            Ok((_, next)) => next,
            Err(_) => &[],
        };
        Some(parsed.map(|(message, _)| message))
    })
}

/// The first message in `buf`, and what follows it.
fn parse_message(buf: &[u8]) -> Result<(Message<'_>, &[u8])> {
    let truncated = |need| ParseError::Truncated { what: "netlink message", have: buf.len(), need };
    let len = ne_u32(buf, 0).ok_or(truncated(NLMSG_HDRLEN))? as usize;
    if len < NLMSG_HDRLEN || len > buf.len() {
        return Err(truncated(len.max(NLMSG_HDRLEN)));
    }
    let field16 = |at| ne_u16(buf, at).unwrap_or_default();
    let field32 = |at| ne_u32(buf, at).unwrap_or_default();
    let message = Message {
        kind: field16(4),
        flags: field16(6),
        seq: field32(8),
        portid: field32(12),
        payload: &buf[NLMSG_HDRLEN..len],
    };
    let next = buf.get(align(len)..).unwrap_or_default();
    Ok((message, next))
}

/// One netlink attribute.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Attr<'a> {
    /// The attribute type, without the nested and byte-order flags.
    pub kind: u16,
    /// The value, without padding.
    pub value: &'a [u8],
}

/// The attributes in `buf`, in order. One whose length is shorter than its header or runs past
/// the buffer is an error, and the last item.
pub fn attributes(buf: &[u8]) -> impl Iterator<Item = Result<Attr<'_>>> {
    let mut rest = buf;
    std::iter::from_fn(move || {
        if rest.is_empty() {
            return None;
        }
        let truncated =
            |need| ParseError::Truncated { what: "netlink attribute", have: rest.len(), need };
        let parsed = match ne_u16(rest, 0).map(usize::from) {
            None => Err(truncated(NLA_HDRLEN)),
            Some(len) if len < NLA_HDRLEN || len > rest.len() => {
                Err(truncated(len.max(NLA_HDRLEN)))
            }
            Some(len) => Ok(Attr {
                kind: ne_u16(rest, 2).unwrap_or_default() & NLA_TYPE_MASK,
                value: &rest[NLA_HDRLEN..len],
            }),
        };
        rest = match &parsed {
            Ok(attr) => rest.get(align(NLA_HDRLEN + attr.value.len())..).unwrap_or_default(),
            Err(_) => &[],
        };
        Some(parsed)
    })
}

/// The attributes in `buf` indexed by type; types `N` and above are ignored, a repeated one
/// keeps its last value.
pub fn attribute_table<const N: usize>(buf: &[u8]) -> Result<[Option<&[u8]>; N]> {
    let mut found = [None; N];
    for attr in attributes(buf) {
        let attr = attr?;
        if let Some(slot) = found.get_mut(usize::from(attr.kind)) {
            *slot = Some(attr.value);
        }
    }
    Ok(found)
}

/// Appends attribute `kind` (flags included) with `value`, padded.
pub fn put_attr(out: &mut Vec<u8>, kind: u16, value: &[u8]) {
    let len = NLA_HDRLEN + value.len();
    out.extend_from_slice(&(len as u16).to_ne_bytes());
    out.extend_from_slice(&kind.to_ne_bytes());
    out.extend_from_slice(value);
    out.resize(align(out.len()), 0);
}

/// One attribute, encoded as the kernel encodes it: for tests that build what it sends.
#[cfg(test)]
pub fn attr(kind: u16, value: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    put_attr(&mut out, kind, value);
    out
}

/// The value of a mandatory attribute.
pub fn required<'a>(value: Option<&'a [u8]>, what: &'static str) -> Result<&'a [u8]> {
    value.ok_or(ParseError::Missing(what))
}

/// A big-endian (network byte order) `u32` value.
pub fn be_u32(value: &[u8], what: &'static str) -> Result<u32> {
    let bytes: [u8; 4] =
        value.try_into().map_err(|_| ParseError::Size { what, have: value.len(), want: 4 })?;
    Ok(u32::from_be_bytes(bytes))
}

/// A big-endian (network byte order) `u64` value.
pub fn be_u64(value: &[u8], what: &'static str) -> Result<u64> {
    let bytes: [u8; 8] =
        value.try_into().map_err(|_| ParseError::Size { what, have: value.len(), want: 8 })?;
    Ok(u64::from_be_bytes(bytes))
}

/// A NUL-terminated string value (lossy: names are compared, never trusted).
pub fn string(value: &[u8]) -> String {
    let end = value.iter().position(|&b| b == 0).unwrap_or(value.len());
    String::from_utf8_lossy(&value[..end]).into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn messages_round_trip_with_padding() {
        let first =
            Message { kind: 20, flags: NLM_F_REQUEST, seq: 7, portid: 0, payload: b"abcde" };
        let second = Message { kind: NLMSG_DONE, flags: 0, seq: 7, portid: 99, payload: &[] };
        let buf = [first.encode(), second.encode()].concat();
        assert_eq!(buf.len(), 24 + 16, "the first message is padded to 24 bytes");
        assert_eq!(ne_u32(&buf, 0), Some(21), "the length leaves the padding out");
        let read: Vec<_> = messages(&buf).collect::<Result<_>>().unwrap();
        assert_eq!(read, [first, second]);
    }

    #[test]
    fn a_bad_message_header_is_the_last_item() {
        let good = Message { kind: 20, flags: 0, seq: 1, portid: 0, payload: &[1, 2, 3, 4] };
        for len in [0u32, 1, 15, 100, u32::MAX] {
            let mut bad = good.encode();
            bad[..4].copy_from_slice(&len.to_ne_bytes());
            let buf = [bad, good.encode()].concat();
            let items: Vec<_> = messages(&buf).collect();
            assert_eq!(items.len(), 1, "length {len}");
            assert!(matches!(items[0], Err(ParseError::Truncated { .. })), "length {len}");
        }
        // Fewer bytes than a header: an error, not silence.
        assert!(messages(&good.encode()[..10]).next().unwrap().is_err());
        assert_eq!(messages(&[]).count(), 0);
    }

    #[test]
    fn error_messages_and_acks() {
        let mut refusal = (-2i32).to_ne_bytes().to_vec();
        refusal.extend_from_slice(&[0; 16]);
        let buf = [
            Message { kind: NLMSG_ERROR, flags: 0, seq: 5, portid: 0, payload: &refusal }.encode(),
            Message { kind: NLMSG_ERROR, flags: 0, seq: 6, portid: 0, payload: &[0; 20] }.encode(),
        ]
        .concat();
        let codes: Vec<i32> = messages(&buf).map(|m| m.unwrap().error_code().unwrap()).collect();
        assert_eq!(codes, [2, 0]);
        let short = Message { kind: NLMSG_ERROR, flags: 0, seq: 1, portid: 0, payload: &[1, 2] };
        assert!(short.error_code().is_err());
    }

    #[test]
    fn nested_attributes_are_walked_like_any_other() {
        let inner = [attr(1, &3u32.to_be_bytes()), attr(2, b"x\0")].concat();
        let buf = [attr(7, b"name\0"), attr(4 | 0x8000, &inner)].concat();
        let outer: Vec<_> = attributes(&buf).collect::<Result<_>>().unwrap();
        assert_eq!(outer.len(), 2);
        assert_eq!(outer[1].kind, 4, "the nested flag is masked");
        let table = attribute_table::<3>(outer[1].value).unwrap();
        assert_eq!(be_u32(required(table[1], "one").unwrap(), "one"), Ok(3));
        assert_eq!(string(table[2].unwrap()), "x");
        assert_eq!(required(table[0], "zero"), Err(ParseError::Missing("zero")));
        assert!(be_u64(table[2].unwrap(), "two").is_err());
        // Types beyond the table are ignored, not an error.
        assert_eq!(attribute_table::<2>(&buf).unwrap(), [None, None]);
    }

    #[test]
    fn zero_length_attribute_header_ends_parsing() {
        // nla_len 0 would loop forever if taken at face value.
        let buf = [0u8, 0, 1, 0, 0, 0, 0, 0];
        assert!(attributes(&buf).next().unwrap().is_err());
        assert_eq!(attributes(&buf).count(), 1);
        // A length past the end, and a header cut short.
        assert!(attributes(&[200, 0, 1, 0, 0]).next().unwrap().is_err());
        assert!(attributes(&[8, 0]).next().unwrap().is_err());
    }
}
