//! Layers that read another layer's cache (vLLM's KV sharing): registered
//! with `kvcs_worker_add_alias`, they count in the group fingerprint exactly
//! as vLLM's `_group_fingerprint` counts every layer name of a group (SPEC
//! section 7), they add no checksum, and their alias marks travel in the
//! payload extension beside the fingerprint, so that a plain payload
//! (vLLM's) of a model with KV sharing verifies while a side where a layer
//! is an alias never compares with one where it has its own cache.
//!
//! The vLLM side is computed by Python's own `hashlib` (stdlib only; the
//! interpreter is `KVCS_PYTHON` or `python3`), from identities that Python
//! writes as vLLM does: the `repr` of (layer name, spec type, dtype).
//!
//! Reproduce a failure with the seed it printed:
//! `KVCS_TEST_SEED=<seed> cargo test --test it aliases::`.

use crate::support;

use std::ffi::CStr;
use std::process::Command;

use kvcsum::ffi::status::kvcs_last_error;
use kvcsum::ffi::status::kvcs_status::*;
use kvcsum::ffi::worker::*;
use kvcsum::payload::Payload;
use kvcsum::record::Record;
use kvcsum::verify::{Reason, Verdict, Verifier};
use kvcsum::{Algorithm, Alias, BlockSet, Error, Role, Worker};
use support::*;

const REQ: &str = "req-alias";

/// Layers with a cache of their own, and the sharing layers with their targets
/// (as in models whose upper layers reuse a lower layer's KV).
const OWN_LAYERS: [u32; 4] = [0, 1, 2, 3];
const SHARING: [(u32, u32); 3] = [(4, 2), (5, 3), (6, 2)];

/// Python's identities of layers 0..7 (one line each, hex of the repr's
/// UTF-8), then vLLM's group fingerprint over all of them.
const VLLM_FINGERPRINT: &str = r#"
import hashlib
identities = [repr((f"model.layers.{n}.self_attn.attn", "FullAttentionSpec", "torch.bfloat16")).encode()
              for n in range(7)]
for identity in identities:
    print(identity.hex())
# vLLM's _group_fingerprint: every layer name of the group counts, KV-sharing ones too.
total = sum(int.from_bytes(hashlib.sha256(i).digest()[:8], "little") for i in identities) % 2**64
print(total)
"#;

fn python() -> String {
    std::env::var("KVCS_PYTHON").unwrap_or_else(|_| "python3".to_owned())
}

