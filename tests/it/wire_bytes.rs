//! The record and payload decoders: round trips, and every class of
//! malformed input rejected with `Error::Malformed` and a message that says
//! what was wrong, without panics or large allocations. Inputs are built
//! with the tests' msgpack writer (tests/it/support/msgpack.rs, independent of
//! the crate's encoder).
//!
//! Reproduce a failure with the seed it printed:
//! `KVCS_TEST_SEED=<seed> cargo test --test it wire_bytes::<name>`.

use crate::support;

use std::ffi::CString;
use std::ptr::null_mut;

use kvcsum::ffi::status::kvcs_status::*;
use kvcsum::ffi::verifier::*;
use kvcsum::payload::{
    decode_base64, encode_base64, Extension, ExtensionGroup, FingerprintConvention, LayerPartial, Payload,
    PayloadGroup, FIRST_COPY,
};
use kvcsum::record::Record;
use kvcsum::{Error, Role, StoredOutcome};
use support::address_limit::under_address_space_limit;
use support::hand_made_records::*;
use support::handles::*;
use support::msgpack::Msgpack;
use support::*;

/// A msgpack value, written in the shortest form unless `Raw`.
#[derive(Debug, Clone)]
enum V {
    U(u64),
    /// A signed integer in the `int 64` form.
    I64(i64),
    S(String),
    B(Vec<u8>),
    A(Vec<V>),
    Bool(bool),
    Nil,
    F64(f64),
    /// Bytes as they are (crafted headers).
    Raw(Vec<u8>),
}

fn s(text: &str) -> V {
    V::S(text.to_owned())
}

fn values(v: &[u64]) -> V {
    V::B(v.iter().flat_map(|x| x.to_le_bytes()).collect())
}

impl V {
    fn encode(&self, out: &mut Msgpack) {
        match self {
            V::U(x) => out.uint(*x),
            V::I64(x) => out.int64(*x),
            V::S(text) => out.str(text),
            V::B(bytes) => out.bin(bytes),
            V::A(items) => {
                out.array(items.len());
                for item in items {
                    item.encode(out);
                }
                out
            }
            V::Bool(b) => out.bool(*b),
            V::Nil => out.nil(),
            V::F64(x) => out.f64(*x),
            V::Raw(bytes) => out.raw(bytes),
        };
    }

    fn bytes(&self) -> Vec<u8> {
        let mut out = Msgpack::default();
        self.encode(&mut out);
        out.0
    }

    /// The element at `path` (indices into nested arrays).
    fn at(&mut self, path: &[usize]) -> &mut V {
        let mut value = self;
        for &index in path {
            match value {
                V::A(items) => value = &mut items[index],
                other => panic!("no array at {path:?}: {other:?}"),
            }
        }
        value
    }
}

/// A valid consumer record in detail mode: TP rank 1 of 2, stage 0, group 3
/// (block size 16) with columns (1,0) and (2,1), one layer partial each, and
/// group 5 skipped.
fn record_value() -> V {
    V::A(vec![
        s("kvcsum.record"),
        V::U(4),
        V::A(vec![V::U(1), V::U(2), V::U(0)]),
        V::U(1),
        V::Bool(true),
        V::A(vec![V::A(vec![
            V::U(3),
            V::U(16),
            V::U(u64::MAX - 5),
            V::U(0x0a11_a5ed), // marks
            V::Bool(false),
            V::Bool(true),
            V::Bool(false),
            V::A(vec![
                V::A(vec![V::U(1), V::U(0), V::U(0x1234_5678)]),
                V::A(vec![V::U(2), V::U(1), V::U(u64::MAX - 9)]),
            ]),
            decodings(),
        ])]),
        V::A(vec![V::A(vec![
            s("req-1"),
            V::U(40),
            V::A(vec![V::A(vec![
                V::U(3),
                V::U(0),
                V::U(3),
                V::A(vec![
                    V::A(vec![V::U(1), V::U(0), values(&[1, 2, 3])]),
                    V::A(vec![V::U(2), V::U(1), values(&[4, 5, 6])]),
                ]),
                V::A(vec![
                    V::A(vec![V::U(0), V::U(2), V::U(2), V::U(1), V::U(0), values(&[1, 2, 3])]),
                    V::A(vec![V::U(1), V::U(0), V::U(1), V::U(2), V::U(1), values(&[4, 5, 6])]),
                ]),
                V::Nil,
            ])]),
            V::A(vec![V::A(vec![V::U(5), s("mamba state")])]),
        ])]),
        V::U(2),
    ])
}

/// Layer decodings (SPEC section 7) as records and extensions write them:
/// layer 0 fp8 with both scales, layer 2 only its element type.
fn decodings() -> V {
    V::A(vec![
        V::A(vec![
            V::U(0),
            s("fp8_e4m3"),
            V::U(128),
            V::U(0.0125f64.to_bits()),
            V::U(0.5f64.to_bits()),
        ]),
        V::A(vec![V::U(2), s("bfloat16"), V::U(0), V::U(0), V::U(0)]),
    ])
}

/// A valid payload with the extension (version 3).
fn payload_value() -> V {
    V::A(vec![
        V::U(1),
        V::U(40),
        V::A(vec![
            V::A(vec![V::U(0), V::U(u64::MAX), V::U(0), values(&[7, 8, 9])]),
            V::A(vec![V::U(2), V::U(17), V::U(1), values(&[10, 11])]),
        ]),
        V::A(vec![
            V::U(3),
            V::U(2),
            V::A(vec![V::A(vec![
                V::U(0),
                V::U(16),
                V::A(vec![
                    V::A(vec![V::U(0), V::U(0), V::U(4), values(&[1, 1, 1])]),
                    V::A(vec![V::U(0), V::U(4), V::U(4), values(&[6, 7, 8])]),
                ]),
                V::U(0x5eed_c0fe_0000_0001), // the producer's coverage
                V::U(0x0a11_a5ed),           // its marks
                decodings(),
            ])]),
            V::U(2),
        ]),
    ])
}

