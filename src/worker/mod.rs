//! A worker: one TP rank / PP stage's registered layout and the engine that
//! computes its partial checksums. What differs between the engines is the
//! [`Engine`] trait (`engine.rs`), each engine's rules in a file of its own:
//! `host_engine.rs` and `device_engine.rs`.

mod device_engine;
mod engine;
mod host_engine;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};

use crate::base::checksum::Algorithm;
use crate::base::error::{err, Result};
use crate::engines::cuda;
use crate::engines::detail::Shadow;
use crate::engines::host;
use crate::engines::stored;
use crate::inputs::blocks::BlockSet;
use crate::inputs::decoding::LayerDecoding;
use crate::inputs::fingerprint::{group_fingerprint, group_marks};
use crate::inputs::layout::{Alias, LayerSpec, Layout, Region, StoredBuffer};
use crate::inputs::placement::GroupPlacement;
use crate::inputs::role::Role;
use crate::inputs::state::StateSpec;
use crate::inputs::stream::StreamHandle;
use crate::plan::{FullBlock, FullBlockRows, Plan};
use crate::results::checksums::{Checksums, DetailValues, RecordInfo, StoredExpectation, Values};
use crate::results::record_facts::{GroupInfo, Rank};
use engine::{Call, Detail, Engine};

/// Where a worker's caches live and how it is placed in the model.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WorkerOptions {
    /// This worker's tensor-parallel rank.
    pub tp_rank: u32,
    /// Tensor-parallel size.
    pub tp_size: u32,
    /// Pipeline-parallel stage.
    pub pp_rank: u32,
    /// CUDA device ordinal, or `None` for host memory.
    pub device: Option<u32>,
    /// Host engine threads, at most 256; 0 = the environment variable
    /// `KVCS_HOST_THREADS` when set, else the cores this process may run on
    /// divided by 8, between 1 and 4 (see `kvcs_worker_options`).
    pub num_threads: u32,
}

impl WorkerOptions {
    /// The place of a worker created with these options.
    pub fn rank(&self) -> Rank {
        Rank {
            tp_rank: self.tp_rank,
            tp_size: self.tp_size,
            pp_rank: self.pp_rank,
        }
    }
}

/// The group facts of a layout, sorted by group id (fingerprints hashed now),
/// whatever order the groups were registered in: records list groups by id.
fn group_infos(layout: &Layout) -> Vec<GroupInfo> {
    let mut infos: Vec<GroupInfo> = layout
        .groups()
        .map(|group| GroupInfo {
            group_id: group.group_id,
            block_size: group.block_size,
            fingerprint: group_fingerprint(group),
            marks: group_marks(group),
            shard_keyed: group.is_shard_keyed(),
            holds_caches: !group.layers().is_empty() || !group.states().is_empty(),
            state: group.is_state(),
            coverage: group.coverage(),
            decodings: group.decodings(),
            geometry: group.geometry(),
            placement: group.placement(),
        })
        .collect();
    infos.sort_by_key(|info| info.group_id);
    infos
}

/// One worker's layout and engine.
pub struct Worker {
    options: WorkerOptions,
    layout: Layout,
    engine: Box<dyn Engine>,
    /// Detail mode: results also carry per-layer partials (see
    /// `set_detail`). The shadow is built from the layout at the first call
    /// that needs it and reset when the layout changes, so that registering
    /// n layers in detail mode builds it once, not n times.
    detail: Option<OnceLock<Detail>>,
    /// The record's group facts (fingerprints hashed once), reset when the layout changes.
    group_infos: OnceLock<Arc<[GroupInfo]>>,
    /// What `f` of SPEC section 12 every value of this worker uses.
    algorithm: Algorithm,
    /// Whether a checksum, store or load check has run: the algorithm is
    /// then fixed, so that every value of the worker is comparable.
    computed: AtomicBool,
}

