//! `cargo fuzz run forwarder_message`: see nodelocaldns_ha::fuzzing::forwarder_message.

#![no_main]
#![forbid(unsafe_code)]

libfuzzer_sys::fuzz_target!(|data: &[u8]| nodelocaldns_ha::fuzzing::forwarder_message(data));
