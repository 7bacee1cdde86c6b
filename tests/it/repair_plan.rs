//! The repair plan (SPEC section 15), called as C would:
//! `kvcs_repair_plan` on random mismatch entries against a naive loop over
//! tokens and block positions, and `kvcs_report_repair_plan` on real
//! reports: a producer and a consumer of other block sizes (caches
//! described with `kvcs_layer_from_layout`), random tokens flipped on the
//! consumer, the plan against the naive expectation, and reloading only the
//! planned tokens gives a match. A plan under any block size 1 to 64 but
//! the report's is refused (a report's exactly; entries wherever they show
//! it), and so is a report of another request.
//!
//! Reproduce a failure with the seed it printed:
//! `KVCS_TEST_SEED=<seed> cargo test --test it repair_plan::<name>`.

use crate::support;

use std::collections::{BTreeMap, BTreeSet};
use std::ptr::{null, null_mut};

use kvcsum::ffi::blocks::*;
use kvcsum::ffi::layout_string::*;
use kvcsum::ffi::repair::*;
use kvcsum::ffi::report::*;
use kvcsum::ffi::result::*;
use kvcsum::ffi::status::kvcs_status::*;
use kvcsum::ffi::status::*;
use kvcsum::ffi::verifier::*;
use kvcsum::ffi::worker::*;
use support::handles::{host_options, last_error};
use support::*;

/// Asserts that a call succeeded; `context` says which case.
fn ok(status: kvcs_status, context: &str) {
    assert_eq!(status, KVCS_OK, "{context}: {}", last_error());
}

fn gcd(a: u64, b: u64) -> u64 {
    if b == 0 {
        a
    } else {
        gcd(b, a % b)
    }
}

/// (group, position, block id, start token, end token).
type Entry = (u32, u64, u32, u64, u64);

/// The naive plan: every block position `q` of a group's table whose
/// tokens `[q*S, (q+1)*S)` hold a differing token, with the first and one
/// past the last of them (differing tokens of one block are contiguous:
/// they are runs of whole lcm multiples).
fn naive_plan(tables: &BTreeMap<u32, (u64, Vec<u32>, u32)>, differing: &BTreeMap<u32, BTreeSet<u64>>) -> Vec<Entry> {
    let mut plan = Vec::new();
    for (&group, tokens) in differing {
        let (first_position, ids, size) = &tables[&group];
        for (i, &block_id) in ids.iter().enumerate() {
            let q = first_position + i as u64;
            let held: Vec<u64> = (q * *size as u64..(q + 1) * *size as u64)
                .filter(|t| tokens.contains(t))
                .collect();
            if let (Some(&low), Some(&high)) = (held.first(), held.last()) {
                plan.push((group, q, block_id, low, high + 1));
            }
        }
    }
    plan
}

/// A block set with request "r" of `num_tokens` and each group's table.
fn blocks_of(num_tokens: u64, tables: &BTreeMap<u32, (u64, Vec<u32>, u32)>, context: &str) -> *mut kvcs_blocks {
    let mut blocks = null_mut();
    ok(kvcs_blocks_create(&mut blocks), context);
    ok(kvcs_blocks_add_request(blocks, c"r".as_ptr(), num_tokens), context);
    for (&group, (first_position, ids, _)) in tables {
        ok(
            kvcs_blocks_add_group(blocks, c"r".as_ptr(), group, *first_position, ids.as_ptr(), ids.len()),
            context,
        );
    }
    blocks
}

/// The plan's entries as tuples, asking for the size first.
fn plan_of(call: impl Fn(*mut kvcs_repair_block, usize, *mut usize) -> kvcs_status, context: &str) -> Vec<Entry> {
    let mut needed = usize::MAX;
    let status = call(null_mut(), 0, &mut needed);
    if needed == 0 {
        ok(status, context);
        return Vec::new();
    }
    assert_eq!(status, KVCS_ERR_BUFFER_TOO_SMALL, "{context}: {}", last_error());
    let mut entries = vec![
        kvcs_repair_block {
            group_id: 0,
            block_id: 0,
            position: 0,
            start_token: 0,
            end_token: 0
        };
        needed
    ];
    let mut len = 0;
    ok(call(entries.as_mut_ptr(), needed, &mut len), context);
    assert_eq!(len, needed, "{context}");
    entries
        .iter()
        .map(|e| (e.group_id, e.position, e.block_id, e.start_token, e.end_token))
        .collect()
}

