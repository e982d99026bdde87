//! The command line: what to look up, where, how fast, and how to label the answers.

use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;
use std::time::Duration;

use clap::Parser;
use hickory_proto::rr::{Name, RecordType};
use nodelocaldns_ha::config;

/// A glibc-like DNS load client that counts answers by origin.
#[derive(Parser, Debug)]
#[command(name = "dnsload", version)]
pub struct Args {
    /// DNS server: IP or IP:port ([IPv6]:port); port 53 by default
    #[arg(long, value_parser = parse_server, required_unless_present = "system_resolver")]
    pub server: Option<SocketAddr>,

    /// Look names up with the C library's getaddrinfo() (A: AF_INET, AAAA: AF_INET6), which
    /// follows /etc/resolv.conf, instead of sending queries to --server
    #[arg(long, conflicts_with_all = ["server", "tcp"])]
    pub system_resolver: bool,

    /// With --system-resolver: ask for both families (AF_UNSPEC: an A and an AAAA query per
    /// lookup, as an application that does not pick one), whatever --qtype says
    #[arg(long, requires = "system_resolver")]
    pub both_families: bool,

    /// Write one line per lookup to PATH: start (ms since the run's start), latency (ms),
    /// origin label or "failed", failed attempts
    #[arg(long, value_name = "PATH")]
    pub lookups_out: Option<PathBuf>,

    /// Name to look up
    #[arg(long, default_value = "who.test", value_parser = parse_name)]
    pub name: Name,

    /// Query type: A or AAAA
    #[arg(long, default_value = "A", value_parser = parse_qtype)]
    pub qtype: RecordType,

    /// Lookups started per second
    #[arg(long, default_value_t = 500, value_parser = clap::value_parser!(u32).range(1..=100_000))]
    pub rate: u32,

    /// How long to keep starting lookups (e.g. 500ms, 10s, 2m)
    #[arg(long, default_value = "10s", value_parser = parse_duration)]
    pub duration: Duration,

    /// Timeout of one attempt
    #[arg(long, default_value = "1s", value_parser = parse_positive_duration)]
    pub timeout: Duration,

    /// Attempts per lookup (glibc's `options attempts:N`)
    #[arg(long, default_value_t = 2, value_parser = clap::value_parser!(u32).range(1..=10))]
    pub attempts: u32,

    /// Label answers by address, ADDR=LABEL (repeatable); other addresses count as "other"
    #[arg(
        long = "origin",
        value_name = "ADDR=LABEL",
        value_parser = parse_origin,
        default_values = ["1.1.1.1=cache", "fd00::1:1:1:1=cache", "2.2.2.2=coredns", "fd00::2:2:2:2=coredns"]
    )]
    pub origins: Vec<Origin>,

    /// Print a timeline line per interval (0 = no timeline)
    #[arg(long, default_value = "500ms", value_parser = parse_duration)]
    pub report_interval: Duration,

    /// JSON file with a top-level string field "route", shown in each timeline line
    #[arg(long, value_name = "PATH")]
    pub route_file: Option<PathBuf>,

    /// Use TCP (a new connection per attempt) instead of UDP
    #[arg(long)]
    pub tcp: bool,

    /// Lookups in flight at most: a lookup due while this many are is not started, and counted
    /// as `skipped` [default: rate × the longest a lookup can take, + 100]
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u32).range(1..))]
    pub max_in_flight: Option<u32>,
}

/// `--origin ADDR=LABEL`: answers with this address are counted under this label.
#[derive(Clone, Debug)]
pub struct Origin {
    /// The address in the answer.
    pub addr: IpAddr,
    /// Who gives it (`cache`, `coredns`); "other" is what no origin names.
    pub label: String,
}

pub(crate) fn parse_server(s: &str) -> Result<SocketAddr, String> {
    s.parse::<SocketAddr>()
        .or_else(|_| s.parse::<IpAddr>().map(|ip| SocketAddr::new(ip, 53)))
        .map_err(|_| format!("expected IP, IP:port or [IPv6]:port, got {s:?}"))
}