fn malformed(result: kvcsum::Result<impl std::fmt::Debug>, needle: &str, case: &str) {
    match result {
        Err(Error::Malformed(message)) => assert!(
            message.contains(needle),
            "{case}: the message {message:?} should contain {needle:?}"
        ),
        other => panic!("{case}: expected Malformed containing {needle:?}, got {other:?}"),
    }
}

#[test]
fn extension_versions_carry_the_algorithm() {
    let payload = Payload::decode(&payload_value().bytes()).expect("version 3");
    assert_eq!(payload.algorithm(), kvcsum::Algorithm::Mixed);
    let group = &payload.extension.as_ref().unwrap().groups[0];
    assert_eq!(group.coverage, Some(0x5eed_c0fe_0000_0001));
    assert_eq!(group.marks, Some(0x0a11_a5ed));
    // Algorithm 3 is MIXED2 (kvcsum 0.3's default), 1 WEIGHTED.
    for (code, algorithm) in [(1, kvcsum::Algorithm::Weighted), (3, kvcsum::Algorithm::Mixed2)] {
        let mut other = payload_value();
        *other.at(&[3, 3]) = V::U(code);
        assert_eq!(
            Payload::decode(&other.bytes()).expect("algorithm").algorithm(),
            algorithm
        );
    }
    assert_eq!(
        payload.fingerprint_convention(0),
        FingerprintConvention::Separate { marks: 0x0a11_a5ed }
    );
    assert_eq!(
        payload.fingerprint_convention(2),
        FingerprintConvention::Unknown,
        "no entry"
    );
    assert_eq!(group.decodings.len(), 2);
    assert_eq!(
        group.decodings[0].1.parts(),
        ("fp8_e4m3", 128, 0.0125f64.to_bits(), 0.5f64.to_bits())
    );
    assert_eq!(group.decodings[1].1.parts(), ("bfloat16", 0, 0, 0));
    // Version 2 (groups of 4: no marks, no decodings) still carries the
    // algorithm and the coverage; its fingerprints counted the marks.
    let mut v2 = payload_value();
    *v2.at(&[3, 0]) = V::U(2);
    if let V::A(items) = v2.at(&[3, 2, 0]) {
        items.truncate(4);
    }
    let decoded = Payload::decode(&v2.bytes()).expect("version 2");
    assert_eq!(decoded.algorithm(), kvcsum::Algorithm::Mixed);
    assert_eq!(decoded.extension.as_ref().unwrap().groups[0].marks, None);
    assert_eq!(decoded.fingerprint_convention(0), FingerprintConvention::Marked);
    assert_eq!(decoded.encode(), v2.bytes(), "a version-2 extension encodes as it came");
    // Version 1 (3 elements, no algorithm; groups of 3, no coverage) means
    // WEIGHTED, as a plain payload does.
    let mut v1 = v2.clone();
    *v1.at(&[3, 0]) = V::U(1);
    if let V::A(items) = v1.at(&[3]) {
        items.pop();
    }
    if let V::A(items) = v1.at(&[3, 2, 0]) {
        items.truncate(3);
    }
    let decoded = Payload::decode(&v1.bytes()).expect("version 1");
    assert_eq!(decoded.algorithm(), kvcsum::Algorithm::Weighted);
    assert_eq!(decoded.fingerprint_convention(0), FingerprintConvention::Unmarked);
    let mut plain = payload_value();
    if let V::A(items) = &mut plain {
        items.pop();
    }
    assert_eq!(
        Payload::decode(&plain.bytes()).expect("plain").algorithm(),
        kvcsum::Algorithm::Weighted
    );
}

