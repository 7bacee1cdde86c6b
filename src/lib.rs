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

// The layers, lowest first; each imports only from those before it
// (docs/ARCHITECTURE.md says what each holds).
// 1. Arithmetic and plumbing.
pub(crate) mod base;
// 2. Inputs.
pub(crate) mod inputs;
// 3. Results.
pub(crate) mod results;
// 4. The plan of a call.
pub(crate) mod plan;
// 5. Engines.
pub(crate) mod engines;
// 6. The worker: a layout plus an engine.
pub(crate) mod worker;
// 7. The values of a worker's full blocks by block hash.
pub(crate) mod tier_index;
// 8. Records and payloads, as bytes.
pub(crate) mod wire;
// 9. The verifier.
pub mod verify;
// 10. The repair plan of a verifier's report.
pub(crate) mod repair;
// 11. The C boundary.
pub mod ffi;

pub use base::topology;
pub use wire::{payload, record};

/// The checksum arithmetic (SPEC sections 2, 3 and 12): public for the
/// fault catalogue and benchmarks, which measure it directly.
pub use base::checksum::{
    mix, mix2, mix2_round, slice_weight, weighted_run, Algorithm, MIX2_MULTIPLIER_1, MIX2_MULTIPLIER_2,
    MIX2_MULTIPLIER_3, MIX_MULTIPLIER,
};
pub use base::error::{Error, Result};
pub use engines::cuda::{checksum_ptx, libraries_present};
pub use engines::stored::{check_result_entries, result_entries};
pub use inputs::blocks::{BlockArrays, BlockSet, GroupBlocks, RequestBlocks};
pub use inputs::decoding::{GeometryDifference, LayerDecoding, LayerGeometry};
pub use inputs::layout::{Alias, LayerSpec, Layout, Region, ReplicaKey, Segment};
pub use inputs::placement::GroupPlacement;
pub use inputs::role::Role;
pub use inputs::state::{StateSpec, StateTensor};
pub use inputs::stream::StreamHandle;
/// A call's blocks checked and laid out; public so that benchmarks can time it.
pub use plan::{Plan, RowRoom};
pub use results::checksums::{
    Checksums, GroupChecksums, RequestChecksums, SkippedGroup, StoredExpectation, StoredOutcome, StoredRef,
    StoredValues,
};
/// The values of a worker's full blocks by block hash (docs/vllm-tiers.md).
pub use tier_index::{TierArrays, TierBlock, TierIndex, TierIndexInfo, TierOutcome};
pub use worker::{Worker, WorkerOptions};
