//! The C boundary of verification, called as C would: records through
//! `kvcs_result_encode`, the `kvcs_verifier_*` calls, `kvcs_report_*`
//! accessors, the base64 helpers, and their error paths (NULLs, bad enum
//! values, malformed bytes, small buffers; out-parameters untouched on
//! error).
//!
//! Reproduce a failure with the seed it printed:
//! `KVCS_TEST_SEED=<seed> cargo test --test it verify_ffi::<name>`.

use crate::support;

use std::ffi::{c_char, CStr, CString};
use std::ptr::{null, null_mut};

use kvcsum::ffi::blocks::*;
use kvcsum::ffi::constants::KVCS_HOST;
use kvcsum::ffi::report::*;
use kvcsum::ffi::result::*;
use kvcsum::ffi::status::kvcs_status::*;
use kvcsum::ffi::verifier::*;
use kvcsum::ffi::worker::*;
use support::handles::{c_layer, c_segments, host_options, last_error, text};
use support::*;

const REQ: &CStr = c"req-c";

/// A worker deployment through the C API: per rank, its placement (kept
/// alive) and worker handle.
struct CSide {
    workers: Vec<*mut kvcs_worker>,
    _placements: Vec<Placement>,
    blocks: *mut kvcs_blocks,
    table: GroupTable,
}

impl Drop for CSide {
    fn drop(&mut self) {
        for &worker in &self.workers {
            kvcs_worker_destroy(worker);
        }
        kvcs_blocks_destroy(self.blocks);
    }
}

fn c_side(rng: &mut Rng, kv: &LogicalKv, tp_size: u32, kind: LayoutKind, detail: bool) -> CSide {
    let count = positions_for(kv.num_tokens(), 16, 0, 0);
    let table = GroupTable {
        group_id: 2,
        first_position: 0,
        block_ids: BlockAllocator::new(rng, count as u32 + 2).take(count),
    };
    let mut workers = Vec::new();
    let mut placements = Vec::new();
    for tp_rank in 0..tp_size {
        let options = kvcs_worker_options {
            tp_rank,
            tp_size,
            pp_rank: 0,
            device: KVCS_HOST,
            num_threads: 1,
        };
        let mut worker = null_mut();
        assert_eq!(kvcs_worker_create(&options, &mut worker), KVCS_OK);
        let shard = shard(kv, tp_rank, tp_size, 0, 1);
        let mut placement = Placement::for_shard(rng, kv, &shard, kind, 2, 16, count as u32 + 2);
        placement.write_request(kv, 0, &table.block_ids);
        for region in placement.regions(&placement.host_bases()) {
            assert_eq!(kvcs_worker_add_region(worker, region.address, region.length), KVCS_OK);
        }
        assert_eq!(kvcs_worker_add_group(worker, 2, 16), KVCS_OK);
        for spec in placement.host_layer_specs() {
            let segments = c_segments(&spec);
            let layer = kvcs_layer {
                group_id: 2,
                ..c_layer(&spec, &segments)
            };
            assert_eq!(kvcs_worker_add_layer(worker, &layer), KVCS_OK, "{}", last_error());
        }
        if detail {
            assert_eq!(kvcs_worker_set_detail(worker, 1), KVCS_OK);
        }
        workers.push(worker);
        placements.push(placement);
    }
    let mut blocks = null_mut();
    assert_eq!(kvcs_blocks_create(&mut blocks), KVCS_OK);
    assert_eq!(kvcs_blocks_add_request(blocks, REQ.as_ptr(), kv.num_tokens()), KVCS_OK);
    assert_eq!(
        kvcs_blocks_add_group(
            blocks,
            REQ.as_ptr(),
            2,
            0,
            table.block_ids.as_ptr(),
            table.block_ids.len()
        ),
        KVCS_OK
    );
    CSide {
        workers,
        _placements: placements,
        blocks,
        table,
    }
}