#[test]
fn valid_inputs_decode() {
    let record = Record::decode(&record_value().bytes()).expect("valid record");
    assert_eq!(record.rank.tp_rank, 1);
    assert_eq!(record.role, Role::Consumer);
    assert_eq!(record.requests[0].groups[0].columns[1].values, vec![4, 5, 6]);
    assert_eq!(record.requests[0].skipped[0].reason, "mamba state");
    assert_eq!(Record::decode(&record.encode()).unwrap(), record, "round trip");
    assert_eq!(record.requests[0].groups[0].stored, None, "nil: not a load check");
    let mut load_check = record_value();
    *load_check.at(&[6, 0, 2, 0, 5]) = V::B(vec![0, 1, 2]);
    let decoded = Record::decode(&load_check.bytes()).expect("a load check's record");
    assert_eq!(
        decoded.requests[0].groups[0].stored,
        Some(vec![
            StoredOutcome::Failed,
            StoredOutcome::Matched,
            StoredOutcome::NotChecked
        ])
    );
    // A version-4 record (0.3.0's development builds) reads as one without
    // short last values and geometry, and is written as version 7: the
    // same bytes with a nil short_last before the group's stored outcomes,
    // an empty geometry after each group's decodings and the default
    // placement [1, 0, 1, 1] after that.
    let mut as_version_6 = load_check.clone();
    *as_version_6.at(&[1]) = V::U(6);
    if let V::A(items) = as_version_6.at(&[6, 0, 2, 0]) {
        items.insert(5, V::Nil);
    }
    if let V::A(items) = as_version_6.at(&[5, 0]) {
        items.push(V::A(Vec::new()));
    }
    let mut as_version_7 = as_version_6.clone();
    *as_version_7.at(&[1]) = V::U(7);
    if let V::A(items) = as_version_7.at(&[5, 0]) {
        items.push(V::A(vec![V::U(1), V::U(0), V::U(1), V::U(1)]));
    }
    assert_eq!(decoded.encode(), as_version_7.bytes(), "shortest forms, same bytes");
    assert_eq!(Record::decode(&as_version_7.bytes()).unwrap(), decoded);
    assert_eq!(Record::decode(&as_version_6.bytes()).unwrap(), decoded);
    // Version 5 (short last values, no geometry) reads the same.
    let mut as_version_5 = load_check.clone();
    *as_version_5.at(&[1]) = V::U(5);
    if let V::A(items) = as_version_5.at(&[6, 0, 2, 0]) {
        items.insert(5, V::Nil);
    }
    assert_eq!(Record::decode(&as_version_5.bytes()).unwrap(), decoded);
    // A version-6 record's geometry runs: sorted, not overlapping, cells of
    // whole pieces (a positive multiple of 8 bytes, or of 4 and not of 8)
    // with K of whole pieces and shorter.
    let run = |layer: u64, first: u64, heads: u64, cell: u64, k: u64| {
        V::A(vec![V::U(layer), V::U(first), V::U(heads), V::U(cell), V::U(k)])
    };
    let with_geometry = |runs: Vec<V>| {
        let mut record = as_version_6.clone();
        *record.at(&[5, 0, 9]) = V::A(runs);
        Record::decode(&record.bytes())
    };
    let good = with_geometry(vec![
        run(0, 0, 4, 256, 128),
        run(0, 4, 1, 136, 0),
        run(1, 0, 1, 132, 128),
        run(2, 0, 4, 12, 0),
    ])
    .unwrap();
    assert_eq!(good.groups[0].geometry.len(), 4);
    assert_eq!(Record::decode(&good.encode()).unwrap(), good);
    for (case, runs, needle) in [
        (
            "overlapping",
            vec![run(0, 0, 4, 256, 0), run(0, 2, 4, 256, 0)],
            "follows or overlaps",
        ),
        (
            "out of order",
            vec![run(2, 0, 4, 256, 0), run(0, 0, 4, 256, 0)],
            "follows or overlaps",
        ),
        ("no heads", vec![run(0, 0, 0, 256, 0)], "num_heads 0"),
        ("a cell of 10 bytes", vec![run(0, 0, 4, 10, 0)], "cell_bytes 10"),
        (
            "K of 4 bytes in a cell of 8-byte pieces",
            vec![run(0, 0, 4, 256, 4)],
            "k_bytes 4",
        ),
        (
            "K of 2 bytes in a cell of 4-byte pieces",
            vec![run(0, 0, 1, 132, 2)],
            "k_bytes 2",
        ),
        ("K as long as the cell", vec![run(0, 0, 4, 256, 256)], "k_bytes 256"),
    ] {
        malformed(with_geometry(runs), needle, case);
    }
    let payload = Payload::decode(&payload_value().bytes()).expect("valid payload");
    assert_eq!(payload.groups[1].values, vec![10, 11]);
    assert_eq!(payload.extension.as_ref().unwrap().groups[0].layers[1].first_head, 4);
    assert_eq!(payload.encode(), payload_value().bytes(), "shortest forms, same bytes");
    // Integers in wider or signed forms are valid msgpack of the same shape.
    let mut wide = payload_value();
    *wide.at(&[1]) = V::Raw(vec![0xcf, 0, 0, 0, 0, 0, 0, 0, 40]);
    *wide.at(&[2, 0, 0]) = V::I64(0);
    assert_eq!(Payload::decode(&wide.bytes()).unwrap(), payload);
}

#[test]
fn records_of_real_workers_round_trip() {
    let mut rng = Rng::for_test("records_of_real_workers_round_trip");
    let kv = LogicalKv::random(&mut rng, KvShape::gqa(3, 2, 16, 50));
    let table = GroupTable {
        group_id: 4,
        first_position: 1,
        block_ids: vec![3, 0, 2],
    };
    let mut ranks = deploy_host(
        &mut rng,
        Deploy {
            tp_size: 4,
            pp_size: 1,
            kind: LayoutKind::Nhd,
            group_id: 4,
            block_size: 16,
            num_blocks: 5,
            num_threads: 1,
        },
        &[(&kv, &table)],
    );
    let blocks = block_set(&[TestRequest {
        req_id: "r".to_owned(),
        num_tokens: 50,
        tables: vec![table.clone()],
    }]);
    let rank = &mut ranks[3];
    rank.worker.set_detail(true).unwrap();
    for role in [Role::Producer, Role::Consumer] {
        let result = checksum(&rank.worker, &blocks, role);
        let record = Record::from_checksums(&result).unwrap();
        let decoded = Record::decode(&record.encode()).unwrap();
        assert_eq!(decoded, record, "seed {}", rng.seed());
        assert_eq!((decoded.rank.tp_rank, decoded.rank.tp_size), (3, 4));
        assert_eq!(decoded.groups[0].block_size, 16);
        let group = &decoded.requests[0].groups[0];
        assert_eq!((group.first_position, group.num_positions), (1, 3));
        // Rank 3 holds head 1 as replica 1 of 2: a producer computes nothing.
        assert_eq!(group.columns.len(), if role == Role::Consumer { 1 } else { 0 });
        if role == Role::Consumer {
            assert_eq!(
                group.columns[0].values,
                naive_positions(&kv, &kv.layer_numbers(), &[1], 16, 1, 3),
                "seed {}",
                rng.seed()
            );
            assert_eq!(group.layers.len(), 3, "one partial per layer");
        }
    }
}

