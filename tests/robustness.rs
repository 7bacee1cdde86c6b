//! The C ABI under hostile and careless callers (issue 9): one regression
//! test per defect found, each through the `extern "C"` functions as C
//! would call them, so that the class of defect stays caught.
//!
//! - Registration order of groups does not matter (records list groups by id).
//! - Declared lengths in payloads and records cannot make the decoders
//!   allocate beyond their input: the calls return normally under an
//!   address-space limit (the test re-runs itself in a child process with
//!   `RLIMIT_AS` set).
//! - Inputs built to be quadratic (many groups, layers, columns, requests,
//!   differing positions) take time in proportion to their size: each bound
//!   is generous (seconds) where the quadratic code took many times longer.
//! - A record's role is compared with the role its request is expected in.
//! - Records of requests not expected change nothing.
//! - Out-of-bounds messages print negative addresses with a sign.
//! - Reports count the loaded positions that were not compared, and an
//!   option makes such loads unverified.
//! - Issue 18: a region at address 0 is refused (a host worker read it and
//!   crashed); topology calls given a TP size from a handshake of 2^31
//!   refuse it under an address-space limit instead of allocating 8 GiB, and
//!   head sources take time per run, not per head; registering layers in
//!   detail mode is linear.
//!
//! Hand-made records and payloads are written by the small msgpack writer
//! below, independently of the library's encoder (layouts per the record and
//! payload module documentation).
//!
//! Reproduce a failure with the seed it printed:
//! `KVCS_TEST_SEED=<seed> cargo test --release --test robustness <name>`.

mod support;

use std::ffi::{c_char, CStr, CString};
use std::ptr::{null, null_mut};
use std::time::{Duration, Instant};

use kvcsum::ffi::blocks::*;
use kvcsum::ffi::report::*;
use kvcsum::ffi::result::*;
use kvcsum::ffi::status::kvcs_status::*;
use kvcsum::ffi::status::*;
use kvcsum::ffi::tensor_parallel::*;
use kvcsum::ffi::topology::*;
use kvcsum::ffi::verifier::*;
use kvcsum::ffi::worker::*;
use support::Rng;

fn last_error() -> String {
    // SAFETY: kvcs_last_error never returns NULL.
    unsafe { CStr::from_ptr(kvcs_last_error()) }
        .to_string_lossy()
        .into_owned()
}

fn text(ptr: *const c_char) -> String {
    assert!(!ptr.is_null());
    // SAFETY: the library's strings are NUL-terminated and live long enough.
    unsafe { CStr::from_ptr(ptr) }.to_string_lossy().into_owned()
}

/// A generous bound on work the fixed code does in a small fraction of it;
/// the quadratic code took many times longer on the same input.
fn assert_fast(what: &str, elapsed: Duration, bound_s: f64) {
    assert!(
        elapsed.as_secs_f64() < bound_s,
        "{what} took {:.2} s (bound {bound_s} s): work is not linear in the input",
        elapsed.as_secs_f64()
    );
}

// ---------------------------------------------------------------------------
// msgpack, written by hand

#[derive(Default)]
struct Mp(Vec<u8>);

impl Mp {
    fn array(&mut self, len: usize) -> &mut Self {
        match len {
            0..=15 => self.0.push(0x90 | len as u8),
            16..=0xffff => {
                self.0.push(0xdc);
                self.0.extend_from_slice(&(len as u16).to_be_bytes());
            }
            _ => {
                self.0.push(0xdd);
                self.0.extend_from_slice(&(len as u32).to_be_bytes());
            }
        }
        self
    }

    /// Every integer as `uint 64`: any width is valid msgpack.
    fn uint(&mut self, value: u64) -> &mut Self {
        if value < 0x80 {
            self.0.push(value as u8);
        } else {
            self.0.push(0xcf);
            self.0.extend_from_slice(&value.to_be_bytes());
        }
        self
    }

    fn bool(&mut self, value: bool) -> &mut Self {
        self.0.push(if value { 0xc3 } else { 0xc2 });
        self
    }

    fn str(&mut self, text: &str) -> &mut Self {
        self.0.push(0xdb);
        self.0.extend_from_slice(&(text.len() as u32).to_be_bytes());
        self.0.extend_from_slice(text.as_bytes());
        self
    }

    fn nil(&mut self) -> &mut Self {
        self.0.push(0xc0);
        self
    }

    fn u64s(&mut self, values: &[u64]) -> &mut Self {
        self.0.push(0xc6);
        self.0.extend_from_slice(&((values.len() * 8) as u32).to_be_bytes());
        for value in values {
            self.0.extend_from_slice(&value.to_le_bytes());
        }
        self
    }
}

/// One layer entry of a hand-made record: (layer, first head, heads, replica
/// key, values).
type TLayer = (u32, u32, u32, (u32, u32), Vec<u64>);

struct TGroup {
    group_id: u32,
    first_position: u64,
    num_positions: u64,
    columns: Vec<((u32, u32), Vec<u64>)>,
    layers: Vec<TLayer>,
}

struct TRequest {
    req_id: String,
    num_tokens: u64,
    groups: Vec<TGroup>,
}

/// A hand-made worker record.
struct TRecord {
    rank: (u32, u32, u32),
    /// 0 producer, 1 consumer.
    role: u64,
    detail: bool,
    /// (group id, block size, fingerprint), sorted by id.
    groups: Vec<(u32, u32, u64)>,
    requests: Vec<TRequest>,
}

impl TRecord {
    fn encode(&self) -> Vec<u8> {
        let mut w = Mp::default();
        w.array(8).str("kvcsum.record").uint(3);
        w.array(3)
            .uint(self.rank.0 as u64)
            .uint(self.rank.1 as u64)
            .uint(self.rank.2 as u64);
        w.uint(self.role).bool(self.detail);
        w.array(self.groups.len());
        for &(id, block_size, fingerprint) in &self.groups {
            w.array(7)
                .uint(id as u64)
                .uint(block_size as u64)
                .uint(fingerprint)
                .bool(false)
                .bool(true)
                .bool(false)
                .array(0);
        }
        w.array(self.requests.len());
        for request in &self.requests {
            w.array(4).str(&request.req_id).uint(request.num_tokens);
            w.array(request.groups.len());
            for group in &request.groups {
                w.array(6)
                    .uint(group.group_id as u64)
                    .uint(group.first_position)
                    .uint(group.num_positions);
                w.array(group.columns.len());
                for ((replicas, index), values) in &group.columns {
                    w.array(3).uint(*replicas as u64).uint(*index as u64).u64s(values);
                }
                w.array(group.layers.len());
                for (layer, first_head, num_heads, (replicas, index), values) in &group.layers {
                    w.array(6)
                        .uint(*layer as u64)
                        .uint(*first_head as u64)
                        .uint(*num_heads as u64)
                        .uint(*replicas as u64)
                        .uint(*index as u64)
                        .u64s(values);
                }
                w.nil();
            }
            w.array(0);
        }
        // WEIGHTED: the payloads these records meet are plain (vLLM's).
        w.uint(1);
        w.0
    }
}

/// One layer entry of a hand-made payload extension.
type PLayer = (u32, u32, u32, Vec<u64>);

/// The extension of a hand-made payload: producer TP size, and per group its
/// id, block size and layers.
type TExtension = (u32, Vec<(u32, u32, Vec<PLayer>)>);

/// A request of a block set: id, token count, and per group its id, first
/// position and block ids.
type TBlocks<'a> = (&'a str, u64, Vec<(u32, u64, Vec<u32>)>);

/// A hand-made payload: (group id, fingerprint, first position, values) per
/// group, and the extension's producer TP size and (group id, block size,
/// layers) per group.
struct TPayload {
    num_tokens: u64,
    groups: Vec<(u32, u64, u64, Vec<u64>)>,
    extension: Option<TExtension>,
}

