//! Stored checksums on the device (SPEC section 8): round trips in device
//! and pinned memory, faults, the caller's stream, bad buffers.

use std::sync::Arc;

use cudarc::driver::{result as cu, sys, CudaContext};
use kvcsum::record::Record;
use kvcsum::{BlockSet, Error, Role, StreamHandle, Worker};

use super::common::*;
use super::streams::*;
use crate::support::*;

const STORED_REQ: &str = "offload-1";
const HASH_BYTES: usize = 32;

/// Where a device worker's buffer of stored checksums lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum StoredMemory {
    Device,
    Pinned,
}

/// A buffer of stored checksums in device or pinned host memory, two words
/// (value, stamp) per block id, filled with `junk` (freed on drop).
struct StoredBuffer {
    context: Arc<CudaContext>,
    memory: StoredMemory,
    address: u64,
    /// Words in the buffer (two per block id).
    num_words: usize,
}

impl StoredBuffer {
    fn new(memory: StoredMemory, junk: &[u64]) -> StoredBuffer {
        let context = CudaContext::new(0).expect("primary context of device 0");
        context.bind_to_thread().expect("bind");
        let bytes = junk.len() * 8;
        // SAFETY: fresh allocations of `bytes`, filled from `junk`.
        let address = unsafe {
            match memory {
                StoredMemory::Device => {
                    let address = cu::malloc_sync(bytes).expect("cuMemAlloc");
                    cu::memcpy_htod_sync(address, junk).expect("fill");
                    address
                }
                StoredMemory::Pinned => {
                    let host = cu::malloc_host(bytes, 0).expect("cuMemHostAlloc").cast::<u64>();
                    std::ptr::copy_nonoverlapping(junk.as_ptr(), host, junk.len());
                    host as u64
                }
            }
        };
        StoredBuffer {
            context,
            memory,
            address,
            num_words: junk.len(),
        }
    }

    /// The buffer's words, after the device work that wrote them completed.
    fn read(&self) -> Vec<u64> {
        let mut values = vec![0u64; self.num_words];
        self.context.bind_to_thread().expect("bind");
        // SAFETY: the buffer holds `num_words` words; nothing writes it now.
        unsafe {
            match self.memory {
                StoredMemory::Device => cu::memcpy_dtoh_sync(&mut values, self.address).expect("read back"),
                StoredMemory::Pinned => {
                    std::ptr::copy_nonoverlapping(self.address as *const u64, values.as_mut_ptr(), self.num_words)
                }
            }
        }
        values
    }

    /// Copies the stored value and stamp of block `from` to block `to` on
    /// the device (as an offload connector moves them with the block).
    fn copy_on_device(&self, from: u32, to: u32) {
        self.context.bind_to_thread().expect("bind");
        // SAFETY: both lie inside the buffer (unified addressing covers pinned memory).
        unsafe {
            sys::cuMemcpy(self.address + 16 * to as u64, self.address + 16 * from as u64, 16)
                .result()
                .expect("cuMemcpy");
        }
    }
}

impl StoredBuffer {
    /// XORs `mask` into word `word` of the buffer (a stored value or stamp
    /// damaged in the tier).
    fn xor_word(&self, word: usize, mask: u64) {
        let mut words = self.read();
        words[word] ^= mask;
        self.context.bind_to_thread().expect("bind");
        // SAFETY: the buffer holds `num_words` words; nothing else uses it now.
        unsafe {
            match self.memory {
                StoredMemory::Device => cu::memcpy_htod_sync(self.address, &words).expect("write back"),
                StoredMemory::Pinned => {
                    std::ptr::copy_nonoverlapping(words.as_ptr(), self.address as *mut u64, self.num_words)
                }
            }
        }
    }
}

impl Drop for StoredBuffer {
    fn drop(&mut self) {
        let _ = self.context.bind_to_thread();
        // SAFETY: allocated in `new`; the workers' work is done.
        unsafe {
            let _ = cu::ctx::synchronize();
            match self.memory {
                StoredMemory::Device => {
                    let _ = cu::free_sync(self.address);
                }
                StoredMemory::Pinned => {
                    let _ = cu::free_host(self.address as *mut std::ffi::c_void);
                }
            }
        }
    }
}

/// One TP rank: a host worker (the reference) and a device worker over the
/// same cache, each with its buffer of stored checksums.
struct StoredRank {
    host: Worker,
    device: Worker,
    placement: Placement,
    copy: DeviceCopy,
    host_stored: Vec<u64>,
    stored: StoredBuffer,
}

