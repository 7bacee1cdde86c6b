//! The verdict rule's wrong verdicts, silent passes and the stored-buffer
//! crash, each through the C ABI as an engine calls it (`kvcsum::ffi`), on
//! fresh random KV and state: a configuration difference gives UNVERIFIED
//! with its reason (or an error at registration), never MISMATCH; data never
//! read never gives MATCH. Each test names its defect (K1, K4 .. K11, S1) and
//! also shows that a corrupted byte is still found where it can be.
//!
//! Reproduce a failure with the seed it printed:
//! `KVCS_TEST_SEED=<seed> cargo test --release --test it verdicts::<name>`.

use crate::support;

use kvcsum::ffi::constants::KVCS_BLOCK_CHECKSUM_BYTES;
use kvcsum::ffi::report::kvcs_unverified_reason::{self, *};
use kvcsum::ffi::result::kvcs_stored_outcome::*;
use kvcsum::ffi::status::kvcs_status::*;
use kvcsum::StateSpec;

use support::handles::*;
use support::state::{place_rank, random_state, LogicalState, RankCaches};
use support::*;

const REQ: &str = "req-verdicts";
const HASH_BYTES: usize = 32;

/// The identity an engine registers for an attention layer.
fn identity(layer: u32) -> Vec<u8> {
    format!("('model.layers.{layer}.self_attn.attn', 'FullAttentionSpec', 'bfloat16')").into_bytes()
}

/// Another identity of the same layer (another dtype, say).
fn other_identity(layer: u32) -> Vec<u8> {
    format!("('model.layers.{layer}.self_attn.attn', 'FullAttentionSpec', 'float8_e4m3')").into_bytes()
}

// ---------------------------------------------------------------------------
// Attention sides through the C ABI

/// One TP deployment of one attention group holding one request.
struct Side {
    workers: Vec<CWorker>,
    placements: Vec<Placement>,
    table: GroupTable,
    blocks: CBlocks,
    block_size: u32,
}

/// How an attention side registers its layers.
#[derive(Clone, Copy)]
struct AttentionPlan {
    group_id: u32,
    tp_size: u32,
    kind: LayoutKind,
    block_size: u32,
    /// `(layer, target)`: register `layer` as an alias of `target` rather
    /// than with its own cache.
    alias: Option<(u32, u32)>,
    /// Positions scheduled past those holding tokens (they sum to 0).
    extra_positions: usize,
}

fn plan(tp_size: u32, kind: LayoutKind, block_size: u32) -> AttentionPlan {
    AttentionPlan {
        group_id: 0,
        tp_size,
        kind,
        block_size,
        alias: None,
        extra_positions: 0,
    }
}

/// Registers `plan`'s group and `placement`'s layers on `worker` (the alias
/// instead of its layer's cache), with identities from `identity_of`.
fn register_attention(
    worker: &CWorker,
    placement: &Placement,
    plan: &AttentionPlan,
    identity_of: &dyn Fn(u32) -> Vec<u8>,
) -> Result<(), Failure> {
    worker.group(plan.group_id, plan.block_size)?;
    for region in placement.regions(&placement.host_bases()) {
        worker.region(region.address, region.length)?;
    }
    for mut spec in placement.host_layer_specs() {
        if plan.alias.is_some_and(|(layer, _)| layer == spec.layer_number) {
            continue;
        }
        spec.identity = identity_of(spec.layer_number);
        worker.layer(&spec)?;
    }
    if let Some((layer, target)) = plan.alias {
        worker.alias(plan.group_id, layer, target, &identity_of(layer))?;
    }
    Ok(())
}

/// A side holding `kv` at fresh scattered blocks of its own.
fn attention_side(rng: &mut Rng, kv: &LogicalKv, plan: AttentionPlan, identity_of: &dyn Fn(u32) -> Vec<u8>) -> Side {
    let count = positions_for(kv.num_tokens(), plan.block_size, 0, plan.extra_positions);
    let num_blocks = count as u32 + 2;
    let table = GroupTable {
        group_id: plan.group_id,
        first_position: 0,
        block_ids: BlockAllocator::new(rng, num_blocks).take(count),
    };
    let mut workers = Vec::new();
    let mut placements = Vec::new();
    for tp_rank in 0..plan.tp_size {
        let worker = CWorker::host(tp_rank, plan.tp_size, 0).expect("worker");
        let shard = shard(kv, tp_rank, plan.tp_size, 0, 1);
        let mut placement =
            Placement::for_shard(rng, kv, &shard, plan.kind, plan.group_id, plan.block_size, num_blocks);
        placement.write_request(kv, 0, &table.block_ids);
        register_attention(&worker, &placement, &plan, identity_of).expect("register");
        workers.push(worker);
        placements.push(placement);
    }
    let blocks = CBlocks::of(&[TestRequest {
        req_id: REQ.to_owned(),
        num_tokens: kv.num_tokens(),
        tables: vec![table.clone()],
    }]);
    Side {
        workers,
        placements,
        table,
        blocks,
        block_size: plan.block_size,
    }
}

impl Side {
    /// Flips bits of one byte of the cell (layer, head, token) on every rank
    /// holding that head (every replica copy).
    fn corrupt(&mut self, layer: u32, head: u32, token: u64, byte: u32) {
        let block_size = self.block_size as u64;
        let block_id = self.table.block_ids[(token / block_size) as usize];
        for placement in &mut self.placements {
            let spec = placement.spec();
            if (spec.first_head..spec.first_head + spec.num_heads).contains(&head) {
                placement.xor_byte(layer, head, block_id, (token % block_size) as u32, byte, 0x24);
            }
        }
    }
}

/// Every worker's record of its side's blocks in `role`.
fn records<'a>(workers: impl IntoIterator<Item = &'a CWorker>, blocks: &CBlocks, role: u32) -> Vec<Vec<u8>> {
    workers
        .into_iter()
        .map(|worker| worker.record(blocks, role).expect("record"))
        .collect()
}

/// The producer's payload of `workers`' records.
fn payload_of(workers: &[CWorker], blocks: &CBlocks, extension: bool) -> Vec<u8> {
    let verifier = CVerifier::new(workers.len() as u32);
    verifier.extension(extension);
    verifier.expect(blocks, PRODUCER);
    for record in records(workers, blocks, PRODUCER) {
        verifier.add(&record).expect("add_record");
    }
    verifier.payload(REQ).expect("payload")
}

/// The consumer's report on `payload`, after `setup` of its verifier.
fn judge(workers: &[CWorker], blocks: &CBlocks, payload: &[u8], setup: &dyn Fn(&CVerifier)) -> CReport {
    let verifier = CVerifier::new(workers.len() as u32);
    setup(&verifier);
    verifier.expect(blocks, CONSUMER);
    for record in records(workers, blocks, CONSUMER) {
        verifier.add(&record).expect("add_record");
    }
    verifier.check(REQ, payload).expect("check")
}

fn no_setup(_: &CVerifier) {}

/// The report is UNVERIFIED for `reason`, its first finding, about
/// `group_id`, and that finding's message contains every needle.
#[track_caller]
fn assert_unverified(report: &CReport, reason: kvcs_unverified_reason, group_id: u32, needles: &[&str], seed: u64) {
    let message = report.message();
    assert_eq!(
        report.verdict(),
        UNVERIFIED,
        "{} (seed {seed}): {message}",
        report.verdict_name()
    );
    assert_eq!(
        reason_name(report.reason()),
        reason_name(reason as u32),
        "first finding (seed {seed}): {message}"
    );
    let findings = report.findings();
    let finding = findings
        .iter()
        .find(|f| f.reason == reason as u32 && f.group_id == group_id)
        .unwrap_or_else(|| panic!("no {reason:?} finding of group {group_id} (seed {seed}): {findings:?}"));
    for needle in needles {
        assert!(
            finding.message.contains(needle),
            "the finding does not say {needle:?} (seed {seed}): {}",
            finding.message
        );
    }
    assert!(!report.passed(), "fail-closed: an unverified load fails (seed {seed})");
}

