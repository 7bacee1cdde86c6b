//! The generator of the verdict rule, "a difference of configuration gives
//! UNVERIFIED with a reason, or an error at registration, never MISMATCH;
//! data never read never gives MATCH": random producer/consumer pairs (or
//! store/load pairs of an offload) with intact KV, one piece of
//! configuration changed on one side, judged through the C ABI.
//!
//! A case is a random model (one or two attention groups, GQA or MLA, an
//! optional shared layer, an optional state group), a base pair of side
//! configurations that must verify (random TP and PP sizes, layouts, block
//! sizes from 1 to 64, positions allocated past the tokens, detail mode;
//! the consumer told the producer's block sizes and TP size by the payload
//! extension, or by its settings: both, or the block sizes alone when
//! nothing needs the TP size), and one change of one side. Each case runs
//! four arms:
//!
//! - base pair, intact KV: must be MATCH;
//! - base pair, one corrupted byte the consumer reads (or the producer
//!   sends): must be MISMATCH;
//! - changed pair, intact KV: must never be MISMATCH (MATCH where the change
//!   does not matter, UNVERIFIED with a reason, or refused by a call);
//! - changed pair, one corrupted byte the consumer reads: must never be
//!   MATCH.
//!
//! The sweep of block-size pairs (`run_block_size_pair`) runs every pair of
//! producer and consumer block sizes from 1 to 64 with a plain payload and
//! nothing told (which must be UNVERIFIED BLOCK_SIZE_UNKNOWN, intact or
//! not: a plain payload says nothing of the producer's block size), with
//! the block size set, and with the extension (MATCH intact, MISMATCH with
//! a flipped bit).
//!
//! Shared by `tests/it/verdict_property.rs` and the fuzz target `verdicts`
//! (included with `#[path]`); the crate root declares `mod support;`
//! (tests/it/support, whose `handles` wraps the C ABI).

#![allow(dead_code)]

use std::collections::BTreeMap;
use std::fmt::Write as _;

use kvcsum::ffi::status::kvcs_status;
use kvcsum::{ReplicaKey, StateSpec};

use crate::support::handles::*;
use crate::support::state::{place_requests, random_state, LogicalState, RankCaches};
use crate::support::*;

pub const REQ: &str = "req-property";
const HASH_BYTES: usize = 32;
const TP_SIZES: [u32; 3] = [1, 2, 4];
const BLOCK_SIZES: [u32; 3] = [8, 16, 32];
/// The block sizes the sweep of every pair runs (and a case sometimes draws).
pub const SWEPT_BLOCK_SIZES: std::ops::RangeInclusive<u32> = 1..=64;

/// A block size: mostly a usual one, sometimes any of 1 to 64.
fn random_block_size(rng: &mut Rng) -> u32 {
    if rng.chance(3, 4) {
        *rng.pick(&BLOCK_SIZES)
    } else {
        rng.range(*SWEPT_BLOCK_SIZES.start() as u64..*SWEPT_BLOCK_SIZES.end() as u64 + 1) as u32
    }
}

fn identity(layer: u32) -> Vec<u8> {
    format!("('model.layers.{layer}.self_attn.attn', 'FullAttentionSpec', 'bfloat16')").into_bytes()
}

fn other_identity(layer: u32) -> Vec<u8> {
    format!("('model.layers.{layer}.self_attn.attn', 'SlidingWindowSpec', 'bfloat16')").into_bytes()
}

// ---------------------------------------------------------------------------
// The model both sides hold

/// An attention group's KV; `shared` = `(layer, target)`: `layer` holds the
/// same KV as `target` (vLLM's KV sharing), so it may be an alias of it.
#[derive(Clone, Debug)]
pub struct AttentionModel {
    pub kv: LogicalKv,
    pub shared: Option<(u32, u32)>,
}

#[derive(Clone, Debug)]
pub enum GroupModel {
    Attention(AttentionModel),
    State(LogicalState),
}

/// One request of a model: its groups (group `i` has id `i` unless a side
/// renumbers it) and block hashes.
#[derive(Clone, Debug)]
pub struct Model {
    pub num_tokens: u64,
    pub groups: Vec<GroupModel>,
    pub hash_seed: u64,
}

impl Model {
    fn random(rng: &mut Rng) -> Model {
        let num_tokens = if rng.chance(1, 5) {
            16 * rng.range(1..6)
        } else {
            rng.range(1..130)
        };
        let heads = *rng.pick(&[1u32, 2, 4, 8]);
        let mut groups = Vec::new();
        let shared = rng.chance(1, 3);
        let layers = if shared { rng.range(3..5) } else { rng.range(1..5) } as u32;
        let shape = |rng: &mut Rng, first_layer: u32, layers: u32| {
            let shape = if heads == 1 {
                KvShape::mla(layers, *rng.pick(&[16u32, 32, 64]), num_tokens)
            } else {
                KvShape::gqa(layers, heads, *rng.pick(&[8u32, 16, 32]), num_tokens)
            };
            KvShape { first_layer, ..shape }
        };
        let first = shape(rng, 0, layers);
        let mut kv = LogicalKv::random(rng, first);
        let shared = shared.then(|| (layers - 1, layers - 2));
        if let Some((layer, target)) = shared {
            for head in kv.heads() {
                for token in 0..num_tokens {
                    let cell = kv.cell(target, head, token).to_vec();
                    kv.cell_mut(layer, head, token).copy_from_slice(&cell);
                }
            }
        }
        groups.push(GroupModel::Attention(AttentionModel { kv, shared }));
        if rng.chance(1, 3) {
            let layers = rng.range(1..4) as u32;
            let second = shape(rng, 10, layers);
            groups.push(GroupModel::Attention(AttentionModel {
                kv: LogicalKv::random(rng, second),
                shared: None,
            }));
        }
        if rng.chance(1, 3) {
            let layers: &[u32] = if rng.chance(1, 2) { &[20, 21] } else { &[20] };
            groups.push(GroupModel::State(random_state(rng, layers)));
        }
        Model {
            num_tokens,
            groups,
            hash_seed: rng.next_u64(),
        }
    }

    fn heads(&self) -> u32 {
        match &self.groups[0] {
            GroupModel::Attention(a) => a.kv.shape.total_kv_heads,
            GroupModel::State(_) => unreachable!("group 0 is attention"),
        }
    }

    fn state_group(&self) -> Option<usize> {
        self.groups.iter().position(|g| matches!(g, GroupModel::State(_)))
    }

    fn attention_groups(&self) -> Vec<usize> {
        (0..self.groups.len())
            .filter(|&g| matches!(self.groups[g], GroupModel::Attention(_)))
            .collect()
    }

    /// Model-wide layer numbers of group `g`.
    fn layers(&self, g: usize) -> Vec<u32> {
        match &self.groups[g] {
            GroupModel::Attention(a) => a.kv.layer_numbers(),
            GroupModel::State(s) => s.layers.iter().map(|(l, _)| *l).collect(),
        }
    }

    /// The block hashes of group `g`'s `count` positions with blocks of
    /// `block_size` tokens (a block's hash follows its tokens).
    fn hashes(&self, g: usize, block_size: u32, count: usize) -> Vec<u8> {
        let mut rng = Rng::from_seed_and_name(self.hash_seed ^ ((g as u64) << 32 | block_size as u64), "block hashes");
        let mut hashes = vec![0u8; count * HASH_BYTES];
        rng.fill(&mut hashes);
        hashes
    }
}

// ---------------------------------------------------------------------------
// Side configurations

/// Workers an edit applies to (by index `pp_rank * tp_size + tp index`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Workers {
    All,
    One(usize),
}

impl Workers {
    fn has(self, worker: usize) -> bool {
        match self {
            Workers::All => true,
            Workers::One(w) => w == worker,
        }
    }
}

/// A change to how a group's layers are registered.
#[derive(Clone, Debug)]
pub enum LayerEdit {
    /// Registered under another identity.
    Identity { layer: u32, workers: Workers },
    /// Not registered.
    Drop { layer: u32, workers: Workers },
    /// Registered with its last head left out (one worker).
    Narrow { layer: u32, worker: usize },
    /// Registered as two entries of head ranges.
    Split { layer: u32, workers: Workers },
    /// A worker's layers of the group declare another replica key.
    Replica { worker: usize, key: ReplicaKey },
    /// State layers registered with the other `split_known` (one worker).
    SplitKnown { worker: usize },
    /// An alias the other side does not have.
    ExtraAlias { layer: u32, target: u32 },
    /// A layer (with a cache of its own) the other side does not have.
    ExtraLayer { layer: u32 },
}

#[derive(Clone, Debug)]
pub struct GroupConfig {
    pub id: u32,
    pub block_size: u32,
    /// Layout of attention caches.
    pub kind: LayoutKind,
    /// State groups.
    pub split_known: bool,
    /// The shared layer registered as an alias of its target.
    pub alias: bool,
    /// Registered (and scheduled) at all.
    pub registered: bool,
    /// Registered with no layers.
    pub no_layers: bool,
    pub skip: Option<Workers>,
    /// A worker whose block set leaves the group out.
    pub unscheduled_on: Option<usize>,
    pub edits: Vec<LayerEdit>,
    /// Attention groups: positions scheduled past those holding tokens
    /// (blocks allocated ahead; their sums are 0).
    pub extra_positions: usize,
}

/// What a side's workers call to checksum.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Call {
    Checksum,
    /// A producer's workers store (offloading) and send those records.
    Store,
    /// A consumer's workers run load checks and send those records.
    CheckStored,
}

