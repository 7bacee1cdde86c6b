//! Any bytes given to the record decoder: no panic, no hang, no allocation
//! beyond a multiple of the input; a failure is `Malformed` with a message
//! naming the record; a success re-encodes to a record that decodes equal.

#![no_main]

use kvcsum::record::Record;
use kvcsum::Error;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|bytes: &[u8]| {
    match Record::decode(bytes) {
        Ok(record) => {
            let again = Record::decode(&record.encode()).expect("a decoded record re-encodes validly");
            assert_eq!(again, record);
        }
        Err(Error::Malformed(message)) => assert!(message.starts_with("record: "), "{message}"),
        Err(other) => panic!("not Malformed: {other:?}"),
    }
});