#[track_caller]
fn assert_verdict(report: &CReport, verdict: u32, seed: u64) {
    assert_eq!(
        report.verdict(),
        verdict,
        "{} (seed {seed}): {}",
        report.verdict_name(),
        report.message()
    );
}

#[track_caller]
fn assert_failure(result: Result<(), Failure>, status: kvcsum::ffi::status::kvcs_status, needles: &[&str]) {
    let (got, message) = match result {
        Ok(()) => panic!("the call succeeded; {} was expected", status_name(status)),
        Err(failure) => failure,
    };
    assert_eq!(got, status, "{message}");
    for needle in needles {
        assert!(message.contains(needle), "the error does not say {needle:?}: {message}");
    }
}

/// Random GQA KV: `layers` layers of 4 heads of 32 bytes of K and of V.
fn random_kv(rng: &mut Rng, layers: u32, num_tokens: u64) -> LogicalKv {
    LogicalKv::random(rng, KvShape::gqa(layers, 4, 32, num_tokens))
}

/// A random byte of a random valid cell of `kv`.
fn random_cell(rng: &mut Rng, kv: &LogicalKv) -> (u32, u32, u64, u32) {
    let layer = *rng.pick(&kv.layer_numbers());
    let head = *rng.pick(&kv.heads());
    let token = rng.below(kv.num_tokens());
    let byte = rng.below(kv.cell_bytes() as u64) as u32;
    (layer, head, token, byte)
}

// ---------------------------------------------------------------------------
// Stored buffers through the C ABI

fn random_hashes(rng: &mut Rng, count: usize) -> Vec<u8> {
    let mut hashes = vec![0u8; count * HASH_BYTES];
    rng.fill(&mut hashes);
    hashes
}

/// The block set of one request of `kv` at `table`, with `hashes`.
fn hashed_blocks(num_tokens: u64, tables: &[(&GroupTable, &[u8])]) -> CBlocks {
    let blocks = CBlocks::new();
    blocks.request(REQ, num_tokens).expect("add_request");
    for (table, hashes) in tables {
        blocks.table(REQ, table).expect("add_group");
        blocks
            .hashes(REQ, table.group_id, hashes, HASH_BYTES)
            .expect("set_hashes");
    }
    blocks
}

/// A load check's outcomes of group `group_id` on every worker.
fn load_check(workers: &[CWorker], blocks: &CBlocks, group_id: u32) -> (Vec<Vec<u8>>, Vec<Vec<u8>>) {
    let mut outcomes = Vec::new();
    let mut records = Vec::new();
    for worker in workers {
        let result = worker.check_stored(blocks).expect("check_stored");
        outcomes.push(result.stored(REQ, group_id).expect("outcomes"));
        records.push(result.encode().expect("encode"));
    }
    (outcomes, records)
}

/// `kvcs_verifier_check_stored` on the load-check records.
fn judge_stored(num_workers: u32, blocks: &CBlocks, records: &[Vec<u8>]) -> CReport {
    let verifier = CVerifier::new(num_workers);
    verifier.expect(blocks, CONSUMER);
    for record in records {
        verifier.add(record).expect("add_record");
    }
    verifier.check_stored(REQ).expect("check_stored")
}

const FAILED: u8 = KVCS_STORED_FAILED as u8;
const MATCHED: u8 = KVCS_STORED_MATCHED as u8;
const OTHER_FINGERPRINT: u8 = KVCS_STORED_OTHER_FINGERPRINT as u8;

// ---------------------------------------------------------------------------
// K1

/// K1: `kvcs_worker_add_stored` on a host worker took address 0 or memory
/// outside every registered region, and `kvcs_worker_store` then wrote
/// there (SEGV).
#[test]
fn stored_buffers_at_address_0_or_outside_every_region_are_refused() {
    let mut rng = Rng::for_test("stored_buffers_at_address_0_or_outside_every_region_are_refused");
    let seed = rng.seed();
    let num_tokens = rng.range(17..120);
    let kv = random_kv(&mut rng, 2, num_tokens);
    let side = attention_side(&mut rng, &kv, plan(1, LayoutKind::Hnd, 16), &identity);
    let worker = &side.workers[0];
    let num_blocks = side.table.block_ids.len() + 2;
    let memory = StoredMemory::random(&mut rng, num_blocks);
    let before = memory.words.clone();
    let n = num_blocks as u64;

    assert_failure(
        worker.stored(0, 0, n),
        KVCS_ERR_INVALID_ARGUMENT,
        &["address is 0", "group_id 0"],
    );
    assert_failure(
        worker.stored(0, memory.address(), n),
        KVCS_ERR_OUT_OF_BOUNDS,
        &[
            "group_id 0",
            "no registered region",
            &format!("{:#x}", memory.address()),
        ],
    );
    // A region holding all but the last block's 16 bytes: still outside.
    worker
        .region(memory.address(), memory.bytes() - KVCS_BLOCK_CHECKSUM_BYTES)
        .expect("region");
    assert_failure(
        worker.stored(0, memory.address(), n),
        KVCS_ERR_OUT_OF_BOUNDS,
        &["no registered region", &format!("num_blocks {n}")],
    );
    // Nothing was registered: a store finds no buffer and writes nothing.
    let hashes = random_hashes(&mut rng, side.table.block_ids.len());
    let blocks = hashed_blocks(num_tokens, &[(&side.table, &hashes)]);
    let status = worker.store(&blocks).map(|_| ());
    assert_failure(
        status,
        KVCS_ERR_NOT_FOUND,
        &["no buffer of stored checksums", "group_id 0"],
    );
    assert_eq!(memory.words, before, "nothing written (seed {seed})");

    // Inside a region: accepted, and the store writes value and stamp per block.
    worker.region(memory.address(), memory.bytes()).expect("region");
    worker.stored(0, memory.address(), n).expect("add_stored");
    drop(worker.store(&blocks).expect("store"));
    let expected = naive_full(&kv, 16, 0, side.table.block_ids.len());
    let mut tags = vec![0u64; side.table.block_ids.len()];
    assert_eq!(block_tags(worker, 0, &hashes, &mut tags), KVCS_OK, "{}", last_error());
    // Full blocks (16 valid tokens) share the stamp's digest (its low 32
    // bits: configuration and tokens); its check (high 32) is the block's own.
    let digest = memory.entry(side.table.block_ids[0]).1 as u32;
    for (i, &block_id) in side.table.block_ids.iter().enumerate() {
        let (value, block_stamp) = memory.entry(block_id);
        assert_eq!(value ^ tags[i], expected[i], "position {i} (seed {seed})");
        if num_tokens >= 16 * (i as u64 + 1) {
            assert_eq!(
                block_stamp as u32, digest,
                "one digest per configuration and tokens (seed {seed})"
            );
        }
    }
    let (outcomes, _) = load_check(&side.workers, &blocks, 0);
    assert!(outcomes[0].iter().all(|&o| o == MATCHED), "{outcomes:?} (seed {seed})");
}

fn block_tags(worker: &CWorker, group_id: u32, hashes: &[u8], tags: &mut [u64]) -> kvcsum::ffi::status::kvcs_status {
    kvcsum::ffi::worker::kvcs_block_tags(
        worker.handle,
        group_id,
        hashes.as_ptr(),
        HASH_BYTES,
        tags.len(),
        tags.as_mut_ptr(),
    )
}

