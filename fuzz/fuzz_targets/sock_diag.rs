//! `cargo fuzz run sock_diag`: see nodelocaldns_ha::fuzzing::sock_diag.

#![no_main]
#![forbid(unsafe_code)]

libfuzzer_sys::fuzz_target!(|data: &[u8]| nodelocaldns_ha::fuzzing::sock_diag(data));