/// A change to a side's buffers of stored checksums (offload).
#[derive(Clone, Copy, Debug)]
pub enum StoredEdit {
    Missing { group: usize, worker: usize },
    OverCache { group: usize, worker: usize },
    Shared { worker: usize },
    TooSmall { group: usize, worker: usize },
}

#[derive(Clone, Debug)]
pub struct SideConfig {
    pub tp_size: u32,
    pub pp_size: u32,
    pub detail: bool,
    pub groups: Vec<GroupConfig>,
    /// Per TP index, the `tp_rank` its worker is created with.
    pub rank_labels: Vec<u32>,
    /// Per TP index, the rank whose attention heads it holds.
    pub head_ranks: Vec<u32>,
    /// Workers computing in the other role.
    pub flipped_roles: Option<Workers>,
    pub call: Call,
    pub stored_buffers: bool,
    pub stored_edit: Option<StoredEdit>,
}

/// The layouts group `g` can have in blocks of `block_size` tokens: one
/// segment for MLA latents, and kernel blocks only where they divide the
/// block.
fn kinds_for(model: &Model, g: usize, block_size: u32) -> Vec<LayoutKind> {
    let kinds = match &model.groups[g] {
        GroupModel::Attention(a) if a.kv.shape.v_bytes == 0 => single_segment_kinds(),
        _ => all_kinds(),
    };
    kinds
        .into_iter()
        .filter(|kind| !matches!(kind, LayoutKind::KernelBlocks { kernel_blocks } if !block_size.is_multiple_of(*kernel_blocks)))
        .collect()
}

impl GroupConfig {
    /// Group `g` of `model` in blocks of `block_size` tokens, laid out as
    /// `kind`, registered plainly.
    fn plain(g: usize, block_size: u32, kind: LayoutKind) -> GroupConfig {
        GroupConfig {
            id: g as u32,
            block_size,
            kind,
            split_known: true,
            alias: false,
            registered: true,
            no_layers: false,
            skip: None,
            unscheduled_on: None,
            edits: Vec::new(),
            extra_positions: 0,
        }
    }
}

impl SideConfig {
    fn random(rng: &mut Rng, model: &Model) -> SideConfig {
        let tp_size = *rng.pick(&TP_SIZES);
        let groups = (0..model.groups.len())
            .map(|g| {
                let block_size = random_block_size(rng);
                let mut group = GroupConfig::plain(g, block_size, *rng.pick(&kinds_for(model, g, block_size)));
                if matches!(model.groups[g], GroupModel::Attention(_)) && rng.chance(1, 3) {
                    group.extra_positions = rng.range(1..3) as usize;
                }
                group
            })
            .collect();
        SideConfig {
            tp_size,
            pp_size: *rng.pick(&[1u32, 2]),
            detail: rng.chance(1, 4),
            groups,
            rank_labels: (0..tp_size).collect(),
            head_ranks: (0..tp_size).collect(),
            flipped_roles: None,
            call: Call::Checksum,
            stored_buffers: false,
            stored_edit: None,
        }
    }

    pub fn num_workers(&self) -> u32 {
        self.tp_size * self.pp_size
    }

    fn set_tp_size(&mut self, tp_size: u32) {
        self.tp_size = tp_size;
        self.rank_labels = (0..tp_size).collect();
        self.head_ranks = (0..tp_size).collect();
    }

    /// The workers (indices) of the stage holding layer `layer` of group `g`.
    fn workers_holding(&self, model: &Model, g: usize, layer: u32) -> Vec<usize> {
        let layers = model.layers(g);
        (0..self.pp_size)
            .filter(|&pp| pp_layers(&layers, pp, self.pp_size).contains(&layer))
            .flat_map(|pp| (0..self.tp_size).map(move |t| (pp * self.tp_size + t) as usize))
            .collect()
    }
}

/// How the consumer learns the producer's block sizes and TP size.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Informed {
    /// The payload extension (`kvcs_verifier_set_extension` on the producer).
    Extension,
    /// A plain payload; `set_producer_tp_size` / `set_producer_block_size`.
    Settings,
    /// A plain payload; `set_producer_block_size` only (the TP size stays
    /// unknown).
    BlockSizes,
    /// A plain payload and no settings: a plain payload says nothing of the
    /// producer's block sizes, so its attention groups are never compared
    /// (the sweep of block-size pairs runs it; a case never does).
    Plain,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Flow {
    Payload(Informed),
    /// Store on one side, load check on the other (SPEC section 8).
    Offload,
}

// ---------------------------------------------------------------------------
// Changes

/// What a change alters; one is drawn per case among those that apply.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Kind {
    BlockSize,
    TpSize,
    PpSize,
    Layout,
    RankSwap,
    RankDup,
    HeadPermute,
    HeadNarrow,
    HeadSplit,
    ReplicaIndex,
    ReplicaCount,
    Identity,
    AliasFlip,
    AliasExtra,
    SplitKnown,
    Role,
    LayerDrop,
    LayerExtra,
    GroupDrop,
    GroupRenumber,
    GroupNoLayers,
    GroupUnscheduled,
    SkipAll,
    SkipOne,
    StoredCall,
    StoredMissing,
    StoredOverCache,
    StoredShared,
    StoredTooSmall,
}

pub const KINDS: [Kind; 29] = [
    Kind::BlockSize,
    Kind::TpSize,
    Kind::PpSize,
    Kind::Layout,
    Kind::RankSwap,
    Kind::RankDup,
    Kind::HeadPermute,
    Kind::HeadNarrow,
    Kind::HeadSplit,
    Kind::ReplicaIndex,
    Kind::ReplicaCount,
    Kind::Identity,
    Kind::AliasFlip,
    Kind::AliasExtra,
    Kind::SplitKnown,
    Kind::Role,
    Kind::LayerDrop,
    Kind::LayerExtra,
    Kind::GroupDrop,
    Kind::GroupRenumber,
    Kind::GroupNoLayers,
    Kind::GroupUnscheduled,
    Kind::SkipAll,
    Kind::SkipOne,
    Kind::StoredCall,
    Kind::StoredMissing,
    Kind::StoredOverCache,
    Kind::StoredShared,
    Kind::StoredTooSmall,
];

impl Kind {
    pub fn name(self) -> &'static str {
        match self {
            Kind::BlockSize => "block size",
            Kind::TpSize => "TP size",
            Kind::PpSize => "PP size",
            Kind::Layout => "layout",
            Kind::RankSwap => "TP ranks swapped",
            Kind::RankDup => "TP rank twice",
            Kind::HeadPermute => "heads of other ranks",
            Kind::HeadNarrow => "head range narrowed",
            Kind::HeadSplit => "head range split",
            Kind::ReplicaIndex => "replica index",
            Kind::ReplicaCount => "replicas",
            Kind::Identity => "identity",
            Kind::AliasFlip => "alias vs cache",
            Kind::AliasExtra => "extra alias",
            Kind::SplitKnown => "split_known",
            Kind::Role => "role",
            Kind::LayerDrop => "layer left out",
            Kind::LayerExtra => "extra layer",
            Kind::GroupDrop => "group left out",
            Kind::GroupRenumber => "group id",
            Kind::GroupNoLayers => "group with no layers",
            Kind::GroupUnscheduled => "group not scheduled",
            Kind::SkipAll => "group skipped",
            Kind::SkipOne => "group skipped by one",
            Kind::StoredCall => "store/load-check records",
            Kind::StoredMissing => "stored buffer missing",
            Kind::StoredOverCache => "stored buffer over KV",
            Kind::StoredShared => "stored buffer shared",
            Kind::StoredTooSmall => "stored buffer too small",
        }
    }
}

/// A generated case: the model, the base pair, and the changed pair.
#[derive(Clone, Debug)]
pub struct Case {
    pub model: Model,
    pub flow: Flow,
    /// Producer (or storing side) and consumer (or load-checking side).
    pub base: [SideConfig; 2],
    pub changed: [SideConfig; 2],
    pub kind: Kind,
    /// The change in words.
    pub change: String,
}

const SIDE_NAMES: [&str; 2] = ["producer", "consumer"];
const OFFLOAD_SIDE_NAMES: [&str; 2] = ["storing side", "load side"];

impl Case {
    /// A random case.
    pub fn random(rng: &mut Rng) -> Case {
        let model = Model::random(rng);
        let offload = rng.chance(1, 4);
        let mut informed = *rng.pick(&[Informed::Extension, Informed::Settings, Informed::BlockSizes]);
        let producer = SideConfig::random(rng, &model);
        let consumer = if offload {
            // A load runs on the storing engine's configuration; its caches
            // may be laid out otherwise.
            let mut consumer = producer.clone();
            for (g, group) in consumer.groups.iter_mut().enumerate() {
                group.kind = *rng.pick(&kinds_for(&model, g, group.block_size));
            }
            consumer.detail = rng.chance(1, 4);
            consumer
        } else {
            SideConfig::random(rng, &model)
        };
        let mut base = [producer, consumer];
        let alias = rng.chance(1, 2);
        let split_known = rng.chance(2, 3);
        if !offload && !split_known && model.state_group().is_some() {
            // Shard-keyed state verifies only at a known, equal TP size.
            if informed == Informed::BlockSizes {
                informed = *rng.pick(&[Informed::Extension, Informed::Settings]);
            }
            let tp_size = base[0].tp_size;
            base[1].set_tp_size(tp_size);
        }
        for side in &mut base {
            side.stored_buffers = offload;
            for (g, group) in side.groups.iter_mut().enumerate() {
                group.alias = alias && matches!(&model.groups[g], GroupModel::Attention(a) if a.shared.is_some());
                if matches!(model.groups[g], GroupModel::State(_)) {
                    group.split_known = split_known;
                }
            }
        }
        let flow = if offload {
            Flow::Offload
        } else {
            Flow::Payload(informed)
        };
        loop {
            let kind = *rng.pick(&KINDS);
            let mut changed = base.clone();
            let side = rng.below(2) as usize;
            if let Some(change) = apply(rng, &model, flow, &mut changed, side, kind) {
                let names = if offload { OFFLOAD_SIDE_NAMES } else { SIDE_NAMES };
                return Case {
                    model,
                    flow,
                    change: format!("{} on the {}: {change}", kind.name(), names[side]),
                    base,
                    changed,
                    kind,
                };
            }
        }
    }
}