// ---------------------------------------------------------------------------
// K11

/// K11: a stored buffer overlapping the worker's own KV (a layer segment or
/// a state tensor), or one buffer shared by two groups, was accepted; the
/// store overwrote KV and the load gave MISMATCH.
#[test]
fn stored_buffers_overlapping_a_cache_or_another_groups_buffer_are_refused() {
    let mut rng = Rng::for_test("stored_buffers_overlapping_a_cache_or_another_groups_buffer_are_refused");
    let seed = rng.seed();
    let num_tokens = rng.range(17..100);
    let kv = random_kv(&mut rng, 2, num_tokens);
    let kind = *rng.pick(&all_kinds());
    let side = attention_side(&mut rng, &kv, plan(1, kind, 16), &identity);
    let worker = &side.workers[0];
    let positions = side.table.block_ids.len();
    let expected = naive_full(&kv, 16, 0, positions);
    let sums = |blocks: &CBlocks| {
        worker
            .checksum(blocks, CONSUMER)
            .expect("checksum")
            .position_sums(REQ, 0)
            .expect("sums")
    };
    assert_eq!(sums(&side.blocks), expected, "intact before (seed {seed})");

    // Over a layer's cache (inside its region, so only the overlap is wrong).
    let cache = &side.placements[0].buffers()[0];
    let words = cache.len() as u64 / 8;
    let inside = cache.address() + 8 * rng.range(words / 4..words * 3 / 4);
    assert_failure(
        worker.stored(0, inside, 2),
        KVCS_ERR_INVALID_ARGUMENT,
        &[
            "stored checksums of group_id 0",
            "overlap the cache of layer_number",
            "a store would overwrite KV",
        ],
    );

    // Over a state tensor of a state group.
    let state = random_state(&mut rng, &[20]);
    let caches = place_rank(&mut rng, &state, 0, 1, 2, true, 3, 1);
    worker.group(2, 16).expect("state group");
    for buffer in &caches.buffers {
        worker
            .region(buffer.as_ptr() as u64, buffer.len() as u64 * 8)
            .expect("region");
    }
    for spec in &caches.specs {
        worker.state(spec).expect("add_state");
    }
    let tensor = caches.specs[0].tensors[0].address & !7;
    assert_failure(
        worker.stored(2, tensor, 1),
        KVCS_ERR_INVALID_ARGUMENT,
        &["group_id 2", "overlap the cache of layer_number 20"],
    );

    // Two groups in one buffer; adjacent buffers are fine.
    let n = positions as u64 + 2;
    let memory = StoredMemory::random(&mut rng, 2 * n as usize);
    worker.region(memory.address(), memory.bytes()).expect("region");
    worker.stored(0, memory.address(), n).expect("group 0's buffer");
    let overlap = rng.range(1..n);
    assert_failure(
        worker.stored(2, memory.at(overlap as usize), n),
        KVCS_ERR_INVALID_ARGUMENT,
        &[
            "stored checksums of group_id 2",
            "overlap those of group_id 0",
            "a buffer of its own",
        ],
    );
    worker
        .stored(2, memory.at(n as usize), n)
        .expect("group 2's own buffer");

    // A layer registered later over a stored buffer.
    let later_kv = LogicalKv::random(
        &mut rng,
        KvShape {
            first_layer: 10,
            ..KvShape::gqa(1, 4, 32, num_tokens)
        },
    );
    let later = Placement::for_shard(
        &mut rng,
        &later_kv,
        &shard(&later_kv, 0, 1, 0, 1),
        LayoutKind::Hnd,
        3,
        16,
        4,
    );
    worker.group(3, 16).expect("group 3");
    for region in later.regions(&later.host_bases()) {
        worker.region(region.address, region.length).expect("region");
    }
    worker
        .stored(3, later.buffers()[0].address(), 1)
        .expect("group 3's buffer, no layer yet");
    let mut spec = later.host_layer_specs().remove(0);
    spec.identity = identity(10);
    assert_failure(
        worker.layer(&spec),
        KVCS_ERR_INVALID_ARGUMENT,
        &[
            "layer_number 10",
            "overlap the stored checksums of group_id 3",
            "a store would overwrite KV",
        ],
    );
    // ... and a state layer over one.
    let other_state = random_state(&mut rng, &[21]);
    let other = place_rank(&mut rng, &other_state, 0, 1, 4, true, 2, 0);
    worker.group(4, 16).expect("group 4");
    for buffer in &other.buffers {
        worker
            .region(buffer.as_ptr() as u64, buffer.len() as u64 * 8)
            .expect("region");
    }
    let first_tensor = other.specs[0].tensors[0].address & !7;
    worker
        .stored(4, first_tensor, 1)
        .expect("group 4's buffer, no state yet");
    assert_failure(
        worker.state(&other.specs[0]),
        KVCS_ERR_INVALID_ARGUMENT,
        &["state layer_number 21", "overlap the stored checksums of group_id 4"],
    );

    // Nothing of the refused calls was registered: group 3 holds no layer
    // (sums over nothing), and the store writes group 0's buffer only,
    // leaving the KV intact.
    let hashes = random_hashes(&mut rng, positions);
    let blocks = hashed_blocks(num_tokens, &[(&side.table, &hashes)]);
    drop(worker.store(&blocks).expect("store"));
    assert_eq!(
        sums(&side.blocks),
        expected,
        "the KV is intact after the store (seed {seed})"
    );
    let (outcomes, records) = load_check(&side.workers, &blocks, 0);
    assert!(outcomes[0].iter().all(|&o| o == MATCHED), "{outcomes:?} (seed {seed})");
    assert_verdict(&judge_stored(1, &blocks, &records), MATCH, seed);
    let empty = CBlocks::new();
    empty.request(REQ, num_tokens).unwrap();
    empty
        .table(
            REQ,
            &GroupTable {
                group_id: 3,
                first_position: 0,
                block_ids: vec![0, 1],
            },
        )
        .unwrap();
    let result = worker.checksum(&empty, CONSUMER).expect("checksum of group 3");
    assert_eq!(
        result.position_sums(REQ, 3).unwrap(),
        vec![0, 0],
        "group 3 has no layer"
    );
}

// ---------------------------------------------------------------------------
// K4

/// A consistent copy of `kv`'s first `num_tokens` tokens (a request sharing
/// its prefix).
fn prefix_of(rng: &mut Rng, kv: &LogicalKv, num_tokens: u64) -> LogicalKv {
    let mut shape = kv.shape;
    shape.num_tokens = num_tokens;
    let mut prefix = LogicalKv::random(rng, shape);
    for layer in kv.layer_numbers() {
        for head in kv.heads() {
            for token in 0..num_tokens {
                prefix
                    .cell_mut(layer, head, token)
                    .copy_from_slice(kv.cell(layer, head, token));
            }
        }
    }
    prefix
}

