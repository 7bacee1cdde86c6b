//! What the GPU tests share: device copies of placements, device workers,
//! host and device workers over the same placements, and the comparison of
//! a device worker with the host and the reference.

use std::collections::BTreeMap;
use std::sync::Arc;

use cudarc::driver::{result as cu, CudaContext};
use kvcsum::{BlockSet, ReplicaKey, Role, Worker, WorkerOptions};

use crate::support::*;

pub const NEEDS_GPU: &str = "needs a CUDA device";

/// A placement's buffers copied to device memory (freed on drop).
pub struct DeviceCopy {
    pub context: Arc<CudaContext>,
    pub bases: Vec<u64>,
}

impl DeviceCopy {
    pub fn new(placement: &Placement) -> DeviceCopy {
        let context = CudaContext::new(0).expect("primary context of device 0");
        context.bind_to_thread().expect("bind");
        let bases = placement
            .buffers()
            .iter()
            .map(|buffer| {
                // Keep the host buffer's address modulo 16, so layouts that are 8-
                // but not 16-byte aligned stay that way on the device.
                let skew = buffer.address() % 16;
                // SAFETY: a fresh allocation, filled from a host buffer of the same length.
                unsafe {
                    let base = cu::malloc_sync(buffer.len() + 16).expect("cuMemAlloc") + skew;
                    cu::memcpy_htod_sync(base, buffer.bytes()).expect("copy to device");
                    base
                }
            })
            .collect();
        DeviceCopy { context, bases }
    }
}

impl Drop for DeviceCopy {
    fn drop(&mut self) {
        let _ = self.context.bind_to_thread();
        for &base in &self.bases {
            // SAFETY: allocated in `new` (minus its skew); no call reads it any more.
            let _ = unsafe { cu::free_sync(base - base % 16) };
        }
    }
}

/// A device worker of this thread's algorithm (`support::algorithm`).
pub fn device_worker(tp_rank: u32, tp_size: u32) -> Worker {
    let mut worker = Worker::new(WorkerOptions {
        tp_rank,
        tp_size,
        pp_rank: 0,
        device: Some(0),
        num_threads: 0,
    })
    .expect("device worker");
    worker
        .set_algorithm(algorithm())
        .expect("a new worker takes an algorithm");
    worker
}

/// Every column of every request and group of a result.
pub fn all_columns(result: &kvcsum::Checksums) -> BTreeMap<(String, u32), BTreeMap<ReplicaKey, Vec<u64>>> {
    let mut all = BTreeMap::new();
    for request in result.requests() {
        for group in &request.groups {
            all.insert(
                (request.req_id.clone(), group.group_id),
                columns_of(result, &request.req_id, group.group_id),
            );
        }
    }
    all
}

/// Host and device workers over the same placements (host buffers / device copies).
pub struct Pair {
    pub host: Worker,
    pub device: Worker,
    pub _copies: Vec<DeviceCopy>,
}

impl Pair {
    pub fn new(tp_rank: u32, tp_size: u32, placements: &[&Placement]) -> Pair {
        let mut host = host_worker(tp_rank, tp_size, 0, 2);
        let mut device = device_worker(tp_rank, tp_size);
        let mut copies = Vec::new();
        for placement in placements {
            register_host(&mut host, placement);
            let copy = DeviceCopy::new(placement);
            register_at(&mut device, placement, &copy.bases).expect("register on the device worker");
            copies.push(copy);
        }
        Pair {
            host,
            device,
            _copies: copies,
        }
    }

    /// Both engines' values for `blocks` in `role`, asserted equal.
    pub fn compare(
        &self,
        blocks: &BlockSet,
        role: Role,
        what: &str,
    ) -> BTreeMap<(String, u32), BTreeMap<ReplicaKey, Vec<u64>>> {
        let host = all_columns(&checksum(&self.host, blocks, role));
        let device = all_columns(&checksum(&self.device, blocks, role));
        assert_eq!(
            device,
            host,
            "{what}: device and host values differ (seed {})",
            run_seed_note()
        );
        host
    }
}

pub fn run_seed_note() -> String {
    std::env::var("KVCS_TEST_SEED").unwrap_or_else(|_| "printed at the start of the test".to_owned())
}

/// Requests over `placement`'s group: non-zero first positions, partial last
/// blocks, positions past num_tokens, the cache's last block id in use.
pub fn requests_for(
    rng: &mut Rng,
    kv: &LogicalKv,
    placements: &mut [&mut Placement],
    count: usize,
) -> Vec<TestRequest> {
    let spec = placements[0].spec().clone();
    let mut allocator = BlockAllocator::new(rng, spec.num_blocks);
    let last = allocator.reserve(spec.num_blocks - 1);
    let mut requests = Vec::new();
    for r in 0..count {
        let first_position = rng.below(2);
        let positions = positions_for(kv.num_tokens(), spec.block_size, first_position, 1);
        let mut block_ids = allocator.take(positions);
        if r == 0 {
            block_ids[0] = last;
        }
        for placement in placements.iter_mut() {
            placement.write_request(kv, first_position, &block_ids);
        }
        requests.push(TestRequest {
            req_id: format!("req-{r}"),
            num_tokens: kv.num_tokens(),
            tables: vec![GroupTable {
                group_id: spec.group_id,
                first_position,
                block_ids,
            }],
        });
    }
    requests
}

/// Lays `kv`'s shard of rank `tp_rank` of `tp_size` out as `kind` (16-token
/// blocks), writes `count` random requests into it, checksums them on a host
/// and a device worker of that rank, and asserts the two equal and each
/// request's values equal to the naive reference.
pub fn assert_device_matches_reference(
    rng: &mut Rng,
    kv: &LogicalKv,
    tp: (u32, u32),
    kind: LayoutKind,
    count: usize,
    what: &str,
) {
    assert_device_matches_reference_in_blocks_of(rng, kv, tp, kind, 16, count, what);
}

/// [`assert_device_matches_reference`] with `block_size`-token blocks.
pub fn assert_device_matches_reference_in_blocks_of(
    rng: &mut Rng,
    kv: &LogicalKv,
    (tp_rank, tp_size): (u32, u32),
    kind: LayoutKind,
    block_size: u32,
    count: usize,
    what: &str,
) {
    let seed = rng.seed();
    let shard = shard(kv, tp_rank, tp_size, 0, 1);
    let mut placement = Placement::for_shard(rng, kv, &shard, kind, 0, block_size, 24);
    let requests = &requests_for(rng, kv, &mut [&mut placement], count);
    let placement = &placement;
    let pair = Pair::new(shard.tp_rank, shard.tp_size, &[placement]);
    let values = pair.compare(&block_set(requests), Role::Consumer, what);
    for request in requests {
        let table = request.table(0);
        let naive = naive_positions(
            kv,
            &shard.layer_numbers,
            &shard.heads(),
            block_size,
            table.first_position,
            table.block_ids.len(),
        );
        assert_eq!(
            values[&(request.req_id.clone(), 0)][&shard.replica],
            naive,
            "{what} {}: not the naive reference (seed {seed})",
            request.req_id
        );
    }
}