/// Each worker's record through `kvcs_result_encode` (size query first).
fn c_records(side: &CSide, role: kvcs_role) -> Vec<Vec<u8>> {
    side.workers
        .iter()
        .map(|&worker| {
            let mut result = null_mut();
            assert_eq!(
                kvcs_worker_checksum(worker, side.blocks, role as u32, null_mut(), &mut result),
                KVCS_OK
            );
            let mut len = 0usize;
            assert_eq!(
                kvcs_result_encode(result, null_mut(), 0, &mut len),
                KVCS_ERR_BUFFER_TOO_SMALL
            );
            assert!(len > 20, "the size needed is reported");
            let mut bytes = vec![0xAAu8; len];
            let mut short_len = 0usize;
            assert_eq!(
                kvcs_result_encode(result, bytes.as_mut_ptr(), len - 1, &mut short_len),
                KVCS_ERR_BUFFER_TOO_SMALL
            );
            assert_eq!(short_len, len);
            assert!(bytes.iter().all(|&b| b == 0xAA), "a too-small buffer is not written");
            let mut written = 0usize;
            assert_eq!(
                kvcs_result_encode(result, bytes.as_mut_ptr(), len, &mut written),
                KVCS_OK
            );
            assert_eq!(written, len);
            kvcs_result_destroy(result);
            bytes
        })
        .collect()
}

fn verifier(num_workers: u32) -> *mut kvcs_verifier {
    let mut verifier = null_mut();
    assert_eq!(kvcs_verifier_create(num_workers, &mut verifier), KVCS_OK);
    verifier
}

fn payload_of(producer: &CSide) -> Vec<u8> {
    let v = verifier(producer.workers.len() as u32);
    assert_eq!(kvcs_verifier_set_extension(v, 1), KVCS_OK);
    assert_eq!(
        kvcs_verifier_expect(v, producer.blocks, kvcs_role::KVCS_ROLE_PRODUCER as u32),
        KVCS_OK
    );
    let mut len = 0usize;
    for record in c_records(producer, kvcs_role::KVCS_ROLE_PRODUCER) {
        // Not every worker yet: no payload.
        assert_eq!(
            kvcs_verifier_payload(v, REQ.as_ptr(), null_mut(), 0, &mut len),
            KVCS_ERR_NOT_READY
        );
        assert!(last_error().contains("workers reported"), "{}", last_error());
        assert_eq!(kvcs_verifier_add_record(v, record.as_ptr(), record.len()), KVCS_OK);
    }
    assert_eq!(
        kvcs_verifier_payload(v, REQ.as_ptr(), null_mut(), 0, &mut len),
        KVCS_ERR_BUFFER_TOO_SMALL
    );
    let mut payload = vec![0u8; len];
    assert_eq!(
        kvcs_verifier_payload(v, REQ.as_ptr(), payload.as_mut_ptr(), len, &mut len),
        KVCS_OK
    );
    assert_eq!(len, payload.len());
    kvcs_verifier_destroy(v);
    payload
}

struct Report(*mut kvcs_report);

impl Drop for Report {
    fn drop(&mut self) {
        kvcs_report_destroy(self.0);
    }
}

impl Report {
    fn verdict(&self) -> u32 {
        let mut verdict = 99;
        assert_eq!(kvcs_report_verdict(self.0, &mut verdict), KVCS_OK);
        verdict
    }

    fn reason(&self) -> u32 {
        let mut reason = 99;
        assert_eq!(kvcs_report_reason(self.0, &mut reason), KVCS_OK);
        reason
    }

    fn message(&self) -> String {
        let mut message = null();
        assert_eq!(kvcs_report_message(self.0, &mut message), KVCS_OK);
        text(message)
    }
}

