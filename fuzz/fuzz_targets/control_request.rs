//! `cargo fuzz run control_request`: see nodelocaldns_ha::fuzzing::control_request.

#![no_main]
#![forbid(unsafe_code)]

libfuzzer_sys::fuzz_target!(|data: &[u8]| nodelocaldns_ha::fuzzing::control_request(data));