impl Case {
    /// The model and both sides in one paragraph (for a violation's report).
    pub fn summary(&self) -> String {
        let mut out = format!("{} tokens; groups:", self.model.num_tokens);
        for (g, group) in self.model.groups.iter().enumerate() {
            match group {
                GroupModel::Attention(a) => {
                    let s = a.kv.shape;
                    let _ = write!(
                        out,
                        " {g}: attention layers {:?} of {} heads, cell {} bytes{};",
                        a.kv.layer_numbers(),
                        s.total_kv_heads,
                        s.cell_bytes(),
                        a.shared
                            .map(|(l, t)| format!(", layer {l} shares layer {t}'s KV"))
                            .unwrap_or_default()
                    );
                }
                GroupModel::State(state) => {
                    let layers: Vec<u32> = state.layers.iter().map(|(l, _)| *l).collect();
                    let _ = write!(out, " {g}: state layers {layers:?};");
                }
            }
        }
        for (name, configs) in [("base", &self.base), ("changed", &self.changed)] {
            for (s, config) in configs.iter().enumerate() {
                let groups: Vec<String> = config
                    .groups
                    .iter()
                    .map(|g| {
                        format!(
                            "id {} bs {}{} {:?}{}{}{}{}{}{}",
                            g.id,
                            g.block_size,
                            if g.extra_positions > 0 {
                                format!(" (+{} positions past the tokens)", g.extra_positions)
                            } else {
                                String::new()
                            },
                            g.kind,
                            if g.split_known { "" } else { " shard-keyed" },
                            if g.alias { " alias" } else { "" },
                            if g.registered { "" } else { " unregistered" },
                            if g.no_layers { " no layers" } else { "" },
                            g.skip.map(|s| format!(" skipped by {s:?}")).unwrap_or_default(),
                            if g.edits.is_empty() {
                                String::new()
                            } else {
                                format!(" {:?}", g.edits)
                            },
                        )
                    })
                    .collect();
                let _ = write!(
                    out,
                    "\n  {name} {}: TP {} PP {} ranks {:?} heads of {:?} detail {} call {:?} roles flipped {:?} stored {} {:?}; groups [{}]",
                    SIDE_NAMES[s],
                    config.tp_size,
                    config.pp_size,
                    config.rank_labels,
                    config.head_ranks,
                    config.detail,
                    config.call,
                    config.flipped_roles,
                    config.stored_buffers,
                    config.stored_edit,
                    groups.join("; ")
                );
            }
        }
        out
    }
}

fn other<T: Copy + PartialEq>(rng: &mut Rng, choices: &[T], not: T) -> T {
    let others: Vec<T> = choices.iter().copied().filter(|&c| c != not).collect();
    *rng.pick(&others)
}

fn workers(rng: &mut Rng, of: &[usize]) -> Workers {
    if of.len() > 1 && rng.chance(1, 2) {
        Workers::One(*rng.pick(of))
    } else {
        Workers::All
    }
}

/// Applies a change of `kind` to side `side` of `pair`; `None` when it does
/// not apply to this model, flow and pair.
fn apply(
    rng: &mut Rng,
    model: &Model,
    flow: Flow,
    pair: &mut [SideConfig; 2],
    side: usize,
    kind: Kind,
) -> Option<String> {
    let offload = flow == Flow::Offload;
    let attention = model.attention_groups();
    let heads = model.heads();
    let all_groups: Vec<usize> = (0..model.groups.len()).collect();
    let config = &mut pair[side];
    let all_workers: Vec<usize> = (0..config.num_workers() as usize).collect();
    let tp = config.tp_size;
    match kind {
        Kind::BlockSize if !offload => {
            let g = *rng.pick(&all_groups);
            let group = &mut config.groups[g];
            let to = loop {
                let to = random_block_size(rng);
                if to != group.block_size && kinds_for(model, g, to).contains(&group.kind) {
                    break to;
                }
            };
            group.block_size = to;
            Some(format!("group {g} block size {to}"))
        }
        Kind::TpSize if !offload => {
            let to = other(rng, &TP_SIZES, tp);
            config.set_tp_size(to);
            Some(format!("TP size {tp} -> {to}"))
        }
        Kind::PpSize if !offload => {
            let to = 3 - config.pp_size;
            config.pp_size = to;
            Some(format!("PP size {to}"))
        }
        Kind::Layout => {
            let g = *rng.pick(&attention);
            let to = other(
                rng,
                &kinds_for(model, g, config.groups[g].block_size),
                config.groups[g].kind,
            );
            config.groups[g].kind = to;
            Some(format!("group {g} layout {to:?}"))
        }
        Kind::RankSwap if tp >= 2 => {
            let a = rng.below(tp as u64) as usize;
            let b = (a + 1 + rng.below(tp as u64 - 1) as usize) % tp as usize;
            config.rank_labels.swap(a, b);
            Some(format!(
                "the workers of TP ranks {a} and {b} are created with each other's tp_rank"
            ))
        }
        Kind::RankDup if tp >= 2 => {
            let a = rng.below(tp as u64) as usize;
            let b = (a + 1 + rng.below(tp as u64 - 1) as usize) % tp as usize;
            config.rank_labels[a] = b as u32;
            Some(format!("the worker of TP rank {a} is created with tp_rank {b}"))
        }
        Kind::HeadPermute if !offload && tp >= 2 && tp <= heads => {
            let mut perm = rng.permutation(tp);
            if perm.iter().enumerate().all(|(i, &r)| i as u32 == r) {
                perm.rotate_left(1);
            }
            config.head_ranks = perm.clone();
            Some(format!(
                "TP index i holds the attention heads of rank {perm:?}[i] (consistently)"
            ))
        }
        Kind::HeadNarrow if tp < heads => {
            let g = *rng.pick(&attention);
            let layer = pick_real_layer(rng, model, config, g)?;
            let worker = *rng.pick(&config.workers_holding(model, g, layer));
            config.groups[g].edits.push(LayerEdit::Narrow { layer, worker });
            Some(format!(
                "worker {worker} registers layer {layer} of group {g} without its last head"
            ))
        }
        Kind::HeadSplit if tp < heads => {
            let g = *rng.pick(&attention);
            let layer = pick_real_layer(rng, model, config, g)?;
            let holding = config.workers_holding(model, g, layer);
            let workers = workers(rng, &holding);
            config.groups[g].edits.push(LayerEdit::Split { layer, workers });
            Some(format!(
                "layer {layer} of group {g} registered as two head ranges on {workers:?}"
            ))
        }
        Kind::ReplicaIndex if tp > heads => {
            let g = *rng.pick(&attention);
            let worker = *rng.pick(&all_workers);
            let replicas = tp / heads;
            let index = (worker as u32 % tp) % replicas;
            let to = other(rng, &(0..replicas).collect::<Vec<_>>(), index);
            let key = ReplicaKey {
                replicas,
                replica_index: to,
            };
            config.groups[g].edits.push(LayerEdit::Replica { worker, key });
            Some(format!(
                "worker {worker} declares replica index {to} of {replicas} in group {g}"
            ))
        }
        Kind::ReplicaCount => {
            let g = *rng.pick(&attention);
            let worker = *rng.pick(&all_workers);
            let key = if tp > heads {
                ReplicaKey {
                    replicas: 1,
                    replica_index: 0,
                }
            } else {
                ReplicaKey {
                    replicas: 2,
                    replica_index: rng.below(2) as u32,
                }
            };
            config.groups[g].edits.push(LayerEdit::Replica { worker, key });
            Some(format!("worker {worker} declares replica key {key:?} in group {g}"))
        }
        Kind::Identity => {
            let g = *rng.pick(&all_groups);
            let layer = *rng.pick(&model.layers(g));
            let holding = config.workers_holding(model, g, layer);
            let workers = workers(rng, &holding);
            config.groups[g].edits.push(LayerEdit::Identity { layer, workers });
            Some(format!(
                "layer {layer} of group {g} under another identity on {workers:?}"
            ))
        }
        Kind::AliasFlip => {
            let GroupModel::Attention(a) = &model.groups[0] else {
                return None;
            };
            a.shared?;
            let group = &mut config.groups[0];
            group.alias = !group.alias;
            Some(format!(
                "the shared layer {}",
                if group.alias {
                    "is an alias"
                } else {
                    "has a cache of its own"
                }
            ))
        }
        Kind::AliasExtra => {
            let g = *rng.pick(&attention);
            let target = model.layers(g)[0];
            let layer = 40 + g as u32;
            config.groups[g].edits.push(LayerEdit::ExtraAlias { layer, target });
            Some(format!("layer {layer} of group {g} an alias of layer {target}"))
        }
        Kind::SplitKnown => {
            let g = model.state_group()?;
            if rng.chance(1, 2) || config.num_workers() == 1 {
                let group = &mut config.groups[g];
                group.split_known = !group.split_known;
                Some(format!("split_known {} on every worker", group.split_known as u32))
            } else {
                let holding: Vec<usize> = model
                    .layers(g)
                    .into_iter()
                    .flat_map(|layer| config.workers_holding(model, g, layer))
                    .collect();
                let worker = *rng.pick(&holding);
                config.groups[g].edits.push(LayerEdit::SplitKnown { worker });
                Some(format!("split_known flipped on worker {worker}"))
            }
        }
        Kind::Role if !offload => {
            let workers = workers(rng, &all_workers);
            config.flipped_roles = Some(workers);
            Some(format!("{workers:?} compute in the other role"))
        }
        Kind::LayerDrop => {
            let g = *rng.pick(&all_groups);
            let layer = *rng.pick(&model.layers(g));
            let holding = config.workers_holding(model, g, layer);
            let workers = workers(rng, &holding);
            config.groups[g].edits.push(LayerEdit::Drop { layer, workers });
            Some(format!("layer {layer} of group {g} not registered on {workers:?}"))
        }
        Kind::LayerExtra => {
            let g = *rng.pick(&attention);
            let layer = 30 + g as u32;
            config.groups[g].edits.push(LayerEdit::ExtraLayer { layer });
            Some(format!("an extra layer {layer} in group {g}"))
        }
        Kind::GroupDrop if model.groups.len() >= 2 => {
            let g = *rng.pick(&all_groups);
            config.groups[g].registered = false;
            Some(format!("group {g} neither registered nor scheduled"))
        }
        Kind::GroupRenumber => {
            let g = *rng.pick(&all_groups);
            config.groups[g].id = 7 + g as u32;
            Some(format!("group {g} has id {}", 7 + g))
        }
        Kind::GroupNoLayers => {
            let g = *rng.pick(&all_groups);
            config.groups[g].no_layers = true;
            Some(format!("group {g} registered with no layers on every worker"))
        }
        Kind::GroupUnscheduled => {
            let g = *rng.pick(&all_groups);
            let worker = *rng.pick(&all_workers);
            config.groups[g].unscheduled_on = Some(worker);
            Some(format!("worker {worker}'s block set leaves group {g} out"))
        }
        Kind::SkipAll => {
            let g = *rng.pick(&all_groups);
            config.groups[g].skip = Some(Workers::All);
            Some(format!("every worker skips group {g}"))
        }
        Kind::SkipOne if all_workers.len() >= 2 => {
            let g = *rng.pick(&all_groups);
            let worker = *rng.pick(&all_workers);
            config.groups[g].skip = Some(Workers::One(worker));
            Some(format!("worker {worker} skips group {g}"))
        }
        Kind::StoredCall if !offload => {
            config.stored_buffers = true;
            config.call = if side == 0 { Call::Store } else { Call::CheckStored };
            Some(format!("the workers send the records of {:?} calls", config.call))
        }
        Kind::StoredMissing if offload => {
            let group = *rng.pick(&all_groups);
            let worker = *rng.pick(&all_workers);
            config.stored_edit = Some(StoredEdit::Missing { group, worker });
            Some(format!("worker {worker} has no stored buffer for group {group}"))
        }
        Kind::StoredOverCache if offload => {
            let group = *rng.pick(&attention);
            let layer = *rng.pick(&model.layers(group));
            let worker = *rng.pick(&config.workers_holding(model, group, layer));
            config.stored_edit = Some(StoredEdit::OverCache { group, worker });
            Some(format!(
                "worker {worker}'s stored buffer of group {group} lies over its KV"
            ))
        }
        Kind::StoredShared if offload && model.groups.len() >= 2 => {
            let worker = *rng.pick(&all_workers);
            config.stored_edit = Some(StoredEdit::Shared { worker });
            Some(format!("worker {worker} gives two groups one stored buffer"))
        }
        Kind::StoredTooSmall if offload => {
            let group = *rng.pick(&all_groups);
            let worker = *rng.pick(&all_workers);
            config.stored_edit = Some(StoredEdit::TooSmall { group, worker });
            Some(format!(
                "worker {worker}'s stored buffer of group {group} holds too few blocks"
            ))
        }
        _ => None,
    }
}

