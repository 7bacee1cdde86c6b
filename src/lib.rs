//! kvcsum: connector-agnostic checksums of LLM KV-cache blocks.
//!
//! The modules are layered, each importing only from those below it;
//! `docs/ARCHITECTURE.md` lists them in that order (the one list of them),
//! and `tests/it/module_imports.rs` fails on an import that runs back up and on a
//! module that page leaves out.
//!
//! The Rust API is what is re-exported here plus the public modules
//! [`record`], [`payload`], [`verify`] (verification from Rust), [`topology`]
//! (transfer topology for agents) and [`ffi`]
//! (the C ABI, callable from Rust for tests). The other modules are internal.

#![warn(missing_docs)]

pub(crate) mod blocks;
pub(crate) mod checksum;
pub(crate) mod cuda;
pub(crate) mod decoding;
pub(crate) mod detail;
pub(crate) mod error;
pub mod ffi;
pub(crate) mod fingerprint;
pub(crate) mod host;
pub(crate) mod layout;
pub(crate) mod layout_string;
pub(crate) mod msgpack;
pub mod payload;
pub(crate) mod placement;
pub(crate) mod plan;
pub(crate) mod pool;
pub mod record;
pub(crate) mod record_facts;
pub(crate) mod repair;
pub(crate) mod result;
pub(crate) mod state;
pub(crate) mod stored;
pub(crate) mod stored_entry;
pub(crate) mod stream;
pub(crate) mod tier_index;
pub mod topology;
pub mod verify;
pub(crate) mod worker;

pub use blocks::{BlockArrays, BlockSet, GroupBlocks, RequestBlocks};
/// The checksum arithmetic (SPEC sections 2, 3 and 12): public for the
/// fault catalogue and benchmarks, which measure it directly.
pub use checksum::{
    mix, mix2, mix2_round, slice_weight, weighted_run, Algorithm, MIX2_MULTIPLIER_1, MIX2_MULTIPLIER_2,
    MIX2_MULTIPLIER_3, MIX_MULTIPLIER,
};
pub use cuda::{checksum_ptx, libraries_present};
pub use decoding::{GeometryDifference, LayerDecoding, LayerGeometry};
pub use error::{Error, Result};
pub use layout::{Alias, LayerSpec, Layout, Region, ReplicaKey, Role, Segment};
pub use placement::GroupPlacement;
/// A call's blocks checked and laid out; public so that benchmarks can time it.
pub use plan::{Plan, RowRoom};
pub use result::{
    Checksums, GroupChecksums, RequestChecksums, SkippedGroup, StoredExpectation, StoredOutcome, StoredRef,
    StoredValues,
};
pub use state::{StateSpec, StateTensor};
pub use stored::{check_result_entries, result_entries};
pub use stream::StreamHandle;
/// The values of a worker's full blocks by block hash (docs/vllm-tiers.md).
pub use tier_index::{TierBlock, TierIndex, TierIndexInfo, TierOutcome};
pub use worker::{Worker, WorkerOptions};
