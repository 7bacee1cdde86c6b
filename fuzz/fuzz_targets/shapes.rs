//! Generated records and payloads, not mutations of small valid bytes: the
//! fuzzer's input is a recipe that picks one array of the record or payload
//! schema, a declared length for it (up to 2^24 elements) and how the bytes
//! after its header are made: zero bytes (declared elements that are not
//! there), or that many real minimal elements (many-element inputs), then a
//! tail of the input's own bytes. Outputs reach megabytes, far past the 64
//! KiB the byte-level targets get, so the allocation limits of
//! scripts/fuzz.sh (256 MiB a malloc, 1 GiB in all) and its timeout catch a
//! decoder that reserves by declared length or validates in quadratic time.
//!
//! Decoding must end in `Ok` or `Malformed`, never a panic.

#![no_main]

use kvcsum::payload::Payload;
use kvcsum::record::Record;
use kvcsum::Error;
use libfuzzer_sys::fuzz_target;

// The tests' msgpack writer, included rather than copied, so that the
// shapes do not depend on the library's encoder.
#[path = "../../tests/it/support/msgpack.rs"]
mod msgpack;

use msgpack::Msgpack;

/// The arrays a recipe can make large: where it sits in the schema.
#[derive(Clone, Copy, Debug)]
enum Site {
    PayloadGroups,
    ExtensionGroups,
    ExtensionLayers,
    RecordGroups,
    Requests,
    RequestGroups,
    Columns,
    Layers,
    Skipped,
}

const SITES: [Site; 9] = [
    Site::PayloadGroups,
    Site::ExtensionGroups,
    Site::ExtensionLayers,
    Site::RecordGroups,
    Site::Requests,
    Site::RequestGroups,
    Site::Columns,
    Site::Layers,
    Site::Skipped,
];

/// Writes the schema down to the site's array header (of `len` elements).
fn prefix(out: &mut Msgpack, site: Site, len: usize) {
    let record_head = |out: &mut Msgpack| {
        out.array(8).str("kvcsum.record").uint(4);
        out.array(3).uint(0).uint(1).uint(0);
        out.uint(1).bool(true);
    };
    let request_head = |out: &mut Msgpack| {
        record_head(out);
        out.array(1).array(9).uint(0).uint(16).uint(0).uint(0);
        out.bool(false).bool(true).bool(false).array(0).array(0);
        out.array(1).array(4).str("r").uint(16);
    };
    match site {
        Site::PayloadGroups => {
            out.array(3).uint(1).uint(16).array(len);
        }
        Site::ExtensionGroups => {
            out.array(4).uint(1).uint(16).array(0).array(3).uint(1).uint(1).array(len);
        }
        Site::ExtensionLayers => {
            out.array(4).uint(1).uint(16).array(1).array(4).uint(0).uint(7).uint(0).bin(&[]);
            out.array(3).uint(1).uint(1).array(1).array(3).uint(0).uint(16).array(len);
        }
        Site::RecordGroups => {
            record_head(out);
            out.array(len);
        }
        Site::Requests => {
            record_head(out);
            out.array(0).array(len);
        }
        Site::RequestGroups => {
            request_head(out);
            out.array(len);
        }
        Site::Columns => {
            request_head(out);
            out.array(1).array(6).uint(0).uint(0).uint(0).array(len);
        }
        Site::Layers => {
            request_head(out);
            out.array(1).array(6).uint(0).uint(0).uint(0);
            out.array(1).array(3).uint(1).uint(0).bin(&[]);
            out.array(len);
        }
        Site::Skipped => {
            request_head(out);
            out.array(0).array(len);
        }
    }
}

/// One real, minimal element of the site's array (the `i`-th, so that ids
/// and keys differ).
fn element(out: &mut Msgpack, site: Site, i: u64) {
    match site {
        Site::PayloadGroups => {
            out.array(4).uint(i).uint(7).uint(0).bin(&[]);
        }
        Site::ExtensionGroups => {
            out.array(3).uint(i).uint(16).array(0);
        }
        Site::ExtensionLayers => {
            out.array(4).uint(i).uint(0).uint(1).bin(&[]);
        }
        Site::RecordGroups => {
            out.array(9).uint(i).uint(16).uint(0).uint(0).bool(false).bool(true).bool(false);
            out.array(0).array(0);
        }
        Site::Requests => {
            out.array(4).str(&format!("{i:x}")).uint(0).array(0).array(0);
        }
        Site::RequestGroups => {
            out.array(6).uint(i).uint(0).uint(0).array(0).array(0).nil();
        }
        Site::Columns => {
            out.array(3).uint(1 << 20).uint(i).bin(&[]);
        }
        Site::Layers => {
            out.array(6).uint(i).uint(0).uint(1).uint(1).uint(0).bin(&[]);
        }
        Site::Skipped => {
            out.array(2).uint(i).str("r");
        }
    }
}

fn decode(site: Site, bytes: &[u8]) {
    match site {
        Site::PayloadGroups | Site::ExtensionGroups | Site::ExtensionLayers => match Payload::decode(bytes) {
            Ok(_) => {}
            Err(Error::Malformed(message)) => assert!(message.starts_with("payload"), "{message}"),
            Err(other) => panic!("not Malformed: {other:?}"),
        },
        _ => match Record::decode(bytes) {
            Ok(_) => {}
            Err(Error::Malformed(message)) => assert!(message.starts_with("record: "), "{message}"),
            Err(other) => panic!("not Malformed: {other:?}"),
        },
    }
}

fuzz_target!(|recipe: &[u8]| {
    if recipe.len() < 6 {
        return;
    }
    let site = SITES[recipe[0] as usize % SITES.len()];
    let real = recipe[1] & 1 == 1;
    let len = u32::from_le_bytes([recipe[2], recipe[3], recipe[4], 0]) as usize;
    // Real elements take several bytes each: fewer of them keep a run short.
    let len = if real { len % (1 << 20) } else { len };
    let tail = &recipe[5..];
    let mut out = Msgpack::default();
    prefix(&mut out, site, len);
    if real {
        for i in 0..len as u64 {
            element(&mut out, site, i);
        }
    } else {
        out.0.resize(out.0.len() + len, 0);
    }
    out.0.extend_from_slice(tail);
    decode(site, &out.0);
});