/// A layer of attention group `g` registered with a cache of its own.
fn pick_real_layer(rng: &mut Rng, model: &Model, config: &SideConfig, g: usize) -> Option<u32> {
    let GroupModel::Attention(a) = &model.groups[g] else {
        return None;
    };
    let layers: Vec<u32> = model
        .layers(g)
        .into_iter()
        .filter(|&l| !(config.groups[g].alias && a.shared.map(|s| s.0) == Some(l)))
        .collect();
    Some(*rng.pick(&layers))
}

// ---------------------------------------------------------------------------
// Deployment through the C ABI

/// A byte a worker reads: where to corrupt.
#[derive(Clone, Debug)]
enum ReadTarget {
    Attention {
        group: usize,
        placement: usize,
        layer: u32,
        first_head: u32,
        num_heads: u32,
        replica_index: u32,
    },
    State {
        group: usize,
        caches: usize,
        spec: usize,
    },
}

/// One deployed worker and what it holds.
pub struct DeployedWorker {
    pub handle: CWorker,
    placements: Vec<Placement>,
    states: Vec<RankCaches>,
    /// Per group, its buffer of stored checksums.
    stored: Vec<Option<StoredMemory>>,
    targets: Vec<ReadTarget>,
    blocks: CBlocks,
}

/// A deployed side.
pub struct Deployed {
    pub workers: Vec<DeployedWorker>,
    /// Per group (of the model), its table where registered.
    tables: Vec<Option<GroupTable>>,
    /// Per group, blocks in its caches.
    num_blocks: Vec<u32>,
    /// The block set the verifier expects.
    scheduled: CBlocks,
}

fn block_set(model: &Model, config: &SideConfig, tables: &[Option<GroupTable>], leave_out: Option<usize>) -> CBlocks {
    let blocks = CBlocks::new();
    blocks.request(REQ, model.num_tokens).expect("add_request");
    for (g, table) in tables.iter().enumerate() {
        let Some(table) = table else { continue };
        if config.groups[g].unscheduled_on.is_some() && config.groups[g].unscheduled_on == leave_out {
            continue;
        }
        blocks.table(REQ, table).expect("add_group");
        let hashes = model.hashes(g, config.groups[g].block_size, table.block_ids.len());
        blocks
            .hashes(REQ, table.group_id, &hashes, HASH_BYTES)
            .expect("set_hashes");
    }
    blocks
}

/// Deploys `config` of `model` on fresh host workers: the request's KV and
/// state written at fresh blocks; a failed call is the side's refusal.
fn deploy(rng: &mut Rng, model: &Model, config: &SideConfig) -> Result<Deployed, (&'static str, Failure)> {
    let mut tables = Vec::new();
    let mut num_blocks = Vec::new();
    for (g, group) in config.groups.iter().enumerate() {
        let (table, blocks) = match &model.groups[g] {
            GroupModel::Attention(_) => {
                let count = positions_for(model.num_tokens, group.block_size, 0, group.extra_positions);
                let blocks = count as u32 + 3;
                let ids = BlockAllocator::new(rng, blocks).take(count);
                (ids, blocks)
            }
            GroupModel::State(_) => (vec![rng.below(4) as u32], 4),
        };
        num_blocks.push(blocks);
        tables.push(group.registered.then_some(GroupTable {
            group_id: group.id,
            first_position: 0,
            block_ids: table,
        }));
    }
    let mut workers = Vec::new();
    for pp_rank in 0..config.pp_size {
        for t in 0..config.tp_size {
            let w = (pp_rank * config.tp_size + t) as usize;
            let worker = deploy_worker(rng, model, config, &tables, &num_blocks, pp_rank, t, w)?;
            workers.push(worker);
        }
    }
    let scheduled = block_set(model, config, &tables, None);
    Ok(Deployed {
        workers,
        tables,
        num_blocks,
        scheduled,
    })
}

#[allow(clippy::too_many_arguments)] // one worker of a deployment: each argument is a piece of it
fn deploy_worker(
    rng: &mut Rng,
    model: &Model,
    config: &SideConfig,
    tables: &[Option<GroupTable>],
    num_blocks: &[u32],
    pp_rank: u32,
    t: u32,
    w: usize,
) -> Result<DeployedWorker, (&'static str, Failure)> {
    let reg = |failure: Failure| ("registration", failure);
    let tp_size = config.tp_size;
    let handle = CWorker::host(config.rank_labels[t as usize], tp_size, pp_rank).map_err(reg)?;
    if config.detail {
        handle.detail(true).map_err(reg)?;
    }
    let mut worker = DeployedWorker {
        handle,
        placements: Vec::new(),
        states: Vec::new(),
        stored: Vec::new(),
        targets: Vec::new(),
        blocks: block_set(model, config, tables, Some(w)),
    };
    for (g, group) in config.groups.iter().enumerate() {
        worker.stored.push(None);
        let Some(table) = &tables[g] else { continue };
        worker.handle.group(group.id, group.block_size).map_err(reg)?;
        if group.skip.is_some_and(|s| s.has(w)) {
            worker
                .handle
                .skip(group.id, "property test: this worker cannot checksum it")
                .map_err(reg)?;
            continue;
        }
        if !group.no_layers {
            match &model.groups[g] {
                GroupModel::Attention(a) => {
                    register_attention(rng, config, &mut worker, g, a, table, num_blocks[g], pp_rank, t, w)
                        .map_err(reg)?
                }
                GroupModel::State(state) => {
                    register_state(rng, config, &mut worker, g, state, table, num_blocks[g], pp_rank, t, w)
                        .map_err(reg)?
                }
            }
        }
    }
    if config.stored_buffers {
        register_stored(rng, config, &mut worker, tables, num_blocks, w).map_err(reg)?;
    }
    Ok(worker)
}