#[test]
fn every_malformed_record_class_is_rejected_with_a_message() {
    let valid = record_value();
    type Edit = (&'static str, Box<dyn Fn(&mut V)>, &'static str);
    let cases: Vec<Edit> = vec![
        ("not an array", Box::new(|v| *v = V::Nil), "expected an array"),
        ("a map", Box::new(|v| *v = V::Raw(vec![0x80])), "found a map"),
        (
            "other magic",
            Box::new(|v| *v.at(&[0]) = s("kvcsum.payload")),
            "not a kvcsum record",
        ),
        (
            "version 1 (before stored outcomes)",
            Box::new(|v| *v.at(&[1]) = V::U(1)),
            "version 1 is not supported",
        ),
        (
            "version 2 (before stamps and holds_caches)",
            Box::new(|v| *v.at(&[1]) = V::U(2)),
            "version 2 is not supported",
        ),
        (
            "version 3 (before marks and decodings)",
            Box::new(|v| *v.at(&[1]) = V::U(3)),
            "version 3 is not supported",
        ),
        (
            "version 8",
            Box::new(|v| *v.at(&[1]) = V::U(8)),
            "version 8 is not supported",
        ),
        (
            "version 5 with version 4's request groups (no short_last)",
            Box::new(|v| *v.at(&[1]) = V::U(5)),
            "a request group",
        ),
        (
            "group of 7 elements (version 3's)",
            Box::new(|v| {
                if let V::A(items) = v.at(&[5, 0]) {
                    items.remove(3);
                    items.pop();
                }
            }),
            "expected an array of 9 elements, found 7",
        ),
        ("marks a string", Box::new(|v| *v.at(&[5, 0, 3]) = s("marks")), "marks"),
        (
            "decoding with a bad element type",
            Box::new(|v| *v.at(&[5, 0, 8, 0, 1]) = s("FP8")),
            "the decoding of layer 0: dtype \"FP8\" is not an element type name",
        ),
        (
            "decoding with a NaN scale",
            Box::new(|v| *v.at(&[5, 0, 8, 0, 3]) = V::U(f64::NAN.to_bits())),
            "k_scale NaN",
        ),
        (
            "decoding with a negative scale",
            Box::new(|v| *v.at(&[5, 0, 8, 0, 4]) = V::U((-0.5f64).to_bits())),
            "v_scale -0.5",
        ),
        (
            "decoding that declares nothing",
            Box::new(|v| *v.at(&[5, 0, 8, 1, 1]) = s("")),
            "declares nothing",
        ),
        (
            "decodings out of order",
            Box::new(|v| *v.at(&[5, 0, 8, 1, 0]) = V::U(0)),
            "sorted by layer number and distinct",
        ),
        (
            "decoding of 4 elements",
            Box::new(|v| {
                if let V::A(items) = v.at(&[5, 0, 8, 1]) {
                    items.pop();
                }
            }),
            "a decoding (byte",
        ),
        (
            "huge declared decodings",
            Box::new(|v| *v.at(&[5, 0, 8]) = V::Raw(vec![0xdd, 0xff, 0xff, 0xff, 0xff])),
            "cannot fit",
        ),
        (
            "algorithm 0",
            Box::new(|v| *v.at(&[7]) = V::U(0)),
            "algorithm 0 is not 1 (weighted), 2 (mixed) or 3 (mixed2)",
        ),
        ("algorithm 4", Box::new(|v| *v.at(&[7]) = V::U(4)), "algorithm 4 is not"),
        (
            "algorithm a string",
            Box::new(|v| *v.at(&[7]) = s("mixed")),
            "algorithm",
        ),
        (
            "too few elements",
            Box::new(|v| {
                if let V::A(items) = v {
                    items.pop();
                }
            }),
            "expected an array of 8 elements",
        ),
        (
            "tp_rank past tp_size",
            Box::new(|v| *v.at(&[2, 0]) = V::U(2)),
            "tp_rank 2 is not below tp_size 2",
        ),
        ("tp_size 0", Box::new(|v| *v.at(&[2, 1]) = V::U(0)), "tp_size 0"),
        (
            "rank past 32 bits",
            Box::new(|v| *v.at(&[2, 2]) = V::U(1 << 32)),
            "does not fit in 32 bits",
        ),
        (
            "negative rank",
            Box::new(|v| *v.at(&[2, 2]) = V::I64(-1)),
            "-1 is negative",
        ),
        ("role 2", Box::new(|v| *v.at(&[3]) = V::U(2)), "role 2"),
        (
            "detail not a bool",
            Box::new(|v| *v.at(&[4]) = V::U(1)),
            "expected a boolean",
        ),
        ("float", Box::new(|v| *v.at(&[5, 0, 1]) = V::F64(16.0)), "found a float"),
        (
            "block size 0",
            Box::new(|v| *v.at(&[5, 0, 1]) = V::U(0)),
            "block_size 0",
        ),
        (
            "groups unsorted",
            Box::new(|v| {
                let group = v.at(&[5, 0]).clone();
                *v.at(&[5]) = V::A(vec![group.clone(), group]);
            }),
            "sorted by id and distinct",
        ),
        ("empty req_id", Box::new(|v| *v.at(&[6, 0, 0]) = s("")), "empty req_id"),
        (
            "req_id not UTF-8",
            Box::new(|v| *v.at(&[6, 0, 0]) = V::Raw(vec![0xa2, 0xff, 0xfe])),
            "not UTF-8",
        ),
        (
            "req_id a bin",
            Box::new(|v| *v.at(&[6, 0, 0]) = V::B(b"r".to_vec())),
            "expected a string",
        ),
        (
            "duplicate request",
            Box::new(|v| {
                let request = v.at(&[6, 0]).clone();
                *v.at(&[6]) = V::A(vec![request.clone(), request]);
            }),
            "appears twice",
        ),
        (
            "unregistered group",
            Box::new(|v| *v.at(&[6, 0, 2, 0, 0]) = V::U(4)),
            "not among the record's registered groups",
        ),
        (
            "position overflow",
            Box::new(|v| *v.at(&[6, 0, 2, 0, 1]) = V::U(u64::MAX - 1)),
            "overflows",
        ),
        (
            "too few values",
            Box::new(|v| *v.at(&[6, 0, 2, 0, 2]) = V::U(4)),
            "has 3 values for num_positions 4",
        ),
        (
            "replicas 0",
            Box::new(|v| *v.at(&[6, 0, 2, 0, 3, 0, 0]) = V::U(0)),
            "replica key (0, 0) is invalid",
        ),
        (
            "replica index past replicas",
            Box::new(|v| *v.at(&[6, 0, 2, 0, 3, 1, 1]) = V::U(2)),
            "is invalid",
        ),
        (
            "columns unsorted",
            Box::new(|v| {
                let columns = v.at(&[6, 0, 2, 0, 3]).clone();
                if let V::A(mut items) = columns {
                    items.reverse();
                    *v.at(&[6, 0, 2, 0, 3]) = V::A(items);
                }
            }),
            "out of order or repeated",
        ),
        (
            "producer with replica 1",
            Box::new(|v| *v.at(&[3]) = V::U(0)),
            "a producer record has a column of replica_index 1",
        ),
        (
            "values not whole u64s",
            Box::new(|v| *v.at(&[6, 0, 2, 0, 3, 0, 2]) = V::B(vec![0; 23])),
            "not a whole number of 8-byte values",
        ),
        (
            "values a string",
            Box::new(|v| *v.at(&[6, 0, 2, 0, 3, 0, 2]) = s("12345678")),
            "expected a bin",
        ),
        (
            "layers without detail",
            Box::new(|v| *v.at(&[4]) = V::Bool(false)),
            "not in detail mode",
        ),
        (
            "layer without its column",
            Box::new(|v| *v.at(&[6, 0, 2, 0, 4, 1, 3]) = V::U(3)),
            "no column has its replica key",
        ),
        (
            "layer of no heads",
            Box::new(|v| *v.at(&[6, 0, 2, 0, 4, 0, 2]) = V::U(0)),
            "num_heads 0",
        ),
        (
            "layer past head 65536",
            Box::new(|v| *v.at(&[6, 0, 2, 0, 4, 0, 1]) = V::U(65535)),
            "reaches past head 65536",
        ),
        (
            "layers out of order",
            Box::new(|v| {
                let layers = v.at(&[6, 0, 2, 0, 4]).clone();
                if let V::A(mut items) = layers {
                    items.reverse();
                    *v.at(&[6, 0, 2, 0, 4]) = V::A(items);
                }
            }),
            "out of order or overlap",
        ),
        (
            "layer values short",
            Box::new(|v| *v.at(&[6, 0, 2, 0, 4, 0, 5]) = values(&[1])),
            "1 values for 3 positions",
        ),
        (
            "stored outcomes of the wrong count",
            Box::new(|v| *v.at(&[6, 0, 2, 0, 5]) = V::B(vec![1, 1])),
            "2 stored outcomes for num_positions 3",
        ),
        (
            "stored outcome that is none",
            Box::new(|v| *v.at(&[6, 0, 2, 0, 5]) = V::B(vec![1, 7, 1])),
            "outcome 1 is 7",
        ),
        (
            "stored outcomes an integer",
            Box::new(|v| *v.at(&[6, 0, 2, 0, 5]) = V::U(0)),
            "expected nil or a bin",
        ),
        (
            "stored outcomes declared huge",
            Box::new(|v| *v.at(&[6, 0, 2, 0, 5]) = V::Raw(vec![0xc6, 0xff, 0xff, 0xff, 0xff])),
            "truncated",
        ),
        (
            "empty skip reason",
            Box::new(|v| *v.at(&[6, 0, 3, 0, 1]) = s("")),
            "empty reason",
        ),
        (
            "skipped and checksummed",
            Box::new(|v| *v.at(&[6, 0, 3, 0, 0]) = V::U(3)),
            "listed twice",
        ),
        (
            "group array of 5 (version 1's)",
            Box::new(|v| {
                if let V::A(items) = v.at(&[6, 0, 2, 0]) {
                    items.pop();
                }
            }),
            "expected an array of 6 elements",
        ),
        (
            "huge declared request count",
            Box::new(|v| *v.at(&[6]) = V::Raw(vec![0xdd, 0xff, 0xff, 0xff, 0xff])),
            "cannot fit",
        ),
        (
            "huge declared bin",
            Box::new(|v| *v.at(&[6, 0, 2, 0, 3, 0, 2]) = V::Raw(vec![0xc6, 0xff, 0xff, 0xff, 0xf8])),
            "truncated",
        ),
        (
            "huge declared string",
            Box::new(|v| *v.at(&[6, 0, 0]) = V::Raw(vec![0xdb, 0x7f, 0xff, 0xff, 0xff])),
            "truncated",
        ),
        (
            "nil for an integer",
            Box::new(|v| *v.at(&[6, 0, 1]) = V::Nil),
            "found nil",
        ),
    ];
    for (case, edit, needle) in cases {
        let mut value = valid.clone();
        edit(&mut value);
        malformed(Record::decode(&value.bytes()), needle, case);
    }
    malformed(Record::decode(&[]), "truncated", "empty input");
    let mut trailing = valid.bytes();
    trailing.push(0);
    malformed(Record::decode(&trailing), "1 trailing bytes", "trailing byte");
    let bytes = valid.bytes();
    for len in 0..bytes.len() {
        let result = Record::decode(&bytes[..len]);
        assert!(
            matches!(&result, Err(Error::Malformed(m)) if m.starts_with("record: ")),
            "prefix {len}: {result:?}"
        );
    }
}