#[test]
fn random_mismatch_entries_give_the_naive_plan() {
    let mut rng = Rng::for_test("random_mismatch_entries_give_the_naive_plan");
    let seed = rng.seed();
    for case in 0..300 {
        let num_tokens = rng.range(1..200);
        let mut tables = BTreeMap::new();
        let mut mismatches = Vec::new();
        let mut differing: BTreeMap<u32, BTreeSet<u64>> = BTreeMap::new();
        for _ in 0..rng.range(1..4) {
            let group = rng.below(6) as u32;
            if tables.contains_key(&group) {
                continue;
            }
            let consumer_size = rng.range(1..9);
            let producer_size = rng.range(1..9);
            let run = consumer_size * producer_size / gcd(consumer_size, producer_size);
            // Runs the verifier compares start at a multiple of both sizes.
            let first_run = rng.below(3);
            let first_position = first_run * run / consumer_size;
            let end_position = num_tokens.div_ceil(consumer_size).max(first_position) + rng.below(3);
            let ids = rng.permutation(1000)[..(end_position - first_position) as usize].to_vec();
            tables.insert(group, (first_position, ids, consumer_size as u32));
            for r in first_run..num_tokens.div_ceil(run) {
                if !rng.chance(1, 3) {
                    continue;
                }
                let (start, end) = (r * run, ((r + 1) * run).min(num_tokens));
                mismatches.push(kvcs_mismatch {
                    group_id: group,
                    localised: 0,
                    first_position: start / consumer_size,
                    num_positions: end.div_ceil(consumer_size) - start / consumer_size,
                    first_token: start,
                    num_tokens: end - start,
                    num_failed_checks: 0,
                    num_layers: 0,
                });
                differing.entry(group).or_default().extend(start..end);
            }
        }
        rng.shuffle(&mut mismatches);
        let context = format!("seed {seed}, case {case}: tables {tables:?}, mismatches {mismatches:?}");
        let blocks = blocks_of(num_tokens, &tables, &context);
        // Block sizes of every group, and of one no mismatch names.
        let mut sizes: Vec<(u32, u32)> = tables.iter().map(|(&g, t)| (g, t.2)).collect();
        sizes.push((99, 1));
        rng.shuffle(&mut sizes);
        let (group_ids, block_sizes): (Vec<u32>, Vec<u32>) = sizes.into_iter().unzip();
        let got = plan_of(
            |buf, cap, len| {
                kvcs_repair_plan(
                    mismatches.as_ptr(),
                    mismatches.len(),
                    blocks,
                    c"r".as_ptr(),
                    group_ids.as_ptr(),
                    block_sizes.as_ptr(),
                    group_ids.len(),
                    buf,
                    cap,
                    len,
                )
            },
            &context,
        );
        assert_eq!(got, naive_plan(&tables, &differing), "{context}");
        kvcs_blocks_destroy(blocks);
    }
}

/// Tokens of the test's caches: `HEADS` heads of `PIECES` u64 pieces.
const HEADS: usize = 2;
const PIECES: usize = 3;

/// An HND cache of `num_blocks` blocks of `block_size` tokens, as u64s.
struct Cache {
    values: Vec<u64>,
    block_size: usize,
    num_blocks: usize,
}

impl Cache {
    fn new(rng: &mut Rng, num_blocks: usize, block_size: usize) -> Cache {
        let values = (0..num_blocks * HEADS * block_size * PIECES)
            .map(|_| rng.next_u64())
            .collect();
        Cache {
            values,
            block_size,
            num_blocks,
        }
    }

    /// Index of piece `piece` of `head` at slot `slot` of block `block`.
    fn at(&self, block: usize, head: usize, slot: usize, piece: usize) -> usize {
        ((block * HEADS + head) * self.block_size + slot) * PIECES + piece
    }

    /// Copies request token `token`'s cell (every head) from `source`.
    fn copy_token(&mut self, ids: &[u32], source: &Cache, source_ids: &[u32], token: usize) {
        for head in 0..HEADS {
            for piece in 0..PIECES {
                let from = source.at(
                    source_ids[token / source.block_size] as usize,
                    head,
                    token % source.block_size,
                    piece,
                );
                let to = self.at(
                    ids[token / self.block_size] as usize,
                    head,
                    token % self.block_size,
                    piece,
                );
                self.values[to] = source.values[from];
            }
        }
    }

