//! The verdict rule (a configuration difference never gives MISMATCH,
//! corrupted KV that is read never MATCH), driven from fuzz bytes: the input seeds the generator of
//! tests/it/verdict_property.rs (tests/it/verdict_property/generator.rs, shared
//! with `#[path]`, not copied), which builds a random producer/consumer (or
//! store/load) pair with intact KV, changes one piece of configuration on
//! one side, and judges it through the C ABI. Any violation panics: the
//! unchanged pair must MATCH intact and MISMATCH with a corrupted byte, a
//! changed pair must never MISMATCH intact nor MATCH with a corrupted byte
//! the consumer reads.

#![no_main]

use libfuzzer_sys::fuzz_target;

#[path = "../../tests/it/support/mod.rs"]
mod support;

#[path = "../../tests/it/verdict_property/generator.rs"]
mod generator;

fuzz_target!(|data: &[u8]| {
    // FNV-1a of the input: every byte moves the seed.
    let seed = data.iter().fold(0xCBF2_9CE4_8422_2325u64, |hash, &byte| {
        (hash ^ byte as u64).wrapping_mul(0x0000_0100_0000_01B3)
    });
    let result = generator::run_case(seed, 0);
    let violations = result.violations();
    if let Some((_, details)) = violations.first() {
        panic!("{} violation(s) of the verdict rule:\n{details}", violations.len());
    }
});
