//! Whether the node carries DNS traffic, so that an idle node's watch can look less often.
//!
//! Looking every 20 ms is 50 wake-ups a second, the larger part of an idle agent's CPU. Yet on a
//! node with no traffic there is nothing to see: a hang then leaves no queue behind, and the
//! probes find it within their own bound. The node's UDP counter of datagrams sent
//! (`OutDatagrams` in `/proc/net/snmp`, `Udp6OutDatagrams` in `/proc/net/snmp6`: the agent
//! shares the node's network namespace with the cache) rises with every answer the cache sends.
//! [`Traffic`] compares its rise with what the agent's own probes account for: more means
//! traffic, and the watch looks every `--stall-look` until it has seen none for [`HOLD`];
//! otherwise it looks every [`QUIET_LOOK`]. A hang that begins on a quiet node is then seen
//! at most [`QUIET_LOOK`] later, by the queue it leaves; one that begins under traffic, at
//! the usual pace.
//!
//! The counter is the whole namespace's: any other UDP sender only keeps the watch at the
//! faster pace, the safe side. An unreadable counter counts as traffic. Its files are opened
//! once and read again from their start at each reading ([`DatagramsSent`]): opening a procfs
//! file cost more than reading it, a tenth of an idle agent's CPU.

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::time::{Duration, Instant};

/// How often the queues are looked at, and the counter read, on a node without traffic.
pub const QUIET_LOOK: Duration = Duration::from_millis(100);

/// How long the watch keeps its faster pace after the last sign of traffic.
pub const HOLD: Duration = Duration::from_secs(1);

/// Datagrams a reading may show beyond the agent's own before they count as traffic: a probe
/// and its answer may fall on either side of a reading.
const SLACK: f64 = 4.0;

/// The traffic seen in the node's UDP counter; pure, fed the readings.
#[derive(Debug)]
pub struct Traffic {
    /// Datagrams per second the agent's own probes make the node send (probe and answer).
    own_per_sec: f64,
    /// The last reading, and when it was taken.
    last: Option<(Instant, u64)>,
    /// Until when the watch keeps its faster pace.
    until: Instant,
}

impl Traffic {
    /// Starts at the faster pace: nothing is known yet.
    pub fn new(own_per_sec: f64, now: Instant) -> Traffic {
        Traffic { own_per_sec, last: None, until: now + HOLD }
    }

    /// The agent's own rate changed (the probes' pace, [`crate::pace`]): readings are judged by
    /// the new one from a fresh first reading, none straddling the change.
    pub fn set_own_per_sec(&mut self, own_per_sec: f64) {
        if own_per_sec != self.own_per_sec {
            self.own_per_sec = own_per_sec;
            self.last = None;
        }
    }

    /// Takes a reading of the counter (`None`: it could not be read).
    pub fn read(&mut self, now: Instant, sent: Option<u64>) {
        let Some(sent) = sent else {
            self.until = now + HOLD;
            self.last = None;
            return;
        };
        if let Some((then, before)) = self.last {
            let own = self.own_per_sec * now.saturating_duration_since(then).as_secs_f64();
            // A counter that went back (it cannot, short of a new namespace) counts as traffic.
            let more = sent.checked_sub(before).map_or(f64::INFINITY, |d| d as f64);
            if more > own + SLACK {
                self.until = now + HOLD;
            }
        }
        self.last = Some((now, sent));
    }

    /// Whether the node has carried traffic within [`HOLD`].
    pub fn seen(&self, now: Instant) -> bool {
        now < self.until
    }
}

/// The node's counters of UDP datagrams sent, IPv4 and (for a watch of IPv6 addresses) IPv6:
/// their files open, read again from the start at each reading (a seq_file generates its text
/// afresh for a read at offset 0).
#[derive(Debug)]
pub struct DatagramsSent {
    snmp: Option<File>,
    /// `None` when IPv6 is not watched; `Some(None)` when it is and cannot be read.
    snmp6: Option<Option<File>>,
    buffer: Vec<u8>,
}

impl DatagramsSent {
    /// Opens the files (of the caller's network namespace); one that cannot be opened makes
    /// every reading `None`.
    pub fn open(v6: bool) -> DatagramsSent {
        DatagramsSent {
            snmp: File::open("/proc/net/snmp").ok(),
            snmp6: v6.then(|| File::open("/proc/net/snmp6").ok()),
            buffer: vec![0; 16 * 1024],
        }
    }

    /// The datagrams sent so far; `None` if unreadable.
    pub fn read(&mut self) -> Option<u64> {
        let v4 = out_datagrams(read_whole(self.snmp.as_ref()?, &mut self.buffer)?)?;
        match &self.snmp6 {
            None => Some(v4),
            Some(snmp6) => {
                Some(v4 + out_datagrams6(read_whole(snmp6.as_ref()?, &mut self.buffer)?)?)
            }
        }
    }
}

/// The whole text of `file`, read from its start into `buffer` (grown until it holds it).
fn read_whole<'a>(file: &File, buffer: &'a mut Vec<u8>) -> Option<&'a str> {
    loop {
        let len = file.read_at(buffer, 0).ok()?;
        if len < buffer.len() {
            return std::str::from_utf8(&buffer[..len]).ok();
        }
        buffer.resize(buffer.len() * 2, 0);
    }
}