pub(crate) fn parse_name(s: &str) -> Result<Name, String> {
    let mut name = Name::from_ascii(s).map_err(|e| format!("bad name {s:?}: {e}"))?;
    name.set_fqdn(true);
    Ok(name)
}

pub(crate) fn parse_qtype(s: &str) -> Result<RecordType, String> {
    match s.to_ascii_uppercase().as_str() {
        "A" => Ok(RecordType::A),
        "AAAA" => Ok(RecordType::AAAA),
        _ => Err(format!("expected A or AAAA, got {s:?}")),
    }
}

/// Parses `0` (for `--report-interval`: no timeline), or a duration as the agent's flags take
/// it: `500ms`, `1.5s`, `2m`, `1m30s`.
pub(crate) fn parse_duration(s: &str) -> Result<Duration, String> {
    if s == "0" {
        return Ok(Duration::ZERO);
    }
    config::parse_duration(s)
        .ok_or_else(|| format!("expected a duration like 500ms, 10s or 2m, got {s:?}"))
}

pub(crate) fn parse_positive_duration(s: &str) -> Result<Duration, String> {
    match parse_duration(s)? {
        d if d.is_zero() => Err("must be greater than 0".to_string()),
        d => Ok(d),
    }
}

pub(crate) fn parse_origin(s: &str) -> Result<Origin, String> {
    let (addr, label) =
        s.split_once('=').ok_or_else(|| format!("expected ADDR=LABEL, got {s:?}"))?;
    let addr = addr.parse().map_err(|_| format!("bad address {addr:?} in {s:?}"))?;
    if label.is_empty() || label == "other" {
        return Err(format!("bad label {label:?} in {s:?} (\"other\" is reserved)"));
    }
    Ok(Origin { addr, label: label.to_string() })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::counts::Origins;

    #[test]
    fn durations() {
        assert_eq!(parse_duration("500ms"), Ok(Duration::from_millis(500)));
        assert_eq!(parse_duration("10s"), Ok(Duration::from_secs(10)));
        assert_eq!(parse_duration("1.5s"), Ok(Duration::from_millis(1500)));
        assert_eq!(parse_duration("2m"), Ok(Duration::from_secs(120)));
        assert_eq!(parse_duration("0"), Ok(Duration::ZERO));
        for bad in ["", "10", "s", "-1s", "10x", "1e400s"] {
            assert!(parse_duration(bad).is_err(), "{bad:?}");
        }
        assert!(parse_positive_duration("0ms").is_err());
    }

    #[test]
    fn servers_and_origins() {
        assert_eq!(parse_server("10.96.0.10"), Ok("10.96.0.10:53".parse().unwrap()));
        assert_eq!(parse_server("[fd00::10]:5353"), Ok("[fd00::10]:5353".parse().unwrap()));
        assert_eq!(parse_server("fd00::10"), Ok("[fd00::10]:53".parse().unwrap()));
        assert!(parse_server("nope").is_err());
        let o = Origins::new(&[
            parse_origin("1.1.1.1=cache").unwrap(),
            parse_origin("fd00::1=cache").unwrap(),
            parse_origin("2.2.2.2=coredns").unwrap(),
        ]);
        assert_eq!(o.labels, ["cache", "coredns", "other"]);
        assert_eq!(o.index("fd00::1".parse().unwrap()), 0);
        assert_eq!(o.index("9.9.9.9".parse().unwrap()), 2);
        assert!(parse_origin("1.1.1.1=other").is_err());
    }

    #[test]
    fn system_resolver_and_server_are_exclusive() {
        assert!(Args::try_parse_from(["dnsload", "--system-resolver"]).is_ok());
        assert!(Args::try_parse_from(["dnsload"]).is_err());
        let both = ["dnsload", "--system-resolver", "--server", "10.96.0.10"];
        assert!(Args::try_parse_from(both).is_err());
    }
}