/// K4: a block id stored at two positions kept only the last write, so the
/// load check failed the other position on intact data. Refused at store
/// (and load check) time now, nothing written; the same block at the same
/// position of two requests (a shared prefix) is fine.
#[test]
fn a_block_id_at_two_positions_of_one_store_is_refused_and_nothing_is_written() {
    let mut rng = Rng::for_test("a_block_id_at_two_positions_of_one_store_is_refused_and_nothing_is_written");
    let seed = rng.seed();
    let num_tokens = rng.range(49..120);
    let kv = random_kv(&mut rng, 2, num_tokens);
    let kind = *rng.pick(&all_kinds());
    let side = attention_side(&mut rng, &kv, plan(1, kind, 16), &identity);
    let worker = &side.workers[0];
    let positions = side.table.block_ids.len();
    let memory = StoredMemory::random(&mut rng, positions + 2);
    worker.region(memory.address(), memory.bytes()).expect("region");
    worker
        .stored(0, memory.address(), positions as u64 + 2)
        .expect("add_stored");
    let before = memory.words.clone();

    // One block id at positions i < j (a null block, say).
    let i = rng.below(positions as u64 - 1) as usize;
    let j = rng.range(i as u64 + 1..positions as u64) as usize;
    let mut twice = side.table.clone();
    twice.block_ids[j] = twice.block_ids[i];
    let hashes = random_hashes(&mut rng, positions);
    let blocks = hashed_blocks(num_tokens, &[(&twice, &hashes)]);
    let needles = [
        format!("block id {} of group_id 0", twice.block_ids[i]),
        format!("position {i}"),
        format!("position {j}"),
        "one value per block id".to_owned(),
    ];
    let needles: Vec<&str> = needles.iter().map(String::as_str).collect();
    assert_failure(worker.store(&blocks).map(|_| ()), KVCS_ERR_INVALID_ARGUMENT, &needles);
    assert_eq!(memory.words, before, "nothing written (seed {seed})");
    assert_failure(
        worker.check_stored(&blocks).map(|_| ()),
        KVCS_ERR_INVALID_ARGUMENT,
        &needles,
    );

    // A shared prefix: a second request with the same first block (same
    // position, hash and valid tokens) and a block of its own after it.
    let short_tokens = rng.range(17..33);
    let short_kv = prefix_of(&mut rng, &kv, short_tokens);
    let mut placement = side.placements[0].clone();
    let own = (0..placement.spec().num_blocks)
        .find(|b| !side.table.block_ids.contains(b))
        .expect("a free block");
    let shared = GroupTable {
        group_id: 0,
        first_position: 0,
        block_ids: vec![side.table.block_ids[0], own],
    };
    placement.write_request(&short_kv, 0, &shared.block_ids);
    // The placement is a copy: register it on a worker of its own.
    let copy = CWorker::host(0, 1, 0).unwrap();
    register_attention(&copy, &placement, &plan(1, placement.spec().kind, 16), &identity).unwrap();
    let copy_memory = StoredMemory::random(&mut rng, positions + 2);
    copy.region(copy_memory.address(), copy_memory.bytes()).unwrap();
    copy.stored(0, copy_memory.address(), positions as u64 + 2).unwrap();
    let mut second_hashes = random_hashes(&mut rng, 2);
    second_hashes[..HASH_BYTES].copy_from_slice(&hashes[..HASH_BYTES]);
    let two_requests = |second_hashes: &[u8], second_tokens: u64| {
        let blocks = CBlocks::new();
        blocks.request(REQ, num_tokens).unwrap();
        blocks.table(REQ, &side.table).unwrap();
        blocks.hashes(REQ, 0, &hashes, HASH_BYTES).unwrap();
        blocks.request("req-prefix", second_tokens).unwrap();
        blocks.table("req-prefix", &shared).unwrap();
        blocks.hashes("req-prefix", 0, second_hashes, HASH_BYTES).unwrap();
        blocks
    };
    let blocks = two_requests(&second_hashes, short_tokens);
    drop(copy.store(&blocks).expect("a shared prefix stores"));
    let result = copy.check_stored(&blocks).expect("check_stored");
    for req_id in [REQ, "req-prefix"] {
        let outcomes = result.stored(req_id, 0).unwrap();
        assert!(
            outcomes.iter().all(|&o| o == MATCHED),
            "{req_id}: {outcomes:?} (seed {seed})"
        );
    }
    // The same block and position with another block hash ...
    let mut other_hash = second_hashes.clone();
    other_hash[0] ^= 1;
    assert_failure(
        copy.store(&two_requests(&other_hash, short_tokens)).map(|_| ()),
        KVCS_ERR_INVALID_ARGUMENT,
        &[
            "position 0 of req_id",
            "req-prefix",
            "another block hash or other valid tokens",
        ],
    );
    // ... or other valid tokens (the second request ends inside block 0).
    let mut one_block = shared.clone();
    one_block.block_ids.truncate(1);
    let blocks = CBlocks::new();
    blocks.request(REQ, num_tokens).unwrap();
    blocks.table(REQ, &side.table).unwrap();
    blocks.hashes(REQ, 0, &hashes, HASH_BYTES).unwrap();
    blocks.request("req-prefix", rng.range(1..16)).unwrap();
    blocks.table("req-prefix", &one_block).unwrap();
    blocks
        .hashes("req-prefix", 0, &hashes[..HASH_BYTES], HASH_BYTES)
        .unwrap();
    assert_failure(
        copy.store(&blocks).map(|_| ()),
        KVCS_ERR_INVALID_ARGUMENT,
        &["another block hash or other valid tokens"],
    );
}

// ---------------------------------------------------------------------------
// K5

/// K5: values stored under one layer identity and load-checked under
/// another failed everywhere and the verifier said MISMATCH. The stamp now
/// says the configuration changed: positions come out OTHER_FINGERPRINT and
/// the offload load is UNVERIFIED (FINGERPRINT_DIFFERS).
#[test]
fn a_load_check_under_another_layer_identity_is_unverified_not_a_mismatch() {
    let mut rng = Rng::for_test("a_load_check_under_another_layer_identity_is_unverified_not_a_mismatch");
    let seed = rng.seed();
    let num_tokens = rng.range(17..120);
    let kv = random_kv(&mut rng, 3, num_tokens);
    let tp_size = *rng.pick(&[1u32, 2, 4]);
    let kind = *rng.pick(&all_kinds());
    let mut side = attention_side(&mut rng, &kv, plan(tp_size, kind, 16), &identity);
    let positions = side.table.block_ids.len();
    let num_blocks = positions as u64 + 2;
    let memories: Vec<StoredMemory> = side
        .workers
        .iter()
        .map(|worker| {
            let memory = StoredMemory::random(&mut rng, num_blocks as usize);
            worker.region(memory.address(), memory.bytes()).unwrap();
            worker.stored(0, memory.address(), num_blocks).unwrap();
            memory
        })
        .collect();
    let hashes = random_hashes(&mut rng, positions);
    let blocks = hashed_blocks(num_tokens, &[(&side.table, &hashes)]);
    for worker in &side.workers {
        drop(worker.store(&blocks).expect("store"));
    }
    let (outcomes, records) = load_check(&side.workers, &blocks, 0);
    assert!(
        outcomes.iter().flatten().all(|&o| o == MATCHED),
        "{outcomes:?} (seed {seed})"
    );
    assert_verdict(&judge_stored(tp_size, &blocks, &records), MATCH, seed);

    // The same KV and stored values, load-checked by workers that register
    // one layer under another identity (another dtype, say).
    let changed = rng.below(3) as u32;
    let relabelled = |layer: u32| {
        if layer == changed {
            other_identity(layer)
        } else {
            identity(layer)
        }
    };
    let reloaded = |side: &Side| -> Vec<CWorker> {
        side.placements
            .iter()
            .zip(&memories)
            .enumerate()
            .map(|(tp_rank, (placement, memory))| {
                let worker = CWorker::host(tp_rank as u32, tp_size, 0).unwrap();
                register_attention(
                    &worker,
                    placement,
                    &plan(tp_size, placement.spec().kind, 16),
                    &relabelled,
                )
                .unwrap();
                worker.region(memory.address(), memory.bytes()).unwrap();
                worker.stored(0, memory.address(), num_blocks).unwrap();
                worker
            })
            .collect()
    };
    let workers = reloaded(&side);
    let (outcomes, records) = load_check(&workers, &blocks, 0);
    for rank in &outcomes {
        assert_eq!(rank, &vec![OTHER_FINGERPRINT; positions], "seed {seed}");
    }
    let report = judge_stored(tp_size, &blocks, &records);
    assert_unverified(
        &report,
        KVCS_UNVERIFIED_FINGERPRINT_DIFFERS,
        0,
        &[
            "group 0",
            "another group fingerprint",
            "stored under another configuration",
        ],
        seed,
    );
    assert!(report.mismatches().is_empty(), "seed {seed}");

    // A corrupted byte: a mismatch under the storing configuration, and
    // still never a match under the other.
    let (layer, head, token, byte) = random_cell(&mut rng, &kv);
    side.corrupt(layer, head, token, byte);
    let position = token / 16;
    let (outcomes, records) = load_check(&side.workers, &blocks, 0);
    assert!(
        outcomes.iter().any(|rank| rank[position as usize] == FAILED),
        "seed {seed}"
    );
    let report = judge_stored(tp_size, &blocks, &records);
    assert_verdict(&report, MISMATCH, seed);
    assert_eq!(report.mismatches()[0].first_position, position, "seed {seed}");
    let (_, records) = load_check(&workers, &blocks, 0);
    assert_verdict(&judge_stored(tp_size, &blocks, &records), UNVERIFIED, seed);
}

