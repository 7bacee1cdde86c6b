//! MIXED2's eight-piece step written once, over a lane type: eight `u64`
//! lanes in the SIMD registers of one instruction set ([`Lanes`]), each
//! instruction set in its own file (`avx2.rs`, `avx512.rs`).
//!
//! Soundness is carried by types, not by who calls what: a lane value can
//! only be made from its instruction set's detection token ([`Lanes::Isa`]),
//! and a token only by a detection that succeeded, so every operation on a
//! lane value runs on a CPU that has its instructions.

use crate::base::checksum::{mix2, PieceFn, MIX2_MULTIPLIER_1, MIX2_MULTIPLIER_2, MIX2_MULTIPLIER_3};

/// Eight `u64` lanes (one cache line of pieces) held in SIMD registers, with
/// the lane-wise operations a MIXED2 round and fold are made of.
///
/// A value exists only where the CPU has the instructions: `load` and
/// `splat`, the only ways to make one, take an [`Lanes::Isa`] token, and
/// the implementing type's field is private to its file.
pub(super) trait Lanes: Copy {
    /// The detection token of the instruction set: a value exists only
    /// once detection found it (its `new() -> Option<Self>`).
    type Isa: Copy;

    /// The eight pieces, lane `l` holding `pieces[l]`.
    fn load(isa: Self::Isa, pieces: [u64; 8]) -> Self;

    /// `x` in every lane.
    fn splat(isa: Self::Isa, x: u64) -> Self;

    /// The lanes back as pieces.
    fn store(self) -> [u64; 8];

    /// Lane-wise `self + other` (wrapping).
    fn add(self, other: Self) -> Self;

    /// Lane-wise `low32(self) * low32(other)`, the full 64-bit product.
    fn mul_low(self, other: Self) -> Self;

    /// Lane-wise `self.rotate_left(32)`: the two halves swapped.
    fn swap_halves(self) -> Self;

    /// Lane-wise `self ^ (self >> 32)`.
    fn fold(self) -> Self;
}

/// `K - 1` for each of MIXED2's multipliers `K`, as lanes take them: a
/// round `(hi << 32) + lo * K` is `v + lo * (K - 1)`.
const MIX2_ROUND_ADDENDS: [u64; 3] = [
    MIX2_MULTIPLIER_1 as u64 - 1,
    MIX2_MULTIPLIER_2 as u64 - 1,
    MIX2_MULTIPLIER_3 as u64 - 1,
];

/// [`mix2`] as a [`PieceFn`] whose eight-piece step runs in lanes `L`:
/// per lane, each round is one 32x32->64 multiply, one add and one swap of
/// halves (`(hi << 32) + lo * K = v + lo * (K - 1)`, then the rotate), each
/// fold a shift and a XOR. The pieces and the lane sums stay in registers
/// throughout (the compiler left to itself moved them through general
/// registers, at a third of the speed).
pub(super) struct Mix2Lanes<L: Lanes>(pub L::Isa);

impl<L: Lanes> Clone for Mix2Lanes<L> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<L: Lanes> Copy for Mix2Lanes<L> {}

impl<L: Lanes> Mix2Lanes<L> {
    /// One round of [`mix2`] in every lane, `k` holding `K - 1`.
    #[inline(always)]
    fn round(v: L, k: L) -> L {
        v.add(v.mul_low(k)).swap_halves()
    }

    /// [`mix2`] of every lane.
    #[inline(always)]
    fn mix(self, v: L) -> L {
        let [k1, k2, k3] = MIX2_ROUND_ADDENDS.map(|k| L::splat(self.0, k));
        let v = Self::round(v, k1);
        let v = Self::round(v, k2);
        let v = v.fold();
        let v = Self::round(v, k3);
        v.fold()
    }
}

impl<L: Lanes> PieceFn for Mix2Lanes<L> {
    #[inline(always)]
    fn value(self, x: u64) -> u64 {
        mix2(x)
    }

    #[inline(always)]
    fn lanes(self, pieces: &[u64; 8]) -> [u64; 8] {
        self.mix(L::load(self.0, *pieces)).store()
    }

    #[inline(always)]
    fn accumulate(self, pieces: &[u64], sum: &mut [u64; 8], running: &mut [u64; 8]) {
        debug_assert!(pieces.len().is_multiple_of(8));
        let mut sums = L::load(self.0, *sum);
        let mut runs = L::load(self.0, *running);
        for chunk in pieces.chunks_exact(8) {
            let values = self.mix(L::load(self.0, chunk.try_into().expect("chunks of 8 pieces")));
            sums = sums.add(values);
            runs = runs.add(sums);
        }
        *sum = sums.store();
        *running = runs.store();
    }
}
