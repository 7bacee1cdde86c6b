//! What a worker asks of its engine: the one trait both engines implement,
//! each engine's rules in a file of its own (`host_engine.rs`,
//! `device_engine.rs`). The worker holds a `Box<dyn Engine>` and never asks
//! which engine it has.

use std::sync::Arc;

use crate::base::checksum::Algorithm;
use crate::base::error::Result;
use crate::engines::cuda::{DeviceEngine, StoredMode};
use crate::engines::detail::Shadow;
use crate::inputs::blocks::BlockSet;
use crate::inputs::layout::{Layout, Region, StoredBuffer};
use crate::inputs::role::Role;
use crate::inputs::stream::StreamHandle;
use crate::plan::{FullBlock, FullBlockRows, Plan};
use crate::results::checksums::{Checksums, StoredExpectation, Values};
use crate::results::record_facts::GroupInfo;

/// What an engine's part of a worker's call needs of the worker.
pub(super) struct Call<'a> {
    /// The worker's layout.
    pub(super) layout: &'a Layout,
    /// Its record's group facts.
    pub(super) infos: Arc<[GroupInfo]>,
    /// The algorithm of its values.
    pub(super) algorithm: Algorithm,
}

/// The worker's checksum call over the blocks at hand, every column, with
/// a store or gather of stored checksums queued by the same call (a device
/// engine's) or none: the result and a load check's expectations.
pub(super) type ChecksumWith<'a> = &'a dyn Fn(Option<StoredMode>) -> Result<(Checksums, Vec<StoredExpectation>)>;

/// Detail mode's shadow layout and, on a device worker, the engine that
/// holds its descriptors.
pub(super) struct Detail {
    pub(super) shadow: Shadow,
    pub(super) engine: Option<DeviceEngine>,
}

/// A change of a worker's layout (`Layout::add_layer`, say), which leaves
/// the layout as it was when it fails.
pub(super) type LayoutChange<'a> = Box<dyn FnOnce(&mut Layout) -> Result<()> + 'a>;

/// A worker's engine: where its caches live and how its values are made.
pub(super) trait Engine: Send + Sync {
    /// What the engine runs on, for logs.
    fn description(&self) -> String;

    /// Checks that `region` (which the layout's own rules accepted) is
    /// memory this engine reads.
    fn check_region(&self, region: Region) -> Result<()>;

    /// Applies `change` to `layout`; on error nothing changes, on the
    /// engine either.
    fn change_layout(&mut self, layout: &mut Layout, change: LayoutChange<'_>) -> Result<()>;

    /// Registers `group_id`'s buffer of stored checksums in `layout`, after
    /// the engine's checks of the memory.
    fn add_stored(&self, layout: &mut Layout, group_id: u32, buffer: StoredBuffer) -> Result<()>;

    /// The plan and the values (computed, or queued on `stream`) of a
    /// worker's checksum call over `blocks`; with `stored`, the call also
    /// queues that store or gather, whose expectations go into
    /// `expectations`.
    fn checksum(
        &self,
        call: &Call<'_>,
        blocks: &BlockSet,
        role: Role,
        stream: StreamHandle,
        stored: Option<StoredMode>,
        expectations: &mut Vec<StoredExpectation>,
    ) -> Result<(Plan, Values)>;

    /// The sums of the worker's columns in `role` of full blocks taken one
    /// by one (`plan::full_block_rows`), block `i`'s into value `i`, with
    /// `rows.computed[i]` saying which have one: computed into `values`
    /// before it returns (`None`, the host engine), or queued on `stream`
    /// and given as values read once the work is done (a device engine).
    /// `rows` and `values` are the caller's, reused.
    fn full_block_values(
        &self,
        call: &Call<'_>,
        blocks: &[FullBlock],
        role: Role,
        stream: StreamHandle,
        rows: &mut FullBlockRows,
        values: &mut Vec<u64>,
    ) -> Result<Option<Values>>;

    /// `Worker::store` on this engine: `blocks` checksummed through
    /// `checksum_with` and each block's stored checksum written.
    fn store(&self, call: &Call<'_>, blocks: &BlockSet, checksum_with: ChecksumWith<'_>) -> Result<Checksums>;

    /// `Worker::check_stored` on this engine: `blocks` checksummed through
    /// `checksum_with`, with the stored checksums read back.
    fn check_stored(&self, call: &Call<'_>, blocks: &BlockSet, checksum_with: ChecksumWith<'_>) -> Result<Checksums>;

    /// The engine that holds detail mode's `shadow` layout, where this one
    /// cannot compute over it directly (a device's descriptors).
    fn detail_engine(&self, shadow: &Shadow) -> Result<Option<DeviceEngine>>;

    /// The plan and values of detail mode's per-layer partials of
    /// `shadow_blocks` (the call's blocks in the shadow layout).
    fn detail_values(
        &self,
        detail: &Detail,
        shadow_blocks: &BlockSet,
        role: Role,
        algorithm: Algorithm,
        stream: StreamHandle,
    ) -> Result<(Plan, Values)>;
}
