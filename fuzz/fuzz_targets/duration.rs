//! `cargo fuzz run duration`: see nodelocaldns_ha::fuzzing::duration.

#![no_main]
#![forbid(unsafe_code)]

libfuzzer_sys::fuzz_target!(|data: &[u8]| nodelocaldns_ha::fuzzing::duration(data));