impl StoredRank {
    /// Copies the host cache to the device copy (after it was rewritten).
    fn upload(&self) {
        self.copy.context.bind_to_thread().expect("bind");
        for (buffer, &base) in self.placement.buffers().iter().zip(&self.copy.bases) {
            // SAFETY: the copy holds the buffer's length at `base`.
            unsafe { cu::memcpy_htod_sync(base, buffer.bytes()).expect("upload") };
        }
    }
}

fn stored_ranks(rng: &mut Rng, kv: &LogicalKv, tp_size: u32, num_blocks: u32, memory: StoredMemory) -> Vec<StoredRank> {
    (0..tp_size)
        .map(|tp_rank| {
            let placement = Placement::for_shard(
                rng,
                kv,
                &shard(kv, tp_rank, tp_size, 0, 1),
                LayoutKind::Hnd,
                0,
                16,
                num_blocks,
            );
            let mut host = host_worker(tp_rank, tp_size, 0, 2);
            register_host(&mut host, &placement);
            let copy = DeviceCopy::new(&placement);
            let mut device = device_worker(tp_rank, tp_size);
            register_at(&mut device, &placement, &copy.bases).expect("register on the device worker");
            // Junk, so that a value never written cannot pass by chance.
            let junk: Vec<u64> = (0..2 * num_blocks).map(|_| rng.next_u64()).collect();
            let host_stored = junk.clone();
            host.add_region(kvcsum::Region {
                address: host_stored.as_ptr() as u64,
                length: 8 * host_stored.len() as u64,
            })
            .expect("host stored region");
            host.add_stored(0, host_stored.as_ptr() as u64, num_blocks as u64)
                .expect("host add_stored");
            let stored = StoredBuffer::new(memory, &junk);
            device
                .add_stored(0, stored.address, num_blocks as u64)
                .unwrap_or_else(|e| panic!("device add_stored ({memory:?}): {e}"));
            StoredRank {
                host,
                device,
                placement,
                copy,
                host_stored,
                stored,
            }
        })
        .collect()
}

fn stored_blocks(num_tokens: u64, block_ids: &[u32], hashes: &[u8]) -> BlockSet {
    let mut blocks = BlockSet::new();
    blocks.add_request(STORED_REQ, num_tokens).unwrap();
    blocks.add_group(STORED_REQ, 0, 0, block_ids).unwrap();
    blocks.set_hashes(STORED_REQ, 0, hashes, HASH_BYTES).unwrap();
    blocks
}

/// The group fingerprint (SPEC section 7) of the placements' layers,
/// computed naively from `Placement::layer_specs`' identities.
fn naive_fingerprint(placement: &Placement) -> u64 {
    use sha2::{Digest, Sha256};
    placement.host_layer_specs().iter().fold(0u64, |sum, spec| {
        let digest = Sha256::digest(&spec.identity);
        sum.wrapping_add(u64::from_le_bytes(digest[..8].try_into().unwrap()))
    })
}

/// Per rank, a device load check's verdicts (waited for).
fn device_load_check(ranks: &[StoredRank], blocks: &BlockSet) -> Vec<Vec<kvcsum::StoredOutcome>> {
    ranks
        .iter()
        .map(|rank| {
            let result = rank
                .device
                .check_stored(blocks, StreamHandle::legacy_default())
                .expect("check_stored");
            result.wait().expect("wait");
            result.stored_outcomes(STORED_REQ, 0).expect("outcomes")
        })
        .collect()
}

fn failed_at(outcomes: &[Vec<kvcsum::StoredOutcome>]) -> Vec<usize> {
    (0..outcomes[0].len())
        .filter(|&q| outcomes.iter().any(|rank| rank[q] == kvcsum::StoredOutcome::Failed))
        .collect()
}

struct StoredScenario {
    kv: LogicalKv,
    ranks: Vec<StoredRank>,
    block_ids: Vec<u32>,
    hashes: Vec<u8>,
    count: usize,
}