impl TPayload {
    fn encode(&self) -> Vec<u8> {
        let mut w = Mp::default();
        w.array(if self.extension.is_some() { 4 } else { 3 })
            .uint(1)
            .uint(self.num_tokens);
        w.array(self.groups.len());
        for (id, fingerprint, first_position, values) in &self.groups {
            w.array(4)
                .uint(*id as u64)
                .uint(*fingerprint)
                .uint(*first_position)
                .u64s(values);
        }
        if let Some((tp_size, groups)) = &self.extension {
            w.array(3).uint(1).uint(*tp_size as u64).array(groups.len());
            for (id, block_size, layers) in groups {
                w.array(3).uint(*id as u64).uint(*block_size as u64).array(layers.len());
                for (layer, first_head, num_heads, values) in layers {
                    w.array(4)
                        .uint(*layer as u64)
                        .uint(*first_head as u64)
                        .uint(*num_heads as u64)
                        .u64s(values);
                }
            }
        }
        w.0
    }
}

// ---------------------------------------------------------------------------
// handles

struct Verifier(*mut kvcs_verifier);

impl Drop for Verifier {
    fn drop(&mut self) {
        kvcs_verifier_destroy(self.0);
    }
}

// SAFETY: a verifier may be used from any thread (its documented contract).
unsafe impl Send for Verifier {}
// SAFETY: every call but destroy may run concurrently (its documented contract).
unsafe impl Sync for Verifier {}

struct Blocks(*mut kvcs_blocks);

impl Drop for Blocks {
    fn drop(&mut self) {
        kvcs_blocks_destroy(self.0);
    }
}

struct Report(*mut kvcs_report);

// SAFETY: a report is immutable; every accessor may run from any thread.
unsafe impl Send for Report {}

impl Drop for Report {
    fn drop(&mut self) {
        kvcs_report_destroy(self.0);
    }
}

const PRODUCER: u32 = kvcs_role::KVCS_ROLE_PRODUCER as u32;
const CONSUMER: u32 = kvcs_role::KVCS_ROLE_CONSUMER as u32;