/// `OutDatagrams` of the `Udp:` lines of `/proc/net/snmp` (a header line, then the values).
pub fn out_datagrams(snmp: &str) -> Option<u64> {
    let mut udp = snmp.lines().filter(|l| l.starts_with("Udp: "));
    let names = udp.next()?.split_whitespace();
    let values = udp.next()?.split_whitespace();
    let (_, value) = names.zip(values).find(|(name, _)| *name == "OutDatagrams")?;
    value.parse().ok()
}

/// `Udp6OutDatagrams` of `/proc/net/snmp6` (a name and a value per line).
pub fn out_datagrams6(snmp6: &str) -> Option<u64> {
    snmp6.lines().find_map(|l| {
        let mut fields = l.split_whitespace();
        (fields.next()? == "Udp6OutDatagrams").then(|| fields.next()?.parse().ok())?
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const SNMP: &str = "\
Ip: Forwarding DefaultTTL InReceives
Ip: 1 64 1000
Udp: InDatagrams NoPorts InErrors OutDatagrams RcvbufErrors SndbufErrors InCsumErrors IgnoredMulti MemErrors
Udp: 2275 259 0 2709 0 0 0 0 0
UdpLite: InDatagrams NoPorts InErrors OutDatagrams RcvbufErrors SndbufErrors InCsumErrors IgnoredMulti MemErrors
UdpLite: 0 0 0 77 0 0 0 0 0
";

    const SNMP6: &str = "\
Udp6InDatagrams                 \t15
Udp6NoPorts                     \t0
Udp6OutDatagrams                \t31
UdpLite6OutDatagrams            \t99
";

    #[test]
    fn the_counters_are_read_by_name_not_place() {
        assert_eq!(out_datagrams(SNMP), Some(2709));
        assert_eq!(out_datagrams6(SNMP6), Some(31));
        assert_eq!(out_datagrams("Udp: InDatagrams\nUdp: 5\n"), None);
        assert_eq!(out_datagrams6("Udp6InDatagrams 1\n"), None);
        assert_eq!(out_datagrams(""), None);
    }

    /// This machine's own files parse, and a reading of the open files is a new one: a UDP
    /// datagram sent on loopback between two readings is counted (nothing leaves loopback).
    #[test]
    fn the_kernels_files_parse_and_are_read_afresh() {
        let mut v4 = DatagramsSent::open(false);
        let before = v4.read().expect("/proc/net/snmp has no Udp OutDatagrams");
        let socket = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
        socket.send_to(b"x", socket.local_addr().unwrap()).unwrap();
        assert!(v4.read().unwrap() > before, "the second reading is not a new one");
        if std::path::Path::new("/proc/net/snmp6").exists() {
            let mut both = DatagramsSent::open(true);
            assert!(both.read().is_some(), "/proc/net/snmp6 has no Udp6OutDatagrams");
        }
        let mut tiny = DatagramsSent { buffer: vec![0; 8], ..DatagramsSent::open(false) };
        assert!(tiny.read().is_some(), "the buffer grows to hold the file");
    }

    #[test]
    fn the_agents_own_datagrams_are_not_traffic_and_others_are() {
        let ms = Duration::from_millis;
        let t0 = Instant::now();
        // A probe and its answer every 100 ms, an upstream probe a second: 21 a second.
        let mut traffic = Traffic::new(21.0, t0);
        assert!(traffic.seen(t0), "nothing known yet: the faster pace");
        let mut sent = 1000;
        let mut at = t0;
        for _ in 0..20 {
            at += ms(100);
            sent += 2;
            traffic.read(at, Some(sent));
        }
        assert!(!traffic.seen(at), "only the agent's own: quiet");
        // A few more than the agent's own (a probe falling either side of a reading): quiet.
        at += ms(100);
        sent += 6;
        traffic.read(at, Some(sent));
        assert!(!traffic.seen(at));
        // Pods' queries answered, 100 a second.
        at += ms(100);
        sent += 2 + 10;
        traffic.read(at, Some(sent));
        assert!(traffic.seen(at));
        // Held for HOLD after the last sign of it.
        at += HOLD - ms(1);
        sent += 2;
        traffic.read(at, Some(sent));
        assert!(traffic.seen(at));
        at += ms(1);
        assert!(!traffic.seen(at));
    }

    /// At the quiet pace the agent's own probes are fewer: the same few pods' queries that
    /// hid behind the fast pace's own count are traffic then.
    #[test]
    fn the_own_rate_follows_the_pace() {
        let ms = Duration::from_millis;
        let t0 = Instant::now();
        let mut traffic = Traffic::new(21.0, t0);
        let (mut at, mut sent) = (t0 + HOLD, 1000);
        traffic.read(at, Some(sent));
        traffic.set_own_per_sec(3.0);
        // Straddling the change: no judgement.
        at += ms(1000);
        sent += 21;
        traffic.read(at, Some(sent));
        assert!(!traffic.seen(at));
        // Quiet: 3 of the agent's own a second, and 15 more.
        at += ms(1000);
        sent += 3 + 15;
        traffic.read(at, Some(sent));
        assert!(traffic.seen(at), "more than the quiet pace's own: traffic");
    }

    #[test]
    fn an_unreadable_counter_counts_as_traffic() {
        let t0 = Instant::now();
        let mut traffic = Traffic::new(21.0, t0);
        let later = t0 + 2 * HOLD;
        traffic.read(later, Some(5));
        assert!(!traffic.seen(later));
        traffic.read(later, None);
        assert!(traffic.seen(later));
        // The next reading is a first one again: no rise can be told from it.
        let after = later + HOLD;
        traffic.read(after, Some(1_000_000));
        assert!(!traffic.seen(after));
    }
}