#[test]
fn every_malformed_payload_class_is_rejected_with_a_message() {
    let valid = payload_value();
    type Edit = (&'static str, Box<dyn Fn(&mut V)>, &'static str);
    let cases: Vec<Edit> = vec![
        ("not an array", Box::new(|v| *v = V::U(1)), "expected an array"),
        (
            "two elements",
            Box::new(|v| *v = V::A(vec![V::U(1), V::U(40)])),
            "found 2",
        ),
        (
            "five elements",
            Box::new(|v| {
                if let V::A(items) = v {
                    items.push(V::Nil);
                }
            }),
            "found 5",
        ),
        (
            "version 2",
            Box::new(|v| *v.at(&[0]) = V::U(2)),
            "version 2 is not supported",
        ),
        (
            "version a string",
            Box::new(|v| *v.at(&[0]) = s("1")),
            "expected an integer, found a string",
        ),
        (
            "negative num_tokens",
            Box::new(|v| *v.at(&[1]) = V::I64(-40)),
            "-40 is negative",
        ),
        (
            "float num_tokens",
            Box::new(|v| *v.at(&[1]) = V::F64(40.0)),
            "found a float",
        ),
        (
            "groups a map",
            Box::new(|v| *v.at(&[2]) = V::Raw(vec![0x80])),
            "found a map",
        ),
        (
            "group of 3",
            Box::new(|v| {
                if let V::A(items) = v.at(&[2, 0]) {
                    items.pop();
                }
            }),
            "expected an array of 4 elements",
        ),
        (
            "group_id past 32 bits",
            Box::new(|v| *v.at(&[2, 0, 0]) = V::U(1 << 40)),
            "does not fit in 32 bits",
        ),
        (
            "duplicate group",
            Box::new(|v| *v.at(&[2, 1, 0]) = V::U(0)),
            "group 0 appears twice",
        ),
        (
            "values a string",
            Box::new(|v| *v.at(&[2, 0, 3]) = s("abcdefgh")),
            "expected a bin",
        ),
        (
            "values a list",
            Box::new(|v| *v.at(&[2, 0, 3]) = V::A(vec![V::U(7)])),
            "expected a bin",
        ),
        (
            "values not whole u64s",
            Box::new(|v| *v.at(&[2, 0, 3]) = V::B(vec![1; 12])),
            "not a whole number of 8-byte values",
        ),
        (
            "position overflow",
            Box::new(|v| *v.at(&[2, 1, 2]) = V::U(u64::MAX)),
            "overflows",
        ),
        (
            "huge declared group count",
            Box::new(|v| *v.at(&[2]) = V::Raw(vec![0xdd, 0xff, 0xff, 0xff, 0xff])),
            "cannot fit",
        ),
        (
            "huge declared bin",
            Box::new(|v| *v.at(&[2, 0, 3]) = V::Raw(vec![0xc6, 0xff, 0xff, 0xff, 0xf8, 1, 2])),
            "truncated",
        ),
        (
            "extension version 9",
            Box::new(|v| *v.at(&[3, 0]) = V::U(9)),
            "extension version 9",
        ),
        (
            "extension tp 0",
            Box::new(|v| *v.at(&[3, 1]) = V::U(0)),
            "producer_tp_size is 0",
        ),
        (
            "extension of an unknown group",
            Box::new(|v| *v.at(&[3, 2, 0, 0]) = V::U(7)),
            "group 7 is not in the payload",
        ),
        (
            "extension block size 0",
            Box::new(|v| *v.at(&[3, 2, 0, 1]) = V::U(0)),
            "block_size 0",
        ),
        (
            "extension layers overlap",
            Box::new(|v| *v.at(&[3, 2, 0, 2, 1, 1]) = V::U(2)),
            "out of order or overlap",
        ),
        (
            "extension layer values",
            Box::new(|v| *v.at(&[3, 2, 0, 2, 0, 3]) = values(&[1])),
            "1 values for 3 positions",
        ),
        (
            "extension group twice",
            Box::new(|v| {
                let group = v.at(&[3, 2, 0]).clone();
                *v.at(&[3, 2]) = V::A(vec![group.clone(), group]);
            }),
            "appears twice",
        ),
        (
            "extension not an array",
            Box::new(|v| *v.at(&[3]) = V::Nil),
            "expected an array",
        ),
        (
            "extension algorithm 4",
            Box::new(|v| *v.at(&[3, 3]) = V::U(4)),
            "algorithm 4 is not 1 (weighted), 2 (mixed) or 3 (mixed2)",
        ),
        (
            "extension version 3 without its algorithm",
            Box::new(|v| {
                if let V::A(items) = v.at(&[3]) {
                    items.pop();
                }
            }),
            "the extension of version 3 has 4 elements, found 3",
        ),
        (
            "extension version 3 with groups of version 2",
            Box::new(|v| {
                if let V::A(items) = v.at(&[3, 2, 0]) {
                    items.truncate(4);
                }
            }),
            "expected an array of 6 elements, found 4",
        ),
        (
            "extension version 2 with groups of version 3",
            Box::new(|v| *v.at(&[3, 0]) = V::U(2)),
            "expected an array of 4 elements, found 6",
        ),
        (
            "extension marks a bin",
            Box::new(|v| *v.at(&[3, 2, 0, 4]) = V::B(vec![0; 8])),
            "marks",
        ),
        (
            "extension decoding with a bad element type",
            Box::new(|v| *v.at(&[3, 2, 0, 5, 1, 1]) = s("bf16!")),
            "is not an element type name",
        ),
        (
            "extension decoding with an infinite scale",
            Box::new(|v| *v.at(&[3, 2, 0, 5, 0, 4]) = V::U(f64::INFINITY.to_bits())),
            "v_scale inf",
        ),
        (
            "extension decodings repeated",
            Box::new(|v| {
                let decoding = v.at(&[3, 2, 0, 5, 0]).clone();
                *v.at(&[3, 2, 0, 5]) = V::A(vec![decoding.clone(), decoding]);
            }),
            "sorted by layer number and distinct",
        ),
        (
            "extension version 1 with an algorithm",
            Box::new(|v| *v.at(&[3, 0]) = V::U(1)),
            "the extension of version 1 has 3 elements, found 4",
        ),
    ];
    for (case, edit, needle) in cases {
        let mut value = valid.clone();
        edit(&mut value);
        malformed(Payload::decode(&value.bytes()), needle, case);
    }
    let mut trailing = valid.bytes();
    trailing.extend([0x90, 0x90]);
    malformed(Payload::decode(&trailing), "2 trailing bytes", "trailing bytes");
    let bytes = valid.bytes();
    for len in 0..bytes.len() {
        let result = Payload::decode(&bytes[..len]);
        assert!(
            matches!(&result, Err(Error::Malformed(m)) if m.starts_with("payload: ")),
            "prefix {len}: {result:?}"
        );
    }
}