/// A block set of `(req_id, num_tokens, [(group id, first position, block ids)])`.
fn blocks(requests: &[TBlocks<'_>]) -> Blocks {
    let mut handle = null_mut();
    assert_eq!(kvcs_blocks_create(&mut handle), KVCS_OK);
    let blocks = Blocks(handle);
    for (req_id, num_tokens, groups) in requests {
        let req_id = CString::new(*req_id).unwrap();
        assert_eq!(kvcs_blocks_add_request(blocks.0, req_id.as_ptr(), *num_tokens), KVCS_OK);
        for (group_id, first_position, ids) in groups {
            assert_eq!(
                kvcs_blocks_add_group(
                    blocks.0,
                    req_id.as_ptr(),
                    *group_id,
                    *first_position,
                    ids.as_ptr(),
                    ids.len()
                ),
                KVCS_OK,
                "{}",
                last_error()
            );
        }
    }
    blocks
}

impl Verifier {
    fn new(num_workers: u32) -> Verifier {
        let mut handle = null_mut();
        assert_eq!(kvcs_verifier_create(num_workers, &mut handle), KVCS_OK);
        Verifier(handle)
    }

    fn expect(&self, blocks: &Blocks, role: u32) {
        assert_eq!(
            kvcs_verifier_expect(self.0, blocks.0, role),
            KVCS_OK,
            "{}",
            last_error()
        );
    }

    fn add(&self, record: &[u8]) -> kvcs_status {
        kvcs_verifier_add_record(self.0, record.as_ptr(), record.len())
    }

    fn check(&self, req_id: &str, payload: &[u8]) -> Report {
        let req_id = CString::new(req_id).unwrap();
        let mut out = null_mut();
        assert_eq!(
            kvcs_verifier_check(self.0, req_id.as_ptr(), payload.as_ptr(), payload.len(), &mut out),
            KVCS_OK,
            "{}",
            last_error()
        );
        Report(out)
    }

    fn payload(&self, req_id: &str) -> Result<Vec<u8>, (kvcs_status, String)> {
        let req_id = CString::new(req_id).unwrap();
        let mut len = 0usize;
        match kvcs_verifier_payload(self.0, req_id.as_ptr(), null_mut(), 0, &mut len) {
            KVCS_ERR_BUFFER_TOO_SMALL => {}
            status => return Err((status, last_error())),
        }
        let mut bytes = vec![0u8; len];
        assert_eq!(
            kvcs_verifier_payload(self.0, req_id.as_ptr(), bytes.as_mut_ptr(), len, &mut len),
            KVCS_OK
        );
        Ok(bytes)
    }
}

impl Report {
    fn verdict(&self) -> kvcs_verdict {
        let mut verdict = 99u32;
        assert_eq!(kvcs_report_verdict(self.0, &mut verdict), KVCS_OK);
        match verdict {
            0 => kvcs_verdict::KVCS_VERDICT_MATCH,
            1 => kvcs_verdict::KVCS_VERDICT_MISMATCH,
            2 => kvcs_verdict::KVCS_VERDICT_UNVERIFIED,
            v => panic!("verdict {v}"),
        }
    }

    fn reason(&self) -> String {
        let mut reason = 99u32;
        assert_eq!(kvcs_report_reason(self.0, &mut reason), KVCS_OK);
        text(kvcs_unverified_reason_name(reason))
    }

    fn message(&self) -> String {
        let mut message = null();
        assert_eq!(kvcs_report_message(self.0, &mut message), KVCS_OK);
        text(message)
    }

    fn compared(&self) -> u64 {
        let mut n = u64::MAX;
        assert_eq!(kvcs_report_compared_positions(self.0, &mut n), KVCS_OK);
        n
    }

    fn uncompared(&self) -> u64 {
        let mut n = u64::MAX;
        assert_eq!(kvcs_report_uncompared_positions(self.0, &mut n), KVCS_OK);
        n
    }

    fn mismatches(&self) -> Vec<kvcs_mismatch> {
        let mut count = 0usize;
        assert_eq!(kvcs_report_num_mismatches(self.0, &mut count), KVCS_OK);
        (0..count)
            .map(|i| {
                // SAFETY: all-zero bytes are a valid kvcs_mismatch (integers only).
                let mut entry: kvcs_mismatch = unsafe { std::mem::zeroed() };
                assert_eq!(kvcs_report_mismatch(self.0, i, &mut entry), KVCS_OK);
                entry
            })
            .collect()
    }

    fn layer_differences(&self, mismatch: usize, count: usize) -> Vec<(u32, u32, u32, u32)> {
        (0..count)
            .map(|j| {
                // SAFETY: all-zero bytes are a valid kvcs_layer_difference.
                let mut d: kvcs_layer_difference = unsafe { std::mem::zeroed() };
                assert_eq!(kvcs_report_layer_difference(self.0, mismatch, j, &mut d), KVCS_OK);
                (d.layer_number, d.first_head, d.num_heads, d.check)
            })
            .collect()
    }
}

// ---------------------------------------------------------------------------
// a host worker on random KV: one head per layer, NHD, K and V in one
// 16-byte cell per token

struct HostWorker {
    handle: *mut kvcs_worker,
    cache: Vec<u64>,
}

impl Drop for HostWorker {
    fn drop(&mut self) {
        kvcs_worker_destroy(self.handle);
    }
}

const CELL: u64 = 16;

impl HostWorker {
    /// A TP=1 host worker whose region holds `num_layers` caches of
    /// `num_blocks` blocks of `block_size` tokens, filled from `rng`.
    fn new(rng: &mut Rng, num_layers: u32, num_blocks: u32, block_size: u32) -> HostWorker {
        let options = kvcs_worker_options {
            tp_rank: 0,
            tp_size: 1,
            pp_rank: 0,
            device: KVCS_HOST,
            num_threads: 1,
        };
        let mut handle = null_mut();
        assert_eq!(kvcs_worker_create(&options, &mut handle), KVCS_OK);
        // WEIGHTED, as the plain payloads and the records these tests write by hand.
        assert_eq!(kvcs_worker_set_algorithm(handle, 1), KVCS_OK);
        let words = num_layers as usize * num_blocks as usize * block_size as usize * (CELL as usize / 8);
        let cache: Vec<u64> = (0..words).map(|_| rng.next_u64()).collect();
        let worker = HostWorker { handle, cache };
        assert_eq!(
            kvcs_worker_add_region(worker.handle, worker.base(), words as u64 * 8),
            KVCS_OK
        );
        worker
    }

    fn base(&self) -> u64 {
        self.cache.as_ptr() as u64
    }

    fn add_layer(&self, group_id: u32, layer_number: u32, slot: u32, num_blocks: u32, block_size: u32) -> kvcs_status {
        let layer_bytes = num_blocks as u64 * block_size as u64 * CELL;
        let segment = kvcs_segment {
            address: self.base() + slot as u64 * layer_bytes,
            block_stride: (block_size as u64 * CELL) as i64,
            kernel_block_stride: 0,
            head_stride: CELL as i64,
            token_stride: CELL as i64,
            bytes_per_token: CELL as u32,
        };
        self.add_segment(group_id, layer_number, num_blocks, block_size, segment)
    }

    fn add_segment(
        &self,
        group_id: u32,
        layer_number: u32,
        num_blocks: u32,
        block_size: u32,
        segment: kvcs_segment,
    ) -> kvcs_status {
        let identity = format!("model.layers.{layer_number}");
        let layer = kvcs_layer {
            group_id,
            layer_number,
            first_head: 0,
            num_heads: 1,
            replicas: 1,
            replica_index: 0,
            num_blocks,
            kernel_blocks: 1,
            tokens_per_kernel_block: block_size,
            num_segments: 1,
            segments: &segment,
            identity: identity.as_ptr(),
            identity_len: identity.len(),
        };
        kvcs_worker_add_layer(self.handle, &layer)
    }

    fn checksum(&self, blocks: &Blocks, role: u32) -> *mut kvcs_result {
        let mut result = null_mut();
        assert_eq!(
            kvcs_worker_checksum(self.handle, blocks.0, role, null_mut(), &mut result),
            KVCS_OK,
            "{}",
            last_error()
        );
        result
    }

    /// The record of a checksum call, or the status and message of
    /// `kvcs_result_encode`.
    fn record(&self, blocks: &Blocks, role: u32) -> Result<Vec<u8>, (kvcs_status, String)> {
        let result = self.checksum(blocks, role);
        let mut len = 0usize;
        let status = kvcs_result_encode(result, null_mut(), 0, &mut len);
        if status != KVCS_ERR_BUFFER_TOO_SMALL {
            let error = last_error();
            kvcs_result_destroy(result);
            return Err((status, error));
        }
        let mut bytes = vec![0u8; len];
        assert_eq!(kvcs_result_encode(result, bytes.as_mut_ptr(), len, &mut len), KVCS_OK);
        kvcs_result_destroy(result);
        Ok(bytes)
    }
}

/// Column 0 of a group of `num_positions` positions.
fn column(result: *mut kvcs_result, req_id: &CStr, group_id: u32, num_positions: usize) -> Vec<u64> {
    let mut values = vec![0u64; num_positions];
    assert_eq!(
        kvcs_result_column(
            result,
            req_id.as_ptr(),
            group_id,
            0,
            null_mut(),
            null_mut(),
            values.as_mut_ptr()
        ),
        KVCS_OK,
        "{}",
        last_error()
    );
    values
}

/// A one-worker consumer verifier expecting `req` (group 0, blocks 0..n at
/// position 0, `num_tokens`), with a hand-made consumer record of it.
fn consumer_with_record(record: &TRecord, n: u32, num_tokens: u64) -> (Verifier, Blocks) {
    let verifier = Verifier::new(1);
    let scheduled = blocks(&[("req", num_tokens, vec![(0, 0, (0..n).collect())])]);
    verifier.expect(&scheduled, CONSUMER);
    assert_eq!(verifier.add(&record.encode()), KVCS_OK, "{}", last_error());
    (verifier, scheduled)
}

/// A consumer record of `req`: group 0 (block size 16, fingerprint 7) at
/// positions 0..values.len(), one column.
fn simple_record(values: Vec<u64>, num_tokens: u64) -> TRecord {
    TRecord {
        rank: (0, 1, 0),
        role: 1,
        detail: false,
        groups: vec![(0, 16, 7)],
        requests: vec![TRequest {
            req_id: "req".to_owned(),
            num_tokens,
            groups: vec![TGroup {
                group_id: 0,
                first_position: 0,
                num_positions: values.len() as u64,
                columns: vec![((1, 0), values)],
                layers: Vec::new(),
            }],
        }],
    }
}

// ---------------------------------------------------------------------------
// Defect 1: groups registered out of id order

#[test]
fn groups_registered_out_of_id_order_give_valid_records_that_match() {
    let mut rng = Rng::for_test("groups_registered_out_of_id_order_give_valid_records_that_match");
    let seed = rng.seed();
    let (num_blocks, block_size) = (4, 16);
    let worker = HostWorker::new(&mut rng, 3, num_blocks, block_size);
    // Group 1 first, then group 0; layers in both.
    assert_eq!(kvcs_worker_add_group(worker.handle, 1, block_size), KVCS_OK);
    assert_eq!(kvcs_worker_add_group(worker.handle, 0, block_size), KVCS_OK);
    assert_eq!(
        worker.add_layer(0, 0, 0, num_blocks, block_size),
        KVCS_OK,
        "{}",
        last_error()
    );
    assert_eq!(
        worker.add_layer(1, 1, 1, num_blocks, block_size),
        KVCS_OK,
        "{}",
        last_error()
    );
    assert_eq!(
        worker.add_layer(0, 2, 2, num_blocks, block_size),
        KVCS_OK,
        "{}",
        last_error()
    );
    let scheduled = blocks(&[("req", 40, vec![(0, 0, vec![2, 0, 3]), (1, 0, vec![1, 3, 0])])]);
    let producer_record = worker.record(&scheduled, PRODUCER).unwrap_or_else(|(status, message)| {
        panic!("seed {seed}: kvcs_result_encode gave {status:?}: {message}");
    });
    let consumer_record = worker.record(&scheduled, CONSUMER).unwrap();
    let producer = Verifier::new(1);
    producer.expect(&scheduled, PRODUCER);
    assert_eq!(producer.add(&producer_record), KVCS_OK, "{}", last_error());
    let payload = producer.payload("req").unwrap();
    let consumer = Verifier::new(1);
    consumer.expect(&scheduled, CONSUMER);
    assert_eq!(consumer.add(&consumer_record), KVCS_OK, "{}", last_error());
    let report = consumer.check("req", &payload);
    assert_eq!(
        report.verdict(),
        kvcs_verdict::KVCS_VERDICT_MATCH,
        "seed {seed}: {}",
        report.message()
    );
    assert_eq!((report.compared(), report.uncompared()), (6, 0), "seed {seed}");
}

// ---------------------------------------------------------------------------
// Defect 2: declared lengths under an address-space limit

/// Runs `body` in a child process (this test binary, this test only) whose
/// address space is limited to 2 GiB; the child must exit normally.
fn under_address_space_limit(name: &str, body: fn()) {
    const CHILD: &str = "KVCS_ROBUSTNESS_CHILD";
    if std::env::var(CHILD).as_deref() == Ok(name) {
        let limit = libc::rlimit {
            rlim_cur: 2 << 30,
            rlim_max: 2 << 30,
        };
        // SAFETY: setrlimit reads the struct given; no memory is shared.
        assert_eq!(unsafe { libc::setrlimit(libc::RLIMIT_AS, &limit) }, 0);
        body();
        return;
    }
    let output = std::process::Command::new(std::env::current_exe().unwrap())
        .args([name, "--exact", "--test-threads=1", "--nocapture"])
        .env(CHILD, name)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(
        output.status.success() && stdout.contains("1 passed"),
        "{name} under a 2 GiB address-space limit: {:?}\n{stdout}\n{}",
        output.status,
        String::from_utf8_lossy(&output.stderr)
    );
}

/// `prefix`, then `filler` zero bytes: every declared element would be an
/// integer 0, so nothing but the declared length is large.
fn padded(prefix: &[u8], filler: usize) -> Vec<u8> {
    let mut bytes = Vec::with_capacity(prefix.len() + filler);
    bytes.extend_from_slice(prefix);
    bytes.resize(prefix.len() + filler, 0);
    bytes
}

fn array32(len: usize) -> Vec<u8> {
    let mut bytes = vec![0xdd];
    bytes.extend_from_slice(&(len as u32).to_be_bytes());
    bytes
}

#[test]
fn payloads_declaring_huge_lengths_give_unverified_reports_under_a_memory_limit() {
    under_address_space_limit(
        "payloads_declaring_huge_lengths_give_unverified_reports_under_a_memory_limit",
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
                let report = verifier.check("req", payload);
                assert_eq!(report.verdict(), kvcs_verdict::KVCS_VERDICT_UNVERIFIED, "{what}");
                assert_eq!(report.reason(), "KVCS_UNVERIFIED_INVALID_CHECKSUMS", "{what}");
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
            let report = Report(out);
            assert_eq!(report.reason(), "KVCS_UNVERIFIED_INVALID_CHECKSUMS");
            // Many real elements: a million one-value groups decode and compare.
            let mut w = Mp::default();
            w.array(3).uint(1).uint(16).array(1 << 20);
            for id in 0..1u64 << 20 {
                w.array(4).uint(id).uint(7).uint(0).u64s(&[5]);
            }
            let report = verifier.check("req", &w.0);
            assert_eq!(
                report.verdict(),
                kvcs_verdict::KVCS_VERDICT_MATCH,
                "{}",
                report.message()
            );
        },
    );
}