    /// The worker record of this cache checksummed in `role` for request
    /// "r" of `num_tokens` held in blocks `ids` (group 0), the layer from
    /// "HND" through `kvcs_layer_from_layout`.
    fn record(&self, ids: &[u32], num_tokens: u64, role: u32, context: &str) -> Vec<u8> {
        let shape = [
            self.num_blocks as i64,
            HEADS as i64,
            self.block_size as i64,
            PIECES as i64,
        ];
        let strides = [
            (HEADS * self.block_size * PIECES * 8) as i64,
            (self.block_size * PIECES * 8) as i64,
            (PIECES * 8) as i64,
            8,
        ];
        let tensor = kvcs_tensor {
            address: self.values.as_ptr() as u64,
            shape: shape.as_ptr(),
            strides: strides.as_ptr(),
            ndim: 4,
            element_size: 8,
        };
        // SAFETY: all-zero layers and segments are valid values.
        let (mut layer, mut segments): (kvcs_layer, [kvcs_segment; 2]) = unsafe { std::mem::zeroed() };
        ok(
            kvcs_layer_from_layout(c"HND".as_ptr(), &tensor, null(), 1, &mut layer, segments.as_mut_ptr()),
            context,
        );
        layer.layer_number = 5;
        let options = host_options();
        let mut worker = null_mut();
        ok(kvcs_worker_create(&options, &mut worker), context);
        ok(
            kvcs_worker_add_region(worker, tensor.address, (self.values.len() * 8) as u64),
            context,
        );
        ok(kvcs_worker_add_group(worker, 0, self.block_size as u32), context);
        ok(kvcs_worker_add_layer(worker, &layer), context);
        let tables = BTreeMap::from([(0, (0, ids.to_vec(), self.block_size as u32))]);
        let blocks = blocks_of(num_tokens, &tables, context);
        let mut result = null_mut();
        ok(
            kvcs_worker_checksum(worker, blocks, role, null_mut(), &mut result),
            context,
        );
        let mut len = 0;
        assert_eq!(
            kvcs_result_encode(result, null_mut(), 0, &mut len),
            KVCS_ERR_BUFFER_TOO_SMALL
        );
        let mut record = vec![0u8; len];
        ok(kvcs_result_encode(result, record.as_mut_ptr(), len, &mut len), context);
        kvcs_result_destroy(result);
        kvcs_blocks_destroy(blocks);
        kvcs_worker_destroy(worker);
        record
    }
}

/// A verifier of one worker expecting request "r" in `role`, with `record`.
fn verifier(
    ids: &[u32],
    block_size: u32,
    num_tokens: u64,
    role: u32,
    record: &[u8],
    context: &str,
) -> *mut kvcs_verifier {
    let mut verifier = null_mut();
    ok(kvcs_verifier_create(1, &mut verifier), context);
    let blocks = blocks_of(
        num_tokens,
        &BTreeMap::from([(0, (0, ids.to_vec(), block_size))]),
        context,
    );
    ok(kvcs_verifier_expect(verifier, blocks, role), context);
    kvcs_blocks_destroy(blocks);
    ok(
        kvcs_verifier_add_record(verifier, record.as_ptr(), record.len()),
        context,
    );
    verifier
}

/// A transfer of request "r" through the C ABI: a producer and a consumer
/// of `producer_size` and `consumer_size` tokens per block holding the same
/// random tokens, then some tokens flipped on the consumer.
struct Transfer {
    producer_size: usize,
    consumer_size: usize,
    num_tokens: usize,
    /// The producer's plain payload (its block size set on the consumer).
    payload: Vec<u8>,
    consumer: Cache,
    intact: Cache,
    consumer_ids: Vec<u32>,
    /// The consumer's tokens flipped.
    flipped: BTreeSet<usize>,
    context: String,
}