#[allow(clippy::too_many_arguments)] // one group of one worker
fn register_attention(
    rng: &mut Rng,
    config: &SideConfig,
    worker: &mut DeployedWorker,
    g: usize,
    a: &AttentionModel,
    table: &GroupTable,
    num_blocks: u32,
    pp_rank: u32,
    t: u32,
    w: usize,
) -> Result<(), Failure> {
    let group = &config.groups[g];
    let held = shard(
        &a.kv,
        config.head_ranks[t as usize],
        config.tp_size,
        pp_rank,
        config.pp_size,
    );
    let edits = &group.edits;
    let dropped = |layer: u32| {
        edits
            .iter()
            .any(|e| matches!(e, LayerEdit::Drop { layer: l, workers } if *l == layer && workers.has(w)))
    };
    if !held.layer_numbers.is_empty() {
        let mut placement = Placement::for_shard(rng, &a.kv, &held, group.kind, group.id, group.block_size, num_blocks);
        placement.write_request(&a.kv, 0, &table.block_ids);
        for region in placement.regions(&placement.host_bases()) {
            worker.handle.region(region.address, region.length)?;
        }
        let index = worker.placements.len();
        for mut spec in placement.host_layer_specs() {
            let layer = spec.layer_number;
            if (group.alias && a.shared.map(|s| s.0) == Some(layer)) || dropped(layer) {
                continue;
            }
            spec.identity = identity(layer);
            let mut split = false;
            for edit in edits {
                match *edit {
                    LayerEdit::Identity { layer: l, workers } if l == layer && workers.has(w) => {
                        spec.identity = other_identity(layer)
                    }
                    LayerEdit::Narrow { layer: l, worker } if l == layer && worker == w && spec.num_heads >= 2 => {
                        spec.num_heads -= 1
                    }
                    LayerEdit::Split { layer: l, workers } if l == layer && workers.has(w) && spec.num_heads >= 2 => {
                        split = true
                    }
                    LayerEdit::Replica { worker, key } if worker == w => spec.replica = key,
                    _ => {}
                }
            }
            let mut specs = vec![spec.clone()];
            if split {
                let first = spec.num_heads / 2;
                specs[0].num_heads = first;
                let mut second = spec.clone();
                second.first_head += first;
                second.num_heads -= first;
                for segment in &mut second.segments {
                    segment.address = (segment.address as i64 + first as i64 * segment.head_stride) as u64;
                }
                specs.push(second);
            }
            for spec in specs {
                worker.handle.layer(&spec)?;
                worker.targets.push(ReadTarget::Attention {
                    group: g,
                    placement: index,
                    layer,
                    first_head: spec.first_head,
                    num_heads: spec.num_heads,
                    replica_index: spec.replica.replica_index,
                });
            }
        }
        let stage = &held.layer_numbers;
        if let Some((layer, target)) = a.shared.filter(|_| group.alias) {
            if stage.contains(&target) && !dropped(target) && !dropped(layer) {
                let renamed = edits
                    .iter()
                    .any(|e| matches!(e, LayerEdit::Identity { layer: l, workers } if *l == layer && workers.has(w)));
                let alias_identity = if renamed {
                    other_identity(layer)
                } else {
                    identity(layer)
                };
                worker.handle.alias(group.id, layer, target, &alias_identity)?;
            }
        }
        for edit in edits {
            if let LayerEdit::ExtraAlias { layer, target } = *edit {
                if stage.contains(&target) && !dropped(target) {
                    worker.handle.alias(group.id, layer, target, &identity(layer))?;
                }
            }
        }
        worker.placements.push(placement);
    }
    for edit in edits {
        if let LayerEdit::ExtraLayer { layer } = *edit {
            if pp_rank != 0 {
                continue;
            }
            let shape = KvShape {
                first_layer: layer,
                num_layers: 1,
                ..a.kv.shape
            };
            let extra = LogicalKv::random(rng, shape);
            let extra_shard = shard(&extra, config.head_ranks[t as usize], config.tp_size, 0, 1);
            let mut placement = Placement::for_shard(
                rng,
                &extra,
                &extra_shard,
                group.kind,
                group.id,
                group.block_size,
                num_blocks,
            );
            placement.write_request(&extra, 0, &table.block_ids);
            worker.handle.placement(&placement, &identity)?;
            worker.targets.push(ReadTarget::Attention {
                group: g,
                placement: worker.placements.len(),
                layer,
                first_head: extra_shard.first_head,
                num_heads: extra_shard.num_heads,
                replica_index: extra_shard.replica.replica_index,
            });
            worker.placements.push(placement);
        }
    }
    Ok(())
}

#[allow(clippy::too_many_arguments)] // one group of one worker
fn register_state(
    rng: &mut Rng,
    config: &SideConfig,
    worker: &mut DeployedWorker,
    g: usize,
    state: &LogicalState,
    table: &GroupTable,
    num_blocks: u32,
    pp_rank: u32,
    t: u32,
    w: usize,
) -> Result<(), Failure> {
    let group = &config.groups[g];
    let numbers: Vec<u32> = state.layers.iter().map(|(l, _)| *l).collect();
    let held = pp_layers(&numbers, pp_rank, config.pp_size);
    let stage = LogicalState {
        layers: state.layers.iter().filter(|(l, _)| held.contains(l)).cloned().collect(),
    };
    if stage.layers.is_empty() {
        return Ok(());
    }
    let flipped = group
        .edits
        .iter()
        .any(|e| matches!(e, LayerEdit::SplitKnown { worker } if *worker == w));
    let split_known = group.split_known != flipped;
    let caches = place_requests(
        rng,
        &[(&stage, table.block_ids[0])],
        t,
        config.tp_size,
        group.id,
        split_known,
        num_blocks,
    );
    for buffer in &caches.buffers {
        worker.handle.region(buffer.as_ptr() as u64, buffer.len() as u64 * 8)?;
    }
    let index = worker.states.len();
    for (s, spec) in caches.specs.iter().enumerate() {
        let layer = spec.layer_number;
        let mut spec: StateSpec = spec.clone();
        let mut dropped = false;
        for edit in &group.edits {
            match *edit {
                LayerEdit::Identity { layer: l, workers } if l == layer && workers.has(w) => {
                    spec.identity.extend_from_slice(b" (another)")
                }
                LayerEdit::Drop { layer: l, workers } if l == layer && workers.has(w) => dropped = true,
                _ => {}
            }
        }
        if dropped {
            continue;
        }
        worker.handle.state(&spec)?;
        worker.targets.push(ReadTarget::State {
            group: g,
            caches: index,
            spec: s,
        });
    }
    worker.states.push(caches);
    Ok(())
}

/// A buffer of stored checksums per registered, unskipped group (as the
/// side's stored edit says).
fn register_stored(
    rng: &mut Rng,
    config: &SideConfig,
    worker: &mut DeployedWorker,
    tables: &[Option<GroupTable>],
    num_blocks: &[u32],
    w: usize,
) -> Result<(), Failure> {
    let mut first_buffer: Option<u64> = None;
    for (g, group) in config.groups.iter().enumerate() {
        let Some(table) = &tables[g] else { continue };
        if group.skip.is_some_and(|s| s.has(w)) {
            continue;
        }
        let memory = StoredMemory::random(rng, num_blocks[g] as usize);
        worker.handle.region(memory.address(), memory.bytes())?;
        let (mut address, mut blocks) = (memory.address(), num_blocks[g] as u64);
        match config.stored_edit {
            Some(StoredEdit::Missing { group, worker }) if group == g && worker == w => continue,
            Some(StoredEdit::OverCache { group, worker: at }) if group == g && at == w => {
                let placement = worker.targets.iter().find_map(|target| match target {
                    ReadTarget::Attention { group, placement, .. } if *group == g => Some(*placement),
                    _ => None,
                });
                if let Some(placement) = placement {
                    let buffer = &worker.placements[placement].buffers()[0];
                    address = buffer.address() + 8 * (buffer.len() as u64 / 16);
                    blocks = 1;
                }
            }
            Some(StoredEdit::TooSmall { group, worker }) if group == g && worker == w => {
                blocks = table.block_ids.iter().copied().max().unwrap_or(0) as u64;
            }
            Some(StoredEdit::Shared { worker }) if worker == w => {
                if let Some(first) = first_buffer {
                    address = first;
                }
            }
            _ => {}
        }
        worker.handle.stored(group.id, address, blocks)?;
        first_buffer.get_or_insert(address);
        worker.stored[g] = Some(memory);
    }
    Ok(())
}

// ---------------------------------------------------------------------------
// Corruption

