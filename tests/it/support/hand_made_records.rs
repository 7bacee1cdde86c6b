//! Records, payloads and block sets written by hand, for tests that call
//! the `extern "C"` functions as careless or hostile C would (decoder
//! limits, the C boundary, cost bounds). Records and payloads are written
//! by the tests' msgpack writer (tests/it/support/msgpack.rs), independently
//! of the library's encoder (layouts per the record and payload module
//! documentation); they meet the library through the owning wrappers of
//! tests/it/support/handles. Each test binary uses a part of it.

use super::handles::{CBlocks, CVerifier, CONSUMER};
use super::msgpack::Msgpack;
use super::{GroupTable, TestRequest};

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

/// A block set of `(req_id, num_tokens, [(group id, first position, block ids)])`.
pub fn blocks(requests: &[TBlocks<'_>]) -> CBlocks {
    let requests: Vec<TestRequest> = requests
        .iter()
        .map(|(req_id, num_tokens, groups)| TestRequest {
            req_id: (*req_id).to_owned(),
            num_tokens: *num_tokens,
            tables: groups
                .iter()
                .map(|(group_id, first_position, block_ids)| GroupTable {
                    group_id: *group_id,
                    first_position: *first_position,
                    block_ids: block_ids.clone(),
                })
                .collect(),
        })
        .collect();
    CBlocks::of(&requests)
}

/// A one-worker consumer verifier expecting `req` (group 0, blocks 0..n at
/// position 0, `num_tokens`), with a hand-made consumer record of it; the
/// producer's block size of group 0 is set to 16, as the plain payloads
/// these tests write have it.
pub fn consumer_with_record(record: &TRecord, n: u32, num_tokens: u64) -> (CVerifier, CBlocks) {
    let verifier = CVerifier::new(1);
    verifier.producer_block_size(0, 16);
    let scheduled = blocks(&[("req", num_tokens, vec![(0, 0, (0..n).collect())])]);
    verifier.expect(&scheduled, CONSUMER);
    verifier.add(&record.encode()).expect("kvcs_verifier_add_record");
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