// ---------------------------------------------------------------------------
// State sides through the C ABI

/// One TP deployment of a state group (group 2) holding one request's state.
struct StateSide {
    workers: Vec<CWorker>,
    caches: Vec<RankCaches>,
    block_id: u32,
    blocks: CBlocks,
}

const STATE_GROUP: u32 = 2;

fn state_side(
    rng: &mut Rng,
    state: &LogicalState,
    tp_size: u32,
    split_known: bool,
    block_size: u32,
    num_tokens: u64,
) -> StateSide {
    let block_id = rng.below(4) as u32;
    let mut workers = Vec::new();
    let mut caches = Vec::new();
    for tp_rank in 0..tp_size {
        let worker = CWorker::host(tp_rank, tp_size, 0).unwrap();
        let rank = place_rank(rng, state, tp_rank, tp_size, STATE_GROUP, split_known, 4, block_id);
        worker.group(STATE_GROUP, block_size).unwrap();
        for buffer in &rank.buffers {
            worker.region(buffer.as_ptr() as u64, buffer.len() as u64 * 8).unwrap();
        }
        for spec in &rank.specs {
            worker.state(spec).expect("add_state");
        }
        workers.push(worker);
        caches.push(rank);
    }
    let blocks = CBlocks::of(&[TestRequest {
        req_id: REQ.to_owned(),
        num_tokens,
        tables: vec![GroupTable {
            group_id: STATE_GROUP,
            first_position: 0,
            block_ids: vec![block_id],
        }],
    }]);
    StateSide {
        workers,
        caches,
        block_id,
        blocks,
    }
}

impl StateSide {
    /// Flips bits of one byte of the request's state on a random rank.
    fn corrupt(&mut self, rng: &mut Rng) {
        let rank = rng.below(self.caches.len() as u64) as usize;
        let caches = &mut self.caches[rank];
        let (layer, tensor) = {
            let l = rng.below(caches.specs.len() as u64) as usize;
            (l, rng.below(caches.specs[l].tensors.len() as u64) as usize)
        };
        let spec: &StateSpec = &caches.specs[layer];
        let t = &spec.tensors[tensor];
        let row = rng.below(t.num_rows as u64) as i64;
        let byte = rng.below(t.bytes_per_row as u64) as i64;
        let address = t.address as i64 + self.block_id as i64 * t.block_stride + row * t.row_stride + byte;
        let buffer_index = caches.specs[..layer].iter().map(|s| s.tensors.len()).sum::<usize>() + tensor;
        let buffer = &mut caches.buffers[buffer_index];
        let offset = (address - buffer.as_ptr() as i64) as usize;
        // SAFETY: the offset lies inside the buffer (a byte of a row of the
        // request's block), which is read as bytes.
        let bytes: &mut [u8] = unsafe { std::slice::from_raw_parts_mut(buffer.as_mut_ptr().cast(), buffer.len() * 8) };
        bytes[offset] ^= 0x41;
    }
}

/// A state whose every element is 0.
fn zero_state(rng: &mut Rng, layers: &[u32]) -> LogicalState {
    let mut state = random_state(rng, layers);
    for (_, tensors) in &mut state.layers {
        for tensor in tensors {
            for row in &mut tensor.rows {
                row.fill(0);
            }
        }
    }
    state
}

// ---------------------------------------------------------------------------
// K6

/// K6: state groups with `split_known` 1 on one side and 0 on the other
/// gave MISMATCH at equal TP. Shard-keyed state layers carry a mark beside
/// the fingerprint now: UNVERIFIED, FINGERPRINT_DIFFERS.
#[test]
fn state_split_known_on_one_side_only_is_unverified_fingerprint_differs() {
    let mut rng = Rng::for_test("state_split_known_on_one_side_only_is_unverified_fingerprint_differs");
    let seed = rng.seed();
    let state = random_state(&mut rng, &[20, 21]);
    let tp_size = *rng.pick(&[1u32, 2, 4]);
    let num_tokens = rng.range(1..200);
    for (producer_split, consumer_split) in [(true, false), (false, true), (true, true), (false, false)] {
        let producer = state_side(&mut rng, &state, tp_size, producer_split, 16, num_tokens);
        let mut consumer = state_side(&mut rng, &state, tp_size, consumer_split, 16, num_tokens);
        for extension in [false, true] {
            let payload = payload_of(&producer.workers, &producer.blocks, extension);
            // The producer's TP size is known either way (here from the setting).
            let report = judge(&consumer.workers, &consumer.blocks, &payload, &|v| {
                v.producer_tp_size(tp_size)
            });
            if producer_split == consumer_split {
                assert_verdict(&report, MATCH, seed);
            } else {
                assert_unverified(
                    &report,
                    KVCS_UNVERIFIED_FINGERPRINT_DIFFERS,
                    STATE_GROUP,
                    &["group 2", "fingerprint"],
                    seed,
                );
            }
        }
        if producer_split == consumer_split {
            consumer.corrupt(&mut rng);
            let payload = payload_of(&producer.workers, &producer.blocks, true);
            assert_verdict(
                &judge(&consumer.workers, &consumer.blocks, &payload, &no_setup),
                MISMATCH,
                seed,
            );
        }
    }
}

// ---------------------------------------------------------------------------
// S1

