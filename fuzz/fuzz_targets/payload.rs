//! Any bytes given to the payload decoder, as bytes and as base64 text: no
//! panic, no hang, no allocation beyond a multiple of the input; a failure
//! is `Malformed` with a message; a success re-encodes to a payload that
//! decodes equal.

#![no_main]

use kvcsum::payload::{decode_base64, Payload};
use kvcsum::Error;
use libfuzzer_sys::fuzz_target;

fn check(bytes: &[u8]) {
    match Payload::decode(bytes) {
        Ok(payload) => {
            let again = Payload::decode(&payload.encode()).expect("a decoded payload re-encodes validly");
            assert_eq!(again, payload);
        }
        Err(Error::Malformed(message)) => assert!(message.starts_with("payload"), "{message}"),
        Err(other) => panic!("not Malformed: {other:?}"),
    }
}

fuzz_target!(|bytes: &[u8]| {
    check(bytes);
    match decode_base64(bytes) {
        Ok(decoded) => check(&decoded),
        Err(Error::Malformed(message)) => assert!(message.starts_with("base64: "), "{message}"),
        Err(other) => panic!("not Malformed: {other:?}"),
    }
});