#[test]
fn a_transfer_through_the_c_api_matches_then_localises_a_flipped_bit() {
    let mut rng = Rng::for_test("a_transfer_through_the_c_api_matches_then_localises_a_flipped_bit");
    let seed = rng.seed();
    let kv = LogicalKv::random(&mut rng, KvShape::gqa(3, 2, 16, 45));
    let producer = c_side(&mut rng, &kv, 2, LayoutKind::Hnd, true);
    let mut consumer = c_side(&mut rng, &kv, 4, LayoutKind::Nhd, true);
    let payload = payload_of(&producer);
    // Base64 through the helpers: size query, then the NUL-terminated text.
    let mut text_len = 0usize;
    assert_eq!(
        kvcs_base64_encode(payload.as_ptr(), payload.len(), null_mut(), 0, &mut text_len),
        KVCS_ERR_BUFFER_TOO_SMALL
    );
    let mut base64 = vec![0 as c_char; text_len];
    assert_eq!(
        kvcs_base64_encode(
            payload.as_ptr(),
            payload.len(),
            base64.as_mut_ptr(),
            text_len,
            &mut text_len
        ),
        KVCS_OK
    );
    assert_eq!(text_len, payload.len().div_ceil(3) * 4 + 1, "text and its NUL");
    let mut decoded = vec![0u8; payload.len()];
    let mut decoded_len = 0usize;
    assert_eq!(
        kvcs_base64_decode(
            base64.as_ptr(),
            text_len - 1,
            decoded.as_mut_ptr(),
            decoded.len(),
            &mut decoded_len
        ),
        KVCS_OK
    );
    assert_eq!((decoded_len, &decoded), (payload.len(), &payload));

    let check = |consumer: &CSide| -> Report {
        let v = verifier(4);
        assert_eq!(
            kvcs_verifier_expect(v, consumer.blocks, kvcs_role::KVCS_ROLE_CONSUMER as u32),
            KVCS_OK
        );
        for record in c_records(consumer, kvcs_role::KVCS_ROLE_CONSUMER) {
            assert_eq!(kvcs_verifier_add_record(v, record.as_ptr(), record.len()), KVCS_OK);
        }
        let mut report = null_mut();
        assert_eq!(
            kvcs_verifier_check_base64(v, REQ.as_ptr(), base64.as_ptr(), &mut report),
            KVCS_OK
        );
        kvcs_verifier_destroy(v);
        Report(report)
    };
    let report = check(&consumer);
    assert_eq!(
        report.verdict(),
        kvcs_verdict::KVCS_VERDICT_MATCH as u32,
        "seed {seed}: {}",
        report.message()
    );
    let mut passed = 9;
    assert_eq!(kvcs_report_passed(report.0, &mut passed), KVCS_OK);
    assert_eq!(passed, 1);
    let mut compared = 0u64;
    assert_eq!(kvcs_report_compared_positions(report.0, &mut compared), KVCS_OK);
    assert_eq!(compared, 3);
    assert_eq!(report.reason(), kvcs_unverified_reason::KVCS_UNVERIFIED_NONE as u32);

    // TP rank 3 holds head 1 as replica 1 of 2: flip a bit of layer 2 at token 20.
    let block = consumer.table.block_ids[1];
    consumer._placements[3].xor_byte(2, 1, block, 4, 0, 0x01);
    let report = check(&consumer);
    assert_eq!(
        report.verdict(),
        kvcs_verdict::KVCS_VERDICT_MISMATCH as u32,
        "seed {seed}"
    );
    let mut count = 0usize;
    assert_eq!(kvcs_report_num_mismatches(report.0, &mut count), KVCS_OK);
    assert_eq!(count, 1);
    let mut mismatch = std::mem::MaybeUninit::<kvcs_mismatch>::zeroed();
    assert_eq!(kvcs_report_mismatch(report.0, 0, mismatch.as_mut_ptr()), KVCS_OK);
    // SAFETY: written by the call that returned KVCS_OK.
    let mismatch = unsafe { mismatch.assume_init() };
    assert_eq!(
        (mismatch.group_id, mismatch.first_position, mismatch.num_positions),
        (2, 1, 1)
    );
    assert_eq!((mismatch.first_token, mismatch.num_tokens), (16, 16));
    assert_eq!(
        (mismatch.num_failed_checks, mismatch.localised, mismatch.num_layers),
        (1, 1, 1)
    );
    let mut check_index = 99;
    assert_eq!(kvcs_report_failed_check(report.0, 0, 0, &mut check_index), KVCS_OK);
    assert_eq!(check_index, 1);
    let mut layer = kvcs_layer_difference {
        layer_number: 0,
        first_head: 0,
        num_heads: 0,
        check: 0,
    };
    assert_eq!(kvcs_report_layer_difference(report.0, 0, 0, &mut layer), KVCS_OK);
    assert_eq!(
        (layer.layer_number, layer.first_head, layer.num_heads, layer.check),
        (2, 1, 1, 1)
    );
    // Indices past the end: OUT_OF_BOUNDS, out-parameters untouched.
    assert_eq!(
        kvcs_report_layer_difference(report.0, 0, 1, &mut layer),
        KVCS_ERR_OUT_OF_BOUNDS
    );
    assert!(last_error().contains("index 1 is not below 1"), "{}", last_error());
    assert_eq!(layer.layer_number, 2);
    let mut untouched = 77u32;
    assert_eq!(
        kvcs_report_failed_check(report.0, 5, 0, &mut untouched),
        KVCS_ERR_OUT_OF_BOUNDS
    );
    assert_eq!(untouched, 77);
    assert!(report.message().contains("layer 2 heads 1..2"), "{}", report.message());
}