#[test]
fn base64_is_standard_and_padded() {
    assert_eq!(encode_base64(b"\x93\x01\x28\x90"), "kwEokA==");
    assert_eq!(decode_base64(b"kwEokA==").unwrap(), b"\x93\x01\x28\x90");
    for bad in [
        &b"kwEokA"[..],
        b"kwEokA=",
        b"kwE-kA==",
        b"kwEo kA==",
        b"kwEokA==\n",
        b"kwEokA====",
    ] {
        malformed(decode_base64(bad), "base64", &String::from_utf8_lossy(bad));
    }
}

/// A version-4 extension's short last value is one `u64` or none, and only
/// where the group's positions hold the request's last token: two values,
/// or one on a group that ends before the last token, are refused with a
/// message naming the group (SPEC section 9).
#[test]
fn a_short_last_value_of_two_or_off_the_last_position_is_refused() {
    let mut rng = Rng::for_test("a_short_last_value_of_two_or_off_the_last_position_is_refused");
    let seed = rng.seed();
    let short = 0x5A5A_0123_4567_89ABu64 ^ (rng.next_u64() & 0xFFFF);
    let mut payload = |first_position: u64, positions: usize| Payload {
        num_tokens: 300,
        groups: vec![PayloadGroup {
            group_id: 1,
            fingerprint: rng.next_u64(),
            first_position,
            values: (0..positions).map(|_| rng.next_u64() | 1).collect(),
        }],
        extension: Some(Extension {
            producer_tp_size: 1,
            groups: vec![ExtensionGroup {
                group_id: 1,
                block_size: 16,
                layers: Vec::new(),
                coverage: Some(rng.next_u64()),
                marks: Some(rng.next_u64()),
                decodings: Vec::new(),
                short_last: Some(short),
                geometry: Vec::new(),
            }],
            algorithm: kvcsum::Algorithm::Mixed2,
        }),
    };
    // Positions 2..22 of 16 tokens hold token 299 (position 18): valid.
    let valid = payload(2, 20).encode();
    let decoded = Payload::decode(&valid).unwrap_or_else(|e| panic!("seed {seed}: {e:?}"));
    assert_eq!(
        decoded.extension.unwrap().groups[0].short_last,
        Some(short),
        "seed {seed}"
    );
    // Two values: the bin8 of 8 bytes holding `short` made one of 16.
    let needle: Vec<u8> = [&[0xc4u8, 8][..], &short.to_le_bytes()].concat();
    let at = valid
        .windows(needle.len())
        .position(|w| w == needle)
        .unwrap_or_else(|| panic!("seed {seed}: the short last value's bin is not in {valid:02x?}"));
    let mut two = valid[..at].to_vec();
    two.extend_from_slice(&[0xc4, 16]);
    two.extend_from_slice(&short.to_le_bytes());
    two.extend_from_slice(&short.to_le_bytes());
    two.extend_from_slice(&valid[at + needle.len()..]);
    malformed(
        Payload::decode(&two),
        "group 1's short_last holds 2 values, not at most 1",
        "two values",
    );
    // Positions 0..10 end at token 160, before the last.
    malformed(
        Payload::decode(&payload(0, 10).encode()),
        "group 1 has a short last value but its positions 0..10",
        "off the last position",
    );
}