#[test]
fn records_declaring_huge_lengths_are_malformed_under_a_memory_limit() {
    under_address_space_limit(
        "records_declaring_huge_lengths_are_malformed_under_a_memory_limit",
        || {
            let verifier = Verifier::new(1);
            let n = 60 << 20;
            let head = |w: &mut Mp| {
                w.array(8).str("kvcsum.record").uint(3);
                w.array(3).uint(0).uint(1).uint(0);
                w.uint(1).bool(true);
            };
            let mut prefixes: Vec<(&str, Vec<u8>)> = Vec::new();
            // The record's groups.
            let mut w = Mp::default();
            head(&mut w);
            prefixes.push(("groups", w.0));
            // Its requests.
            let mut w = Mp::default();
            head(&mut w);
            w.array(1).array(7).uint(0).bool(false);
            prefixes.push(("requests", w.0));
            // A request's groups, a group's columns and layers, skipped groups.
            let mut w = Mp::default();
            head(&mut w);
            w.array(1)
                .array(7)
                .uint(0)
                .bool(false)
                .array(1)
                .array(4)
                .str("req")
                .uint(16);
            let request = w.0.clone();
            prefixes.push(("request groups", request.clone()));
            let mut w = Mp(request.clone());
            w.array(1).array(6).uint(0).uint(0).uint(0);
            prefixes.push(("columns", w.0.clone()));
            w.array(0);
            prefixes.push(("layers", w.0));
            let mut w = Mp(request);
            w.array(0);
            prefixes.push(("skipped groups", w.0));
            for (what, prefix) in prefixes {
                let mut prefix = prefix;
                prefix.extend(array32(n));
                let record = padded(&prefix, n);
                assert_eq!(verifier.add(&record), KVCS_ERR_MALFORMED, "{what}");
            }
        },
    );
}

// ---------------------------------------------------------------------------
// Defect 3: validation linear in payloads and records

#[test]
fn a_payload_of_many_extension_groups_validates_in_linear_time() {
    let (verifier, _blocks) = consumer_with_record(&simple_record(vec![5], 16), 1, 16);
    let n = 160_000u32;
    // Plain groups ascending, extension groups descending: a search of the
    // plain groups per extension group walks most of them.
    let payload = TPayload {
        num_tokens: 16,
        groups: (0..n).map(|id| (id, 7, 0, vec![5])).collect(),
        extension: Some((1, (0..n).rev().map(|id| (id, 16, Vec::new())).collect())),
    }
    .encode();
    let start = Instant::now();
    let report = verifier.check("req", &payload);
    assert_fast("checking a payload of 160k extension groups", start.elapsed(), 3.0);
    assert_eq!(
        report.verdict(),
        kvcs_verdict::KVCS_VERDICT_MATCH,
        "{}",
        report.message()
    );
    // A duplicate extension group is still found.
    let mut duplicate = TPayload {
        num_tokens: 16,
        groups: (0..n).map(|id| (id, 7, 0, vec![5])).collect(),
        extension: Some((1, (0..n).rev().map(|id| (id, 16, Vec::new())).collect())),
    };
    duplicate.extension.as_mut().unwrap().1.push((n / 2, 16, Vec::new()));
    let report = verifier.check("req", &duplicate.encode());
    assert_eq!(report.reason(), "KVCS_UNVERIFIED_INVALID_CHECKSUMS");
    assert!(
        report.message().contains(&format!("group {} appears twice", n / 2)),
        "{}",
        report.message()
    );
}

#[test]
fn a_record_of_many_columns_and_layers_validates_in_linear_time() {
    let n = 60_000u32;
    let record = TRecord {
        rank: (0, 1, 0),
        role: 1,
        detail: true,
        groups: vec![(0, 16, 7)],
        requests: vec![TRequest {
            req_id: "elsewhere".to_owned(),
            num_tokens: 0,
            groups: vec![TGroup {
                group_id: 0,
                first_position: 0,
                num_positions: 0,
                columns: (0..n).map(|i| ((n, i), Vec::new())).collect(),
                layers: (0..n).rev().map(|i| (n - 1 - i, 0, 1, (n, i), Vec::new())).collect(),
            }],
        }],
    };
    let verifier = Verifier::new(1);
    let bytes = record.encode();
    let start = Instant::now();
    assert_eq!(verifier.add(&bytes), KVCS_OK, "{}", last_error());
    assert_fast("adding a record of 60k columns and 60k layers", start.elapsed(), 3.0);
    // A layer whose key no column has is still refused.
    let mut bad = record;
    bad.requests[0].groups[0].columns.pop();
    assert_eq!(verifier.add(&bad.encode()), KVCS_ERR_MALFORMED);
    assert!(
        last_error().contains("no column has its replica key"),
        "{}",
        last_error()
    );
}

// ---------------------------------------------------------------------------
// Defect 4: naming differing layers, outside the lock and linear

/// A detail-mode consumer record and a payload with the extension whose
/// layer `q % num_layers` differs at each position `q`.
fn every_position_differs_in_one_layer(rng: &mut Rng, num_layers: u32, positions: u64) -> (TRecord, Vec<u8>) {
    let layer_values: Vec<Vec<u64>> = (0..num_layers)
        .map(|_| (0..positions).map(|_| rng.next_u64()).collect())
        .collect();
    let sum = |layers: &[Vec<u64>]| -> Vec<u64> {
        (0..positions as usize)
            .map(|q| layers.iter().fold(0u64, |s, l| s.wrapping_add(l[q])))
            .collect()
    };
    let mut sent = layer_values.clone();
    for q in 0..positions as usize {
        let layer = &mut sent[q % num_layers as usize][q];
        *layer = layer.wrapping_add(1 + rng.below(1000));
    }
    let record = TRecord {
        rank: (0, 1, 0),
        role: 1,
        detail: true,
        groups: vec![(0, 16, 7)],
        requests: vec![TRequest {
            req_id: "req".to_owned(),
            num_tokens: positions * 16,
            groups: vec![TGroup {
                group_id: 0,
                first_position: 0,
                num_positions: positions,
                columns: vec![((1, 0), sum(&layer_values))],
                layers: layer_values
                    .iter()
                    .enumerate()
                    .map(|(l, values)| (l as u32, 0, 1, (1, 0), values.clone()))
                    .collect(),
            }],
        }],
    };
    let payload = TPayload {
        num_tokens: positions * 16,
        groups: vec![(0, 7, 0, sum(&sent))],
        extension: Some((
            1,
            vec![(
                0,
                16,
                sent.into_iter()
                    .enumerate()
                    .map(|(l, values)| (l as u32, 0, 1, values))
                    .collect(),
            )],
        )),
    };
    (record, payload.encode())
}