/// Stores a random request's blocks on host and device workers (TP 2),
/// checks the device's values against the host's and the naive reference,
/// then "offloads and loads them back" into fresh block ids: the KV written
/// there and each block's stored value copied on the device.
fn device_stored_and_reloaded(rng: &mut Rng, num_tokens: u64, memory: StoredMemory) -> StoredScenario {
    let kv = LogicalKv::random(rng, KvShape::gqa(3, 4, 64, num_tokens));
    let count = positions_for(num_tokens, 16, 0, 0);
    let num_blocks = 2 * count as u32 + 2;
    let mut ranks = stored_ranks(rng, &kv, 2, num_blocks, memory);
    let mut allocator = BlockAllocator::new(rng, num_blocks);
    let first_ids = allocator.take(count);
    let hashes: Vec<u8> = (0..count * HASH_BYTES).map(|_| rng.next_u64() as u8).collect();
    for rank in &mut ranks {
        rank.placement.write_request(&kv, 0, &first_ids);
        rank.upload();
    }
    let blocks = stored_blocks(num_tokens, &first_ids, &hashes);
    let fingerprint = naive_fingerprint(&ranks[0].placement);
    let expected = naive_full(&kv, 16, 0, count);
    let mut total = vec![0u64; count];
    for rank in &ranks {
        rank.host
            .store(&blocks, StreamHandle::legacy_default())
            .expect("host store");
        let result = rank
            .device
            .store(&blocks, StreamHandle::legacy_default())
            .expect("device store");
        result.wait().expect("wait");
        let device = rank.stored.read();
        assert_eq!(
            device,
            rank.host_stored,
            "{memory:?}: the device stored other values than the host (seed {})",
            rng.seed()
        );
        for (i, &block_id) in first_ids.iter().enumerate() {
            let tag = u64::from_le_bytes(hashes[i * HASH_BYTES..i * HASH_BYTES + 8].try_into().unwrap()) ^ fingerprint;
            total[i] = total[i].wrapping_add(device[2 * block_id as usize] ^ tag);
        }
    }
    assert_eq!(
        total,
        expected,
        "{memory:?}: untagged stored values do not add up to the naive checksums (seed {})",
        rng.seed()
    );
    let block_ids = allocator.take(count);
    for rank in &mut ranks {
        rank.placement.write_request(&kv, 0, &block_ids);
        rank.upload();
        for (&from, &to) in first_ids.iter().zip(&block_ids) {
            rank.stored.copy_on_device(from, to);
        }
    }
    StoredScenario {
        kv,
        ranks,
        block_ids,
        hashes,
        count,
    }
}

#[test]
#[ignore = "needs a CUDA device"]
fn device_stored_round_trip_matches_in_device_and_pinned_memory() {
    // Every case under each algorithm: device, host and reference agree on both.
    for_each_algorithm(|algorithm| {
        println!("algorithm {algorithm:?}");
        use kvcsum::verify::{Verdict, Verifier};
        let mut rng = Rng::for_test("device_stored_round_trip_matches_in_device_and_pinned_memory");
        println!("seed {} ({NEEDS_GPU})", rng.seed());
        for memory in [StoredMemory::Device, StoredMemory::Pinned] {
            for num_tokens in [16, 75, 300] {
                let s = device_stored_and_reloaded(&mut rng, num_tokens, memory);
                let blocks = stored_blocks(num_tokens, &s.block_ids, &s.hashes);
                let outcomes = device_load_check(&s.ranks, &blocks);
                for rank in &outcomes {
                    assert!(
                        rank.iter().all(|&o| o == kvcsum::StoredOutcome::Matched),
                        "{memory:?} {num_tokens} tokens: {rank:?} (seed {})",
                        rng.seed()
                    );
                }
                // NotReady before the values are, not a read of device memory.
                let busy = s.ranks[0]
                    .device
                    .check_stored(&blocks, StreamHandle::legacy_default())
                    .expect("check_stored");
                match busy.stored_outcomes(STORED_REQ, 0) {
                    Ok(o) => assert!(busy.is_ready().unwrap(), "outcomes {o:?} before ready"),
                    Err(e) => assert!(matches!(e, Error::NotReady(_)), "{e}"),
                }
                busy.wait().unwrap();
                // The device load checks' records pass the verifier.
                let verifier = Verifier::new(2).unwrap();
                verifier.expect(&blocks, Role::Consumer).unwrap();
                for rank in &s.ranks {
                    let result = rank
                        .device
                        .check_stored(&blocks, StreamHandle::legacy_default())
                        .expect("check_stored");
                    result.wait().unwrap();
                    let record = Record::from_checksums(&result).expect("record").encode();
                    verifier.add_record(&record).expect("add_record");
                }
                let report = verifier.check_stored(STORED_REQ).unwrap();
                assert_eq!(report.verdict, Verdict::Match, "{memory:?}: {}", report.message);
                assert_eq!(report.compared_positions, s.count as u64);
                // The load check's values are the plain checksums.
                let mut total = vec![0u64; s.count];
                for rank in &s.ranks {
                    let result = checksum(&rank.device, &blocks, Role::Consumer);
                    add_values(&mut total, &result.position_sums(STORED_REQ, 0).unwrap());
                }
                assert_eq!(total, naive_full(&s.kv, 16, 0, s.count), "seed {}", rng.seed());
            }
        }
    });
}