/// Valid encodings mutated many ways (bit flips, byte changes, insertions,
/// deletions, truncations, huge lengths) never panic and always decode or
/// fail with a `Malformed` message. A short, seeded pass for every test run;
/// `scripts/fuzz.sh` runs the long, coverage-guided version.
#[test]
fn mutated_encodings_never_panic() {
    let mut rng = Rng::for_test("mutated_encodings_never_panic");
    let seed = rng.seed();
    let payload = Payload {
        num_tokens: 300,
        groups: vec![PayloadGroup {
            group_id: 1,
            fingerprint: rng.next_u64(),
            first_position: 2,
            values: (0..20).map(|_| rng.next_u64()).collect(),
        }],
        extension: Some(Extension {
            producer_tp_size: 2,
            groups: vec![ExtensionGroup {
                group_id: 1,
                block_size: 16,
                layers: vec![LayerPartial {
                    layer_number: 3,
                    first_head: 0,
                    num_heads: 8,
                    replica: FIRST_COPY,
                    values: (0..20).map(|_| rng.next_u64()).collect(),
                }],
                coverage: Some(rng.next_u64()),
                marks: Some(rng.next_u64()),
                decodings: vec![(
                    3,
                    kvcsum::LayerDecoding::from_parts("fp8_e4m3", 128, 0.0625f64.to_bits(), 0.125f64.to_bits())
                        .unwrap(),
                )],
                // Position 18 holds token 299, the last.
                short_last: Some(rng.next_u64()),
                geometry: vec![kvcsum::LayerGeometry {
                    layer_number: 3,
                    first_head: 0,
                    num_heads: 8,
                    cell_bytes: 256,
                    k_bytes: 128,
                }],
            }],
            algorithm: kvcsum::Algorithm::Mixed,
        }),
    };
    let seeds = [record_value().bytes(), payload.encode()];
    for iteration in 0..20_000u32 {
        let mut bytes = seeds[iteration as usize % 2].clone();
        for _ in 0..=rng.below(4) {
            let at = rng.below(bytes.len() as u64 + 1) as usize;
            match rng.below(6) {
                0 if at < bytes.len() => bytes[at] ^= 1 << rng.below(8),
                1 if at < bytes.len() => bytes[at] = rng.next_u64() as u8,
                2 => bytes.insert(at, *rng.pick(&[0xdd, 0xc6, 0xdb, 0xcf, 0xff, 0x00, 0x9f])),
                3 if at < bytes.len() => {
                    bytes.remove(at);
                }
                4 => bytes.truncate(at),
                _ => bytes.splice(at..at, [0xff; 4]).for_each(drop),
            }
        }
        for result in [Record::decode(&bytes).map(|_| ()), Payload::decode(&bytes).map(|_| ())] {
            if let Err(error) = result {
                assert!(
                    matches!(&error, Error::Malformed(m) if m.len() > 10),
                    "seed {seed}, iteration {iteration}: {error:?} for {bytes:02x?}"
                );
            }
        }
    }
}

/// The checked-in fuzz seeds (written with Python's msgspec) are valid
/// inputs, so the fuzzers start from the full format.
#[test]
fn fuzz_seeds_decode() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("fuzz/seeds");
    let mut count = 0;
    for target in ["record", "payload"] {
        for entry in std::fs::read_dir(root.join(target)).expect("fuzz/seeds") {
            let path = entry.unwrap().path();
            let bytes = std::fs::read(&path).unwrap();
            let bytes = if path.extension().is_some_and(|e| e == "b64") {
                decode_base64(&bytes).unwrap()
            } else {
                bytes
            };
            match target {
                "record" => drop(Record::decode(&bytes).unwrap_or_else(|e| panic!("{}: {e}", path.display()))),
                _ => drop(Payload::decode(&bytes).unwrap_or_else(|e| panic!("{}: {e}", path.display()))),
            }
            count += 1;
        }
    }
    assert!(count >= 8, "{count} seeds");
}