/// S1: a shard-keyed state group (`split_known` 0) with a plain payload and
/// no `kvcs_verifier_set_producer_tp_size` was compared anyway: an all-zero
/// state from producer TP 1 into consumer TP 2 gave MATCH. The producer's
/// TP size is unknown: UNVERIFIED, STATE_TP_DIFFERS.
#[test]
fn shard_keyed_state_of_an_unknown_producer_tp_size_is_unverified() {
    // Plain payloads are vLLM's, WEIGHTED (a MIXED producer sends its TP size).
    set_thread_algorithm(kvcsum::ffi::worker::kvcs_algorithm::KVCS_ALGORITHM_WEIGHTED as u32);
    let mut rng = Rng::for_test("shard_keyed_state_of_an_unknown_producer_tp_size_is_unverified");
    let seed = rng.seed();
    let num_tokens = rng.range(1..200);
    let unknown = [
        "group 2 is shard-keyed state",
        "producer's TP size is unknown",
        "kvcs_verifier_set_producer_tp_size",
    ];
    // The defect's own case: an all-zero state (which every shard sums to 0).
    let zeros = zero_state(&mut rng, &[20, 21]);
    let producer = state_side(&mut rng, &zeros, 1, false, 16, num_tokens);
    let consumer = state_side(&mut rng, &zeros, 2, false, 16, num_tokens);
    let payload = payload_of(&producer.workers, &producer.blocks, false);
    let report = judge(&consumer.workers, &consumer.blocks, &payload, &no_setup);
    assert_unverified(&report, KVCS_UNVERIFIED_STATE_TP_DIFFERS, STATE_GROUP, &unknown, seed);
    // Known and different: unverified too.
    let report = judge(&consumer.workers, &consumer.blocks, &payload, &|v| {
        v.producer_tp_size(1)
    });
    assert_unverified(
        &report,
        KVCS_UNVERIFIED_STATE_TP_DIFFERS,
        STATE_GROUP,
        &["producer TP size 1, consumer 2"],
        seed,
    );

    // Random state at equal TP: unknown, then known (set or sent).
    let state = random_state(&mut rng, &[20, 21]);
    let tp_size = *rng.pick(&[1u32, 2, 4]);
    let producer = state_side(&mut rng, &state, tp_size, false, 16, num_tokens);
    let mut consumer = state_side(&mut rng, &state, tp_size, false, 16, num_tokens);
    let plain = payload_of(&producer.workers, &producer.blocks, false);
    let report = judge(&consumer.workers, &consumer.blocks, &plain, &no_setup);
    assert_unverified(&report, KVCS_UNVERIFIED_STATE_TP_DIFFERS, STATE_GROUP, &unknown, seed);
    let set = |v: &CVerifier| v.producer_tp_size(tp_size);
    assert_verdict(&judge(&consumer.workers, &consumer.blocks, &plain, &set), MATCH, seed);
    let extended = payload_of(&producer.workers, &producer.blocks, true);
    assert_verdict(
        &judge(&consumer.workers, &consumer.blocks, &extended, &no_setup),
        MATCH,
        seed,
    );
    consumer.corrupt(&mut rng);
    assert_verdict(
        &judge(&consumer.workers, &consumer.blocks, &plain, &set),
        MISMATCH,
        seed,
    );
    // Corrupted and unknown: still never a match.
    let report = judge(&consumer.workers, &consumer.blocks, &plain, &no_setup);
    assert_unverified(&report, KVCS_UNVERIFIED_STATE_TP_DIFFERS, STATE_GROUP, &unknown, seed);
}

// ---------------------------------------------------------------------------
// K7

/// K7: an alias (`kvcs_worker_add_alias`) on the producer and a real cache
/// for the same layer on the consumer had equal fingerprints, and intact KV
/// gave MISMATCH. Aliases carry a mark beside the fingerprint (records,
/// the payload extension), which a MIXED producer always sends: UNVERIFIED,
/// FINGERPRINT_DIFFERS.
#[test]
fn an_alias_on_one_side_and_a_real_cache_on_the_other_is_unverified() {
    let mut rng = Rng::for_test("an_alias_on_one_side_and_a_real_cache_on_the_other_is_unverified");
    let seed = rng.seed();
    let num_tokens = rng.range(1..150);
    // Layer 2 shares layer 1's KV (vLLM's KV sharing): a real cache of it
    // holds the same bytes.
    let mut kv = random_kv(&mut rng, 3, num_tokens);
    for head in kv.heads() {
        for token in 0..num_tokens {
            let cell = kv.cell(1, head, token).to_vec();
            kv.cell_mut(2, head, token).copy_from_slice(&cell);
        }
    }
    let sides = |rng: &mut Rng, alias: bool| {
        let tp_size = *rng.pick(&[1u32, 2, 4]);
        let block_size = *rng.pick(&[16u32, 32]);
        let mut plan = plan(tp_size, *rng.pick(&all_kinds()), block_size);
        plan.alias = alias.then_some((2, 1));
        attention_side(rng, &kv, plan, &identity)
    };
    for (producer_alias, consumer_alias) in [(true, false), (false, true), (true, true), (false, false)] {
        let producer = sides(&mut rng, producer_alias);
        let mut consumer = sides(&mut rng, consumer_alias);
        for extension in [false, true] {
            let payload = payload_of(&producer.workers, &producer.blocks, extension);
            let block_size = producer.block_size;
            let report = judge(&consumer.workers, &consumer.blocks, &payload, &|v| {
                v.producer_block_size(0, block_size)
            });
            if producer_alias == consumer_alias {
                assert_verdict(&report, MATCH, seed);
            } else {
                assert_unverified(
                    &report,
                    KVCS_UNVERIFIED_FINGERPRINT_DIFFERS,
                    0,
                    &["group 0", "fingerprint", "alias"],
                    seed,
                );
                assert!(report.mismatches().is_empty(), "seed {seed}");
            }
        }
        if producer_alias == consumer_alias {
            let (layer, head, token, byte) = random_cell(&mut rng, &kv);
            // A consumer aliasing layer 2 reads it through layer 1.
            let layer = if consumer_alias && layer == 2 { 1 } else { layer };
            consumer.corrupt(layer, head, token, byte);
            let payload = payload_of(&producer.workers, &producer.blocks, true);
            assert_verdict(
                &judge(&consumer.workers, &consumer.blocks, &payload, &no_setup),
                MISMATCH,
                seed,
            );
        }
    }
}

// ---------------------------------------------------------------------------
// K8

/// K8: a plain payload says nothing of the producer's block size, and no
/// count or value of its positions tells it: 48 and 32 give 64 tokens two
/// positions each (so do 528 and 512 for 1000, 16 and 24 for 30), and a
/// position past the tokens sums to 0 whatever its size. Taking it to be
/// the consumer's gave MISMATCH of intact KV. Without
/// `kvcs_verifier_set_producer_block_size` (or the extension) the group is
/// UNVERIFIED, BLOCK_SIZE_UNKNOWN, whatever the two sizes, equal ones
/// too; set or sent, it is compared: intact KV matches, a flipped byte
/// mismatches.
#[test]
fn a_plain_payload_without_the_producers_block_size_is_unverified_whatever_the_sizes() {
    // Plain payloads are vLLM's, WEIGHTED (a MIXED producer sends its block size).
    set_thread_algorithm(kvcsum::ffi::worker::kvcs_algorithm::KVCS_ALGORITHM_WEIGHTED as u32);
    let mut rng = Rng::for_test("a_plain_payload_without_the_producers_block_size_is_unverified_whatever_the_sizes");
    let seed = rng.seed();
    // (producer, consumer, tokens, producer positions past the tokens).
    let cases = [
        (48u32, 32u32, 64u64, 0usize),
        (48, 32, 64, 1),
        (528, 512, 1000, 0),
        (32, 48, 64, 0),
        (32, 48, 64, 2),
        (16, 24, 30, 0),
        (16, 16, rng.range(1..200), 0),
        (16, 16, rng.range(1..200), 1),
        (16, 32, rng.range(17..200), 0),
        (32, 16, rng.range(17..200), 0),
        (8, 32, rng.range(17..200), 0),
        (32, 8, rng.range(17..200), 1),
    ];
    for (producer_size, consumer_size, num_tokens, extra_positions) in cases {
        let case = format!(
            "producer block size {producer_size}, consumer {consumer_size}, {num_tokens} tokens, {extra_positions} producer positions past them (seed {seed})"
        );
        let kv = random_kv(&mut rng, 2, num_tokens);
        let producer_plan = AttentionPlan {
            extra_positions,
            ..plan(*rng.pick(&[1u32, 2, 4]), *rng.pick(&all_kinds()), producer_size)
        };
        let producer = attention_side(&mut rng, &kv, producer_plan, &identity);
        let consumer_plan = plan(*rng.pick(&[1u32, 2, 4]), *rng.pick(&all_kinds()), consumer_size);
        let mut consumer = attention_side(&mut rng, &kv, consumer_plan, &identity);
        let plain = payload_of(&producer.workers, &producer.blocks, false);
        let unknown = |report: &CReport| {
            assert_unverified(
                report,
                KVCS_UNVERIFIED_BLOCK_SIZE_UNKNOWN,
                0,
                &[
                    "group 0",
                    "producer's block size is unknown",
                    "kvcs_verifier_set_producer_block_size",
                    &format!("consumer's of block size {consumer_size}"),
                ],
                seed,
            );
            assert!(report.mismatches().is_empty(), "{case}");
        };
        unknown(&judge(&consumer.workers, &consumer.blocks, &plain, &no_setup));
        // Known (set or sent): compared, and a match.
        let set = |v: &CVerifier| v.producer_block_size(0, producer_size);
        let report = judge(&consumer.workers, &consumer.blocks, &plain, &set);
        assert_eq!(report.verdict(), MATCH, "{case}: {}", report.message());
        assert!(report.compared() > 0, "{case}");
        let extended = payload_of(&producer.workers, &producer.blocks, true);
        let report = judge(&consumer.workers, &consumer.blocks, &extended, &no_setup);
        assert_eq!(report.verdict(), MATCH, "{case}: {}", report.message());
        // Another group's block size set tells nothing of group 0.
        let other_group = |v: &CVerifier| v.producer_block_size(1, producer_size);
        unknown(&judge(&consumer.workers, &consumer.blocks, &plain, &other_group));
        let (layer, head, token, byte) = random_cell(&mut rng, &kv);
        consumer.corrupt(layer, head, token, byte);
        for (payload, setup) in [(&plain, &set as &dyn Fn(&CVerifier)), (&extended, &no_setup)] {
            let report = judge(&consumer.workers, &consumer.blocks, payload, setup);
            assert_eq!(
                report.verdict(),
                MISMATCH,
                "{case}: token {token}: {}",
                report.message()
            );
        }
        unknown(&judge(&consumer.workers, &consumer.blocks, &plain, &no_setup));
    }
}