/// Python's identities of layers 0..7 and the fingerprint vLLM gives them.
fn vllm_fingerprint() -> (Vec<Vec<u8>>, u64) {
    let output = Command::new(python())
        .args(["-c", VLLM_FINGERPRINT])
        .output()
        .unwrap_or_else(|e| panic!("running {} (set KVCS_PYTHON): {e}", python()));
    assert!(
        output.status.success(),
        "python failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    let text = String::from_utf8(output.stdout).expect("utf-8");
    let lines: Vec<&str> = text.lines().collect();
    let identities = lines[..7]
        .iter()
        .map(|line| {
            (0..line.len())
                .step_by(2)
                .map(|i| u8::from_str_radix(&line[i..i + 2], 16).unwrap())
                .collect()
        })
        .collect();
    (identities, lines[7].parse().expect("fingerprint"))
}

/// One engine side: TP workers over the own layers, with or without the
/// sharing layers registered as aliases.
struct Side {
    workers: Vec<Worker>,
    _placements: Vec<Placement>,
    blocks: BlockSet,
}

fn deploy(
    rng: &mut Rng,
    kv: &LogicalKv,
    tp_size: u32,
    kind: LayoutKind,
    table: &GroupTable,
    identities: &[Vec<u8>],
    aliases: bool,
) -> Side {
    deploy_sharing(
        rng,
        kv,
        tp_size,
        kind,
        table,
        identities,
        if aliases { &SHARING } else { &[] },
    )
}

/// [`deploy`] with the layers of `kv` as own caches and `sharing` as the
/// (alias, target) pairs.
fn deploy_sharing(
    rng: &mut Rng,
    kv: &LogicalKv,
    tp_size: u32,
    kind: LayoutKind,
    table: &GroupTable,
    identities: &[Vec<u8>],
    sharing: &[(u32, u32)],
) -> Side {
    let mut workers = Vec::new();
    let mut placements = Vec::new();
    for tp_rank in 0..tp_size {
        let mut worker = host_worker(tp_rank, tp_size, 0, 1);
        let shard = shard(kv, tp_rank, tp_size, 0, 1);
        let mut placement = Placement::for_shard(rng, kv, &shard, kind, 0, 16, table.block_ids.len() as u32 + 2);
        placement.write_request(kv, 0, &table.block_ids);
        worker.add_group(0, 16).unwrap();
        for region in placement.regions(&placement.host_bases()) {
            worker.add_region(region).unwrap();
        }
        for mut spec in placement.host_layer_specs() {
            spec.identity = identities[spec.layer_number as usize].clone();
            worker.add_layer(spec).unwrap();
        }
        for &(layer_number, target_layer_number) in sharing {
            let alias = Alias {
                layer_number,
                target_layer_number,
                identity: identities[layer_number as usize].clone(),
            };
            worker.add_alias(0, alias).unwrap();
        }
        workers.push(worker);
        placements.push(placement);
    }
    let request = TestRequest {
        req_id: REQ.to_owned(),
        num_tokens: kv.num_tokens(),
        tables: vec![table.clone()],
    };
    Side {
        workers,
        _placements: placements,
        blocks: block_set(&[request]),
    }
}

impl Side {
    fn records(&self, role: Role) -> Vec<Vec<u8>> {
        self.workers
            .iter()
            .map(|worker| {
                Record::from_checksums(&checksum(worker, &self.blocks, role))
                    .unwrap()
                    .encode()
            })
            .collect()
    }

    fn verifier(&self, role: Role) -> Verifier {
        let verifier = Verifier::new(self.workers.len() as u32).unwrap();
        verifier.expect(&self.blocks, role).unwrap();
        for record in self.records(role) {
            verifier.add_record(&record).unwrap();
        }
        verifier
    }

    fn payload(&self) -> Vec<u8> {
        self.verifier(Role::Producer).payload(REQ).unwrap().encode()
    }

    /// The consumer's report on `payload`.
    fn check(&self, payload: &[u8]) -> kvcsum::verify::Report {
        let verifier = self.verifier(Role::Consumer);
        // Every side here has 16-token blocks; a plain payload does not say
        // so, and the verifier never guesses it (SPEC section 10, reason 14).
        verifier.set_producer_block_size(0, 16).unwrap();
        verifier.check(REQ, Some(payload)).unwrap()
    }
}

fn model(rng: &mut Rng, num_tokens: u64) -> (LogicalKv, GroupTable) {
    let kv = LogicalKv::random(rng, KvShape::gqa(OWN_LAYERS.len() as u32, 4, 64, num_tokens));
    let count = positions_for(num_tokens, 16, 0, 0);
    let table = GroupTable {
        group_id: 0,
        first_position: 0,
        block_ids: BlockAllocator::new(rng, count as u32 + 2).take(count),
    };
    (kv, table)
}

/// What SPEC section 7 adds per alias: `LE_u64(SHA-256("kvcsum alias")[0..8]) | 1`.
fn alias_mark() -> u64 {
    use sha2::{Digest, Sha256};
    let digest = Sha256::digest(b"kvcsum alias");
    u64::from_le_bytes(digest[..8].try_into().unwrap()) | 1
}

#[test]
fn fingerprint_with_aliases_is_vllms_and_the_extension_carries_the_alias_marks() {
    let mut rng = Rng::for_test("fingerprint_with_aliases_is_vllms_and_the_extension_carries_the_alias_marks");
    let seed = rng.seed();
    let (identities, vllm) = vllm_fingerprint();
    let (kv, table) = model(&mut rng, 83);
    let with = deploy(&mut rng, &kv, 2, LayoutKind::Hnd, &table, &identities, true);
    let without = deploy(&mut rng, &kv, 2, LayoutKind::Nhd, &table, &identities, false);
    let payload = Payload::decode(&with.payload()).unwrap();
    // Every identity counts as vLLM counts it, and nothing else: the 3
    // aliases' marks travel beside it in the extension, so that a layer
    // that is an alias on one side and has its own cache on the other
    // does not compare.
    assert_eq!(payload.groups[0].fingerprint, vllm, "vLLM's fingerprint of 7 layers");
    let extension = payload.extension.as_ref().expect("MIXED values carry the extension");
    assert_eq!(
        extension.groups[0].marks,
        Some(alias_mark().wrapping_mul(3)),
        "3 alias marks"
    );
    let plain = Payload::decode(&without.payload()).unwrap();
    assert_ne!(
        plain.groups[0].fingerprint, vllm,
        "without the aliases 3 layers are missing"
    );
    assert_eq!(
        payload.groups[0].values,
        naive_full(&kv, 16, 0, table.block_ids.len()),
        "aliases add no checksum (seed {seed})"
    );
    assert_eq!(payload.groups[0].values, plain.groups[0].values, "seed {seed}");
}

#[test]
fn consumer_with_the_same_aliases_matches_and_without_them_is_unverified() {
    let mut rng = Rng::for_test("consumer_with_the_same_aliases_matches_and_without_them_is_unverified");
    let seed = rng.seed();
    let (identities, _) = vllm_fingerprint();
    let (kv, table) = model(&mut rng, 100);
    let producer = deploy(&mut rng, &kv, 1, LayoutKind::Hnd, &table, &identities, true);
    let payload = producer.payload();
    let consumer = deploy(&mut rng, &kv, 4, LayoutKind::KvSplit, &table, &identities, true);
    let report = consumer.verifier(Role::Consumer).check(REQ, Some(&payload)).unwrap();
    assert_eq!(report.verdict, Verdict::Match, "seed {seed}: {}", report.message);
    let forgetful = deploy(&mut rng, &kv, 4, LayoutKind::KvSplit, &table, &identities, false);
    let report = forgetful.verifier(Role::Consumer).check(REQ, Some(&payload)).unwrap();
    assert_eq!(report.verdict, Verdict::Unverified, "seed {seed}: {}", report.message);
    assert_eq!(report.reason(), Some(Reason::FingerprintDiffers), "{}", report.message);
}

/// A model of `num_layers` layers with caches of their own, on the same
/// block table as [`model`]'s.
fn model_of(rng: &mut Rng, num_layers: u32, num_tokens: u64, table: &GroupTable) -> LogicalKv {
    let kv = LogicalKv::random(rng, KvShape::gqa(num_layers, 4, 64, num_tokens));
    assert!(positions_for(num_tokens, 16, 0, 0) <= table.block_ids.len());
    kv
}

#[test]
fn kv_sharing_with_a_plain_payload_verifies() {
    // vLLM's fork sends plain payloads (WEIGHTED, no extension) whose
    // fingerprint counts every layer name and no mark: a kvcsum consumer
    // with the same KV sharing verifies them, and still sees a flipped bit.
    with_algorithm(Algorithm::Weighted, || {
        let mut rng = Rng::for_test("kv_sharing_with_a_plain_payload_verifies");
        let seed = rng.seed();
        let (identities, vllm) = vllm_fingerprint();
        let (kv, table) = model(&mut rng, 90);
        let producer = deploy(&mut rng, &kv, 2, LayoutKind::Nhd, &table, &identities, true);
        let payload = producer.payload();
        let decoded = Payload::decode(&payload).unwrap();
        assert!(
            decoded.extension.is_none(),
            "a WEIGHTED producer sends vLLM's plain payload"
        );
        assert_eq!(decoded.groups[0].fingerprint, vllm, "the fork's fingerprint, no mark");
        let mut consumer = deploy(&mut rng, &kv, 4, LayoutKind::KvSplit, &table, &identities, true);
        let report = consumer.check(&payload);
        assert_eq!(report.verdict, Verdict::Match, "seed {seed}: {}", report.message);
        // One bit of layer 2 (the target of two aliases) at a random position.
        let position = rng.below(table.block_ids.len() as u64 - 1) as usize;
        let spec = consumer._placements[1].spec().clone();
        let bit = 1u8 << rng.below(8);
        consumer._placements[1].xor_byte(2, spec.first_head, table.block_ids[position], 3, 5, bit);
        let report = consumer.check(&payload);
        assert_eq!(report.verdict, Verdict::Mismatch, "seed {seed}: {}", report.message);
        assert_eq!(report.mismatches.len(), 1, "seed {seed}: {}", report.message);
        assert_eq!(report.mismatches[0].first_position, position as u64, "seed {seed}");
    });
}

#[test]
fn alias_and_own_cache_sides_never_compare() {
    // Layer 4 reads layer 2's cache on one side and has a cache of its own
    // on the other: both fingerprints count the same 7 identities, and the
    // marks the extension carries tell the sides apart, under either
    // algorithm and in either direction.
    for_each_algorithm(|algorithm| {
        let mut rng = Rng::for_test("alias_and_own_cache_sides_never_compare");
        let seed = rng.seed();
        let (identities, vllm) = vllm_fingerprint();
        let (shared, table) = model(&mut rng, 77);
        let own = model_of(&mut rng, 5, 77, &table);
        let aliased = |rng: &mut Rng, tp| deploy(rng, &shared, tp, LayoutKind::Hnd, &table, &identities, true);
        let owning =
            |rng: &mut Rng, tp| deploy_sharing(rng, &own, tp, LayoutKind::Nhd, &table, &identities, &[(5, 3), (6, 2)]);
        for (producer, consumer, what) in [
            (aliased(&mut rng, 2), owning(&mut rng, 1), "alias -> own cache"),
            (owning(&mut rng, 2), aliased(&mut rng, 4), "own cache -> alias"),
        ] {
            let verifier = producer.verifier(Role::Producer);
            verifier.set_extension(true).unwrap();
            let payload = verifier.payload(REQ).unwrap();
            assert_eq!(
                payload.groups[0].fingerprint, vllm,
                "{what}: the plain fingerprints agree"
            );
            let report = consumer.check(&payload.encode());
            assert_eq!(
                report.verdict,
                Verdict::Unverified,
                "{algorithm:?}, {what}, seed {seed}: {}",
                report.message
            );
            assert_eq!(report.reason(), Some(Reason::FingerprintDiffers), "{}", report.message);
            assert!(report.message.contains("alias"), "{what}: {}", report.message);
        }
    });
}

#[test]
fn a_version_2_extension_compares_under_its_fingerprint_that_counted_the_marks() {
    // kvcsum 0.2.0 sent the fingerprint plus the marks, and no marks
    // beside it. A consumer compares such a payload exactly where 0.2.0
    // did: where its own fingerprint plus marks is the one sent. It cannot
    // tell other identities from other marks then (both are "another
    // fingerprint"), and it never compares an alias with an own cache.
    let mut rng = Rng::for_test("a_version_2_extension_compares_under_its_fingerprint_that_counted_the_marks");
    let seed = rng.seed();
    let (identities, vllm) = vllm_fingerprint();
    let (shared, table) = model(&mut rng, 66);
    let own = model_of(&mut rng, 7, 66, &table);
    let as_version_2 = |side: &Side| {
        let mut payload = side.verifier(Role::Producer).payload(REQ).unwrap();
        let extension = payload.extension.as_mut().expect("MIXED values carry the extension");
        for (group, entry) in payload.groups.iter_mut().zip(&mut extension.groups) {
            group.fingerprint = group
                .fingerprint
                .wrapping_add(entry.marks.take().expect("version 4 marks"));
            entry.short_last = None;
            entry.geometry.clear();
        }
        assert_eq!(extension.version(), 2);
        payload.encode()
    };
    let aliased = deploy(&mut rng, &shared, 2, LayoutKind::Hnd, &table, &identities, true);
    let no_aliases = deploy_sharing(&mut rng, &own, 1, LayoutKind::Nhd, &table, &identities, &[]);
    let consumer = deploy(&mut rng, &shared, 4, LayoutKind::KvSplit, &table, &identities, true);
    let old = as_version_2(&aliased);
    assert_eq!(
        Payload::decode(&old).unwrap().groups[0].fingerprint,
        vllm.wrapping_add(alias_mark().wrapping_mul(3))
    );
    let report = consumer.check(&old);
    assert_eq!(report.verdict, Verdict::Match, "seed {seed}: {}", report.message);
    // 0.2.0 without aliases (all 7 layers with caches of their own): its
    // fingerprint is vLLM's, which the consumer's plus its marks is not.
    let report = consumer.check(&as_version_2(&no_aliases));
    assert_eq!(report.verdict, Verdict::Unverified, "seed {seed}: {}", report.message);
    assert_eq!(report.reason(), Some(Reason::FingerprintDiffers), "{}", report.message);
    assert!(report.message.contains("version-2"), "{}", report.message);
    // And 0.2.0 with aliases to a consumer whose layers have their own caches.
    let owner = deploy_sharing(&mut rng, &own, 2, LayoutKind::Hnd, &table, &identities, &[]);
    let report = owner.check(&old);
    assert_eq!(report.verdict, Verdict::Unverified, "seed {seed}: {}", report.message);
    assert_eq!(report.reason(), Some(Reason::FingerprintDiffers), "{}", report.message);
}

#[test]
fn a_plain_payload_with_the_marks_counted_still_verifies() {
    // A kvcsum 0.2.0 producer without extension (WEIGHTED) sent the
    // fingerprint plus the marks in a plain payload: either convention of
    // a plain payload is one the consumer can be sure of.
    with_algorithm(Algorithm::Weighted, || {
        let mut rng = Rng::for_test("a_plain_payload_with_the_marks_counted_still_verifies");
        let seed = rng.seed();
        let (identities, vllm) = vllm_fingerprint();
        let (kv, table) = model(&mut rng, 50);
        let producer = deploy(&mut rng, &kv, 1, LayoutKind::Hnd, &table, &identities, true);
        let mut payload = Payload::decode(&producer.payload()).unwrap();
        assert!(payload.extension.is_none());
        payload.groups[0].fingerprint = vllm.wrapping_add(alias_mark().wrapping_mul(3));
        let consumer = deploy(&mut rng, &kv, 2, LayoutKind::Nhd, &table, &identities, true);
        let report = consumer.check(&payload.encode());
        assert_eq!(report.verdict, Verdict::Match, "seed {seed}: {}", report.message);
        // Two marks where the consumer has three is another fingerprint.
        payload.groups[0].fingerprint = vllm.wrapping_add(alias_mark().wrapping_mul(2));
        let report = consumer.check(&payload.encode());
        assert_eq!(
            report.reason(),
            Some(Reason::FingerprintDiffers),
            "seed {seed}: {}",
            report.message
        );
    });
}

#[test]
fn bad_aliases_are_rejected_and_change_nothing() {
    let mut rng = Rng::for_test("bad_aliases_are_rejected_and_change_nothing");
    let (identities, _) = vllm_fingerprint();
    let (kv, table) = model(&mut rng, 40);
    let mut side = deploy(&mut rng, &kv, 1, LayoutKind::Hnd, &table, &identities, false);
    let worker = &mut side.workers[0];
    worker.add_group(9, 32).unwrap();
    let alias = |layer_number, target_layer_number| Alias {
        layer_number,
        target_layer_number,
        identity: b"x".to_vec(),
    };
    let before = Record::from_checksums(&checksum(worker, &side.blocks, Role::Producer))
        .unwrap()
        .encode();
    type Case = (u32, Alias, fn(&Error) -> bool, &'static str);
    let cases: [Case; 5] = [
        (7, alias(4, 2), |e| matches!(e, Error::NotFound(_)), "group_id 7"),
        (
            0,
            alias(4, 9),
            |e| matches!(e, Error::NotFound(_)),
            "target_layer_number 9",
        ),
        (
            9,
            alias(4, 2),
            |e| matches!(e, Error::NotFound(_)),
            "target_layer_number 2",
        ),
        (
            0,
            alias(1, 2),
            |e| matches!(e, Error::InvalidArgument(_)),
            "layer_number 1",
        ),
        (
            0,
            alias(2, 2),
            |e| matches!(e, Error::InvalidArgument(_)),
            "names itself",
        ),
    ];
    for (group_id, alias, kind, names) in cases {
        let error = worker.add_alias(group_id, alias).unwrap_err();
        assert!(kind(&error), "{error}");
        assert!(error.to_string().contains(names), "{error} names {names}");
    }
    worker.add_alias(0, alias(4, 2)).unwrap();
    let error = worker.add_alias(0, alias(4, 3)).unwrap_err();
    assert!(
        error.to_string().contains("layer_number 4 is already registered"),
        "{error}"
    );
    // A real layer may not take an alias's number either.
    let mut spec = side._placements[0].host_layer_specs()[0].clone();
    spec.layer_number = 4;
    let error = side.workers[0].add_layer(spec).unwrap_err();
    assert!(error.to_string().contains("alias"), "{error}");
    // The failed calls changed nothing: only the one alias was added.
    let after = Record::from_checksums(&checksum(&side.workers[0], &side.blocks, Role::Producer))
        .unwrap()
        .encode();
    assert_ne!(before, after, "the good alias changed the fingerprint");
    let mut expected = deploy(&mut rng, &kv, 1, LayoutKind::Hnd, &table, &identities, false);
    expected.workers[0].add_group(9, 32).unwrap();
    expected.workers[0]
        .add_alias(
            0,
            Alias {
                identity: b"x".to_vec(),
                ..alias(4, 2)
            },
        )
        .unwrap();
    let expected = Record::from_checksums(&checksum(&expected.workers[0], &expected.blocks, Role::Producer))
        .unwrap()
        .encode();
    assert_eq!(after, expected, "exactly the good alias is registered");
}

#[test]
fn c_api_add_alias_checks_its_arguments() {
    let options = kvcs_worker_options {
        tp_rank: 0,
        tp_size: 1,
        pp_rank: 0,
        device: -1,
        num_threads: 1,
    };
    let mut worker = std::ptr::null_mut();
    assert_eq!(kvcs_worker_create(&options, &mut worker), KVCS_OK);
    let last_error = || {
        // SAFETY: kvcs_last_error gives a NUL-terminated string that lives
        // until this thread's next call into the library.
        unsafe { CStr::from_ptr(kvcs_last_error()) }
            .to_string_lossy()
            .into_owned()
    };
    assert_eq!(
        kvcs_worker_add_alias(std::ptr::null_mut(), 0, 1, 0, std::ptr::null(), 0),
        KVCS_ERR_INVALID_ARGUMENT
    );
    assert!(last_error().contains("worker"), "{}", last_error());
    assert_eq!(
        kvcs_worker_add_alias(worker, 0, 1, 0, std::ptr::null(), 5),
        KVCS_ERR_INVALID_ARGUMENT
    );
    assert!(last_error().contains("identity"), "{}", last_error());
    assert_eq!(
        kvcs_worker_add_alias(worker, 0, 1, 0, b"id".as_ptr(), 2),
        KVCS_ERR_NOT_FOUND
    );
    assert!(last_error().contains("group_id 0"), "{}", last_error());
    assert_eq!(kvcs_worker_add_group(worker, 0, 16), KVCS_OK);
    assert_eq!(
        kvcs_worker_add_alias(worker, 0, 1, 0, b"id".as_ptr(), 2),
        KVCS_ERR_NOT_FOUND
    );
    assert!(last_error().contains("target_layer_number 0"), "{}", last_error());
    kvcs_worker_destroy(worker);
}
