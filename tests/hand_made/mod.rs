//! Hand-made records and payloads and thin owning wrappers over the C ABI,
//! for tests that call the `extern "C"` functions as careless or hostile C
//! would (decoder limits, the C boundary, cost bounds). Records and payloads
//! are written by the tests' msgpack writer (tests/support/msgpack.rs),
//! independently of the library's encoder (layouts per the record and
//! payload module documentation). Each test binary uses a part of it.

#![allow(dead_code)]

use std::ffi::{CStr, CString};
use std::ptr::null_mut;
use std::time::Duration;

use kvcsum::ffi::blocks::*;
use kvcsum::ffi::report::*;
use kvcsum::ffi::result::*;
use kvcsum::ffi::status::kvcs_status::*;
use kvcsum::ffi::status::*;
use kvcsum::ffi::topology::*;
use kvcsum::ffi::verifier::*;
use kvcsum::ffi::worker::*;

use crate::support::c_abi::{host_options, last_error, report_compared, report_message, report_mismatches, text};
use crate::support::msgpack::Msgpack;
use crate::support::Rng;

/// A generous bound on work the fixed code does in a small fraction of it;
/// the quadratic code took many times longer on the same input.
pub fn assert_fast(what: &str, elapsed: Duration, bound_s: f64) {
    assert!(
        elapsed.as_secs_f64() < bound_s,
        "{what} took {:.2} s (bound {bound_s} s): work is not linear in the input",
        elapsed.as_secs_f64()
    );
}

/// One layer entry of a hand-made record: (layer, first head, heads, replica
/// key, values).
pub type TLayer = (u32, u32, u32, (u32, u32), Vec<u64>);

pub struct TGroup {
    pub group_id: u32,
    pub first_position: u64,
    pub num_positions: u64,
    pub columns: Vec<((u32, u32), Vec<u64>)>,
    pub layers: Vec<TLayer>,
}

pub struct TRequest {
    pub req_id: String,
    pub num_tokens: u64,
    pub groups: Vec<TGroup>,
}

/// A hand-made worker record.
pub struct TRecord {
    pub rank: (u32, u32, u32),
    /// 0 producer, 1 consumer.
    pub role: u64,
    pub detail: bool,
    /// (group id, block size, fingerprint), sorted by id.
    pub groups: Vec<(u32, u32, u64)>,
    pub requests: Vec<TRequest>,
}

