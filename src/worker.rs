//! A worker: one TP rank / PP stage's registered layout and the engine that
//! computes its partial checksums.

use std::sync::{Arc, OnceLock};

use crate::blocks::BlockSet;
use crate::cuda;
use crate::detail::Shadow;
use crate::error::{err, Result};
use crate::fingerprint::group_fingerprint;
use crate::host;
use crate::layout::{Alias, LayerSpec, Layout, Region, Role, StoredBuffer};
use crate::plan::Plan;
use crate::result::{Checksums, DetailValues, GroupInfo, Rank, RecordInfo, Values};
use crate::state::StateSpec;
use crate::stored;
use crate::stream::StreamHandle;

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
            shard_keyed: group.is_shard_keyed(),
        })
        .collect();
    infos.sort_by_key(|info| info.group_id);
    infos
}

/// Detail mode's shadow layout and, on a device worker, the engine that
/// holds its descriptors.
struct Detail {
    shadow: Shadow,
    engine: Option<cuda::DeviceEngine>,
}

enum Engine {
    Host(host::HostEngine),
    Device(cuda::DeviceEngine),
}

/// One worker's layout and engine.
pub struct Worker {
    options: WorkerOptions,
    layout: Layout,
    engine: Engine,
    /// Detail mode: results also carry per-layer partials (see `set_detail`).
    detail: Option<Detail>,
    /// The record's group facts (fingerprints hashed once), reset when the layout changes.
    group_infos: OnceLock<Arc<[GroupInfo]>>,
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
        let engine = match options.device {
            None => Engine::Host(host::HostEngine::new(options.num_threads)?),
            Some(ordinal) => Engine::Device(cuda::DeviceEngine::new(ordinal)?),
        };
        Ok(Worker {
            options,
            layout: Layout::default(),
            engine,
            detail: None,
            group_infos: OnceLock::new(),
        })
    }

    /// As created.
    pub fn options(&self) -> &WorkerOptions {
        &self.options
    }

    /// What the worker's engine runs on, for logs: host threads, or the
    /// device and its kernel's registers and occupancy.
    pub fn engine_description(&self) -> String {
        match &self.engine {
            Engine::Host(host) => format!(
                "host engine, {} threads ({} helper threads started)",
                host.threads(),
                host.helpers()
            ),
            Engine::Device(device) => device.description().to_owned(),
        }
    }

    /// What has been registered.
    pub fn layout(&self) -> &Layout {
        &self.layout
    }

    /// Registers memory the worker may read (host or device addresses, as the
    /// worker's kind). The caller keeps it readable while the worker lives.
    /// A device worker checks that the range lies in one CUDA allocation of
    /// its device (or in pinned host memory); a host worker cannot check host
    /// memory and trusts the caller.
    pub fn add_region(&mut self, region: Region) -> Result<()> {
        if let Engine::Device(device) = &self.engine {
            if region.length > 0 {
                device.check_region(region.address, region.length)?;
            }
        }
        self.layout.add_region(region)
    }

    /// Registers a group of layers sharing one block table.
    pub fn add_group(&mut self, group_id: u32, block_size: u32) -> Result<()> {
        self.layout.add_group(group_id, block_size)?;
        self.group_infos = OnceLock::new();
        Ok(())
    }

    /// Declares a group this worker cannot checksum.
    pub fn skip_group(&mut self, group_id: u32, reason: &str) -> Result<()> {
        self.layout.skip_group(group_id, reason)
    }

    /// Registers an attention layer's cache; on error nothing changes. A
    /// host worker adds it in place (the layout checks before it changes); a
    /// device worker keeps its layout until the device has the new one.
    pub fn add_layer(&mut self, spec: LayerSpec) -> Result<()> {
        if self.detail.is_some() {
            // Detail mode's shadow is built for the new layout before
            // anything changes, so that a failure leaves both as they were.
            let mut layout = self.layout.clone();
            layout.add_layer(spec)?;
            let detail = self.build_detail(&layout)?;
            if let Engine::Device(device) = &mut self.engine {
                device.upload_layout(&layout)?;
            }
            self.layout = layout;
            self.detail = Some(detail);
        } else {
            match &mut self.engine {
                Engine::Host { .. } => self.layout.add_layer(spec)?,
                Engine::Device(device) => {
                    let mut layout = self.layout.clone();
                    layout.add_layer(spec)?;
                    device.upload_layout(&layout)?;
                    self.layout = layout;
                }
            }
        }
        self.group_infos = OnceLock::new();
        Ok(())
    }

    /// Registers a layer that reads another layer's cache (see
    /// [`Layout::add_alias`]); on error nothing changes.
    pub fn add_alias(&mut self, group_id: u32, alias: Alias) -> Result<()> {
        self.layout.add_alias(group_id, alias)?;
        self.group_infos = OnceLock::new();
        Ok(())
    }

    /// Registers a state layer (SPEC section 6) of a state group; on error
    /// nothing changes. A host worker adds it in place (the layout checks
    /// before it changes); a device worker keeps its layout until the device
    /// has the new tables. Detail mode's shadow has no state layers, so it
    /// stays as it is.
    pub fn add_state(&mut self, spec: StateSpec) -> Result<()> {
        match &mut self.engine {
            Engine::Host(_) => self.layout.add_state(spec, self.options.tp_rank)?,
            Engine::Device(device) => {
                // The tensors lie in registered regions (checked here), which
                // add_region checked are memory this device reads.
                let mut layout = self.layout.clone();
                layout.add_state(spec, self.options.tp_rank)?;
                device.upload_layout(&layout)?;
                self.layout = layout;
            }
        }
        self.group_infos = OnceLock::new();
        Ok(())
    }

    /// Computes (host) or queues (device, on `stream`) the partial checksums
    /// of every block in `blocks`. Fails before any work when a block id or
    /// group is bad.
    pub fn checksum(&self, blocks: &BlockSet, role: Role, stream: StreamHandle) -> Result<Checksums> {
        let plan = Plan::new(&self.layout, blocks, role)?;
        let values = match &self.engine {
            Engine::Host(host) => Values::Ready(host.compute(&self.layout, &plan, role)),
            Engine::Device(device) => device.compute(&plan, role, stream)?,
        };
        let detail = match &self.detail {
            Some(detail) => Some(Arc::new(self.detail_values(detail, blocks, role, stream)?)),
            None => None,
        };
        let groups = self
            .group_infos
            .get_or_init(|| group_infos(&self.layout).into())
            .clone();
        let info = RecordInfo {
            rank: self.options.rank(),
            role,
            groups,
            detail,
        };
        Ok(Checksums::new(plan.shape, values).with_record_info(info))
    }

    /// Registers `group_id`'s buffer of stored checksums (SPEC section 8): 8
    /// bytes per block id for `num_blocks` block ids at `address`, memory the
    /// worker may write and read while it lives. Host workers only for now
    /// (`Unsupported` on a device worker).
    pub fn add_stored(&mut self, group_id: u32, address: u64, num_blocks: u64) -> Result<()> {
        if matches!(self.engine, Engine::Device(_)) {
            return Err(err!(
                Unsupported,
                "stored checksums (group_id {group_id}) are not supported on a device worker yet"
            ));
        }
        self.layout.set_stored(group_id, StoredBuffer { address, num_blocks })
    }

    /// Checksums `blocks` (every column) and writes each block's stored
    /// checksum, `sum XOR tag`, into its group's buffer (SPEC section 8).
    /// Every group of `blocks` needs a buffer and block hashes, checked
    /// before anything is computed or written.
    pub fn store(&self, blocks: &BlockSet, stream: StreamHandle) -> Result<Checksums> {
        stored::check_blocks(&self.layout, blocks)?;
        let result = self.checksum(blocks, Role::Consumer, stream)?;
        stored::store(&self.layout, blocks, &result)?;
        Ok(result)
    }

    /// Checksums loaded `blocks` (every column) and keeps, in the result,
    /// the stored checksums read back: `Checksums::stored_outcomes` then says
    /// per position whether they match.
    pub fn check_stored(&self, blocks: &BlockSet, stream: StreamHandle) -> Result<Checksums> {
        let expectations = stored::expectations(&self.layout, blocks)?;
        Ok(self.checksum(blocks, Role::Consumer, stream)?.with_stored(expectations))
    }

    /// The tags of SPEC section 8 for blocks of `group_id` with the given
    /// block hashes (first 8 bytes, little-endian), for connectors that keep
    /// stored checksums themselves.
    pub fn block_tags(&self, group_id: u32, hashes: &[u64]) -> Result<Vec<u64>> {
        let group = self
            .layout
            .group(group_id)
            .ok_or_else(|| err!(NotFound, "group_id {group_id} is not registered"))?;
        let fingerprint = group_fingerprint(group);
        Ok(hashes
            .iter()
            .map(|&hash| stored::block_tag(hash, fingerprint))
            .collect())
    }

    /// Turns detail mode on or off: results then also carry per-layer partial
    /// checksums, which records and payloads pass on so that a verifier names
    /// the layers that differ. It reads the KV a second time: on a device
    /// worker, one more launch queued on the same stream.
    pub fn set_detail(&mut self, on: bool) -> Result<()> {
        self.detail = if on {
            Some(self.build_detail(&self.layout)?)
        } else {
            None
        };
        Ok(())
    }

    /// Detail mode's shadow of `layout`, and on a device worker an engine
    /// holding its descriptors.
    fn build_detail(&self, layout: &Layout) -> Result<Detail> {
        let shadow = Shadow::new(layout)?;
        let engine = match &self.engine {
            Engine::Host { .. } => None,
            Engine::Device(device) => {
                let mut engine = cuda::DeviceEngine::new(device.ordinal())?;
                if shadow.layout.groups().next().is_some() {
                    engine.upload_layout(&shadow.layout)?;
                }
                Some(engine)
            }
        };
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
        let plan = Plan::new(&shadow.layout, &shadow_blocks, role)?;
        let values = match (&self.engine, &detail.engine) {
            (Engine::Host(host), _) => Values::Ready(host.compute(&shadow.layout, &plan, role)),
            (Engine::Device(_), Some(engine)) => engine.compute(&plan, role, stream)?,
            (Engine::Device(_), None) => {
                return Err(err!(Internal, "detail mode on a device worker has no shadow engine"))
            }
        };
        Ok(DetailValues {
            shape: plan.shape,
            entries: shadow.entries.clone(),
            values,
        })
    }
}