// ---------------------------------------------------------------------------
// K9

/// The KV of two attention groups (0: layers 0 and 1, 1: layers 10 and 11)
/// of one request, and the TP size of the sides holding them.
struct TwoGroups {
    num_tokens: u64,
    kv: LogicalKv,
    kv1: LogicalKv,
    tp_size: u32,
}

impl TwoGroups {
    fn random(rng: &mut Rng) -> TwoGroups {
        let num_tokens = rng.range(1..150);
        let kv = random_kv(rng, 2, num_tokens);
        let kv1 = LogicalKv::random(
            rng,
            KvShape {
                first_layer: 10,
                ..KvShape::gqa(2, 4, 32, num_tokens)
            },
        );
        TwoGroups {
            num_tokens,
            kv,
            kv1,
            tp_size: *rng.pick(&[1u32, 2]),
        }
    }

    /// A side with group 0 (layers) and group 1, registered with or
    /// without layers.
    fn side(&self, rng: &mut Rng, group1_layers: bool) -> Side {
        let TwoGroups {
            num_tokens,
            ref kv,
            ref kv1,
            tp_size,
        } = *self;
        let kind = *rng.pick(&all_kinds());
        let mut side = attention_side(rng, kv, plan(tp_size, kind, 16), &identity);
        let count = positions_for(num_tokens, 16, 0, 0);
        let table1 = GroupTable {
            group_id: 1,
            first_position: 0,
            block_ids: BlockAllocator::new(rng, count as u32 + 2).take(count),
        };
        for (tp_rank, worker) in side.workers.iter().enumerate() {
            if group1_layers {
                let mut placement = Placement::for_shard(
                    rng,
                    kv1,
                    &shard(kv1, tp_rank as u32, tp_size, 0, 1),
                    LayoutKind::Nhd,
                    1,
                    16,
                    count as u32 + 2,
                );
                placement.write_request(kv1, 0, &table1.block_ids);
                let plan1 = AttentionPlan {
                    group_id: 1,
                    ..plan(tp_size, LayoutKind::Nhd, 16)
                };
                register_attention(worker, &placement, &plan1, &identity).unwrap();
                side.placements.push(placement);
            } else {
                worker.group(1, 16).unwrap();
            }
        }
        side.blocks = CBlocks::of(&[TestRequest {
            req_id: REQ.to_owned(),
            num_tokens,
            tables: vec![side.table.clone(), table1],
        }]);
        side
    }
}

/// K9: a group registered on every worker with no layers (and not skipped)
/// gave MATCH ("7 block positions compared") though no byte was read; the
/// offload load check matched too. The consumer's group read nothing:
/// UNVERIFIED, NOTHING_READ.
#[test]
fn a_group_no_worker_registered_a_layer_of_is_unverified_nothing_read() {
    let mut rng = Rng::for_test("a_group_no_worker_registered_a_layer_of_is_unverified_nothing_read");
    let seed = rng.seed();
    let model = TwoGroups::random(&mut rng);
    let (num_tokens, tp_size) = (model.num_tokens, model.tp_size);
    let side = |rng: &mut Rng, group1_layers: bool| model.side(rng, group1_layers);
    let nothing_read = [
        "no worker of req_id",
        "registered a layer of group 1",
        "none of its KV was read",
    ];
    // The consumer registered no layer of group 1; the producer did.
    let producer = side(&mut rng, true);
    let consumer = side(&mut rng, false);
    for extension in [false, true] {
        let payload = payload_of(&producer.workers, &producer.blocks, extension);
        let report = judge(&consumer.workers, &consumer.blocks, &payload, &no_setup);
        assert_unverified(&report, KVCS_UNVERIFIED_NOTHING_READ, 1, &nothing_read, seed);
        assert!(report.compared() > 0, "group 0 was compared (seed {seed})");
    }
    // The producer did not, the consumer did: the consumer's group 1 was
    // read but the producer sent none of it.
    let producer = side(&mut rng, false);
    let payload = payload_of(&producer.workers, &producer.blocks, false);
    let consumer = side(&mut rng, true);
    let report = judge(&consumer.workers, &consumer.blocks, &payload, &no_setup);
    assert_unverified(&report, KVCS_UNVERIFIED_ONE_SIDED_GROUP, 1, &["group 1"], seed);

    // Offload: stored buffers for both groups, one without layers.
    for only_empty in [false, true] {
        let offload = side(&mut rng, false);
        let table1 = GroupTable {
            group_id: 1,
            first_position: 0,
            block_ids: (0..positions_for(num_tokens, 16, 0, 0) as u32).collect(),
        };
        let positions = offload.table.block_ids.len();
        let hashes = random_hashes(&mut rng, positions);
        let hashes1 = random_hashes(&mut rng, positions);
        let mut memories = Vec::new();
        for worker in &offload.workers {
            for group_id in [0u32, 1] {
                let memory = StoredMemory::random(&mut rng, positions + 2);
                worker.region(memory.address(), memory.bytes()).unwrap();
                worker.stored(group_id, memory.address(), positions as u64 + 2).unwrap();
                memories.push(memory);
            }
        }
        let blocks = if only_empty {
            hashed_blocks(num_tokens, &[(&table1, &hashes1)])
        } else {
            hashed_blocks(num_tokens, &[(&offload.table, &hashes), (&table1, &hashes1)])
        };
        for worker in &offload.workers {
            drop(worker.store(&blocks).expect("store"));
        }
        let (_, records) = load_check(&offload.workers, &blocks, 1);
        let report = judge_stored(tp_size, &blocks, &records);
        assert_unverified(&report, KVCS_UNVERIFIED_NOTHING_READ, 1, &nothing_read, seed);
    }
}

