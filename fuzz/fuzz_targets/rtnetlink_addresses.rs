//! `cargo fuzz run rtnetlink_addresses`: see nodelocaldns_ha::fuzzing::rtnetlink_addresses.

#![no_main]
#![forbid(unsafe_code)]

libfuzzer_sys::fuzz_target!(|data: &[u8]| nodelocaldns_ha::fuzzing::rtnetlink_addresses(data));