impl Transfer {
    fn new(rng: &mut Rng, producer_size: usize, consumer_size: usize, num_tokens: usize, context: &str) -> Transfer {
        let context = format!(
            "{context}: block sizes {producer_size} (producer) and {consumer_size} (consumer), {num_tokens} tokens"
        );
        let producer_blocks = num_tokens.div_ceil(producer_size);
        let consumer_blocks = num_tokens.div_ceil(consumer_size);
        let mut producer = Cache::new(rng, producer_blocks + 2, producer_size);
        let mut consumer = Cache::new(rng, consumer_blocks + 3, consumer_size);
        let producer_ids = rng.permutation(producer.num_blocks as u32)[..producer_blocks].to_vec();
        let consumer_ids = rng.permutation(consumer.num_blocks as u32)[..consumer_blocks].to_vec();
        // The transfer, one token at a time; the producer's tokens are random.
        let source = Cache::new(rng, 1, num_tokens);
        for token in 0..num_tokens {
            producer.copy_token(&producer_ids, &source, &[0], token);
            consumer.copy_token(&consumer_ids, &source, &[0], token);
        }
        let intact = Cache {
            values: consumer.values.clone(),
            block_size: consumer_size,
            num_blocks: consumer.num_blocks,
        };
        let flipped: BTreeSet<usize> = (0..rng.range(1..4))
            .map(|_| rng.below(num_tokens as u64) as usize)
            .collect();
        for &token in &flipped {
            let (head, piece) = (rng.below(HEADS as u64) as usize, rng.below(PIECES as u64) as usize);
            let at = consumer.at(
                consumer_ids[token / consumer_size] as usize,
                head,
                token % consumer_size,
                piece,
            );
            consumer.values[at] ^= 1 << rng.below(64);
        }
        let producer_record = producer.record(&producer_ids, num_tokens as u64, 0, &context);
        let sender = verifier(
            &producer_ids,
            producer_size as u32,
            num_tokens as u64,
            0,
            &producer_record,
            &context,
        );
        let mut len = 0;
        assert_eq!(
            kvcs_verifier_payload(sender, c"r".as_ptr(), null_mut(), 0, &mut len),
            KVCS_ERR_BUFFER_TOO_SMALL
        );
        let mut payload = vec![0u8; len];
        ok(
            kvcs_verifier_payload(sender, c"r".as_ptr(), payload.as_mut_ptr(), len, &mut len),
            &context,
        );
        kvcs_verifier_destroy(sender);
        Transfer {
            producer_size,
            consumer_size,
            num_tokens,
            payload,
            consumer,
            intact,
            consumer_ids,
            flipped,
            context,
        }
    }

    /// The consumer's report on `cache` and its verdict.
    fn check(&self, cache: &Cache) -> (*mut kvcs_report, u32) {
        let context = &self.context;
        let record = cache.record(&self.consumer_ids, self.num_tokens as u64, 1, context);
        let receiver = verifier(
            &self.consumer_ids,
            self.consumer_size as u32,
            self.num_tokens as u64,
            1,
            &record,
            context,
        );
        ok(
            kvcs_verifier_set_producer_block_size(receiver, 0, self.producer_size as u32),
            context,
        );
        let mut report = null_mut();
        ok(
            kvcs_verifier_check(
                receiver,
                c"r".as_ptr(),
                self.payload.as_ptr(),
                self.payload.len(),
                &mut report,
            ),
            context,
        );
        kvcs_verifier_destroy(receiver);
        let mut verdict = u32::MAX;
        ok(kvcs_report_verdict(report, &mut verdict), context);
        (report, verdict)
    }

    /// The consumer's table of group 0 (with its block size).
    fn tables(&self) -> BTreeMap<u32, (u64, Vec<u32>, u32)> {
        BTreeMap::from([(0u32, (0u64, self.consumer_ids.clone(), self.consumer_size as u32))])
    }

    /// The tokens of every run (of the lcm of the block sizes) holding a
    /// flipped token: those a mismatch names.
    fn differing(&self) -> BTreeSet<u64> {
        let run = self.producer_size * self.consumer_size
            / gcd(self.producer_size as u64, self.consumer_size as u64) as usize;
        self.flipped
            .iter()
            .flat_map(|&t| {
                let r = t / run;
                (r * run) as u64..((r + 1) * run).min(self.num_tokens) as u64
            })
            .collect()
    }
}