impl TRecord {
    pub fn encode(&self) -> Vec<u8> {
        let mut w = Msgpack::default();
        w.array(8).str("kvcsum.record").uint(4);
        w.array(3)
            .uint(self.rank.0 as u64)
            .uint(self.rank.1 as u64)
            .uint(self.rank.2 as u64);
        w.uint(self.role).bool(self.detail);
        w.array(self.groups.len());
        for &(id, block_size, fingerprint) in &self.groups {
            w.array(9)
                .uint(id as u64)
                .uint(block_size as u64)
                .uint(fingerprint)
                .uint(0) // no marks
                .bool(false)
                .bool(true)
                .bool(false)
                .array(0)
                .array(0); // no decodings
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
pub type PLayer = (u32, u32, u32, Vec<u64>);

/// The extension of a hand-made payload: producer TP size, and per group its
/// id, block size and layers.
pub type TExtension = (u32, Vec<(u32, u32, Vec<PLayer>)>);

/// A request of a block set: id, token count, and per group its id, first
/// position and block ids.
pub type TBlocks<'a> = (&'a str, u64, Vec<(u32, u64, Vec<u32>)>);

/// A hand-made payload: (group id, fingerprint, first position, values) per
/// group, and the extension's producer TP size and (group id, block size,
/// layers) per group.
pub struct TPayload {
    pub num_tokens: u64,
    pub groups: Vec<(u32, u64, u64, Vec<u64>)>,
    pub extension: Option<TExtension>,
}

impl TPayload {
    pub fn encode(&self) -> Vec<u8> {
        let mut w = Msgpack::default();
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

pub struct Verifier(pub *mut kvcs_verifier);

impl Drop for Verifier {
    fn drop(&mut self) {
        kvcs_verifier_destroy(self.0);
    }
}

// SAFETY: a verifier may be used from any thread (its documented contract).
unsafe impl Send for Verifier {}
// SAFETY: every call but destroy may run concurrently (its documented contract).
unsafe impl Sync for Verifier {}

pub struct Blocks(pub *mut kvcs_blocks);

impl Drop for Blocks {
    fn drop(&mut self) {
        kvcs_blocks_destroy(self.0);
    }
}

pub struct Report(pub *mut kvcs_report);

// SAFETY: a report is immutable; every accessor may run from any thread.
unsafe impl Send for Report {}

impl Drop for Report {
    fn drop(&mut self) {
        kvcs_report_destroy(self.0);
    }
}

pub const PRODUCER: u32 = kvcs_role::KVCS_ROLE_PRODUCER as u32;
pub const CONSUMER: u32 = kvcs_role::KVCS_ROLE_CONSUMER as u32;

/// A block set of `(req_id, num_tokens, [(group id, first position, block ids)])`.
pub fn blocks(requests: &[TBlocks<'_>]) -> Blocks {
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
    pub fn new(num_workers: u32) -> Verifier {
        let mut handle = null_mut();
        assert_eq!(kvcs_verifier_create(num_workers, &mut handle), KVCS_OK);
        Verifier(handle)
    }

    pub fn expect(&self, blocks: &Blocks, role: u32) {
        assert_eq!(
            kvcs_verifier_expect(self.0, blocks.0, role),
            KVCS_OK,
            "{}",
            last_error()
        );
    }

    pub fn add(&self, record: &[u8]) -> kvcs_status {
        kvcs_verifier_add_record(self.0, record.as_ptr(), record.len())
    }

    /// Tells a consumer the producer's block size of `group_id`, which a
    /// plain payload does not say.
    pub fn producer_block_size(&self, group_id: u32, block_size: u32) {
        assert_eq!(
            kvcs_verifier_set_producer_block_size(self.0, group_id, block_size),
            KVCS_OK,
            "{}",
            last_error()
        );
    }

    pub fn check(&self, req_id: &str, payload: &[u8]) -> Report {
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

    pub fn payload(&self, req_id: &str) -> Result<Vec<u8>, (kvcs_status, String)> {
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
    pub fn verdict(&self) -> kvcs_verdict {
        let mut verdict = 99u32;
        assert_eq!(kvcs_report_verdict(self.0, &mut verdict), KVCS_OK);
        match verdict {
            0 => kvcs_verdict::KVCS_VERDICT_MATCH,
            1 => kvcs_verdict::KVCS_VERDICT_MISMATCH,
            2 => kvcs_verdict::KVCS_VERDICT_UNVERIFIED,
            v => panic!("verdict {v}"),
        }
    }

    pub fn reason(&self) -> String {
        let mut reason = 99u32;
        assert_eq!(kvcs_report_reason(self.0, &mut reason), KVCS_OK);
        text(kvcs_unverified_reason_name(reason))
    }

    pub fn message(&self) -> String {
        report_message(self.0)
    }

    pub fn compared(&self) -> u64 {
        report_compared(self.0)
    }

    pub fn uncompared(&self) -> u64 {
        let mut n = u64::MAX;
        assert_eq!(kvcs_report_uncompared_positions(self.0, &mut n), KVCS_OK);
        n
    }

    pub fn mismatches(&self) -> Vec<kvcs_mismatch> {
        report_mismatches(self.0)
    }

    pub fn layer_differences(&self, mismatch: usize, count: usize) -> Vec<(u32, u32, u32, u32)> {
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

pub struct HostWorker {
    pub handle: *mut kvcs_worker,
    pub cache: Vec<u64>,
}

impl Drop for HostWorker {
    fn drop(&mut self) {
        kvcs_worker_destroy(self.handle);
    }
}

pub const CELL: u64 = 16;

impl HostWorker {
    /// A TP=1 host worker whose region holds `num_layers` caches of
    /// `num_blocks` blocks of `block_size` tokens, filled from `rng`.
    pub fn new(rng: &mut Rng, num_layers: u32, num_blocks: u32, block_size: u32) -> HostWorker {
        let options = host_options();
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

    pub fn base(&self) -> u64 {
        self.cache.as_ptr() as u64
    }

    pub fn add_layer(
        &self,
        group_id: u32,
        layer_number: u32,
        slot: u32,
        num_blocks: u32,
        block_size: u32,
    ) -> kvcs_status {
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

    pub fn add_segment(
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

    pub fn checksum(&self, blocks: &Blocks, role: u32) -> *mut kvcs_result {
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
    pub fn record(&self, blocks: &Blocks, role: u32) -> Result<Vec<u8>, (kvcs_status, String)> {
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
pub fn column(result: *mut kvcs_result, req_id: &CStr, group_id: u32, num_positions: usize) -> Vec<u64> {
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
/// position 0, `num_tokens`), with a hand-made consumer record of it; the
/// producer's block size of group 0 is set to 16, as the plain payloads
/// these tests write have it.
pub fn consumer_with_record(record: &TRecord, n: u32, num_tokens: u64) -> (Verifier, Blocks) {
    let verifier = Verifier::new(1);
    verifier.producer_block_size(0, 16);
    let scheduled = blocks(&[("req", num_tokens, vec![(0, 0, (0..n).collect())])]);
    verifier.expect(&scheduled, CONSUMER);
    assert_eq!(verifier.add(&record.encode()), KVCS_OK, "{}", last_error());
    (verifier, scheduled)
}

/// A consumer record of `req`: group 0 (block size 16, fingerprint 7) at
/// positions 0..values.len(), one column.
pub fn simple_record(values: Vec<u64>, num_tokens: u64) -> TRecord {
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

/// Runs `body` in a child process (this test binary, this test only) whose
/// address space is limited to 2 GiB; the child must exit normally.
pub fn under_address_space_limit(name: &str, body: fn()) {
    const CHILD: &str = "KVCS_ADDRESS_LIMIT_CHILD";
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
pub fn padded(prefix: &[u8], filler: usize) -> Vec<u8> {
    let mut bytes = Vec::with_capacity(prefix.len() + filler);
    bytes.extend_from_slice(prefix);
    bytes.resize(prefix.len() + filler, 0);
    bytes
}

pub fn array32(len: usize) -> Vec<u8> {
    let mut bytes = vec![0xdd];
    bytes.extend_from_slice(&(len as u32).to_be_bytes());
    bytes
}

/// A topology of local engine "decode" (rank 0 of `tp_size`, `heads` KV
/// heads, 16-token blocks).
pub fn topology(tp_size: u32, heads: u32) -> *mut kvcs_topology {
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

pub fn remote_engine(tp_size: u32) -> kvcs_remote_engine {
    kvcs_remote_engine {
        block_bytes: 4096,
        tp_size,
        block_size: 16,
        kernel_blocks: 1,
    }
}

/// A head source's fields as a tuple: (remote rank, first head, heads,
/// local offset, remote offset).
pub fn fields(source: &kvcs_head_source) -> (u32, u32, u32, u32, u32) {
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
pub fn head_sources_of(
    call: impl Fn(*mut kvcs_head_source, usize, *mut usize) -> kvcs_status,
) -> Vec<kvcs_head_source> {
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