/// Flips bits of one random byte that a worker of `side` reads (of a
/// replica-0 copy where `first_copy`, as a producer sends only those); or,
/// with `stored_values`, sometimes one byte of a stored value a load check
/// reads. `None` when the side reads nothing.
fn corrupt(
    rng: &mut Rng,
    model: &Model,
    config: &SideConfig,
    side: &mut Deployed,
    first_copy: bool,
    stored_values: bool,
) -> Option<String> {
    let mut choices = Vec::new();
    for (w, worker) in side.workers.iter().enumerate() {
        for (i, target) in worker.targets.iter().enumerate() {
            let (group, replica_index) = match target {
                ReadTarget::Attention {
                    group, replica_index, ..
                } => (*group, *replica_index),
                ReadTarget::State { group, .. } => (*group, 0),
            };
            let scheduled = config.groups[group].unscheduled_on != Some(w);
            if scheduled && (!first_copy || replica_index == 0) {
                choices.push((w, i));
            }
        }
    }
    if choices.is_empty() {
        return None;
    }
    let (w, i) = *rng.pick(&choices);
    let mask = 1u8 << rng.below(8);
    let target = side.workers[w].targets[i].clone();
    let group = match target {
        ReadTarget::Attention { group, .. } | ReadTarget::State { group, .. } => group,
    };
    let table = side.tables[group].clone().expect("a read group is registered");
    if stored_values && rng.chance(1, 4) {
        if let Some(memory) = side.workers[w].stored[group].as_mut() {
            // Positions past the tokens are neither stored nor checked.
            let positions = match &model.groups[group] {
                GroupModel::State(_) => 1,
                GroupModel::Attention(_) => positions_for(model.num_tokens, config.groups[group].block_size, 0, 0),
            };
            let position = rng.below(positions as u64) as usize;
            let block = table.block_ids[position] as usize;
            memory.words[block * STORED_WORDS] ^= (mask as u64) << (8 * rng.below(8));
            return Some(format!(
                "worker {w}: the stored value of group {group} position {position}"
            ));
        }
    }
    let worker = &mut side.workers[w];
    match target {
        ReadTarget::Attention {
            placement,
            layer,
            first_head,
            num_heads,
            ..
        } => {
            let head = first_head + rng.below(num_heads as u64) as u32;
            let token = rng.below(model.num_tokens);
            let block_size = config.groups[group].block_size as u64;
            let block_id = table.block_ids[(token / block_size) as usize];
            let placement = &mut worker.placements[placement];
            let byte = rng.below(placement.spec().k_bytes as u64 + placement.spec().v_bytes as u64) as u32;
            placement.xor_byte(layer, head, block_id, (token % block_size) as u32, byte, mask);
            Some(format!(
                "worker {w}: group {group} layer {layer} head {head} token {token} byte {byte}"
            ))
        }
        ReadTarget::State { caches, spec, .. } => {
            let caches = &mut worker.states[caches];
            let s = &caches.specs[spec];
            let tensor = rng.below(s.tensors.len() as u64) as usize;
            let t = &s.tensors[tensor];
            let row = rng.below(t.num_rows as u64) as i64;
            let byte = rng.below(t.bytes_per_row as u64) as i64;
            let address = t.address as i64 + table.block_ids[0] as i64 * t.block_stride + row * t.row_stride + byte;
            let buffer = caches.specs[..spec].iter().map(|s| s.tensors.len()).sum::<usize>() + tensor;
            let layer = s.layer_number;
            let words = &mut caches.buffers[buffer];
            let offset = (address - words.as_ptr() as i64) as usize;
            // SAFETY: the offset is a byte of a row of the request's state
            // block, inside the buffer, which is read as bytes.
            let bytes: &mut [u8] =
                unsafe { std::slice::from_raw_parts_mut(words.as_mut_ptr().cast(), words.len() * 8) };
            bytes[offset] ^= mask;
            Some(format!(
                "worker {w}: state layer {layer} tensor {tensor} row {row} byte {byte}"
            ))
        }
    }
}

// ---------------------------------------------------------------------------
// Running the flows

/// What a load came to.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// The consumer's report: verdict, first reason, message.
    Report { verdict: u32, reason: u32, message: String },
    /// A call failed: where, its status and message.
    Refused {
        at: &'static str,
        status: kvcs_status,
        message: String,
    },
}

impl Outcome {
    fn refused(at: &'static str, (status, message): Failure) -> Outcome {
        Outcome::Refused { at, status, message }
    }

    fn of(report: &CReport) -> Outcome {
        Outcome::Report {
            verdict: report.verdict(),
            reason: report.reason(),
            message: report.message(),
        }
    }

    pub fn is(&self, verdict: u32) -> bool {
        matches!(self, Outcome::Report { verdict: v, .. } if *v == verdict)
    }

    /// "MATCH", "MISMATCH", "UNVERIFIED <REASON>" or "refused: <call> <STATUS>".
    pub fn label(&self) -> String {
        match self {
            Outcome::Report { verdict, reason, .. } => match *verdict {
                MATCH => "MATCH".to_owned(),
                MISMATCH => "MISMATCH".to_owned(),
                _ => format!(
                    "UNVERIFIED {}",
                    reason_name(*reason).trim_start_matches("KVCS_UNVERIFIED_")
                ),
            },
            Outcome::Refused { at, status, .. } => {
                format!("refused: {at} {}", status_name(*status).trim_start_matches("KVCS_ERR_"))
            }
        }
    }

    pub fn message(&self) -> &str {
        match self {
            Outcome::Report { message, .. } | Outcome::Refused { message, .. } => message,
        }
    }
}

/// Every worker's record of `call` in `role` (`flipped` workers in the other).
fn records(side: &Deployed, config: &SideConfig, role: u32, at: &'static str) -> Result<Vec<Vec<u8>>, Outcome> {
    let other = if role == PRODUCER { CONSUMER } else { PRODUCER };
    side.workers
        .iter()
        .enumerate()
        .map(|(w, worker)| {
            let role = if config.flipped_roles.is_some_and(|f| f.has(w)) {
                other
            } else {
                role
            };
            let result = match config.call {
                Call::Checksum => worker.handle.checksum(&worker.blocks, role),
                Call::Store => worker.handle.store(&worker.blocks),
                Call::CheckStored => worker.handle.check_stored(&worker.blocks),
            };
            result
                .map(|r| r.encode().expect("encode"))
                .map_err(|f| Outcome::refused(at, f))
        })
        .collect()
}

/// The payload flow: the producer's payload (none if it is refused: the
/// consumer then has no checksums), judged by the consumer.
fn run_payload(informed: Informed, configs: &[SideConfig; 2], sides: &[Deployed; 2]) -> Outcome {
    let [producer_config, consumer_config] = configs;
    let [producer, consumer] = sides;
    let inner = || -> Result<Outcome, Outcome> {
        let producer_records = records(producer, producer_config, PRODUCER, "producer checksum")?;
        let verifier = CVerifier::new(producer_config.num_workers());
        verifier.extension(informed == Informed::Extension);
        verifier.expect(&producer.scheduled, PRODUCER);
        for record in &producer_records {
            verifier
                .add(record)
                .map_err(|f| Outcome::refused("producer add_record", f))?;
        }
        let payload = verifier.payload(REQ).ok();
        let consumer_records = records(consumer, consumer_config, CONSUMER, "consumer checksum")?;
        let verifier = CVerifier::new(consumer_config.num_workers());
        if informed == Informed::Settings {
            verifier.producer_tp_size(producer_config.tp_size);
        }
        if matches!(informed, Informed::Settings | Informed::BlockSizes) {
            for group in producer_config.groups.iter().filter(|g| g.registered) {
                verifier.producer_block_size(group.id, group.block_size);
            }
        }
        verifier.expect(&consumer.scheduled, CONSUMER);
        for record in &consumer_records {
            verifier
                .add(record)
                .map_err(|f| Outcome::refused("consumer add_record", f))?;
        }
        let report = match &payload {
            Some(payload) => verifier.check(REQ, payload),
            None => verifier.check_no_payload(REQ),
        }
        .map_err(|f| Outcome::refused("consumer check", f))?;
        Ok(Outcome::of(&report))
    };
    inner().unwrap_or_else(|outcome| outcome)
}

/// The offload flow, first half: the storing side stores, and each load-side
/// worker's stored buffer gets the values of the same worker and group
/// (by position), as a connector copies them with the blocks.
fn store_and_copy(sides: &mut [Deployed; 2]) -> Result<(), Outcome> {
    let [storing, loading] = sides;
    for worker in &storing.workers {
        drop(
            worker
                .handle
                .store(&worker.blocks)
                .map_err(|f| Outcome::refused("store", f))?,
        );
    }
    for (from, to) in storing.workers.iter().zip(loading.workers.iter_mut()) {
        for (g, (source, target)) in from.stored.iter().zip(to.stored.iter_mut()).enumerate() {
            let (Some(source), Some(target)) = (source, target.as_mut()) else {
                continue;
            };
            let (Some(from_table), Some(to_table)) = (&storing.tables[g], &loading.tables[g]) else {
                continue;
            };
            for (&a, &b) in from_table.block_ids.iter().zip(&to_table.block_ids) {
                if (a as u64) < source.num_blocks() && (b as u64) < target.num_blocks() {
                    target.set_entry(b, source.entry(a));
                }
            }
        }
    }
    Ok(())
}

/// The offload flow, second half: load checks and the verifier's verdict.
fn load_check(loading: &Deployed, config: &SideConfig) -> Outcome {
    let inner = || -> Result<Outcome, Outcome> {
        let mut records = Vec::new();
        for worker in &loading.workers {
            let result = worker
                .handle
                .check_stored(&worker.blocks)
                .map_err(|f| Outcome::refused("load check", f))?;
            records.push(result.encode().expect("encode"));
        }
        let verifier = CVerifier::new(config.num_workers());
        verifier.expect(&loading.scheduled, CONSUMER);
        for record in &records {
            verifier
                .add(record)
                .map_err(|f| Outcome::refused("consumer add_record", f))?;
        }
        let report = verifier
            .check_stored(REQ)
            .map_err(|f| Outcome::refused("consumer check_stored", f))?;
        Ok(Outcome::of(&report))
    };
    inner().unwrap_or_else(|outcome| outcome)
}