#[test]
fn naming_differing_layers_is_linear_and_never_holds_the_lock() {
    let mut rng = Rng::for_test("naming_differing_layers_is_linear_and_never_holds_the_lock");
    let seed = rng.seed();
    let (num_layers, positions) = (3000u32, 100u64);
    let (record, payload) = every_position_differs_in_one_layer(&mut rng, num_layers, positions);
    let (verifier, _blocks) = consumer_with_record(&record, positions as u32, positions * 16);
    let start = Instant::now();
    let (report, longest_wait) = std::thread::scope(|scope| {
        let checking = scope.spawn(|| verifier.check("req", &payload));
        // set_policy from another thread, while the check runs.
        let mut longest = Duration::ZERO;
        while !checking.is_finished() {
            let asked = Instant::now();
            assert_eq!(kvcs_verifier_set_policy(verifier.0, 1), KVCS_OK);
            longest = longest.max(asked.elapsed());
            std::thread::sleep(Duration::from_millis(1));
        }
        (checking.join().unwrap(), longest)
    });
    assert_fast(
        "a detail-mode check with every position differing",
        start.elapsed(),
        5.0,
    );
    assert!(
        longest_wait < Duration::from_millis(500),
        "kvcs_verifier_set_policy waited {longest_wait:?} for a check"
    );
    assert_eq!(report.verdict(), kvcs_verdict::KVCS_VERDICT_MISMATCH, "seed {seed}");
    let mismatches = report.mismatches();
    assert_eq!(mismatches.len() as u64, positions, "seed {seed}");
    for (i, mismatch) in mismatches.iter().enumerate() {
        assert_eq!(mismatch.localised, 1, "seed {seed}");
        let q = mismatch.first_position;
        let layers = report.layer_differences(i, mismatch.num_layers);
        assert_eq!(
            layers,
            vec![((q % num_layers as u64) as u32, 0, 1, 0)],
            "seed {seed}: position {q}"
        );
    }
}

/// A detail-mode consumer record whose `r` replica copies each hold one
/// layer (key `(r, i)` holds layer `i`), and a payload whose value differs
/// from every check: each of the `r` checks fails, and naming its layers
/// compares all `r` producer layers. The report's size would be `r * r`.
fn every_check_differs(rng: &mut Rng, r: u32) -> (TRecord, Vec<u8>) {
    let values: Vec<u64> = (0..r).map(|_| rng.next_u64()).collect();
    let record = TRecord {
        rank: (0, 1, 0),
        role: 1,
        detail: true,
        groups: vec![(0, 16, 7)],
        requests: vec![TRequest {
            req_id: "req".to_owned(),
            num_tokens: 16,
            groups: vec![TGroup {
                group_id: 0,
                first_position: 0,
                num_positions: 1,
                columns: (0..r).map(|i| ((r, i), vec![values[i as usize]])).collect(),
                layers: (0..r).map(|i| (i, 0, 1, (r, i), vec![values[i as usize]])).collect(),
            }],
        }],
    };
    let differs = values.iter().fold(1u64, |s, &v| s.wrapping_add(v));
    let payload = TPayload {
        num_tokens: 16,
        groups: vec![(0, 7, 0, vec![differs])],
        extension: Some((
            1,
            vec![(0, 16, (0..r).map(|i| (i, 0, 1, vec![values[i as usize]])).collect())],
        )),
    };
    (record, payload.encode())
}

#[test]
fn naming_layers_of_many_failing_replica_checks_is_bounded_by_the_input() {
    let mut rng = Rng::for_test("naming_layers_of_many_failing_replica_checks_is_bounded_by_the_input");
    let seed = rng.seed();
    // Small: every check names the other copies' layers.
    let (record, payload) = every_check_differs(&mut rng, 8);
    let (verifier, _blocks) = consumer_with_record(&record, 1, 16);
    let report = verifier.check("req", &payload);
    let mismatches = report.mismatches();
    assert_eq!(mismatches.len(), 1, "seed {seed}: {}", report.message());
    assert_eq!(
        (mismatches[0].num_failed_checks, mismatches[0].localised),
        (8, 1),
        "seed {seed}"
    );
    let layers = report.layer_differences(0, mismatches[0].num_layers);
    assert_eq!(layers.len(), 8 * 7, "seed {seed}");
    for check in 0..8u32 {
        let named: Vec<u32> = layers.iter().filter(|d| d.3 == check).map(|d| d.0).collect();
        let others: Vec<u32> = (0..8).filter(|&l| l != check).collect();
        assert_eq!(named, others, "seed {seed}: check {check}");
    }
    // Large: the mismatch is reported, without naming r * r layers.
    let r = 5000;
    let (record, payload) = every_check_differs(&mut rng, r);
    let (verifier, _blocks) = consumer_with_record(&record, 1, 16);
    let start = Instant::now();
    let report = verifier.check("req", &payload);
    assert_fast("a check with 5000 failing replica checks", start.elapsed(), 5.0);
    let mismatches = report.mismatches();
    assert_eq!(mismatches.len(), 1, "seed {seed}");
    assert_eq!(mismatches[0].num_failed_checks, r as usize, "seed {seed}");
    assert_eq!(
        (mismatches[0].localised, mismatches[0].num_layers),
        (0, 0),
        "seed {seed}"
    );
}

// ---------------------------------------------------------------------------
// Defect 5: a record computed in the other role

#[test]
fn a_record_of_the_other_role_is_unverified_not_corrupt() {
    let mut rng = Rng::for_test("a_record_of_the_other_role_is_unverified_not_corrupt");
    let seed = rng.seed();
    let (num_blocks, block_size) = (8, 16);
    let worker = HostWorker::new(&mut rng, 2, num_blocks, block_size);
    assert_eq!(kvcs_worker_add_group(worker.handle, 0, block_size), KVCS_OK);
    for layer in 0..2 {
        assert_eq!(worker.add_layer(0, layer, layer, num_blocks, block_size), KVCS_OK);
    }
    let scheduled = blocks(&[("req", 100, vec![(0, 0, vec![3, 1, 4, 0, 5, 2, 6])])]);
    let producer = Verifier::new(1);
    producer.expect(&scheduled, PRODUCER);
    assert_eq!(producer.add(&worker.record(&scheduled, PRODUCER).unwrap()), KVCS_OK);
    let payload = producer.payload("req").unwrap();
    // The consumer rank ran its checksum with KVCS_ROLE_PRODUCER by mistake.
    let consumer = Verifier::new(1);
    consumer.expect(&scheduled, CONSUMER);
    assert_eq!(consumer.add(&worker.record(&scheduled, PRODUCER).unwrap()), KVCS_OK);
    let report = consumer.check("req", &payload);
    assert_eq!(
        report.verdict(),
        kvcs_verdict::KVCS_VERDICT_UNVERIFIED,
        "seed {seed}: {}",
        report.message()
    );
    assert_eq!(report.reason(), "KVCS_UNVERIFIED_ROLE_DIFFERS", "seed {seed}");
    assert!(report.message().contains("as a producer"), "{}", report.message());
    // The right role matches.
    assert_eq!(consumer.add(&worker.record(&scheduled, CONSUMER).unwrap()), KVCS_OK);
    let report = consumer.check("req", &payload);
    assert_eq!(
        report.verdict(),
        kvcs_verdict::KVCS_VERDICT_MATCH,
        "seed {seed}: {}",
        report.message()
    );
    // A producer's verifier given a consumer's record builds no payload.
    let producer = Verifier::new(1);
    producer.expect(&scheduled, PRODUCER);
    assert_eq!(producer.add(&worker.record(&scheduled, CONSUMER).unwrap()), KVCS_OK);
    let (status, message) = producer.payload("req").unwrap_err();
    assert_eq!(status, KVCS_ERR_INVALID_ARGUMENT);
    assert!(message.contains("as a consumer"), "{message}");
}

// ---------------------------------------------------------------------------
// Defect 6: records of requests not expected

fn tp_record(req_id: &str, tp_rank: u32, tp_size: u32, pp_rank: u32) -> Vec<u8> {
    let mut record = simple_record(vec![5], 16);
    record.rank = (tp_rank, tp_size, pp_rank);
    record.requests[0].req_id = req_id.to_owned();
    record.encode()
}