#[test]
#[ignore = "needs a CUDA device"]
fn device_stored_faults_fail_at_their_position_only() {
    // Every case under each algorithm: device, host and reference agree on both.
    for_each_algorithm(|algorithm| {
        println!("algorithm {algorithm:?}");
        let mut rng = Rng::for_test("device_stored_faults_fail_at_their_position_only");
        let seed = rng.seed();
        println!("seed {seed} ({NEEDS_GPU})");
        let num_tokens = 120;
        for memory in [StoredMemory::Device, StoredMemory::Pinned] {
            // A corrupted byte in one loaded block.
            let mut s = device_stored_and_reloaded(&mut rng, num_tokens, memory);
            let q = rng.below(s.count as u64) as usize;
            let (layer, head) = (rng.below(3) as u32, s.ranks[1].placement.spec().first_head);
            s.ranks[1].placement.xor_byte(layer, head, s.block_ids[q], 0, 5, 0x20);
            s.ranks[1].upload();
            let blocks = stored_blocks(num_tokens, &s.block_ids, &s.hashes);
            assert_eq!(
                failed_at(&device_load_check(&s.ranks, &blocks)),
                vec![q],
                "{memory:?}: corrupted byte (seed {seed})"
            );

            // Two blocks' KV loaded into each other's slots.
            let mut s = device_stored_and_reloaded(&mut rng, num_tokens, memory);
            let (a, b) = (1, 4);
            let mut swapped = s.block_ids.clone();
            swapped.swap(a, b);
            for rank in &mut s.ranks {
                rank.placement.write_request(&s.kv, 0, &swapped);
                rank.upload();
            }
            let blocks = stored_blocks(num_tokens, &s.block_ids, &s.hashes);
            assert_eq!(
                failed_at(&device_load_check(&s.ranks, &blocks)),
                vec![a, b],
                "{memory:?}: swapped blocks (seed {seed})"
            );

            // Another shard's KV: rank 1's cache bytes in rank 0's cache.
            let mut s = device_stored_and_reloaded(&mut rng, num_tokens, memory);
            let other: Vec<Vec<u8>> = s.ranks[1]
                .placement
                .buffers()
                .iter()
                .map(|b| b.bytes().to_vec())
                .collect();
            for (buffer, bytes) in s.ranks[0].placement.buffers_mut().iter_mut().zip(&other) {
                buffer.bytes_mut().copy_from_slice(bytes);
            }
            s.ranks[0].upload();
            let blocks = stored_blocks(num_tokens, &s.block_ids, &s.hashes);
            let outcomes = device_load_check(&s.ranks, &blocks);
            assert!(
                outcomes[0].iter().all(|&o| o == kvcsum::StoredOutcome::Failed),
                "{memory:?}: another shard fails everywhere on rank 0: {:?} (seed {seed})",
                outcomes[0]
            );
            assert!(
                outcomes[1].iter().all(|&o| o == kvcsum::StoredOutcome::Matched),
                "seed {seed}"
            );

            // A damaged stamp (one bit of its check or digest): fails, never
            // another configuration.
            let s = device_stored_and_reloaded(&mut rng, num_tokens, memory);
            let q = rng.below(s.count as u64) as usize;
            s.ranks[0]
                .stored
                .xor_word(2 * s.block_ids[q] as usize + 1, 1 << rng.below(64));
            let blocks = stored_blocks(num_tokens, &s.block_ids, &s.hashes);
            let outcomes = device_load_check(&s.ranks, &blocks);
            assert_eq!(failed_at(&outcomes), vec![q], "{memory:?}: damaged stamp (seed {seed})");
            assert!(
                outcomes
                    .iter()
                    .flatten()
                    .all(|&o| matches!(o, kvcsum::StoredOutcome::Matched | kvcsum::StoredOutcome::Failed)),
                "{memory:?}: {outcomes:?} (seed {seed})"
            );

            // The partial last block (120 tokens: 8 of 16) checked holding
            // 16: other tokens, not a failure.
            let s = device_stored_and_reloaded(&mut rng, num_tokens, memory);
            let longer_blocks = stored_blocks(num_tokens + 8, &s.block_ids, &s.hashes);
            for rank in device_load_check(&s.ranks, &longer_blocks) {
                let last = rank.len() - 1;
                assert!(
                    rank[..last].iter().all(|&o| o == kvcsum::StoredOutcome::Matched)
                        && rank[last] == kvcsum::StoredOutcome::OtherTokens,
                    "{memory:?}: {rank:?} (seed {seed})"
                );
            }

            // A wrong block hash for one position.
            let s = device_stored_and_reloaded(&mut rng, num_tokens, memory);
            let q = rng.below(s.count as u64) as usize;
            let mut hashes = s.hashes.clone();
            hashes[q * HASH_BYTES + rng.below(8) as usize] ^= 0x01;
            let blocks = stored_blocks(num_tokens, &s.block_ids, &hashes);
            assert_eq!(
                failed_at(&device_load_check(&s.ranks, &blocks)),
                vec![q],
                "{memory:?}: wrong hash (seed {seed})"
            );
        }
    });
}

