//! Token placement on the device (SPEC section 16): DCP shards (sizes 1, 2
//! and 4, interleaves 1 and 2, read by `kvcs_checksum_placed`) and
//! compressed slots (4 tokens per slot, numbered by the plan), each rank's
//! device values equal to the host engine's and to the naive reference
//! that walks vLLM's forward map.

use cudarc::driver::{result as cu, CudaContext};
use kvcsum::{BlockSet, GroupPlacement, Role, StreamHandle, Worker};

use super::common::*;
use crate::support::token_placement::*;
use crate::support::*;

fn column(worker: &Worker, blocks: &BlockSet, role: Role) -> Vec<u64> {
    let result = worker.checksum(blocks, role, StreamHandle::legacy_default()).unwrap();
    result.wait().unwrap();
    result.column(REQ, GROUP, 0).unwrap().1.to_vec()
}

#[test]
#[ignore = "needs a CUDA device"]
fn device_placed_slots_equal_the_host_and_the_reference() {
    let mut rng = Rng::for_test("device_placed_slots_equal_the_host_and_the_reference");
    let seed = rng.seed();
    let mut cases = Vec::new();
    for dcp_size in [1u32, 2, 4] {
        for interleave in [1u32, 2] {
            for tokens_per_slot in [1u32, 4] {
                cases.push(GroupPlacement {
                    dcp_size,
                    dcp_rank: 0,
                    interleave,
                    tokens_per_slot,
                });
            }
        }
    }
    let context = CudaContext::new(0).expect("primary context of device 0");
    context.bind_to_thread().expect("bind");
    for algorithm in [Algorithm::Weighted, Algorithm::Mixed2] {
        with_algorithm(algorithm, || {
            for &p in &cases {
                let size = 8 * p.dcp_size * p.tokens_per_slot;
                for _ in 0..3 {
                    let positions = 1 + rng.below(4) as usize;
                    let num_tokens = rng.range(1..positions as u64 * size as u64 + 1);
                    let units = Units::random(&mut rng, num_tokens.div_ceil(p.tokens_per_slot as u64) + 1);
                    let mut ids: Vec<u32> = (0..NUM_BLOCKS).collect();
                    rng.shuffle(&mut ids);
                    let ids = &ids[..positions];
                    let mut blocks = BlockSet::new();
                    blocks.add_request(REQ, num_tokens).unwrap();
                    blocks.add_group(REQ, GROUP, 0, ids).unwrap();
                    for (rank, cache) in rank_caches(&mut rng, &units, p, size, ids).iter().enumerate() {
                        let rank = rank as u32;
                        let host = rank_worker(cache, p, size, rank);
                        let bytes: Vec<u8> = cache.words.iter().flat_map(|w| w.to_le_bytes()).collect();
                        // SAFETY: a fresh allocation of the cache's length, filled from it.
                        let base = unsafe {
                            let base = cu::malloc_sync(bytes.len()).expect("cuMemAlloc");
                            cu::memcpy_htod_sync(base, &bytes).expect("copy to device");
                            base
                        };
                        let mut device = device_worker(rank, p.dcp_size);
                        register_rank(&mut device, base, cache, p, size, rank);
                        let naive: Vec<u64> = (0..positions as u64)
                            .map(|q| naive_partial(&units, p, size, num_tokens, q, Some(rank)))
                            .collect();
                        for role in [Role::Producer, Role::Consumer] {
                            let context = format!(
                                "{p:?} rank {rank}, {algorithm:?}, {role:?}, num_tokens {num_tokens}, seed {seed}"
                            );
                            assert_eq!(column(&host, &blocks, role), naive, "host: {context}");
                            assert_eq!(column(&device, &blocks, role), naive, "device: {context}");
                        }
                        drop(device);
                        // SAFETY: allocated above; the worker that read it is gone.
                        unsafe { cu::free_sync(base).expect("cuMemFree") };
                    }
                }
            }
        });
    }
}
