//! Random numbers: the seeded PRNG every test makes from the run's seed.

use std::ops::Range;

/// A small splitmix64 generator; every test makes its own from the run's seed.
#[derive(Debug, Clone)]
pub struct Rng {
    seed: u64,
    state: u64,
}

fn splitmix(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// The run's seed: `KVCS_TEST_SEED` when set, else taken from the clock.
pub fn run_seed() -> u64 {
    match std::env::var("KVCS_TEST_SEED") {
        Ok(text) => text
            .trim()
            .parse()
            .unwrap_or_else(|_| panic!("KVCS_TEST_SEED {text:?} is not a u64")),
        Err(_) => {
            let nanos = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_nanos() as u64);
            let mut state = nanos ^ (std::process::id() as u64) << 32;
            splitmix(&mut state)
        }
    }
}

impl Rng {
    /// The generator of test `test_name`: the run's seed mixed with the name,
    /// so tests draw different data but one seed reproduces all of them. The
    /// seed is printed (shown by cargo for a failing test).
    pub fn for_test(test_name: &str) -> Rng {
        let seed = run_seed();
        eprintln!("[{test_name}] seed {seed}: rerun with KVCS_TEST_SEED={seed} cargo test {test_name}");
        Rng::from_seed_and_name(seed, test_name)
    }

    /// The generator of `test_name` for a given seed.
    pub fn from_seed_and_name(seed: u64, test_name: &str) -> Rng {
        // FNV-1a of the name, so that the stream depends on it.
        let mut name_hash = 0xCBF2_9CE4_8422_2325u64;
        for byte in test_name.bytes() {
            name_hash = (name_hash ^ byte as u64).wrapping_mul(0x0000_0100_0000_01B3);
        }
        let mut state = seed ^ name_hash;
        splitmix(&mut state);
        Rng { seed, state }
    }

    /// The run's seed (put it in assertion messages).
    pub fn seed(&self) -> u64 {
        self.seed
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        splitmix(&mut self.state)
    }

    /// A value in `0 .. n` (`n > 0`).
    pub fn below(&mut self, n: u64) -> u64 {
        assert!(n > 0, "below(0)");
        ((self.next_u64() as u128 * n as u128) >> 64) as u64
    }

    /// A value in `range` (non-empty).
    pub fn range(&mut self, range: Range<u64>) -> u64 {
        assert!(range.start < range.end, "empty range {range:?}");
        range.start + self.below(range.end - range.start)
    }

    /// True with probability `numerator / denominator`.
    pub fn chance(&mut self, numerator: u64, denominator: u64) -> bool {
        self.below(denominator) < numerator
    }

    /// One element of a non-empty slice.
    pub fn pick<'a, T>(&mut self, items: &'a [T]) -> &'a T {
        &items[self.below(items.len() as u64) as usize]
    }

    /// Random bytes, any value.
    pub fn fill(&mut self, bytes: &mut [u8]) {
        for chunk in bytes.chunks_mut(8) {
            let word = self.next_u64().to_le_bytes();
            chunk.copy_from_slice(&word[..chunk.len()]);
        }
    }

    /// Random bytes, none zero (cells are never zero, so that a piece read
    /// from the wrong place or not at all cannot go unnoticed).
    pub fn fill_nonzero(&mut self, bytes: &mut [u8]) {
        self.fill(bytes);
        for byte in bytes.iter_mut() {
            if *byte == 0 {
                *byte = 0x5A;
            }
        }
    }

    /// Shuffles `items` in place (Fisher-Yates).
    pub fn shuffle<T>(&mut self, items: &mut [T]) {
        for i in (1..items.len()).rev() {
            let j = self.below(i as u64 + 1) as usize;
            items.swap(i, j);
        }
    }

    /// A random permutation of `0 .. n`.
    pub fn permutation(&mut self, n: u32) -> Vec<u32> {
        let mut ids: Vec<u32> = (0..n).collect();
        self.shuffle(&mut ids);
        ids
    }
}
