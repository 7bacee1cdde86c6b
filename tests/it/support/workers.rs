//! Workers and results: host workers with placements registered, their
//! checksums read back as columns, and whole host deployments.

use std::collections::BTreeMap;

use kvcsum::{BlockSet, Checksums, ReplicaKey, Role, StreamHandle, Worker, WorkerOptions};

use super::{add_values, algorithm, shard, GroupTable, LayoutKind, LogicalKv, Placement, Rng, Shard};

/// A host worker of this thread's [`algorithm`].
pub fn host_worker(tp_rank: u32, tp_size: u32, pp_rank: u32, num_threads: u32) -> Worker {
    let mut worker = Worker::new(WorkerOptions {
        tp_rank,
        tp_size,
        pp_rank,
        device: None,
        num_threads,
    })
    .expect("host worker");
    worker
        .set_algorithm(algorithm())
        .expect("a new worker takes an algorithm");
    worker
}

/// Registers `placement` with buffer `i` at `bases[i]`: a region per buffer,
/// its group (unless registered already) and its layers.
pub fn register_at(worker: &mut Worker, placement: &Placement, bases: &[u64]) -> kvcsum::Result<()> {
    for region in placement.regions(bases) {
        worker.add_region(region)?;
    }
    let spec = placement.spec();
    if worker.layout().group(spec.group_id).is_none() {
        worker.add_group(spec.group_id, spec.block_size)?;
    }
    for layer in placement.layer_specs(bases) {
        worker.add_layer(layer)?;
    }
    Ok(())
}

/// [`register_at`] at the placement's host buffers; panics on error.
pub fn register_host(worker: &mut Worker, placement: &Placement) {
    register_at(worker, placement, &placement.host_bases()).expect("register placement");
}

/// Runs a checksum call and waits for its values.
pub fn checksum(worker: &Worker, blocks: &BlockSet, role: Role) -> Checksums {
    let result = worker
        .checksum(blocks, role, StreamHandle::legacy_default())
        .expect("checksum");
    result.wait().expect("wait");
    result
}

/// The columns of (`req_id`, `group_id`) in `result`, by replica key.
pub fn columns_of(result: &Checksums, req_id: &str, group_id: u32) -> BTreeMap<ReplicaKey, Vec<u64>> {
    let group = result.group(req_id, group_id).expect("group in result");
    (0..group.columns.len())
        .map(|c| {
            let (key, values) = result.column(req_id, group_id, c).expect("column");
            (key, values.to_vec())
        })
        .collect()
}

/// Adds `part`'s columns into `total`, key by key.
pub fn add_columns(total: &mut BTreeMap<ReplicaKey, Vec<u64>>, part: &BTreeMap<ReplicaKey, Vec<u64>>) {
    for (key, values) in part {
        match total.get_mut(key) {
            Some(sum) => add_values(sum, values),
            None => {
                total.insert(*key, values.clone());
            }
        }
    }
}

/// Sum of every column (a producer's `c` once summed over its workers).
pub fn sum_of_columns(columns: &BTreeMap<ReplicaKey, Vec<u64>>, num_positions: usize) -> Vec<u64> {
    let mut sum = vec![0u64; num_positions];
    for values in columns.values() {
        add_values(&mut sum, values);
    }
    sum
}

/// The consumer checks of SPEC section 4 over columns summed across every
/// worker: check `k` in `0 .. maxR` sums, over the distinct replica counts
/// `R`, the column of key `(R, k % R)`. Panics when a key is missing.
pub fn replica_checks(totals: &BTreeMap<ReplicaKey, Vec<u64>>, num_positions: usize) -> Vec<Vec<u64>> {
    let mut counts: Vec<u32> = totals.keys().map(|key| key.replicas).collect();
    counts.dedup();
    let max = counts.iter().copied().max().unwrap_or(1);
    (0..max)
        .map(|k| {
            let mut check = vec![0u64; num_positions];
            for &replicas in &counts {
                let key = ReplicaKey {
                    replicas,
                    replica_index: k % replicas,
                };
                let column = totals.get(&key).unwrap_or_else(|| panic!("no column {key:?}"));
                add_values(&mut check, column);
            }
            check
        })
        .collect()
}

/// One worker of a host deployment and the placements it reads.
pub struct HostRank {
    /// Its shard of the model.
    pub shard: Shard,
    /// Its caches (kept alive while the worker is).
    pub placements: Vec<Placement>,
    /// The worker, with the placements registered.
    pub worker: Worker,
}

/// How to deploy one group of a logical KV over TP x PP host workers.
#[derive(Debug, Clone, Copy)]
pub struct Deploy {
    /// TP size.
    pub tp_size: u32,
    /// PP stages.
    pub pp_size: u32,
    /// Layout of every rank's caches.
    pub kind: LayoutKind,
    /// Group id.
    pub group_id: u32,
    /// Tokens per block.
    pub block_size: u32,
    /// Blocks per cache.
    pub num_blocks: u32,
    /// Host threads per worker.
    pub num_threads: u32,
}

/// Deploys requests whose KV all have `shape_of`'s shape: every rank gets its
/// shard's caches in `deploy.kind`, each request's cells written at its
/// group table, and a host worker with it all registered. Ranks are ordered
/// `pp_rank * tp_size + tp_rank`.
pub fn deploy_host(rng: &mut Rng, deploy: Deploy, requests: &[(&LogicalKv, &GroupTable)]) -> Vec<HostRank> {
    let model = requests.first().expect("at least one request").0;
    let mut ranks = Vec::new();
    for pp_rank in 0..deploy.pp_size {
        for tp_rank in 0..deploy.tp_size {
            let shard = shard(model, tp_rank, deploy.tp_size, pp_rank, deploy.pp_size);
            let mut worker = host_worker(tp_rank, deploy.tp_size, pp_rank, deploy.num_threads);
            let mut placements = Vec::new();
            if !shard.layer_numbers.is_empty() {
                let mut placement = Placement::for_shard(
                    rng,
                    model,
                    &shard,
                    deploy.kind,
                    deploy.group_id,
                    deploy.block_size,
                    deploy.num_blocks,
                );
                for (kv, table) in requests {
                    assert_eq!(kv.shape.num_layers, model.shape.num_layers);
                    placement.write_request(kv, table.first_position, &table.block_ids);
                }
                register_host(&mut worker, &placement);
                placements.push(placement);
            } else {
                // A stage with no layers of the group still knows the group.
                worker.add_group(deploy.group_id, deploy.block_size).expect("add_group");
            }
            ranks.push(HostRank {
                shard,
                placements,
                worker,
            });
        }
    }
    ranks
}