/// `kvcs_report_repair_plan` of `report` for request `req_id` of `blocks`,
/// group 0 in blocks of `block_size`: the plan, or the status and message.
fn report_plan(
    report: *const kvcs_report,
    blocks: *const kvcs_blocks,
    req_id: &std::ffi::CStr,
    block_size: u32,
) -> Result<Vec<Entry>, (kvcs_status, String)> {
    let (group_ids, block_sizes) = ([0u32], [block_size]);
    let mut entries = vec![
        kvcs_repair_block {
            group_id: 9,
            block_id: 9,
            position: 9,
            start_token: 9,
            end_token: 9
        };
        1024
    ];
    let mut len = usize::MAX;
    let status = kvcs_report_repair_plan(
        report,
        blocks,
        req_id.as_ptr(),
        group_ids.as_ptr(),
        block_sizes.as_ptr(),
        1,
        entries.as_mut_ptr(),
        entries.len(),
        &mut len,
    );
    if status != KVCS_OK {
        assert_eq!(len, usize::MAX, "*len written on an error");
        assert!(entries.iter().all(|e| e.group_id == 9), "entries written on an error");
        return Err((status, last_error()));
    }
    Ok(entries[..len]
        .iter()
        .map(|e| (e.group_id, e.position, e.block_id, e.start_token, e.end_token))
        .collect())
}

/// The report's mismatch entries (`kvcs_report_mismatch`).
fn report_mismatches(report: *const kvcs_report) -> Vec<kvcs_mismatch> {
    let mut count = 0;
    ok(kvcs_report_num_mismatches(report, &mut count), "num_mismatches");
    (0..count)
        .map(|i| {
            // SAFETY: an all-zero kvcs_mismatch is a valid value.
            let mut entry: kvcs_mismatch = unsafe { std::mem::zeroed() };
            ok(kvcs_report_mismatch(report, i, &mut entry), "mismatch");
            entry
        })
        .collect()
}

#[test]
fn a_reports_plan_names_the_blocks_of_each_flipped_run_and_reloading_them_matches() {
    let mut rng = Rng::for_test("a_reports_plan_names_the_blocks_of_each_flipped_run_and_reloading_them_matches");
    let seed = rng.seed();
    for case in 0..40 {
        let producer_size = rng.range(1..9) as usize;
        let consumer_size = rng.range(1..9) as usize;
        let num_tokens = rng.range(1..60) as usize;
        let mut transfer = Transfer::new(
            &mut rng,
            producer_size,
            consumer_size,
            num_tokens,
            &format!("seed {seed}, case {case}"),
        );
        let context = transfer.context.clone();
        let tables = transfer.tables();
        let blocks = blocks_of(num_tokens as u64, &tables, &context);
        let plan_for = |report: *const kvcs_report| {
            report_plan(report, blocks, c"r", consumer_size as u32)
                .unwrap_or_else(|(status, message)| panic!("{context}: {status:?}: {message}"))
        };

        let (report, verdict) = transfer.check(&transfer.consumer);
        let flipped = &transfer.flipped;
        assert_eq!(verdict, 1, "{context}: flipped tokens {flipped:?} are not a mismatch");
        let plan = plan_for(report);
        kvcs_report_destroy(report);
        let want = naive_plan(&tables, &BTreeMap::from([(0, transfer.differing())]));
        assert_eq!(plan, want, "{context}: flipped tokens {flipped:?}");

        // Reloading the planned tokens (and nothing else) restores a match.
        for &(_, _, _, start, end) in &plan {
            for token in start..end {
                let ids = transfer.consumer_ids.clone();
                transfer
                    .consumer
                    .copy_token(&ids, &transfer.intact, &ids, token as usize);
            }
        }
        let (report, verdict) = transfer.check(&transfer.consumer);
        assert_eq!(verdict, 0, "{context}: after the repair of {plan:?}");
        assert_eq!(
            plan_for(report),
            Vec::<Entry>::new(),
            "{context}: a match plans nothing"
        );
        kvcs_report_destroy(report);
        kvcs_blocks_destroy(blocks);
    }
}