#[test]
fn unverified_reports_carry_reason_codes_and_messages() {
    let mut rng = Rng::for_test("unverified_reports_carry_reason_codes_and_messages");
    let kv = LogicalKv::random(&mut rng, KvShape::gqa(2, 2, 16, 30));
    let consumer = c_side(&mut rng, &kv, 2, LayoutKind::Hnd, false);
    let records = c_records(&consumer, kvcs_role::KVCS_ROLE_CONSUMER);
    let v = verifier(2);
    assert_eq!(
        kvcs_verifier_expect(v, consumer.blocks, kvcs_role::KVCS_ROLE_CONSUMER as u32),
        KVCS_OK
    );
    assert_eq!(
        kvcs_verifier_add_record(v, records[0].as_ptr(), records[0].len()),
        KVCS_OK
    );
    let mut report = null_mut();
    assert_eq!(kvcs_verifier_check_no_payload(v, REQ.as_ptr(), &mut report), KVCS_OK);
    let report = Report(report);
    assert_eq!(report.verdict(), kvcs_verdict::KVCS_VERDICT_UNVERIFIED as u32);
    assert_eq!(
        report.reason(),
        kvcs_unverified_reason::KVCS_UNVERIFIED_WORKERS_MISSING as u32
    );
    let (mut reason, mut group, mut message) = (0u32, 0u32, null());
    assert_eq!(
        kvcs_report_unverified(report.0, 0, &mut reason, &mut group, &mut message),
        KVCS_OK
    );
    assert_eq!((reason, group), (3, KVCS_WHOLE_LOAD));
    assert!(text(message).contains("1 of 2 workers reported"), "{}", text(message));
    assert_eq!(
        text(kvcs_unverified_reason_name(reason)),
        "KVCS_UNVERIFIED_WORKERS_MISSING"
    );
    assert_eq!(
        kvcs_verifier_add_record(v, records[1].as_ptr(), records[1].len()),
        KVCS_OK
    );
    let mut report = null_mut();
    assert_eq!(kvcs_verifier_check_no_payload(v, REQ.as_ptr(), &mut report), KVCS_OK);
    assert_eq!(
        Report(report).reason(),
        kvcs_unverified_reason::KVCS_UNVERIFIED_NO_CHECKSUMS as u32
    );
    // Garbage payload bytes, and the empty array: invalid checksums.
    for bytes in [&b"\x00\x01\x02"[..], &[]] {
        let mut report = null_mut();
        assert_eq!(
            kvcs_verifier_check(v, REQ.as_ptr(), bytes.as_ptr(), bytes.len(), &mut report),
            KVCS_OK
        );
        let report = Report(report);
        assert_eq!(
            report.reason(),
            kvcs_unverified_reason::KVCS_UNVERIFIED_INVALID_CHECKSUMS as u32
        );
        let mut passed = 9;
        assert_eq!(kvcs_report_passed(report.0, &mut passed), KVCS_OK);
        assert_eq!(passed, 0, "fail-closed by default");
    }
    assert_eq!(
        kvcs_verifier_set_policy(v, kvcs_policy::KVCS_POLICY_FAIL_OPEN as u32),
        KVCS_OK
    );
    let mut report = null_mut();
    assert_eq!(
        kvcs_verifier_check_base64(v, REQ.as_ptr(), c"!!".as_ptr(), &mut report),
        KVCS_OK
    );
    let report = Report(report);
    assert_eq!(
        report.reason(),
        kvcs_unverified_reason::KVCS_UNVERIFIED_INVALID_CHECKSUMS as u32
    );
    let mut passed = 9;
    assert_eq!(kvcs_report_passed(report.0, &mut passed), KVCS_OK);
    assert_eq!(passed, 1, "fail-open passes");
    assert!(report.message().contains("fail-open"), "{}", report.message());
    assert_eq!(kvcs_verifier_forget(v, REQ.as_ptr()), KVCS_OK);
    assert_eq!(kvcs_verifier_forget(v, REQ.as_ptr()), KVCS_ERR_NOT_FOUND);
    kvcs_verifier_destroy(v);
}