/// Neither side registered a layer of group 1: the producer read nothing of
/// it and left it out of its payload, and the consumer read nothing of it
/// either. That is NOTHING_READ (SPEC section 7, reason 15), not
/// ONE_SIDED_GROUP: nothing was read on either side, which is why the
/// producer sent nothing. Group 0 is still compared, and a flipped byte in
/// it still mismatches.
#[test]
fn a_group_neither_side_read_is_unverified_nothing_read_not_one_sided() {
    let mut rng = Rng::for_test("a_group_neither_side_read_is_unverified_nothing_read_not_one_sided");
    let seed = rng.seed();
    let model = TwoGroups::random(&mut rng);
    let producer = model.side(&mut rng, false);
    let mut consumer = model.side(&mut rng, false);
    for extension in [false, true] {
        let payload = payload_of(&producer.workers, &producer.blocks, extension);
        let report = judge(&consumer.workers, &consumer.blocks, &payload, &no_setup);
        assert_unverified(
            &report,
            KVCS_UNVERIFIED_NOTHING_READ,
            1,
            &["registered a layer of group 1", "none of its KV was read"],
            seed,
        );
        assert_eq!(report.findings().len(), 1, "seed {seed}: {}", report.message());
        assert!(report.compared() > 0, "group 0 was compared (seed {seed})");
    }
    let (layer, head, token, byte) = random_cell(&mut rng, &model.kv);
    consumer.corrupt(layer, head, token, byte);
    let payload = payload_of(&producer.workers, &producer.blocks, true);
    let report = judge(&consumer.workers, &consumer.blocks, &payload, &no_setup);
    assert_eq!(report.verdict(), MISMATCH, "seed {seed}: {}", report.message());
    assert_eq!(report.reason(), KVCS_UNVERIFIED_NOTHING_READ as u32, "seed {seed}");
}

// ---------------------------------------------------------------------------
// K10

/// K10: `num_tokens` = 0 made a state group UNVERIFIED (NO_COMMON_POSITION)
/// even with corrupted state, and differing state block sizes made it
/// UNVERIFIED whenever `num_tokens` exceeded the smaller. A state block is
/// the whole request's state at position 0: compared whatever `num_tokens`
/// and block sizes, so intact state matches and corrupted state mismatches.
#[test]
fn state_is_compared_whatever_num_tokens_and_state_block_sizes() {
    let mut rng = Rng::for_test("state_is_compared_whatever_num_tokens_and_state_block_sizes");
    let seed = rng.seed();
    let state = random_state(&mut rng, &[20, 21]);
    for (producer_size, consumer_size, num_tokens) in [
        (16u32, 16u32, 0u64),
        (16, 32, 0),
        (32, 16, 0),
        (16, 32, rng.range(17..400)),
        (64, 16, rng.range(17..400)),
        (16, 16, rng.range(1..400)),
    ] {
        let (producer_tp, consumer_tp) = (*rng.pick(&[1u32, 2, 4]), *rng.pick(&[1u32, 2, 4]));
        let producer = state_side(&mut rng, &state, producer_tp, true, producer_size, num_tokens);
        let mut consumer = state_side(&mut rng, &state, consumer_tp, true, consumer_size, num_tokens);
        let case = format!("block sizes {producer_size}/{consumer_size}, {num_tokens} tokens (seed {seed})");
        for extension in [false, true] {
            let payload = payload_of(&producer.workers, &producer.blocks, extension);
            let report = judge(&consumer.workers, &consumer.blocks, &payload, &no_setup);
            assert_eq!(report.verdict(), MATCH, "{case}: {}", report.message());
            assert_eq!(report.compared(), 1, "{case}: position 0 compared");
        }
        consumer.corrupt(&mut rng);
        for extension in [false, true] {
            let payload = payload_of(&producer.workers, &producer.blocks, extension);
            let report = judge(&consumer.workers, &consumer.blocks, &payload, &no_setup);
            assert_eq!(report.verdict(), MISMATCH, "{case}: {}", report.message());
            let mismatches = report.mismatches();
            assert_eq!(
                (mismatches[0].group_id, mismatches[0].first_position),
                (STATE_GROUP, 0),
                "{case}"
            );
            assert!(
                report.message().contains("group 2 position 0"),
                "{case}: {}",
                report.message()
            );
        }
    }
}

/// A state position always holds its state, whatever the token count. A
/// state group of a request of no tokens mismatched with the words "tokens
/// 0..0" and a repair plan that refused it, so its block could never be
/// named for reload. Its mismatch now says "the state after 0 tokens", and
/// the plan names its block with the tokens whose state it holds (none
/// here, `0..num_tokens` in general), after a payload check and after an
/// offload load check alike.
#[test]
fn a_state_mismatch_names_its_block_for_reload_whatever_the_token_count() {
    let mut rng = Rng::for_test("a_state_mismatch_names_its_block_for_reload_whatever_the_token_count");
    let seed = rng.seed();
    let state = random_state(&mut rng, &[20, 21]);
    for num_tokens in [0u64, 0, rng.range(1..400)] {
        let (tp_size, block_size) = (*rng.pick(&[1u32, 2, 4]), *rng.pick(&[16u32, 64, 1024]));
        let case = format!("{num_tokens} tokens, TP {tp_size}, block size {block_size} (seed {seed})");
        let producer = state_side(&mut rng, &state, tp_size, true, block_size, num_tokens);
        let mut consumer = state_side(&mut rng, &state, tp_size, true, block_size, num_tokens);
        let want = vec![(STATE_GROUP, 0u64, consumer.block_id, 0u64, num_tokens)];
        let sizes = [(STATE_GROUP, block_size)];
        let words = format!("group {STATE_GROUP} position 0 (the state after {num_tokens} tokens");
        // Offload: the consumer stores, its state goes bad, the load check fails.
        let memories: Vec<StoredMemory> = consumer
            .workers
            .iter()
            .map(|worker| {
                let memory = StoredMemory::random(&mut rng, 4);
                worker.region(memory.address(), memory.bytes()).unwrap();
                worker.stored(STATE_GROUP, memory.address(), 4).unwrap();
                memory
            })
            .collect();
        let table = GroupTable {
            group_id: STATE_GROUP,
            first_position: 0,
            block_ids: vec![consumer.block_id],
        };
        let hashed = hashed_blocks(num_tokens, &[(&table, &random_hashes(&mut rng, 1))]);
        for worker in &consumer.workers {
            drop(worker.store(&hashed).expect("store"));
        }
        let payload = payload_of(&producer.workers, &producer.blocks, true);
        let report = judge(&consumer.workers, &consumer.blocks, &payload, &no_setup);
        assert_eq!(report.verdict(), MATCH, "{case}: {}", report.message());
        assert_eq!(
            report.repair_plan(&consumer.blocks, REQ, &sizes),
            Ok(Vec::new()),
            "{case}"
        );
        consumer.corrupt(&mut rng);
        let report = judge(&consumer.workers, &consumer.blocks, &payload, &no_setup);
        let (_, records) = load_check(&consumer.workers, &hashed, STATE_GROUP);
        let stored = judge_stored(tp_size, &hashed, &records);
        for (flow, report, blocks) in [("payload", &report, &consumer.blocks), ("offload", &stored, &hashed)] {
            assert_eq!(report.verdict(), MISMATCH, "{case}, {flow}: {}", report.message());
            assert!(report.findings().is_empty(), "{case}, {flow}: {}", report.message());
            let message = report.message();
            assert!(message.contains(&words), "{case}, {flow}: {message}");
            assert!(!message.contains("tokens 0..0"), "{case}, {flow}: {message}");
            assert_eq!(
                report.repair_plan(blocks, REQ, &sizes),
                Ok(want.clone()),
                "{case}, {flow}"
            );
        }
        drop(memories);
    }
}