/// A report's positions are counted in the consumer's block size it was
/// made with. Given any other (20, 12 or 11 for a 16-token report gave OK
/// and wrong token ranges), `kvcs_report_repair_plan` refuses, naming both
/// sizes; given the report's, it gives the naive plan. Every block size 1
/// to 64 against random reports of random block sizes 1 to 64.
#[test]
fn a_reports_plan_refuses_every_block_size_but_the_reports() {
    let mut rng = Rng::for_test("a_reports_plan_refuses_every_block_size_but_the_reports");
    let seed = rng.seed();
    let mut sizes = vec![(16usize, 16usize), (16, 48), (48, 16)];
    sizes.extend((0..12).map(|_| (rng.range(1..65) as usize, rng.range(1..65) as usize)));
    for (case, (producer_size, consumer_size)) in sizes.into_iter().enumerate() {
        let num_tokens = rng.range(1..200) as usize;
        let transfer = Transfer::new(
            &mut rng,
            producer_size,
            consumer_size,
            num_tokens,
            &format!("seed {seed}, case {case}"),
        );
        let context = &transfer.context;
        let tables = transfer.tables();
        let blocks = blocks_of(num_tokens as u64, &tables, context);
        let (report, verdict) = transfer.check(&transfer.consumer);
        assert_eq!(verdict, 1, "{context}: flipped tokens are not a mismatch");
        let want = naive_plan(&tables, &BTreeMap::from([(0, transfer.differing())]));
        for block_size in 1..=64u32 {
            let got = report_plan(report, blocks, c"r", block_size);
            if block_size as usize == consumer_size {
                assert_eq!(got, Ok(want.clone()), "{context}: the report's block size");
                continue;
            }
            let (status, message) = got.expect_err(&format!("{context}: block size {block_size} planned"));
            assert_eq!(status, KVCS_ERR_INVALID_ARGUMENT, "{context}: {message}");
            for needle in [
                format!("block size {block_size}"),
                format!("blocks of {consumer_size} tokens"),
                "group 0".to_owned(),
            ] {
                assert!(message.contains(&needle), "{context}: {needle:?} not in: {message}");
            }
        }
        kvcs_report_destroy(report);
        kvcs_blocks_destroy(blocks);
    }
}

/// Mismatch entries carried as `kvcs_mismatch` do not say their block
/// size: `kvcs_repair_plan` refuses every block size under which some entry
/// is not exactly the blocks of its tokens (its first token starting its
/// first position, its last token in its last position), checked here by
/// a naive loop over the entry's tokens; under any other it names exactly
/// the entries' positions, each with its tokens in that block size, and
/// under the report's it gives the naive plan. Every block size 1 to 64.
#[test]
fn mismatch_entries_are_planned_only_under_block_sizes_they_are_whole_blocks_of() {
    let mut rng = Rng::for_test("mismatch_entries_are_planned_only_under_block_sizes_they_are_whole_blocks_of");
    let seed = rng.seed();
    let (mut refused, mut planned) = (0, 0);
    for case in 0..15 {
        let (producer_size, consumer_size) = (rng.range(1..65) as usize, rng.range(1..65) as usize);
        let num_tokens = rng.range(1..200) as usize;
        let transfer = Transfer::new(
            &mut rng,
            producer_size,
            consumer_size,
            num_tokens,
            &format!("seed {seed}, case {case}"),
        );
        let context = &transfer.context;
        let tables = transfer.tables();
        let blocks = blocks_of(num_tokens as u64, &tables, context);
        let (report, verdict) = transfer.check(&transfer.consumer);
        assert_eq!(verdict, 1, "{context}: flipped tokens are not a mismatch");
        let mismatches = report_mismatches(report);
        kvcs_report_destroy(report);
        for block_size in 1..=64u32 {
            let size = block_size as u64;
            // Naively: every token of the entry lies in one of its
            // positions, and every position holds one of its tokens.
            let whole_blocks = mismatches.iter().all(|m| {
                let positions = m.first_position..m.first_position + m.num_positions;
                let tokens = m.first_token..m.first_token + m.num_tokens;
                tokens.clone().all(|t| positions.contains(&(t / size)))
                    && positions.clone().all(|q| tokens.clone().any(|t| t / size == q))
                    && m.first_token % size == 0
            });
            let mut sized = tables.clone();
            sized.get_mut(&0).unwrap().2 = block_size;
            let got = plan_of_entries(&mismatches, blocks, block_size);
            if !whole_blocks {
                let (status, message) = got.expect_err(&format!("{context}: block size {block_size} planned"));
                assert_eq!(status, KVCS_ERR_INVALID_ARGUMENT, "{context}: {message}");
                assert!(
                    message.contains("is not the one the mismatch was made with"),
                    "{context}: {message}"
                );
                refused += 1;
                continue;
            }
            let got = got.unwrap_or_else(|(status, message)| {
                panic!("{context}: block size {block_size}: {status:?}: {message}")
            });
            let differing: BTreeSet<u64> = mismatches
                .iter()
                .flat_map(|m| m.first_token..m.first_token + m.num_tokens)
                .collect();
            assert_eq!(
                got,
                naive_plan(&sized, &BTreeMap::from([(0, differing)])),
                "{context}: block size {block_size}"
            );
            if block_size as usize == consumer_size {
                let want = naive_plan(&tables, &BTreeMap::from([(0, transfer.differing())]));
                assert_eq!(got, want, "{context}: the report's block size");
            }
            planned += 1;
        }
        kvcs_blocks_destroy(blocks);
    }
    assert!(
        refused > 0 && planned > 0,
        "seed {seed}: {refused} refused, {planned} planned"
    );
}