/// A store queued behind busy work on the caller's stream writes after the
/// KV it checksums was written there, without the library waiting: the
/// buffer read after a stream sync holds the values of the new KV.
#[test]
#[ignore = "needs a CUDA device"]
fn device_stored_write_runs_after_work_queued_on_the_stream() {
    // Every case under each algorithm: device, host and reference agree on both.
    for_each_algorithm(|algorithm| {
        println!("algorithm {algorithm:?}");
        let mut rng = Rng::for_test("device_stored_write_runs_after_work_queued_on_the_stream");
        println!("seed {} ({NEEDS_GPU})", rng.seed());
        let num_tokens = 200;
        let kv = LogicalKv::random(&mut rng, KvShape::gqa(4, 2, 128, num_tokens));
        let count = positions_for(num_tokens, 16, 0, 0);
        let mut ranks = stored_ranks(&mut rng, &kv, 1, count as u32 + 3, StoredMemory::Device);
        let rank = &mut ranks[0];
        let block_ids = BlockAllocator::new(&mut rng, count as u32 + 3).take(count);
        rank.placement.write_request(&kv, 0, &block_ids);
        let hashes: Vec<u8> = (0..count * HASH_BYTES).map(|_| rng.next_u64() as u8).collect();
        let blocks = stored_blocks(num_tokens, &block_ids, &hashes);
        rank.host
            .store(&blocks, StreamHandle::legacy_default())
            .expect("host store");

        // The true KV is written on the stream behind a long kernel.
        let contents: Vec<&[u8]> = rank.placement.buffers().iter().map(|b| b.bytes()).collect();
        let writer = LateWriter::new(&rank.copy.context, &rank.copy.bases, &contents);
        let before = rank.stored.read();
        let seed = rng.seed();
        behind_late_writes(
            writer,
            &mut rng,
            Streams::Explicit,
            |_, stream| {
                let result = rank.device.store(&blocks, stream).expect("store");
                assert!(
                    !result.is_ready().expect("query"),
                    "the store returned after the stream's work: the library waited"
                );
                assert_eq!(
                    rank.stored.read(),
                    before,
                    "the store wrote before the stream got to it"
                );
                result
            },
            |_, result| {
                assert!(result.is_ready().unwrap());
                assert_eq!(
                    rank.stored.read(),
                    rank.host_stored,
                    "the stored values are not those of the KV written on the stream (seed {seed})"
                );
            },
        );
    });
}