#[test]
fn bad_arguments_fail_with_a_status_and_a_message_and_write_nothing() {
    let v = verifier(2);
    let mut out: *mut kvcs_verifier = 0x8 as *mut _;
    assert_eq!(kvcs_verifier_create(0, &mut out), KVCS_ERR_INVALID_ARGUMENT);
    assert_eq!(out as usize, 0x8, "out untouched");
    assert!(last_error().contains("num_workers is 0"));
    assert_eq!(kvcs_verifier_create(1, null_mut()), KVCS_ERR_INVALID_ARGUMENT);
    assert_eq!(kvcs_verifier_set_policy(null_mut(), 0), KVCS_ERR_INVALID_ARGUMENT);
    assert!(last_error().contains("verifier is NULL"));
    assert_eq!(kvcs_verifier_set_policy(v, 7), KVCS_ERR_INVALID_ARGUMENT);
    assert!(last_error().contains("policy 7"));
    assert_eq!(kvcs_verifier_set_extension(v, 2), KVCS_ERR_INVALID_ARGUMENT);
    assert_eq!(kvcs_verifier_set_producer_tp_size(v, 0), KVCS_ERR_INVALID_ARGUMENT);
    assert_eq!(
        kvcs_verifier_set_producer_block_size(v, 1, 0),
        KVCS_ERR_INVALID_ARGUMENT
    );
    assert!(last_error().contains("block_size is 0 (group_id 1)"));
    let mut blocks = null_mut();
    assert_eq!(kvcs_blocks_create(&mut blocks), KVCS_OK);
    assert_eq!(kvcs_verifier_expect(v, blocks, 5), KVCS_ERR_INVALID_ARGUMENT);
    assert!(last_error().contains("role 5"));
    assert_eq!(kvcs_verifier_expect(v, null(), 0), KVCS_ERR_INVALID_ARGUMENT);
    kvcs_blocks_destroy(blocks);
    // Malformed records.
    let garbage = b"\x97\xadkvcsum.record\x02";
    assert_eq!(
        kvcs_verifier_add_record(v, garbage.as_ptr(), garbage.len()),
        KVCS_ERR_MALFORMED
    );
    assert!(last_error().starts_with("record: "), "{}", last_error());
    assert_eq!(
        kvcs_verifier_add_record(v, null(), 0),
        KVCS_ERR_MALFORMED,
        "(NULL, 0) is empty bytes"
    );
    assert_eq!(kvcs_verifier_add_record(v, null(), 5), KVCS_ERR_INVALID_ARGUMENT);
    // Unknown requests.
    let mut len = 0usize;
    assert_eq!(
        kvcs_verifier_payload(v, REQ.as_ptr(), null_mut(), 0, &mut len),
        KVCS_ERR_NOT_FOUND
    );
    assert_eq!(
        kvcs_verifier_payload(v, REQ.as_ptr(), null_mut(), 0, null_mut()),
        KVCS_ERR_INVALID_ARGUMENT
    );
    let mut report: *mut kvcs_report = 0x8 as *mut _;
    assert_eq!(
        kvcs_verifier_check(v, REQ.as_ptr(), null(), 0, &mut report),
        KVCS_ERR_NOT_FOUND
    );
    assert_eq!(report as usize, 0x8);
    assert_eq!(
        kvcs_verifier_check_base64(v, REQ.as_ptr(), null(), &mut report),
        KVCS_ERR_INVALID_ARGUMENT
    );
    assert_eq!(
        kvcs_verifier_check_no_payload(v, null(), &mut report),
        KVCS_ERR_INVALID_ARGUMENT
    );
    // Report accessors on NULL.
    let mut verdict = 5u32;
    assert_eq!(kvcs_report_verdict(null(), &mut verdict), KVCS_ERR_INVALID_ARGUMENT);
    assert_eq!(verdict, 5);
    assert_eq!(
        kvcs_report_unverified(null(), 0, null_mut(), null_mut(), null_mut()),
        KVCS_ERR_INVALID_ARGUMENT
    );
    // Base64 helpers.
    let mut buf = [0u8; 4];
    let mut n = 0usize;
    assert_eq!(
        kvcs_base64_decode(c"a$==".as_ptr(), 4, buf.as_mut_ptr(), 4, &mut n),
        KVCS_ERR_MALFORMED
    );
    assert!(last_error().starts_with("base64: "), "{}", last_error());
    assert_eq!(
        kvcs_base64_decode(c"AAAAAA==".as_ptr(), 8, buf.as_mut_ptr(), 3, &mut n),
        KVCS_ERR_BUFFER_TOO_SMALL
    );
    assert_eq!(n, 4);
    assert_eq!(
        kvcs_base64_encode(null(), 0, buf.as_mut_ptr().cast(), 4, &mut n),
        KVCS_OK
    );
    assert_eq!((n, buf[0]), (1, 0), "empty text is just the NUL");
    assert_eq!(
        kvcs_base64_encode(null(), 0, null_mut(), 4, &mut n),
        KVCS_ERR_INVALID_ARGUMENT
    );
    assert!(last_error().contains("buf is NULL with cap 4"));
    // Names: tests/c/verify.c's test_names checks the others.
    assert_eq!(text(kvcs_unverified_reason_name(15)), "KVCS_UNVERIFIED_NOTHING_READ");
    // No-op destroys.
    kvcs_verifier_destroy(null_mut());
    kvcs_report_destroy(null_mut());
    kvcs_verifier_destroy(v);
    let _ = CString::new("keep CString in use").unwrap();
}

