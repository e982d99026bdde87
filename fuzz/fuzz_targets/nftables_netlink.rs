//! `cargo fuzz run nftables_netlink`: see nodelocaldns_ha::fuzzing::nftables_netlink.

#![no_main]
#![forbid(unsafe_code)]

libfuzzer_sys::fuzz_target!(|data: &[u8]| nodelocaldns_ha::fuzzing::nftables_netlink(data));