/// `kvcs_repair_plan` of `mismatches` for request "r" of `blocks`, group 0
/// in blocks of `block_size`.
fn plan_of_entries(
    mismatches: &[kvcs_mismatch],
    blocks: *const kvcs_blocks,
    block_size: u32,
) -> Result<Vec<Entry>, (kvcs_status, String)> {
    let (group_ids, block_sizes) = ([0u32], [block_size]);
    let mut entries = vec![
        kvcs_repair_block {
            group_id: 9,
            block_id: 9,
            position: 9,
            start_token: 9,
            end_token: 9
        };
        1024
    ];
    let mut len = usize::MAX;
    let status = kvcs_repair_plan(
        mismatches.as_ptr(),
        mismatches.len(),
        blocks,
        c"r".as_ptr(),
        group_ids.as_ptr(),
        block_sizes.as_ptr(),
        1,
        entries.as_mut_ptr(),
        entries.len(),
        &mut len,
    );
    if status != KVCS_OK {
        assert_eq!(len, usize::MAX, "*len written on an error");
        return Err((status, last_error()));
    }
    Ok(entries[..len]
        .iter()
        .map(|e| (e.group_id, e.position, e.block_id, e.start_token, e.end_token))
        .collect())
}

/// A plan names the blocks of the request its report judged. Given request
/// "r"'s report and another request's id (with blocks of its own), the
/// plan named the other request's intact blocks and left "r"'s corrupted
/// ones: refused (`KVCS_ERR_INVALID_ARGUMENT`), the message naming both
/// ids, nothing written; "r"'s own id gives the plan.
#[test]
fn a_reports_plan_for_another_request_is_refused_naming_both_ids() {
    let mut rng = Rng::for_test("a_reports_plan_for_another_request_is_refused_naming_both_ids");
    let seed = rng.seed();
    let (producer_size, consumer_size) = (rng.range(1..17) as usize, rng.range(1..17) as usize);
    let num_tokens = rng.range(1..100) as usize;
    let transfer = Transfer::new(
        &mut rng,
        producer_size,
        consumer_size,
        num_tokens,
        &format!("seed {seed}"),
    );
    let context = &transfer.context;
    let (report, verdict) = transfer.check(&transfer.consumer);
    assert_eq!(verdict, 1, "{context}: flipped tokens are not a mismatch");
    // Both requests in one block set, each with its own blocks of group 0.
    let tables = transfer.tables();
    let blocks = blocks_of(num_tokens as u64, &tables, context);
    let other_ids: Vec<u32> = transfer.consumer_ids.iter().map(|id| id + 1000).collect();
    ok(
        kvcs_blocks_add_request(blocks, c"other".as_ptr(), num_tokens as u64),
        context,
    );
    ok(
        kvcs_blocks_add_group(blocks, c"other".as_ptr(), 0, 0, other_ids.as_ptr(), other_ids.len()),
        context,
    );
    let (status, message) = report_plan(report, blocks, c"other", consumer_size as u32)
        .expect_err(&format!("{context}: another request's plan"));
    assert_eq!(status, KVCS_ERR_INVALID_ARGUMENT, "{context}: {message}");
    assert!(
        message.contains("req_id \"r\"") && message.contains("req_id \"other\""),
        "{context}: the message does not name both ids: {message}"
    );
    let want = naive_plan(&tables, &BTreeMap::from([(0, transfer.differing())]));
    assert_eq!(
        report_plan(report, blocks, c"r", consumer_size as u32),
        Ok(want),
        "{context}"
    );
    // A request not in the block set at all is not found.
    let (status, _) = report_plan(report, blocks, c"absent", consumer_size as u32).expect_err(context);
    assert_eq!(status, KVCS_ERR_NOT_FOUND, "{context}");
    kvcs_report_destroy(report);
    kvcs_blocks_destroy(blocks);
}