#[test]
fn result_encode_checks_its_arguments() {
    let mut len = 3usize;
    assert_eq!(
        kvcs_result_encode(null(), null_mut(), 0, &mut len),
        KVCS_ERR_INVALID_ARGUMENT
    );
    assert_eq!(len, 3);
    let mut worker = null_mut();
    let options = host_options();
    assert_eq!(kvcs_worker_create(&options, &mut worker), KVCS_OK);
    assert_eq!(kvcs_worker_set_detail(worker, 3), KVCS_ERR_INVALID_ARGUMENT);
    assert_eq!(kvcs_worker_set_detail(null_mut(), 1), KVCS_ERR_INVALID_ARGUMENT);
    let mut blocks = null_mut();
    assert_eq!(kvcs_blocks_create(&mut blocks), KVCS_OK);
    let mut result = null_mut();
    assert_eq!(
        kvcs_worker_checksum(worker, blocks, 0, null_mut(), &mut result),
        KVCS_OK
    );
    assert_eq!(
        kvcs_result_encode(result, null_mut(), 0, null_mut()),
        KVCS_ERR_INVALID_ARGUMENT
    );
    let mut bytes = vec![0u8; 256];
    assert_eq!(
        kvcs_result_encode(result, bytes.as_mut_ptr(), bytes.len(), &mut len),
        KVCS_OK
    );
    let record = kvcsum::record::Record::decode(&bytes[..len]).unwrap();
    assert!(record.requests.is_empty() && record.groups.is_empty());
    kvcs_result_destroy(result);
    kvcs_blocks_destroy(blocks);
    kvcs_worker_destroy(worker);
}