/// A payload with a version-1 extension (no algorithm, groups without a
/// coverage) re-encodes as version 1, so it decodes equal (found by the
/// payload fuzzer when version 2 gained the coverage).
#[test]
fn a_version_1_extension_round_trips() {
    let mut v1 = payload_value();
    *v1.at(&[3, 0]) = V::U(1);
    if let V::A(items) = v1.at(&[3]) {
        items.pop();
    }
    if let V::A(items) = v1.at(&[3, 2, 0]) {
        items.truncate(3);
    }
    let payload = Payload::decode(&v1.bytes()).expect("version 1");
    assert_eq!(payload.extension.as_ref().unwrap().groups[0].coverage, None);
    assert_eq!(Payload::decode(&payload.encode()).expect("re-encoded"), payload);
    assert_eq!(payload.encode(), v1.bytes(), "the same bytes");
}

// ---------------------------------------------------------------------------
// Declared lengths under an address-space limit

#[test]
fn payloads_declaring_huge_lengths_give_unverified_reports_under_a_memory_limit() {
    under_address_space_limit(
        concat!(
            module_path!(),
            "::payloads_declaring_huge_lengths_give_unverified_reports_under_a_memory_limit"
        ),
        || {
            let (verifier, _blocks) = consumer_with_record(&simple_record(vec![5], 16), 1, 16);
            let n = 100 << 20;
            let mut cases: Vec<(&str, Vec<u8>)> = Vec::new();
            // [1, 100, array32 of n groups] + n zero bytes.
            let mut prefix = vec![0x93, 1, 100];
            prefix.extend(array32(n));
            cases.push(("groups", padded(&prefix, n)));
            // The extension's groups: [1, 16, [], [1, 1, array32 of n]].
            let mut prefix = vec![0x94, 1, 16, 0x90, 0x93, 1, 1];
            prefix.extend(array32(n));
            cases.push(("extension groups", padded(&prefix, n)));
            // One extension group's layers.
            let mut prefix = vec![0x94, 1, 16, 0x91, 0x94, 0, 7, 0, 0xc4, 8, 5, 0, 0, 0, 0, 0, 0, 0];
            prefix.extend([0x93, 1, 1, 0x91, 0x93, 0, 16]);
            prefix.extend(array32(n));
            cases.push(("extension layers", padded(&prefix, n)));
            for (what, payload) in &cases {
                let report = verifier.check("req", payload).expect("check");
                assert_eq!(report.verdict(), UNVERIFIED, "{what}");
                assert_eq!(
                    reason_name(report.reason()),
                    "KVCS_UNVERIFIED_INVALID_CHECKSUMS",
                    "{what}"
                );
            }
            // The same as base64 text.
            let mut text = vec![0u8; cases[0].1.len().div_ceil(3) * 4 + 1];
            let mut len = 0usize;
            assert_eq!(
                kvcs_base64_encode(
                    cases[0].1.as_ptr(),
                    cases[0].1.len(),
                    text.as_mut_ptr().cast(),
                    text.len(),
                    &mut len
                ),
                KVCS_OK
            );
            drop(cases);
            let req_id = CString::new("req").unwrap();
            let mut out = null_mut();
            assert_eq!(
                kvcs_verifier_check_base64(verifier.0, req_id.as_ptr(), text.as_ptr().cast(), &mut out),
                KVCS_OK
            );
            let report = CReport(out);
            assert_eq!(reason_name(report.reason()), "KVCS_UNVERIFIED_INVALID_CHECKSUMS");
            // Many real elements: a million one-value groups decode and compare.
            let mut w = Msgpack::default();
            w.array(3).uint(1).uint(16).array(1 << 20);
            for id in 0..1u64 << 20 {
                w.array(4).uint(id).uint(7).uint(0).u64s(&[5]);
            }
            let report = verifier.check("req", &w.0).expect("check");
            assert_eq!(report.verdict(), MATCH, "{}", report.message());
        },
    );
}

#[test]
fn records_declaring_huge_lengths_are_malformed_under_a_memory_limit() {
    under_address_space_limit(
        concat!(
            module_path!(),
            "::records_declaring_huge_lengths_are_malformed_under_a_memory_limit"
        ),
        || {
            let verifier = CVerifier::new(1);
            let n = 60 << 20;
            let head = |w: &mut Msgpack| {
                w.array(8).str("kvcsum.record").uint(4);
                w.array(3).uint(0).uint(1).uint(0);
                w.uint(1).bool(true);
            };
            // A registered group up to its coverage (group 0, block size 16).
            let group = |w: &mut Msgpack| {
                w.array(9).uint(0).uint(16).uint(7).uint(0);
                w.bool(false).bool(true).bool(false);
            };
            let mut prefixes: Vec<(&str, Vec<u8>)> = Vec::new();
            // The record's groups, a group's coverage and decodings.
            let mut w = Msgpack::default();
            head(&mut w);
            prefixes.push(("groups", w.0.clone()));
            w.array(1);
            group(&mut w);
            prefixes.push(("coverage", w.0.clone()));
            w.array(0);
            prefixes.push(("decodings", w.0));
            // Its requests.
            let mut w = Msgpack::default();
            head(&mut w);
            w.array(1);
            group(&mut w);
            w.array(0).array(0);
            prefixes.push(("requests", w.0));
            // A request's groups, a group's columns and layers, skipped groups.
            let mut w = Msgpack::default();
            head(&mut w);
            w.array(1);
            group(&mut w);
            w.array(0).array(0).array(1).array(4).str("req").uint(16);
            let request = w.0.clone();
            prefixes.push(("request groups", request.clone()));
            let mut w = Msgpack(request.clone());
            w.array(1).array(6).uint(0).uint(0).uint(0);
            prefixes.push(("columns", w.0.clone()));
            w.array(0);
            prefixes.push(("layers", w.0));
            let mut w = Msgpack(request);
            w.array(0);
            prefixes.push(("skipped groups", w.0));
            for (what, prefix) in prefixes {
                let mut prefix = prefix;
                prefix.extend(array32(n));
                let record = padded(&prefix, n);
                assert_eq!(status_of(&verifier.add(&record)), KVCS_ERR_MALFORMED, "{what}");
            }
        },
    );
}
