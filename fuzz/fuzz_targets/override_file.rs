//! `cargo fuzz run override_file`: see nodelocaldns_ha::fuzzing::override_file.

#![no_main]
#![forbid(unsafe_code)]

libfuzzer_sys::fuzz_target!(|data: &[u8]| nodelocaldns_ha::fuzzing::override_file(data));
