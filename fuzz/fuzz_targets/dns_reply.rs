//! `cargo fuzz run dns_reply`: see nodelocaldns_ha::fuzzing::dns_reply.

#![no_main]
#![forbid(unsafe_code)]

libfuzzer_sys::fuzz_target!(|data: &[u8]| nodelocaldns_ha::fuzzing::dns_reply(data));