/// An arm's two runs: intact, then with one byte corrupted (`None` when
/// nothing could be corrupted or the intact run was refused at
/// registration).
#[derive(Clone, Debug)]
pub struct Arm {
    pub intact: Outcome,
    pub corrupted: Option<(String, Outcome)>,
}

/// Deploys `configs` and runs the flow intact, then with one corrupted byte
/// (on the consumer, or where `producer_too` sometimes on the producer).
fn run_arm(rng: &mut Rng, case: &Case, configs: &[SideConfig; 2], producer_too: bool) -> Arm {
    // vLLM's plain payloads are WEIGHTED (a MIXED producer always sends
    // the extension); the other flows run the library's default.
    let algorithm = match case.flow {
        Flow::Payload(Informed::Plain | Informed::Settings | Informed::BlockSizes) => {
            kvcsum::ffi::worker::kvcs_algorithm::KVCS_ALGORITHM_WEIGHTED as u32
        }
        _ => 0,
    };
    crate::support::handles::with_algorithm(algorithm, || run_arm_with(rng, case, configs, producer_too))
}

fn run_arm_with(rng: &mut Rng, case: &Case, configs: &[SideConfig; 2], producer_too: bool) -> Arm {
    let model = &case.model;
    let deployed = |rng: &mut Rng, s: usize| deploy(rng, model, &configs[s]);
    let (producer, consumer) = match (deployed(rng, 0), deployed(rng, 1)) {
        (Ok(p), Ok(c)) => (p, c),
        (Err((at, failure)), _) | (_, Err((at, failure))) => {
            return Arm {
                intact: Outcome::refused(at, failure),
                corrupted: None,
            }
        }
    };
    let mut sides = [producer, consumer];
    match case.flow {
        Flow::Payload(informed) => {
            let intact = run_payload(informed, configs, &sides);
            let on_producer = producer_too && rng.chance(1, 3);
            let s = if on_producer { 0 } else { 1 };
            let corrupted = corrupt(rng, model, &configs[s], &mut sides[s], on_producer, false).map(|what| {
                let what = format!("{} {what}", SIDE_NAMES[s]);
                (what, run_payload(informed, configs, &sides))
            });
            Arm { intact, corrupted }
        }
        Flow::Offload => {
            if let Err(refused) = store_and_copy(&mut sides) {
                return Arm {
                    intact: refused,
                    corrupted: None,
                };
            }
            let intact = load_check(&sides[1], &configs[1]);
            let corrupted = corrupt(rng, model, &configs[1], &mut sides[1], false, true)
                .map(|what| (format!("load side {what}"), load_check(&sides[1], &configs[1])));
            Arm { intact, corrupted }
        }
    }
}

/// A case and its two arms.
#[derive(Clone, Debug)]
pub struct CaseResult {
    pub seed: u64,
    pub index: u64,
    pub case: Case,
    pub base: Arm,
    pub changed: Arm,
}

/// Runs case `index` of the run with `seed`.
pub fn run_case(seed: u64, index: u64) -> CaseResult {
    let mut rng = Rng::from_seed_and_name(seed, &format!("verdict property case {index}"));
    let case = Case::random(&mut rng);
    let base = run_arm(&mut rng, &case, &case.base, true);
    let changed = run_arm(&mut rng, &case, &case.changed, false);
    CaseResult {
        seed,
        index,
        case,
        base,
        changed,
    }
}

impl CaseResult {
    /// Where the case breaks the rule: the rule broken and the details.
    /// Where MISMATCH of intact KV after this case's change is a limit the
    /// SPEC states rather than a defect: which one. A plain payload (vLLM's,
    /// WEIGHTED) carries no coverage, so a side that checksums other heads
    /// than it should cannot be told from corrupted data, and no marks, so
    /// neither can a layer that is an alias (or state that is shard-keyed)
    /// on one side only (SPEC section 10); a shard-keyed state slice is
    /// addressed by its worker's TP rank, so a rank label swapped is the
    /// state of another rank (SPEC section 6); a load check of a group the
    /// storing side never stored reads bytes that are no entry, and they
    /// fail as a damaged entry does (SPEC section 8).
    pub fn blind_spot(&self) -> Option<&'static str> {
        if !self.changed.intact.is(MISMATCH) {
            return None;
        }
        let plain = matches!(
            self.case.flow,
            Flow::Payload(Informed::Plain | Informed::Settings | Informed::BlockSizes)
        );
        let shard_keyed = self
            .case
            .changed
            .iter()
            .any(|side| side.groups.iter().any(|g| !g.split_known));
        match self.case.kind {
            Kind::HeadNarrow | Kind::HeadSplit | Kind::HeadPermute | Kind::ReplicaIndex | Kind::ReplicaCount
                if plain =>
            {
                Some("a plain payload carries no coverage")
            }
            Kind::AliasFlip | Kind::SplitKnown if plain => Some("a plain payload carries no marks"),
            Kind::RankSwap | Kind::RankDup if shard_keyed => Some("a shard-keyed slice is addressed by its TP rank"),
            _ if self.never_stored() => Some("a load check reads bytes the storing side never wrote as no entry"),
            _ => None,
        }
    }

    /// Whether the change left the storing side without entries of a group
    /// that the load side checks (skipped, left out or not scheduled where
    /// it stored): the load check reads the bytes left in the buffer, which
    /// are no entry and fail like a damaged one (SPEC section 8).
    fn never_stored(&self) -> bool {
        self.case.flow == Flow::Offload
            && self.case.change.contains(&format!("on the {}", OFFLOAD_SIDE_NAMES[0]))
            && matches!(
                self.case.kind,
                Kind::SkipAll | Kind::SkipOne | Kind::GroupDrop | Kind::GroupUnscheduled
            )
    }

    pub fn violations(&self) -> Vec<(&'static str, String)> {
        let mut found = Vec::new();
        let mut say = |rule: &'static str, outcome: &Outcome, corruption: Option<&str>| {
            let details = format!(
                "case {} (KVCS_TEST_SEED={} KVCS_PROPERTY_CASE={}): {rule}: got {}{}\n  change: {}\n  flow: {:?}\n  message: {}\n  case: {}",
                self.index,
                self.seed,
                self.index,
                outcome.label(),
                corruption.map(|c| format!(" (corrupted: {c})")).unwrap_or_default(),
                self.case.change,
                self.case.flow,
                outcome.message(),
                self.case.summary()
            );
            found.push((rule, details));
        };
        if !self.base.intact.is(MATCH) {
            say("no change, intact KV must MATCH", &self.base.intact, None);
        }
        match &self.base.corrupted {
            Some((what, outcome)) if !outcome.is(MISMATCH) => {
                say("no change, corrupted KV must be MISMATCH", outcome, Some(what))
            }
            None if self.base.intact.is(MATCH) => say("no change: nothing to corrupt", &self.base.intact, None),
            _ => {}
        }
        if self.changed.intact.is(MISMATCH) && self.blind_spot().is_none() {
            say(
                "a configuration change with intact KV must never be MISMATCH",
                &self.changed.intact,
                None,
            );
        }
        if let Some((what, outcome)) = &self.changed.corrupted {
            if outcome.is(MATCH) {
                say("corrupted KV that is read must never be MATCH", outcome, Some(what));
            }
        }
        found
    }
}

// ---------------------------------------------------------------------------
// Counting

/// Outcome counts per arm and per change kind.
#[derive(Default)]
pub struct Tally {
    pub cases: u64,
    flows: BTreeMap<&'static str, u64>,
    /// (arm, outcome label) -> count.
    arms: BTreeMap<(usize, String), u64>,
    /// (kind, arm, outcome label) -> count (changed arms).
    kinds: BTreeMap<(Kind, usize, String), u64>,
    kind_cases: BTreeMap<Kind, u64>,
}

const ARMS: [&str; 4] = [
    "no change, intact",
    "no change, corrupted",
    "changed, intact",
    "changed, corrupted",
];

impl Tally {
    pub fn add(&mut self, result: &CaseResult) {
        self.cases += 1;
        let flow = match result.case.flow {
            Flow::Payload(Informed::Extension) => "payload with extension",
            Flow::Payload(Informed::Settings) => "plain payload, producer sizes set",
            Flow::Payload(Informed::BlockSizes) => "plain payload, producer block sizes set",
            Flow::Payload(Informed::Plain) => "plain payload, nothing set",
            Flow::Offload => "offload (store, load check)",
        };
        *self.flows.entry(flow).or_default() += 1;
        *self.kind_cases.entry(result.case.kind).or_default() += 1;
        let runs = [
            Some(&result.base.intact),
            result.base.corrupted.as_ref().map(|(_, o)| o),
            Some(&result.changed.intact),
            result.changed.corrupted.as_ref().map(|(_, o)| o),
        ];
        for (arm, outcome) in runs.into_iter().enumerate() {
            let Some(outcome) = outcome else { continue };
            *self.arms.entry((arm, outcome.label())).or_default() += 1;
            if arm >= 2 {
                *self.kinds.entry((result.case.kind, arm, outcome.label())).or_default() += 1;
            }
        }
    }