#[test]
fn records_of_requests_not_expected_change_nothing() {
    let verifier = Verifier::new(2);
    // A stray record (TP size 1, two stages) is accepted and pins nothing.
    assert_eq!(verifier.add(&tp_record("stray", 0, 1, 1)), KVCS_OK);
    let scheduled = blocks(&[("req", 16, vec![(0, 0, vec![0])])]);
    verifier.expect(&scheduled, CONSUMER);
    assert_eq!(verifier.add(&tp_record("req", 0, 2, 0)), KVCS_OK, "{}", last_error());
    assert_eq!(verifier.add(&tp_record("req", 1, 2, 0)), KVCS_OK, "{}", last_error());
    // Every worker reported: the verdict is about the payload.
    let req_id = CString::new("req").unwrap();
    let mut out = null_mut();
    assert_eq!(
        kvcs_verifier_check_no_payload(verifier.0, req_id.as_ptr(), &mut out),
        KVCS_OK
    );
    assert_eq!(Report(out).reason(), "KVCS_UNVERIFIED_NO_CHECKSUMS");
    // While records are held, their TP size is enforced.
    assert_eq!(verifier.add(&tp_record("req", 0, 1, 1)), KVCS_ERR_INVALID_ARGUMENT);
    assert!(last_error().contains("differs from tp_size 2"), "{}", last_error());
    // A stray record of another TP size is still fine, and changes nothing.
    assert_eq!(verifier.add(&tp_record("stray", 0, 1, 1)), KVCS_OK);
    // Once forgotten, a request's records pin nothing either.
    assert_eq!(kvcs_verifier_forget(verifier.0, req_id.as_ptr()), KVCS_OK);
    verifier.expect(&scheduled, CONSUMER);
    assert_eq!(verifier.add(&tp_record("req", 0, 1, 0)), KVCS_OK, "{}", last_error());
    assert_eq!(verifier.add(&tp_record("req", 0, 1, 1)), KVCS_OK, "{}", last_error());
    // Expecting the request again drops its records: the TP size is free.
    verifier.expect(&scheduled, CONSUMER);
    assert_eq!(verifier.add(&tp_record("req", 1, 2, 0)), KVCS_OK, "{}", last_error());
}

// ---------------------------------------------------------------------------
// Defect 7: lookups on the fast path

#[test]
fn adding_many_layers_takes_linear_time() {
    let mut rng = Rng::for_test("adding_many_layers_takes_linear_time");
    let layers = 16_000u32;
    let worker = HostWorker::new(&mut rng, layers, 1, 1);
    assert_eq!(kvcs_worker_add_group(worker.handle, 0, 1), KVCS_OK);
    let start = Instant::now();
    // Registered in a scattered order of layer numbers.
    for slot in 0..layers {
        let layer_number = (slot as u64 * 7919 % layers as u64) as u32;
        assert_eq!(
            worker.add_layer(0, layer_number, slot, 1, 1),
            KVCS_OK,
            "{}",
            last_error()
        );
    }
    assert_fast("adding 16k layers", start.elapsed(), 5.0);
    // Overlapping heads are still refused, naming the range registered before.
    assert_eq!(worker.add_layer(0, 4321, 0, 1, 1), KVCS_ERR_INVALID_ARGUMENT);
    assert!(
        last_error().contains("heads 0..1 of layer_number 4321 overlap heads 0..1 registered before"),
        "{}",
        last_error()
    );
}

#[test]
fn result_columns_are_found_in_constant_time() {
    let mut rng = Rng::for_test("result_columns_are_found_in_constant_time");
    let seed = rng.seed();
    let worker = HostWorker::new(&mut rng, 1, 4, 16);
    assert_eq!(kvcs_worker_add_group(worker.handle, 0, 16), KVCS_OK);
    assert_eq!(worker.add_layer(0, 0, 0, 4, 16), KVCS_OK);
    let requests = 40_000u32;
    let names: Vec<CString> = (0..requests)
        .map(|i| CString::new(format!("request-{i}")).unwrap())
        .collect();
    let mut handle = null_mut();
    assert_eq!(kvcs_blocks_create(&mut handle), KVCS_OK);
    let scheduled = Blocks(handle);
    for (i, name) in names.iter().enumerate() {
        assert_eq!(kvcs_blocks_add_request(scheduled.0, name.as_ptr(), 16), KVCS_OK);
        let block = [(i % 4) as u32];
        assert_eq!(
            kvcs_blocks_add_group(scheduled.0, name.as_ptr(), 0, 0, block.as_ptr(), 1),
            KVCS_OK
        );
    }
    let result = worker.checksum(&scheduled, CONSUMER);
    let first: Vec<Vec<u64>> = (0..4).map(|i| column(result, &names[i], 0, 1)).collect();
    assert!(first.iter().all(|c| c[0] != 0), "seed {seed}");
    let start = Instant::now();
    for (i, name) in names.iter().enumerate().rev() {
        assert_eq!(column(result, name, 0, 1), first[i % 4], "seed {seed}: request {i}");
    }
    assert_fast("40k kvcs_result_column calls", start.elapsed(), 3.0);
    kvcs_result_destroy(result);
}

// ---------------------------------------------------------------------------
// Defect 8: negative addresses in messages

#[test]
fn out_of_bounds_messages_print_negative_bounds_with_a_sign() {
    let mut rng = Rng::for_test("out_of_bounds_messages_print_negative_bounds_with_a_sign");
    let worker = HostWorker::new(&mut rng, 1, 4, 16);
    assert_eq!(kvcs_worker_add_group(worker.handle, 0, 16), KVCS_OK);
    // Blocks run downwards from address 16: block 3 starts 768 bytes below;
    // the 16 tokens of 16 bytes end at 16 + 256.
    let segment = kvcs_segment {
        address: 16,
        block_stride: -256,
        kernel_block_stride: 0,
        head_stride: 16,
        token_stride: 16,
        bytes_per_token: 16,
    };
    assert_eq!(worker.add_segment(0, 0, 4, 16, segment), KVCS_ERR_OUT_OF_BOUNDS);
    let message = last_error();
    assert!(message.contains("reaches bytes -0x2f0..0x110"), "{message}");
    assert!(!message.contains("0xffff"), "{message}");
}

// ---------------------------------------------------------------------------
// Coverage: loaded positions that were not compared

