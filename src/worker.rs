//! A worker: one TP rank / PP stage's registered layout and the engine that
//! computes its partial checksums.

use std::sync::{Arc, OnceLock};

use crate::blocks::BlockSet;
use crate::cuda;
use crate::detail;
use crate::error::{err, Result};
use crate::host;
use crate::layout::{LayerSpec, Layout, Region, Role};
use crate::plan::Plan;
use crate::record::{self, GroupInfo, Rank, RecordInfo};
use crate::result::{Checksums, Values};

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
    /// Host engine threads, at most [`host::MAX_HOST_THREADS`]; 0 =
    /// `KVCS_HOST_THREADS` when set, else [`host::default_threads`].
    pub num_threads: u32,
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
    detail: bool,
    /// The record's group facts (fingerprints hashed once), reset when the layout changes.
    group_infos: OnceLock<Arc<[GroupInfo]>>,
}

/// A CUDA stream handle (`CUstream`) as the caller gives it, passed to the
/// driver unchanged: null is CUDA's legacy default stream, `0x2`
/// (`CU_STREAM_PER_THREAD`) the calling thread's default stream. A device
/// worker's work is ordered after everything already queued on that stream.
/// Meaningless for host workers.
#[derive(Debug, Clone, Copy)]
pub struct StreamHandle(pub *mut std::ffi::c_void);

impl StreamHandle {
    /// CUDA's legacy default stream (a null `CUstream`); host workers take it too.
    pub fn legacy_default() -> Self {
        StreamHandle(std::ptr::null_mut())
    }

    /// The calling thread's per-thread default stream (`CU_STREAM_PER_THREAD`).
    pub fn per_thread_default() -> Self {
        StreamHandle(0x2 as *mut std::ffi::c_void)
    }
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
            detail: false,
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

    /// Registers an attention layer's cache; on error nothing changes.
    pub fn add_layer(&mut self, spec: LayerSpec) -> Result<()> {
        let mut layout = self.layout.clone();
        layout.add_layer(spec)?;
        if let Engine::Device(device) = &mut self.engine {
            device.upload_layout(&layout)?;
        }
        self.layout = layout;
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
        let detail = match (&self.engine, self.detail) {
            (Engine::Host(host), true) => Some(detail::compute(&self.layout, blocks, role, host)?),
            _ => None,
        };
        let groups = self
            .group_infos
            .get_or_init(|| record::group_infos(&self.layout).into())
            .clone();
        let info = RecordInfo {
            rank: Rank::of(&self.options),
            role,
            groups,
            detail,
        };
        Ok(Checksums::new(plan.shape, values).with_record_info(info))
    }

    /// Turns detail mode on or off: results then also carry per-layer partial
    /// checksums, which records and payloads pass on so that a verifier names
    /// the layers that differ. It reads the KV a second time. Host workers
    /// only for now (`Unsupported` on a device worker).
    pub fn set_detail(&mut self, on: bool) -> Result<()> {
        if on && matches!(self.engine, Engine::Device(_)) {
            return Err(err!(Unsupported, "detail mode is not supported on a device worker yet"));
        }
        self.detail = on;
        Ok(())
    }
}
