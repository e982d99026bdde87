//! `cargo fuzz run iptables_save`: see nodelocaldns_ha::fuzzing::iptables_save.

#![no_main]
#![forbid(unsafe_code)]

libfuzzer_sys::fuzz_target!(|data: &[u8]| nodelocaldns_ha::fuzzing::iptables_save(data));