#[test]
#[ignore = "needs a CUDA device"]
fn device_stored_rejects_bad_buffers() {
    let mut rng = Rng::for_test("device_stored_rejects_bad_buffers");
    println!("seed {} ({NEEDS_GPU})", rng.seed());
    let kv = LogicalKv::random(&mut rng, KvShape::gqa(2, 2, 64, 64));
    let mut ranks = stored_ranks(&mut rng, &kv, 1, 8, StoredMemory::Device);
    let rank = &mut ranks[0];
    // Host pageable memory is not memory the device can write.
    let pageable = [0u64; 8];
    let error = rank
        .device
        .add_stored(0, pageable.as_ptr() as u64, 8)
        .expect_err("pageable memory");
    assert!(
        matches!(error, Error::InvalidArgument(_)) && error.to_string().contains("address"),
        "{error:?}"
    );
    assert!(error.to_string().contains("stored checksums of group_id 0"), "{error}");
    // Misaligned.
    let error = rank
        .device
        .add_stored(0, rank.stored.address + 4, 4)
        .expect_err("misaligned");
    assert!(
        matches!(error, Error::Unsupported(_)) && error.to_string().contains("multiple of 8"),
        "{error:?}"
    );
    // Too small: 8 blocks allocated, 1 << 40 claimed.
    let error = rank
        .device
        .add_stored(0, rank.stored.address, 1 << 40)
        .expect_err("too small");
    assert!(matches!(error, Error::OutOfBounds(_)), "{error:?}");
    // Nothing of those replaced the registered buffer: a block id past its 8
    // values fails before anything is queued, and a store into it works.
    rank.placement.write_request(&kv, 0, &[0, 1, 2, 3]);
    rank.upload();
    let hashes: Vec<u8> = (0..4 * HASH_BYTES).map(|_| rng.next_u64() as u8).collect();
    let error = rank
        .device
        .store(
            &stored_blocks(64, &[0, 1, 2, 8], &hashes),
            StreamHandle::legacy_default(),
        )
        .err()
        .expect("block id past the buffer");
    assert!(matches!(error, Error::OutOfBounds(_)), "{error:?}");
    let blocks = stored_blocks(64, &[0, 1, 2, 3], &hashes);
    rank.device
        .store(&blocks, StreamHandle::legacy_default())
        .expect("store")
        .wait()
        .unwrap();
    rank.host.store(&blocks, StreamHandle::legacy_default()).unwrap();
    assert_eq!(rank.stored.read(), rank.host_stored, "seed {}", rng.seed());
}

/// A device worker's buffer of stored checksums needs 16 bytes per block
/// id: a `cudaMalloc` allocation of 8 bytes per block id is refused with
/// `OutOfBounds` even where the next allocation follows it in the address
/// space (which a check of mapped memory alone accepted, and stores then
/// wrote entries into that other allocation); one that fits exactly is
/// accepted.
#[test]
#[ignore = "needs a CUDA device"]
fn device_stored_refuses_a_buffer_too_small_for_num_blocks() {
    let mut rng = Rng::for_test("device_stored_refuses_a_buffer_too_small_for_num_blocks");
    println!("seed {} ({NEEDS_GPU})", rng.seed());
    let kv = LogicalKv::random(&mut rng, KvShape::gqa(2, 2, 64, 64));
    let mut ranks = stored_ranks(&mut rng, &kv, 1, 8, StoredMemory::Device);
    let rank = &mut ranks[0];
    // Small allocations made one after another, so that some lie side by
    // side (the driver packs small allocations).
    let sizes: Vec<u64> = (0..32).map(|_| 2 * (32 + rng.next_u64() % 480)).collect();
    // SAFETY: fresh device allocations, freed below; nothing writes them.
    let buffers: Vec<u64> = sizes
        .iter()
        .map(|&num_blocks| unsafe { cu::malloc_sync(num_blocks as usize * 8).expect("cuMemAlloc") })
        .collect();
    for (&address, &num_blocks) in buffers.iter().zip(&sizes) {
        // 8 bytes per block id: half of what num_blocks needs.
        let error = rank
            .device
            .add_stored(0, address, num_blocks)
            .expect_err("a buffer of 8 bytes per block id");
        assert!(
            matches!(error, Error::OutOfBounds(_)),
            "{error:?} (seed {})",
            rng.seed()
        );
        assert!(
            error.to_string().contains(&format!("num_blocks {num_blocks}")),
            "{error}"
        );
        // The same bytes hold num_blocks / 2 entries exactly.
        rank.device
            .add_stored(0, address, num_blocks / 2)
            .unwrap_or_else(|e| panic!("a buffer that fits: {e} (seed {})", rng.seed()));
    }
    // The group's buffer back to the one its stores are checked against.
    rank.device
        .add_stored(0, rank.stored.address, 8)
        .expect("the rank's buffer");
    for address in buffers {
        // SAFETY: allocated above; the worker no longer holds it.
        unsafe { cu::free_sync(address).expect("cuMemFree") };
    }
}