impl Worker {
    /// A worker with nothing registered. A device worker fails with
    /// `Error::Device` where no CUDA driver or NVRTC is present.
    pub fn new(options: WorkerOptions) -> Result<Worker> {
        if options.tp_size == 0 {
            return Err(err!(InvalidArgument, "tp_size is 0"));
        }
        if options.tp_rank >= options.tp_size {
            return Err(err!(
                InvalidArgument,
                "tp_rank {} is not below tp_size {}",
                options.tp_rank,
                options.tp_size
            ));
        }
        let engine: Box<dyn Engine> = match options.device {
            None => Box::new(host::HostEngine::new(options.num_threads)?),
            Some(ordinal) => Box::new(cuda::DeviceEngine::new(ordinal)?),
        };
        Ok(Worker {
            options,
            layout: Layout::default(),
            engine,
            detail: None,
            group_infos: OnceLock::new(),
            algorithm: Algorithm::default(),
            computed: AtomicBool::new(false),
        })
    }

    /// The algorithm of every value this worker computes (SPEC section 12):
    /// [`Algorithm::Mixed2`] unless set otherwise.
    pub fn algorithm(&self) -> Algorithm {
        self.algorithm
    }

    /// Chooses the algorithm (SPEC section 12) before the worker's first
    /// checksum, store or load check; `InvalidArgument` after one, so that
    /// a worker's values (and the stored checksums it wrote) all use one.
    pub fn set_algorithm(&mut self, algorithm: Algorithm) -> Result<()> {
        if self.computed.load(Ordering::Relaxed) {
            return Err(err!(
                InvalidArgument,
                "algorithm {} cannot be set: this worker has already computed checksums with {} (set it before the first checksum, store or load check)",
                algorithm.name(),
                self.algorithm.name()
            ));
        }
        self.algorithm = algorithm;
        Ok(())
    }

    /// As created.
    pub fn options(&self) -> &WorkerOptions {
        &self.options
    }

    /// Forgets what was derived from the layout (the record's group facts,
    /// detail mode's shadow); every call that changes the layout calls it.
    fn layout_changed(&mut self) {
        self.group_infos = OnceLock::new();
        if let Some(shadow) = &mut self.detail {
            *shadow = OnceLock::new();
        }
    }

    /// The record's group facts, fingerprints hashed once per layout.
    fn infos(&self) -> Arc<[GroupInfo]> {
        self.group_infos
            .get_or_init(|| group_infos(&self.layout).into())
            .clone()
    }