#[test]
fn reports_count_loaded_positions_not_compared_and_may_require_them() {
    let mut rng = Rng::for_test("reports_count_loaded_positions_not_compared_and_may_require_them");
    let seed = rng.seed();
    // Consumer: block size 16, positions 1..5 (tokens 16..80) of 80 tokens.
    // Producer: block size 32, positions 0..3. Runs of 32 tokens: run 0
    // needs the consumer's position 0, which it did not load, so its
    // position 1 is never compared.
    let c: Vec<u64> = (0..4).map(|_| rng.next_u64()).collect();
    let record = |num_tokens: u64, values: Vec<u64>| {
        let mut record = simple_record(values, num_tokens);
        record.requests[0].groups[0].first_position = 1;
        record.encode()
    };
    let first_run = rng.next_u64();
    let payload = |num_tokens: u64| {
        let mut values = vec![first_run, c[1].wrapping_add(c[2]), c[3]];
        values.truncate(num_tokens.div_ceil(32) as usize);
        TPayload {
            num_tokens,
            groups: vec![(0, 7, 0, values)],
            extension: Some((1, vec![(0, 32, Vec::new())])),
        }
        .encode()
    };
    let verifier = Verifier::new(1);
    let scheduled = blocks(&[("req", 80, vec![(0, 1, vec![0, 1, 2, 3])])]);
    verifier.expect(&scheduled, CONSUMER);
    let mut corrupted = c.clone();
    corrupted[0] ^= 1 << 17;
    for values in [c.clone(), corrupted] {
        assert_eq!(verifier.add(&record(80, values)), KVCS_OK, "{}", last_error());
        let report = verifier.check("req", &payload(80));
        // By the definition a match, even with position 1 corrupted; the
        // report says position 1 was not compared.
        assert_eq!(
            report.verdict(),
            kvcs_verdict::KVCS_VERDICT_MATCH,
            "seed {seed}: {}",
            report.message()
        );
        assert_eq!((report.compared(), report.uncompared()), (2, 1), "seed {seed}");
        assert!(
            report.message().contains("1 loaded positions not compared"),
            "{}",
            report.message()
        );
    }
    // A producer of fewer tokens (64): the consumer's position 4 is not
    // compared either.
    let report = verifier.check("req", &payload(64));
    assert_eq!(
        report.verdict(),
        kvcs_verdict::KVCS_VERDICT_MATCH,
        "seed {seed}: {}",
        report.message()
    );
    assert_eq!((report.compared(), report.uncompared()), (1, 2), "seed {seed}");
    // Required coverage: such a load is unverified with its own reason.
    assert_eq!(
        kvcs_verifier_set_require_coverage(verifier.0, 2),
        KVCS_ERR_INVALID_ARGUMENT
    );
    assert_eq!(kvcs_verifier_set_require_coverage(verifier.0, 1), KVCS_OK);
    let report = verifier.check("req", &payload(80));
    assert_eq!(report.verdict(), kvcs_verdict::KVCS_VERDICT_UNVERIFIED, "seed {seed}");
    assert_eq!(report.reason(), "KVCS_UNVERIFIED_UNCOMPARED_POSITIONS", "seed {seed}");
    // A load that compares everything still matches under it.
    let full = Verifier::new(1);
    let scheduled = blocks(&[("req", 80, vec![(0, 0, vec![0, 1, 2, 3, 4])])]);
    full.expect(&scheduled, CONSUMER);
    assert_eq!(kvcs_verifier_set_require_coverage(full.0, 1), KVCS_OK);
    let values: Vec<u64> = (0..5).map(|_| rng.next_u64()).collect();
    assert_eq!(full.add(&simple_record(values.clone(), 80).encode()), KVCS_OK);
    let sent = vec![
        values[0].wrapping_add(values[1]),
        values[2].wrapping_add(values[3]),
        values[4],
    ];
    let payload = TPayload {
        num_tokens: 80,
        groups: vec![(0, 7, 0, sent)],
        extension: Some((1, vec![(0, 32, Vec::new())])),
    };
    let report = full.check("req", &payload.encode());
    assert_eq!(
        report.verdict(),
        kvcs_verdict::KVCS_VERDICT_MATCH,
        "seed {seed}: {}",
        report.message()
    );
    assert_eq!((report.compared(), report.uncompared()), (3, 0), "seed {seed}");
}

// ---------------------------------------------------------------------------
// Issue 18, K2: a host region at address 0

#[test]
fn a_region_at_address_0_or_past_the_end_of_the_address_space_is_refused() {
    let mut rng = Rng::for_test("a_region_at_address_0_or_past_the_end_of_the_address_space_is_refused");
    let worker = HostWorker::new(&mut rng, 1, 4, 16);
    // A host worker cannot check host memory, but address 0 is never
    // memory: accepted, the checksum read it and the process died.
    assert_eq!(
        kvcs_worker_add_region(worker.handle, 0, 1 << 20),
        KVCS_ERR_INVALID_ARGUMENT
    );
    let message = last_error();
    assert!(message.contains("address 0x0"), "{message}");
    assert!(message.contains("length 1048576"), "{message}");
    // A region whose end runs past the end of the address space.
    assert_eq!(
        kvcs_worker_add_region(worker.handle, u64::MAX - 4095, 8192),
        KVCS_ERR_INVALID_ARGUMENT
    );
    assert!(last_error().contains("wraps"), "{}", last_error());
    // Nothing was registered: a layer at address 0 reaches memory no region
    // holds, so no checksum can read it.
    assert_eq!(kvcs_worker_add_group(worker.handle, 0, 16), KVCS_OK);
    let segment = kvcs_segment {
        address: 0,
        block_stride: 256,
        kernel_block_stride: 0,
        head_stride: 16,
        token_stride: 16,
        bytes_per_token: 16,
    };
    assert_eq!(worker.add_segment(0, 0, 4, 16, segment), KVCS_ERR_OUT_OF_BOUNDS);
    assert!(last_error().contains("no registered region"), "{}", last_error());
    // The worker's own region still works.
    assert_eq!(worker.add_layer(0, 0, 0, 4, 16), KVCS_OK, "{}", last_error());
    let scheduled = blocks(&[("req", 64, vec![(0, 0, vec![3, 1, 2, 0])])]);
    assert!(worker.record(&scheduled, CONSUMER).is_ok());
}

// ---------------------------------------------------------------------------
// Issue 18, K3: topology calls with a TP size from a handshake

/// A topology of local engine "decode" (rank 0 of `tp_size`, `heads` KV
/// heads, 16-token blocks).
fn topology(tp_size: u32, heads: u32) -> *mut kvcs_topology {
    let local = kvcs_local_engine {
        tp_rank: 0,
        tp_size,
        total_kv_heads: heads,
        is_mla: 0,
        block_size: 16,
    };
    let mut handle = null_mut();
    assert_eq!(
        kvcs_topology_create(c"decode".as_ptr(), &local, &mut handle),
        KVCS_OK,
        "{}",
        last_error()
    );
    handle
}

fn remote_engine(tp_size: u32) -> kvcs_remote_engine {
    kvcs_remote_engine {
        block_bytes: 4096,
        tp_size,
        block_size: 16,
        kernel_blocks: 1,
    }
}

/// A head source's fields as a tuple: (remote rank, first head, heads,
/// local offset, remote offset).
fn fields(source: &kvcs_head_source) -> (u32, u32, u32, u32, u32) {
    (
        source.remote_rank,
        source.first_head,
        source.num_heads,
        source.local_offset,
        source.remote_offset,
    )
}

/// The head sources a call gives, through a size query and then a buffer
/// of exactly the size it named.
fn head_sources_of(call: impl Fn(*mut kvcs_head_source, usize, *mut usize) -> kvcs_status) -> Vec<kvcs_head_source> {
    let mut len = 0usize;
    assert_eq!(
        call(null_mut(), 0, &mut len),
        KVCS_ERR_BUFFER_TOO_SMALL,
        "{}",
        last_error()
    );
    let empty = kvcs_head_source {
        remote_rank: u32::MAX,
        first_head: 0,
        num_heads: 0,
        local_offset: 0,
        remote_offset: 0,
    };
    let mut sources = vec![empty; len];
    let cap = sources.len();
    assert_eq!(call(sources.as_mut_ptr(), cap, &mut len), KVCS_OK, "{}", last_error());
    assert_eq!(len, cap);
    sources
}