#[test]
fn hostile_mismatch_entries_give_an_error_never_a_crash() {
    let mut rng = Rng::for_test("hostile_mismatch_entries_give_an_error_never_a_crash");
    let seed = rng.seed();
    let extremes = [0, 1, 2, 7, 8, u32::MAX as u64, u64::MAX / 2, u64::MAX - 1, u64::MAX];
    let mut planned = 0;
    for case in 0..5_000 {
        let first_position = if rng.chance(1, 4) {
            *rng.pick(&extremes)
        } else {
            rng.below(4)
        };
        let ids = rng.permutation(50)[..rng.range(0..20) as usize].to_vec();
        let size = *rng.pick(&[0u32, 1, 3, 8, u32::MAX]);
        let tables = BTreeMap::from([(0u32, (first_position.min(u64::MAX - 20), ids.clone(), size))]);
        let value = |rng: &mut Rng| {
            if rng.chance(1, 2) {
                *rng.pick(&extremes)
            } else {
                rng.below(40)
            }
        };
        let mismatches: Vec<kvcs_mismatch> = (0..rng.range(0..5))
            .map(|_| {
                let mut entry = kvcs_mismatch {
                    group_id: rng.below(2) as u32,
                    localised: 0,
                    first_position: value(&mut rng),
                    num_positions: value(&mut rng),
                    first_token: value(&mut rng),
                    num_tokens: value(&mut rng),
                    num_failed_checks: 0,
                    num_layers: 0,
                };
                // Some entries are the blocks of their tokens, as the
                // verifier makes them, so that some plans succeed.
                if rng.chance(1, 2) && size > 0 {
                    let size = size as u64;
                    entry.first_position = first_position.min(u64::MAX - 20) + rng.below(ids.len() as u64 + 1);
                    entry.num_positions = rng.range(1..4);
                    entry.first_token = entry.first_position.saturating_mul(size);
                    let most = entry.num_positions.saturating_mul(size);
                    entry.num_tokens = most - rng.below(size.min(most));
                }
                entry
            })
            .collect();
        let context = format!("seed {seed}, case {case}: tables {tables:?}, mismatches {mismatches:?}");
        let blocks = blocks_of(100, &tables, &context);
        let mut entries = vec![
            kvcs_repair_block {
                group_id: 9,
                block_id: 9,
                position: 9,
                start_token: 9,
                end_token: 9
            };
            ids.len()
        ];
        let mut len = usize::MAX;
        let status = kvcs_repair_plan(
            mismatches.as_ptr(),
            mismatches.len(),
            blocks,
            c"r".as_ptr(),
            [0u32].as_ptr(),
            [size].as_ptr(),
            1,
            entries.as_mut_ptr(),
            entries.len(),
            &mut len,
        );
        match status {
            KVCS_OK => {
                // Each entry a distinct position of the table, inside its block.
                assert!(len <= ids.len(), "{context}");
                planned += len;
                for e in &entries[..len] {
                    let index = (e.position - tables[&0].0) as usize;
                    assert_eq!(e.block_id, ids[index], "{context}");
                    let block_start = e.position as u128 * size as u128;
                    assert!(block_start <= e.start_token as u128, "{context}");
                    assert!(e.start_token < e.end_token, "{context}");
                    assert!((e.end_token as u128) <= block_start + size as u128, "{context}");
                }
            }
            KVCS_ERR_INVALID_ARGUMENT => {
                assert_eq!(len, usize::MAX, "{context}: *len written on an error");
                assert!(
                    entries.iter().all(|e| e.group_id == 9),
                    "{context}: entries written on an error"
                );
            }
            other => panic!("{context}: status {other:?}: {}", last_error()),
        }
        kvcs_blocks_destroy(blocks);
    }
    assert!(planned > 0, "seed {seed}: no case planned anything");
}