    /// The table: cases by flow; per arm MATCH, MISMATCH, UNVERIFIED by
    /// reason, refused by call; per change kind its outcomes.
    pub fn table(&self, seed: u64) -> String {
        let mut out = String::new();
        let _ = writeln!(out, "verdict property: seed {seed}, {} cases", self.cases);
        for (flow, count) in &self.flows {
            let _ = writeln!(out, "  {count:>6}  {flow}");
        }
        for (arm, name) in ARMS.iter().enumerate() {
            let rows: Vec<(&String, &u64)> = self
                .arms
                .iter()
                .filter(|((a, _), _)| *a == arm)
                .map(|((_, label), count)| (label, count))
                .collect();
            let total: u64 = rows.iter().map(|(_, c)| **c).sum();
            let count = |prefix: &str| -> u64 {
                rows.iter()
                    .filter(|(l, _)| l.starts_with(prefix))
                    .map(|(_, c)| **c)
                    .sum()
            };
            let _ = writeln!(
                out,
                "{name}: {total} runs: MATCH {}, MISMATCH {}, UNVERIFIED {}, refused {}",
                count("MATCH"),
                count("MISMATCH"),
                count("UNVERIFIED"),
                count("refused")
            );
            for (label, count) in rows {
                if label.starts_with("UNVERIFIED") || label.starts_with("refused") {
                    let _ = writeln!(out, "  {count:>6}  {label}");
                }
            }
        }
        let _ = writeln!(out, "per change (changed arm: intact | corrupted):");
        for (kind, cases) in &self.kind_cases {
            let summary = |arm: usize| -> String {
                let parts: Vec<String> = self
                    .kinds
                    .iter()
                    .filter(|((k, a, _), _)| k == kind && *a == arm)
                    .map(|((_, _, label), count)| format!("{label} {count}"))
                    .collect();
                parts.join(", ")
            };
            let _ = writeln!(
                out,
                "  {:<26} {cases:>5} cases: {} | {}",
                kind.name(),
                summary(2),
                summary(3)
            );
        }
        out
    }
}

// ---------------------------------------------------------------------------
// Every pair of block sizes

/// The flows of the sweep: nothing told (a plain payload says nothing of
/// the producer's block size), the block size set, the extension.
pub const PAIR_FLOWS: [Informed; 3] = [Informed::Plain, Informed::BlockSizes, Informed::Extension];

/// One pair of block sizes (producer, consumer) of the sweep: one model of
/// one attention group, and per flow of [`PAIR_FLOWS`] its arm (intact, one
/// flipped bit of a token read).
pub struct PairResult {
    pub seed: u64,
    pub case: Case,
    pub arms: Vec<(Informed, Arm)>,
}

/// A token count for blocks of `a` and `b` tokens: half the time one under
/// which both sides hold the same number of positions (the counts that
/// cannot tell the two sizes apart), more than one each where the sizes
/// allow it; else any of 1 to 200.
fn pair_tokens(rng: &mut Rng, a: u32, b: u32) -> u64 {
    if rng.chance(1, 2) {
        let (small, large) = (a.min(b) as u64, a.max(b) as u64);
        // `k` positions each: tokens in ((k-1)*large, k*small].
        let counts: Vec<u64> = (2..=6).filter(|k| (k - 1) * large < k * small).collect();
        let k = counts
            .get(rng.below(counts.len().max(1) as u64) as usize)
            .copied()
            .unwrap_or(1);
        return rng.range((k - 1) * large + 1..k * small + 1);
    }
    rng.range(1..201)
}

/// Runs the pair `(producer_size, consumer_size)` of the run with `seed`:
/// one model (MLA or GQA, one or two layers, TP 1 or 2 on each side, any
/// layout the block size allows, producer and consumer positions past the
/// tokens) under each flow of [`PAIR_FLOWS`].
pub fn run_block_size_pair(seed: u64, producer_size: u32, consumer_size: u32) -> PairResult {
    let mut rng = Rng::from_seed_and_name(seed, &format!("block sizes {producer_size} {consumer_size}"));
    let num_tokens = pair_tokens(&mut rng, producer_size, consumer_size);
    let layers = rng.range(1..3) as u32;
    let shape = if rng.chance(1, 2) {
        KvShape::mla(layers, 16, num_tokens)
    } else {
        KvShape::gqa(layers, 2, 8, num_tokens)
    };
    let model = Model {
        num_tokens,
        groups: vec![GroupModel::Attention(AttentionModel {
            kv: LogicalKv::random(&mut rng, shape),
            shared: None,
        })],
        hash_seed: rng.next_u64(),
    };
    let side = |rng: &mut Rng, block_size: u32, extra_positions: usize| {
        let tp_size = *rng.pick(&[1u32, 2]);
        let kind = *rng.pick(&kinds_for(&model, 0, block_size));
        SideConfig {
            tp_size,
            pp_size: 1,
            detail: rng.chance(1, 4),
            groups: vec![GroupConfig {
                extra_positions,
                ..GroupConfig::plain(0, block_size, kind)
            }],
            rank_labels: (0..tp_size).collect(),
            head_ranks: (0..tp_size).collect(),
            flipped_roles: None,
            call: Call::Checksum,
            stored_buffers: false,
            stored_edit: None,
        }
    };
    let producer_extra = rng.below(3) as usize;
    let consumer_extra = rng.below(2) as usize;
    let base = [
        side(&mut rng, producer_size, producer_extra),
        side(&mut rng, consumer_size, consumer_extra),
    ];
    let mut case = Case {
        model,
        flow: Flow::Payload(Informed::Plain),
        changed: base.clone(),
        base,
        kind: Kind::BlockSize,
        change: format!("producer block size {producer_size}, consumer {consumer_size}, {num_tokens} tokens"),
    };
    let mut arms = Vec::new();
    for informed in PAIR_FLOWS {
        case.flow = Flow::Payload(informed);
        arms.push((informed, run_arm(&mut rng, &case, &case.base, true)));
    }
    PairResult { seed, case, arms }
}

impl PairResult {
    /// The outcomes that break the rule: with nothing told, the group is
    /// UNVERIFIED BLOCK_SIZE_UNKNOWN, intact or not (never MATCH, never
    /// MISMATCH); told by a setting or the extension, intact KV is a
    /// MATCH and a flipped bit a MISMATCH.
    pub fn violations(&self) -> Vec<String> {
        let [producer, consumer] = &self.case.base;
        let (a, b) = (producer.groups[0].block_size, consumer.groups[0].block_size);
        let mut found = Vec::new();
        for (informed, arm) in &self.arms {
            let (intact, corrupted) = match informed {
                Informed::Plain => ("UNVERIFIED BLOCK_SIZE_UNKNOWN", "UNVERIFIED BLOCK_SIZE_UNKNOWN"),
                _ => ("MATCH", "MISMATCH"),
            };
            let mut say = |what: &str, want: &str, outcome: &Outcome| {
                if outcome.label() != want {
                    found.push(format!(
                        "block sizes {a} (producer) and {b} (consumer) (KVCS_TEST_SEED={} KVCS_BLOCK_SIZE_PAIR={a},{b}), {informed:?}: {what} must be {want}, got {}: {}\n  case: {}",
                        self.seed,
                        outcome.label(),
                        outcome.message(),
                        self.case.summary()
                    ));
                }
            };
            say("intact KV", intact, &arm.intact);
            match &arm.corrupted {
                Some((what, outcome)) => say(&format!("a flipped bit ({what})"), corrupted, outcome),
                None => say("a flipped bit (nothing to corrupt)", corrupted, &arm.intact),
            }
        }
        found
    }
}

/// Outcome counts of the sweep, per flow and arm.
#[derive(Default)]
pub struct PairTally {
    pub pairs: u64,
    /// Pairs of two block sizes whose sides hold as many positions of
    /// tokens (which no count of positions tells apart).
    pub equal_position_counts: u64,
    /// (flow, corrupted, label) -> count.
    outcomes: BTreeMap<(String, bool, String), u64>,
}

impl PairTally {
    pub fn add(&mut self, result: &PairResult) {
        self.pairs += 1;
        let tokens = result.case.model.num_tokens;
        let [producer, consumer] = &result.case.base;
        let positions = |side: &SideConfig| tokens.div_ceil(side.groups[0].block_size as u64);
        let sizes_differ = producer.groups[0].block_size != consumer.groups[0].block_size;
        if sizes_differ && positions(producer) == positions(consumer) {
            self.equal_position_counts += 1;
        }
        for (informed, arm) in &result.arms {
            let flow = format!("{informed:?}");
            *self
                .outcomes
                .entry((flow.clone(), false, arm.intact.label()))
                .or_default() += 1;
            if let Some((_, outcome)) = &arm.corrupted {
                *self.outcomes.entry((flow, true, outcome.label())).or_default() += 1;
            }
        }
    }

    pub fn table(&self, seed: u64) -> String {
        let mut out = format!(
            "block-size pairs: seed {seed}, {} pairs ({} of two sizes with as many positions of tokens on both sides)\n",
            self.pairs, self.equal_position_counts
        );
        for informed in PAIR_FLOWS {
            let name = match informed {
                Informed::Plain => "plain payload, nothing set",
                Informed::BlockSizes => "plain payload, producer block size set",
                _ => "payload with extension",
            };
            for corrupted in [false, true] {
                let rows: Vec<String> = self
                    .outcomes
                    .iter()
                    .filter(|((f, c, _), _)| *f == format!("{informed:?}") && *c == corrupted)
                    .map(|((_, _, label), count)| format!("{label} {count}"))
                    .collect();
                let _ = writeln!(
                    out,
                    "  {name:<40} {:<9} {}",
                    if corrupted { "corrupted" } else { "intact" },
                    rows.join(", ")
                );
            }
        }
        out
    }
}
