//! The fault catalogue (docs/SPEC.md section 13): each class of fault, like
//! hardware and like software, injected into fresh random KV, and whether the
//! block checksum changed, under both algorithms. It prints a table of
//! detected and missed per class and algorithm, and asserts:
//!
//! - MIXED misses no fault of any class;
//! - WEIGHTED misses exactly what SPEC section 13 proves it misses: every
//!   even number of bit-63 flips, every swap of tokens that differ only in
//!   bit 63 of each piece, and a bit 63 stuck over a slice exactly when it
//!   changed an even number of pieces; and never a single changed piece.
//!
//! Two paths:
//!
//! - **engine**: real host workers (one per algorithm, `kvcsum::Worker`)
//!   over a cross-layer cache of many blocks; each batch fills the cache with
//!   fresh random KV, checksums every block, injects one fault into every
//!   block, checksums again and compares position by position.
//!   `KVCS_CATALOGUE_ENGINE_TRIALS` faults per class (default 1024).
//! - **direct**: the same faults on one block, checksummed by the crate's
//!   own arithmetic over the block's slices (`kvcsum::weighted_run`,
//!   `kvcsum::slice_weight`), which the engine tests prove equal to the
//!   engine; fast enough for the recorded run of 10^6 trials per class.
//!   `KVCS_CATALOGUE_TRIALS` faults per class (default 4096).
//!
//! The KV is bf16-like: each 16-bit element has a random sign, an exponent
//! of 2^-5 .. 2^2 and a random mantissa, so the high byte of an element is
//! as structured as real activations'. The seed is printed;
//! `KVCS_TEST_SEED=N` repeats a run.

mod support;

use kvcsum::{BlockSet, Role, StreamHandle, Worker};
use support::faults::*;
use support::Rng;

/// The engine path's cache and its workers, one per algorithm.
struct Engine {
    cache: Vec<u64>,
    blocks: BlockSet,
    workers: Vec<Worker>,
    num_blocks: usize,
}

impl Engine {
    fn new(num_blocks: usize) -> Engine {
        let cache = vec![0u64; num_blocks * BLOCK_BYTES / 8];
        let address = cache.as_ptr() as u64;
        let workers = ALGORITHMS
            .iter()
            .map(|&algorithm| catalogue_worker(None, algorithm, address, num_blocks))
            .collect();
        let blocks = catalogue_blocks(num_blocks);
        Engine {
            cache,
            blocks,
            workers,
            num_blocks,
        }
    }

    fn bytes_mut(&mut self) -> &mut [u8] {
        // SAFETY: the u64 cache viewed as its bytes (alignment 1, same length).
        unsafe { std::slice::from_raw_parts_mut(self.cache.as_mut_ptr().cast::<u8>(), self.cache.len() * 8) }
    }

    fn values(&self, worker: usize) -> Vec<u64> {
        let result = self.workers[worker]
            .checksum(&self.blocks, Role::Producer, StreamHandle::legacy_default())
            .unwrap();
        result.column("catalogue", 0, 0).unwrap().1.to_vec()
    }

    /// At least `trials` faults of `class`, one per block, per algorithm.
    fn run(&mut self, rng: &mut Rng, class: &Class, trials: u64) -> [Tally; 2] {
        let mut tallies = [Tally::default(); 2];
        let num_blocks = self.num_blocks;
        while tallies[0].trials < trials {
            fill_kv(rng, self.bytes_mut());
            for block in self.bytes_mut().chunks_exact_mut(BLOCK_BYTES) {
                (class.prepare)(rng, block);
            }
            let clean_bytes = self.bytes_mut().to_vec();
            let clean: Vec<Vec<u64>> = (0..ALGORITHMS.len()).map(|w| self.values(w)).collect();
            let mut changed = Vec::with_capacity(num_blocks);
            for (b, block) in self.bytes_mut().chunks_exact_mut(BLOCK_BYTES).enumerate() {
                let other = (b + 1 + rng.below(num_blocks as u64 - 1) as usize) % num_blocks;
                let other = &clean_bytes[other * BLOCK_BYTES..(other + 1) * BLOCK_BYTES];
                changed.push((class.inject)(rng, block, other));
            }
            for (i, &algorithm) in ALGORITHMS.iter().enumerate() {
                let faulty = self.values(i);
                for b in 0..num_blocks {
                    let expected = expected_miss(class, algorithm, changed[b]);
                    tallies[i].add(faulty[b] == clean[i][b], expected);
                }
            }
        }
        tallies
    }
}

#[test]
fn fault_catalogue() {
    let mut rng = Rng::for_test("fault_catalogue");
    let seed = rng.seed();
    let engine_trials = env_count("KVCS_CATALOGUE_ENGINE_TRIALS", 1024);
    let direct_trials = env_count("KVCS_CATALOGUE_TRIALS", 4096);
    println!(
        "fault catalogue: seed {seed} (KVCS_TEST_SEED={seed} repeats it); {LAYERS} layers x {HEADS} heads x {TOKENS} \
         tokens x {CELL_BYTES}-byte cells of bf16-like KV per block; engine {engine_trials} and direct {direct_trials} \
         faults per class (KVCS_CATALOGUE_ENGINE_TRIALS, KVCS_CATALOGUE_TRIALS)"
    );
    println!();
    println!(
        "| kind | fault class | path | trials | WEIGHTED detected | WEIGHTED missed | MIXED detected | MIXED missed |"
    );
    println!("|---|---|---|---:|---:|---:|---:|---:|");
    let mut engine = Engine::new(256);
    let mut failures = Vec::new();
    for class in catalogue() {
        let runs = [
            ("engine", engine.run(&mut rng, &class, engine_trials)),
            ("direct", run_direct(&mut rng, &class, direct_trials)),
        ];
        for (path, [weighted, mixed]) in runs {
            println!(
                "| {} | {} | {path} | {} | {} | {} | {} | {} |",
                if class.hardware { "hardware" } else { "software" },
                class.name,
                weighted.trials,
                weighted.trials - weighted.missed,
                weighted.missed,
                mixed.trials - mixed.missed,
                mixed.missed
            );
            if mixed.missed > 0 {
                failures.push(format!(
                    "MIXED missed {} of {} \"{}\" ({path})",
                    mixed.missed, mixed.trials, class.name
                ));
            }
            if weighted.unexpected > 0 {
                failures.push(format!(
                    "WEIGHTED broke SPEC section 13's statement on {} of {} \"{}\" ({path})",
                    weighted.unexpected, weighted.trials, class.name
                ));
            }
        }
    }
    assert!(failures.is_empty(), "seed {seed}: {failures:#?}");
}