    /// What the engine's part of a call needs of the worker.
    fn call(&self) -> Call<'_> {
        Call {
            layout: &self.layout,
            infos: self.infos(),
            algorithm: self.algorithm,
        }
    }

    /// What the worker's engine runs on, for logs: host threads, or the
    /// device and its kernel's registers and occupancy.
    pub fn engine_description(&self) -> String {
        self.engine.description()
    }

    /// What has been registered.
    pub fn layout(&self) -> &Layout {
        &self.layout
    }

    /// Registers memory the worker may read (host or device addresses, as the
    /// worker's kind). The caller keeps it readable while the worker lives.
    /// A device worker checks that the range lies in one CUDA allocation of
    /// its device (or in pinned host memory); a host worker checks that
    /// every page of it is mapped in this process and readable ([`host::check_mapped`]).
    pub fn add_region(&mut self, region: Region) -> Result<()> {
        // The layout's rules first (address 0, empty, wrapping), then the
        // engine's: CUDA's for device memory, the page tables' for host memory.
        Layout::check_region(region)?;
        self.engine.check_region(region)?;
        self.layout.add_region(region)?;
        self.layout_changed();
        Ok(())
    }

    /// Registers a group of layers sharing one block table.
    pub fn add_group(&mut self, group_id: u32, block_size: u32) -> Result<()> {
        self.layout.add_group(group_id, block_size)?;
        self.layout_changed();
        Ok(())
    }

    /// Sets where `group_id`'s tokens sit in this worker's caches (SPEC
    /// section 16: DCP shard, tokens per slot), before any of its layers
    /// (see [`Layout::set_group_placement`]); on error nothing changes.
    pub fn set_group_placement(&mut self, group_id: u32, placement: GroupPlacement) -> Result<()> {
        self.layout.set_group_placement(group_id, placement)?;
        self.layout_changed();
        Ok(())
    }

    /// Declares a group this worker cannot checksum.
    pub fn skip_group(&mut self, group_id: u32, reason: &str) -> Result<()> {
        self.layout.skip_group(group_id, reason)
    }

    /// Registers an attention layer's cache; on error nothing changes. A
    /// host worker adds it in place (the layout checks before it changes); a
    /// device worker keeps its layout until the device has the new one. In
    /// detail mode the shadow is rebuilt at the next call, not here.
    pub fn add_layer(&mut self, spec: LayerSpec) -> Result<()> {
        self.engine
            .change_layout(&mut self.layout, Box::new(|layout| layout.add_layer(spec)))?;
        self.layout_changed();
        Ok(())
    }

    /// Registers a layer that reads another layer's cache (see
    /// [`Layout::add_alias`]); on error nothing changes.
    pub fn add_alias(&mut self, group_id: u32, alias: Alias) -> Result<()> {
        self.layout.add_alias(group_id, alias)?;
        self.layout_changed();
        Ok(())
    }

    /// Declares how the engine decodes layer `layer_number` of `group_id`
    /// (SPEC section 7): records carry it from the next call on, and a
    /// verifier reports a load unverified where the two sides declare a
    /// fact of a layer differently. A later declaration of the layer
    /// replaces it (scales computed at run time). On error nothing changes.
    pub fn set_layer_decoding(&mut self, group_id: u32, layer_number: u32, decoding: LayerDecoding) -> Result<()> {
        self.layout.set_layer_decoding(group_id, layer_number, decoding)?;
        // Only the record's group facts follow from it (not detail mode's shadow).
        self.group_infos = OnceLock::new();
        Ok(())
    }

    /// Registers a state layer (SPEC section 6) of a state group; on error
    /// nothing changes. A host worker adds it in place (the layout checks
    /// before it changes); a device worker keeps its layout until the device
    /// has the new tables. Detail mode's shadow has no state layers, so it
    /// stays as it is.
    pub fn add_state(&mut self, spec: StateSpec) -> Result<()> {
        // The tensors lie in registered regions (checked here), which
        // add_region checked are memory this worker's engine reads.
        let tp_rank = self.options.tp_rank;
        self.engine.change_layout(
            &mut self.layout,
            Box::new(move |layout| layout.add_state(spec, tp_rank)),
        )?;
        self.layout_changed();
        Ok(())
    }

    /// Computes (host) or queues (device, on `stream`) the partial checksums
    /// of every block in `blocks`. Fails before any work when a block id or
    /// group is bad.
    pub fn checksum(&self, blocks: &BlockSet, role: Role, stream: StreamHandle) -> Result<Checksums> {
        Ok(self.checksum_with(blocks, role, stream, None)?.0)
    }

    /// [`Worker::checksum`]; on a device worker with `stored`, the call also
    /// queues that store or gather of stored checksums (SPEC section 8),
    /// whose items are checked before anything is queued, and returns a
    /// load check's expectations (empty otherwise).
    fn checksum_with(
        &self,
        blocks: &BlockSet,
        role: Role,
        stream: StreamHandle,
        stored: Option<cuda::StoredMode>,
    ) -> Result<(Checksums, Vec<StoredExpectation>)> {
        // Detail mode's shadow, built before any work is queued, so that a
        // failure to build it queues nothing.
        let detail = match &self.detail {
            Some(shadow) => Some(self.built_detail(shadow)?),
            None => None,
        };
        let mut expectations = Vec::new();
        let (plan, values) = self
            .engine
            .checksum(&self.call(), blocks, role, stream, stored, &mut expectations)?;
        let detail = match detail {
            Some(detail) => Some(Arc::new(self.detail_values(detail, blocks, role, stream)?)),
            None => None,
        };
        // Values exist (or are queued) under this algorithm: it is fixed now.
        self.computed.store(true, Ordering::Relaxed);
        Ok((self.result(plan, values, role, detail), expectations))
    }

    /// The sums of the worker's columns in `role` of full blocks, each at
    /// its position with every token valid (the values a call whose
    /// requests each end with one of them gives, its columns added), block
    /// `i`'s as value `i`, where `rows.computed[i]` (not for a group the
    /// worker skips), with no result built: computed into `values` before
    /// it returns on a host worker (`None`); queued on `stream` on a device
    /// worker, whose values are read once the work is done (`Some`).
    /// `rows` and `values` are the caller's, so that calls reuse their
    /// memory. Every block is checked before anything is computed.
    pub(crate) fn full_block_sums(
        &self,
        blocks: &[FullBlock],
        role: Role,
        stream: StreamHandle,
        rows: &mut FullBlockRows,
        values: &mut Vec<u64>,
    ) -> Result<Option<Values>> {
        let queued = self
            .engine
            .full_block_values(&self.call(), blocks, role, stream, rows, values)?;
        // Values exist (or are queued) under this algorithm: it is fixed now.
        self.computed.store(true, Ordering::Relaxed);
        Ok(queued)
    }

    /// The result of a call: its shape and values, with what its record needs.
    fn result(&self, plan: Plan, values: Values, role: Role, detail: Option<Arc<DetailValues>>) -> Checksums {
        let groups = self.infos();
        let info = RecordInfo {
            rank: self.options.rank(),
            role,
            algorithm: self.algorithm,
            groups,
            detail,
        };
        Checksums::new(plan.shape, values).with_record_info(info)
    }

    /// For benchmarks only (`benches/plan_bench.rs`): the host work of
    /// [`Worker::checksum`] without the engine's (checking and laying out
    /// `blocks`, building the result around no values, dropping it), so that
    /// it can be timed on a machine without a GPU. Reads no cache memory.
    #[doc(hidden)]
    pub fn checksum_host_overhead(&self, blocks: &BlockSet, role: Role) -> Result<()> {
        let (plan, rows) = Plan::new(&self.layout, blocks, role)?;
        drop(std::hint::black_box(rows));
        drop(std::hint::black_box(self.result(
            plan,
            Values::Ready(Vec::new()),
            role,
            None,
        )));
        Ok(())
    }

    /// For benchmarks only (`benches/plan_bench.rs`): the host work a
    /// device worker's store (`load_check` false) or load check adds to a
    /// checksum call (checking `blocks` against the stored buffers, laying
    /// out the kernel's items), without an engine. Reads no memory.
    #[doc(hidden)]
    pub fn stored_host_overhead(&self, blocks: &BlockSet, load_check: bool) -> Result<usize> {
        let infos = self.infos();
        let (plan, _) = Plan::new(&self.layout, blocks, Role::Consumer)?;
        let mode = if load_check {
            cuda::StoredMode::Gather
        } else {
            cuda::StoredMode::Store
        };
        let (work, expectations) =
            stored::device_work(&self.layout, &infos, blocks, self.algorithm, &plan.shape, mode)?;
        Ok(std::hint::black_box(work.items.len() + expectations.len()))
    }

    /// Registers `group_id`'s buffer of stored checksums (SPEC section 8):
    /// [`StoredBuffer::BYTES_PER_BLOCK`] bytes per block id for `num_blocks`
    /// block ids at `address`, memory the worker may write and read while it
    /// lives, overlapping no registered cache and no other group's buffer.
    /// A host worker's buffer lies in a registered region; a device worker
    /// checks that it is device memory of its device or pinned host memory,
    /// and that a buffer starting in a `cudaMalloc` allocation ends in it
    /// (a buffer too small for `num_blocks` is refused, not written past).
    pub fn add_stored(&mut self, group_id: u32, address: u64, num_blocks: u64) -> Result<()> {
        let buffer = StoredBuffer { address, num_blocks };
        self.engine.add_stored(&mut self.layout, group_id, buffer)
    }

    /// Checksums `blocks` (every column) and writes each block's stored
    /// checksum, `sum XOR tag`, into its group's buffer (SPEC section 8).
    /// Every group of `blocks` needs a buffer and block hashes, checked
    /// before anything is computed or written. A device worker queues the
    /// writes on `stream` after the checksums and returns without waiting.
    pub fn store(&self, blocks: &BlockSet, stream: StreamHandle) -> Result<Checksums> {
        let checksum_with = |stored| self.checksum_with(blocks, Role::Consumer, stream, stored);
        self.engine.store(&self.call(), blocks, &checksum_with)
    }

    /// Checksums loaded `blocks` (every column) and keeps, in the result,
    /// the stored checksums read back: `Checksums::stored_outcomes` then says
    /// per position whether they match. A device worker gathers the stored
    /// values on `stream` with the checksums: the verdicts are ready when
    /// the result is.
    pub fn check_stored(&self, blocks: &BlockSet, stream: StreamHandle) -> Result<Checksums> {
        let checksum_with = |stored| self.checksum_with(blocks, Role::Consumer, stream, stored);
        self.engine.check_stored(&self.call(), blocks, &checksum_with)
    }

    /// The tags of SPEC section 8 for blocks of `group_id` with the given
    /// block hashes (first 8 bytes, little-endian), for connectors that keep
    /// stored checksums themselves.
    pub fn block_tags(&self, group_id: u32, hashes: &[u64]) -> Result<Vec<u64>> {
        let infos = self.infos();
        let info = infos
            .iter()
            .find(|info| info.group_id == group_id)
            .ok_or_else(|| err!(NotFound, "group_id {group_id} is not registered"))?;
        let fingerprint = info.entry_config(self.algorithm).fingerprint;
        Ok(hashes
            .iter()
            .map(|&hash| crate::base::stored_entry::block_tag(hash, fingerprint))
            .collect())
    }

    /// Turns detail mode on or off: results then also carry per-layer partial
    /// checksums, which records and payloads pass on so that a verifier names
    /// the layers that differ. It reads the KV a second time: on a device
    /// worker, one more launch queued on the same stream. The shadow layout
    /// those partials come from is built at the first call after the layout
    /// last changed (where its errors, such as a device's, are reported).
    pub fn set_detail(&mut self, on: bool) -> Result<()> {
        match (on, &self.detail) {
            // On already: keep the shadow built, if any.
            (true, Some(_)) => {}
            (true, None) => self.detail = Some(OnceLock::new()),
            (false, _) => self.detail = None,
        }
        Ok(())
    }

    /// Detail mode's shadow of the current layout, built on first use.
    fn built_detail<'a>(&self, shadow: &'a OnceLock<Detail>) -> Result<&'a Detail> {
        if let Some(detail) = shadow.get() {
            return Ok(detail);
        }
        let detail = self.build_detail(&self.layout)?;
        // A concurrent call may have built one first: both are of this
        // layout, so either will do.
        Ok(shadow.get_or_init(|| detail))
    }

    /// Detail mode's shadow of `layout`, and on a device worker an engine
    /// holding its descriptors.
    fn build_detail(&self, layout: &Layout) -> Result<Detail> {
        let shadow = Shadow::new(layout)?;
        let engine = self.engine.detail_engine(&shadow)?;
        Ok(Detail { shadow, engine })
    }

    /// Computes (host) or queues (device) the per-layer partials of `blocks`.
    fn detail_values(
        &self,
        detail: &Detail,
        blocks: &BlockSet,
        role: Role,
        stream: StreamHandle,
    ) -> Result<DetailValues> {
        let shadow = &detail.shadow;
        let shadow_blocks = shadow.blocks(&self.layout, blocks)?;
        let (plan, values) = self
            .engine
            .detail_values(detail, &shadow_blocks, role, self.algorithm, stream)?;
        Ok(DetailValues {
            shape: plan.shape,
            entries: shadow.entries.clone(),
            values,
        })
    }
}

#[cfg(test)]
mod tests;