#[test]
fn topology_calls_with_a_huge_tp_size_are_refused_under_a_memory_limit() {
    under_address_space_limit(
        "topology_calls_with_a_huge_tp_size_are_refused_under_a_memory_limit",
        || {
            // 2^31 remote ranks were 8 GiB of u32 before anything was checked.
            let huge = 1u32 << 31;
            let refused = |status: kvcs_status, needle: &str| {
                assert_eq!(status, KVCS_ERR_INVALID_ARGUMENT, "{needle}: {}", last_error());
                let message = last_error();
                assert!(message.contains(needle) && message.contains("65536"), "{message}");
            };
            let mut len = 7usize;
            refused(
                kvcs_remote_ranks(0, 1, huge, null_mut(), 0, &mut len),
                "remote_tp 2147483648",
            );
            refused(
                kvcs_handshake_targets(0, 1, huge, null_mut(), 0, &mut len),
                "remote_tp 2147483648",
            );
            refused(
                kvcs_head_sources(0, 1, huge, huge, 0, null_mut(), 0, &mut len),
                "remote_tp 2147483648",
            );
            assert_eq!(len, 7, "*len is written only on success or a size query");
            let mut ratio = 0i64;
            refused(kvcs_tp_ratio(huge, 1, &mut ratio), "local_tp 2147483648");
            let (mut first, mut count) = (0u32, 0u32);
            refused(kvcs_rank_heads(0, huge, 1, 0, &mut first, &mut count), "tp 2147483648");
            let mut replicated = 0u32;
            refused(
                kvcs_remote_kv_replicated(huge, 8, &mut replicated),
                "remote_tp 2147483648",
            );
            refused(kvcs_local_kv_replicated(huge, 8, 0, &mut replicated), "tp 2147483648");
            // A handshake telling 2^31 ranks is refused and recorded nowhere.
            let topology = topology(1, 8);
            let mut added = 9u32;
            refused(
                kvcs_topology_add_remote(topology, c"prefill".as_ptr(), &remote_engine(huge), &mut added),
                "tp_size 2147483648",
            );
            assert_eq!(added, 9);
            let mut told = remote_engine(0);
            assert_eq!(
                kvcs_topology_remote(topology, c"prefill".as_ptr(), &mut told),
                KVCS_ERR_NOT_FOUND
            );
            // So is a local engine of that size.
            let local = kvcs_local_engine {
                tp_rank: 0,
                tp_size: huge,
                total_kv_heads: 8,
                is_mla: 0,
                block_size: 16,
            };
            let mut other = null_mut();
            refused(
                kvcs_topology_create(c"decode".as_ptr(), &local, &mut other),
                "tp 2147483648",
            );
            assert!(other.is_null());
            // Just past the bound is refused; the bound itself works.
            refused(
                kvcs_remote_ranks(0, 1, 65_537, null_mut(), 0, &mut len),
                "remote_tp 65537",
            );
            assert_eq!(
                kvcs_remote_ranks(0, 1, 65_536, null_mut(), 0, &mut len),
                KVCS_ERR_BUFFER_TOO_SMALL
            );
            assert_eq!(len, 65_536);
            let mut ranks = vec![u32::MAX; len];
            assert_eq!(
                kvcs_handshake_targets(0, 1, 65_536, ranks.as_mut_ptr(), ranks.len(), &mut len),
                KVCS_OK
            );
            assert!(ranks.iter().enumerate().all(|(i, &rank)| rank == i as u32));
            assert_eq!(
                kvcs_topology_add_remote(topology, c"prefill".as_ptr(), &remote_engine(65_536), &mut added),
                KVCS_OK,
                "{}",
                last_error()
            );
            assert_eq!(added, 1);
            let sources = head_sources_of(|buf, cap, len| {
                kvcs_topology_head_sources(topology, c"prefill".as_ptr(), buf, cap, len)
            });
            // 8 heads on 65,536 ranks: each read once, from the first of its 8,192 holders.
            let expected: Vec<_> = (0..8u32).map(|h| (h * 8192, h, 1, h, 0)).collect();
            assert_eq!(sources.iter().map(fields).collect::<Vec<_>>(), expected);
            kvcs_topology_destroy(topology);
        },
    );
}

#[test]
fn head_sources_take_time_linear_in_the_heads() {
    // Local TP 1 holding 262,144 heads; remote TP 65,536 holding 4 each.
    // Finding each head's rank among the ranks read from was quadratic.
    let (heads, remote_tp) = (262_144u32, 65_536u32);
    let start = Instant::now();
    let sources = head_sources_of(|buf, cap, len| kvcs_head_sources(0, 1, remote_tp, heads, 0, buf, cap, len));
    assert_fast(
        "kvcs_head_sources of 262,144 heads on 65,536 ranks",
        start.elapsed(),
        1.0,
    );
    assert_eq!(sources.len(), remote_tp as usize);
    for (i, source) in sources.iter().enumerate() {
        let i = i as u32;
        assert_eq!(fields(source), (i, 4 * i, 4, 4 * i, 0), "run {i}");
    }
    // The remote engine replicates: 32,768 heads on 65,536 ranks, each head
    // read once, from the lower of its two ranks.
    let start = Instant::now();
    let sources = head_sources_of(|buf, cap, len| kvcs_head_sources(0, 1, remote_tp, 32_768, 0, buf, cap, len));
    assert_fast("kvcs_head_sources of 32,768 replicated heads", start.elapsed(), 1.0);
    assert_eq!(sources.len(), 32_768);
    for (i, source) in sources.iter().enumerate() {
        let i = i as u32;
        assert_eq!(fields(source), (2 * i, i, 1, i, 0), "run {i}");
    }
    // A topology checks the same runs when the handshake is recorded.
    let topology = topology(1, heads);
    let start = Instant::now();
    let mut added = 0u32;
    assert_eq!(
        kvcs_topology_add_remote(topology, c"prefill".as_ptr(), &remote_engine(remote_tp), &mut added),
        KVCS_OK,
        "{}",
        last_error()
    );
    let sources =
        head_sources_of(|buf, cap, len| kvcs_topology_head_sources(topology, c"prefill".as_ptr(), buf, cap, len));
    assert_fast(
        "kvcs_topology_add_remote and kvcs_topology_head_sources of 262,144 heads",
        start.elapsed(),
        1.0,
    );
    assert_eq!((added, sources.len()), (1, remote_tp as usize));
    kvcs_topology_destroy(topology);
    // The work is per run, not per head: 2^31 heads are 65,536 runs.
    let start = Instant::now();
    let sources = head_sources_of(|buf, cap, len| kvcs_head_sources(0, 1, remote_tp, 1 << 31, 0, buf, cap, len));
    assert_fast("kvcs_head_sources of 2^31 heads", start.elapsed(), 1.0);
    assert_eq!(sources.len(), remote_tp as usize);
    let last = sources.last().unwrap();
    assert_eq!(
        fields(last),
        (remote_tp - 1, (1 << 31) - (1 << 15), 1 << 15, (1 << 31) - (1 << 15), 0)
    );
}

// ---------------------------------------------------------------------------
// Issue 18, K12: registration in detail mode

#[test]
fn registering_many_layers_in_detail_mode_takes_linear_time() {
    let rng = Rng::for_test("registering_many_layers_in_detail_mode_takes_linear_time");
    let seed = rng.seed();
    let (layers, num_blocks, block_size) = (4000u32, 2u32, 4u32);
    // Three workers over the same bytes (each cache drawn from one state).
    let data = rng.clone();
    let new_worker = || HostWorker::new(&mut data.clone(), layers, num_blocks, block_size);
    let scheduled = blocks(&[("req", 6, vec![(0, 0, vec![1, 0])])]);
    // Detail on first; a checksum half-way, then the other half: the
    // shadow each detail result comes from must follow the layout.
    let detail_first = new_worker();
    assert_eq!(kvcs_worker_set_detail(detail_first.handle, 1), KVCS_OK);
    assert_eq!(kvcs_worker_add_group(detail_first.handle, 0, block_size), KVCS_OK);
    let mut registering = Duration::ZERO;
    for half in [0..layers / 2, layers / 2..layers] {
        let start = Instant::now();
        for layer in half {
            assert_eq!(
                detail_first.add_layer(0, layer, layer, num_blocks, block_size),
                KVCS_OK,
                "{}",
                last_error()
            );
        }
        registering += start.elapsed();
        assert!(detail_first.record(&scheduled, CONSUMER).is_ok(), "seed {seed}");
    }
    assert_fast("registering 4000 layers in detail mode", registering, 1.0);
    // Detail on last, and never.
    let detail_last = new_worker();
    let plain = new_worker();
    for worker in [&detail_last, &plain] {
        assert_eq!(kvcs_worker_add_group(worker.handle, 0, block_size), KVCS_OK);
        for layer in 0..layers {
            assert_eq!(worker.add_layer(0, layer, layer, num_blocks, block_size), KVCS_OK);
        }
    }
    assert_eq!(kvcs_worker_set_detail(detail_last.handle, 1), KVCS_OK);
    let first = detail_first.record(&scheduled, CONSUMER).unwrap();
    let last = detail_last.record(&scheduled, CONSUMER).unwrap();
    let without = plain.record(&scheduled, CONSUMER).unwrap();
    assert!(
        first == last,
        "seed {seed}: detail records differ with the order of registration"
    );
    // Each record carries 4000 layers' partials (2 positions of 8 bytes).
    assert!(
        first.len() > without.len() + layers as usize * 16,
        "seed {seed}: {} bytes with detail, {} without",
        first.len(),
        without.len()
    );
    // Off again: the plain record.
    assert_eq!(kvcs_worker_set_detail(detail_first.handle, 0), KVCS_OK);
    assert!(
        detail_first.record(&scheduled, CONSUMER).unwrap() == without,
        "seed {seed}"
    );
}
