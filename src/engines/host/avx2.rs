//! The host engine's AVX2 form: the detection token [`Avx2`], the lane
//! type [`Avx2Lanes`] (eight `u64`s in two 256-bit registers) and the
//! AVX2 build of [`item_checksum`].

use std::arch::x86_64::{
    __m256i, _mm256_add_epi64, _mm256_mul_epu32, _mm256_set1_epi64x, _mm256_shuffle_epi32, _mm256_srli_epi64,
    _mm256_xor_si256,
};

use super::lanes::Lanes;
use super::walk::{item_checksum, RowSums};
use crate::base::checksum::PieceFn;
use crate::inputs::layout::Layer;
use crate::plan::Row;

/// Proof that the CPU has AVX2: [`Avx2::new`], the only way to make one,
/// gives one only when the CPU reports AVX2.
#[derive(Clone, Copy, Debug)]
pub(super) struct Avx2 {
    _detected: (),
}

impl Avx2 {
    /// The token, where this CPU has AVX2.
    pub(super) fn new() -> Option<Avx2> {
        std::arch::is_x86_feature_detected!("avx2").then_some(Avx2 { _detected: () })
    }

    /// [`item_checksum`] of `row` in `layer` under `f`, built for AVX2
    /// (everything below it is inlined, so its loops are built with AVX2
    /// too).
    pub(super) fn item_checksum<F: PieceFn>(self, f: F, row: &Row, layer: &Layer, scratch: &mut Vec<RowSums>) -> u64 {
        // SAFETY: `self` exists, so the CPU has AVX2 (see the type).
        unsafe { item_checksum_avx2(f, row, layer, scratch) }
    }
}

#[target_feature(enable = "avx2")]
fn item_checksum_avx2<F: PieceFn>(f: F, row: &Row, layer: &Layer, scratch: &mut Vec<RowSums>) -> u64 {
    item_checksum(f, row, layer, scratch)
}

/// Eight `u64` lanes in two 256-bit registers (lanes 0-3, 4-7). A value
/// exists only where the CPU has AVX2: it is made only from an [`Avx2`].
#[derive(Clone, Copy)]
pub(super) struct Avx2Lanes([__m256i; 2]);

impl Lanes for Avx2Lanes {
    type Isa = Avx2;

    #[inline(always)]
    fn load(_: Avx2, pieces: [u64; 8]) -> Avx2Lanes {
        // SAFETY: `[u64; 8]` and `[__m256i; 2]` are 64 bytes, and every bit
        // pattern is valid for both; a value, so that it stays in registers.
        Avx2Lanes(unsafe { std::mem::transmute::<[u64; 8], [__m256i; 2]>(pieces) })
    }

    #[inline(always)]
    fn splat(_: Avx2, x: u64) -> Avx2Lanes {
        // SAFETY: the `Avx2` argument exists, so the CPU has AVX2.
        let v = unsafe { _mm256_set1_epi64x(x as i64) };
        Avx2Lanes([v, v])
    }

    #[inline(always)]
    fn store(self) -> [u64; 8] {
        // SAFETY: as in `load`, the other way.
        unsafe { std::mem::transmute::<[__m256i; 2], [u64; 8]>(self.0) }
    }

    #[inline(always)]
    fn add(self, other: Avx2Lanes) -> Avx2Lanes {
        // SAFETY: `self` exists, so the CPU has AVX2 (see the type).
        Avx2Lanes(unsafe {
            [
                _mm256_add_epi64(self.0[0], other.0[0]),
                _mm256_add_epi64(self.0[1], other.0[1]),
            ]
        })
    }

    #[inline(always)]
    fn mul_low(self, other: Avx2Lanes) -> Avx2Lanes {
        // SAFETY: `self` exists, so the CPU has AVX2 (see the type).
        Avx2Lanes(unsafe {
            [
                _mm256_mul_epu32(self.0[0], other.0[0]),
                _mm256_mul_epu32(self.0[1], other.0[1]),
            ]
        })
    }

    #[inline(always)]
    fn swap_halves(self) -> Avx2Lanes {
        // An in-lane shuffle of the 32-bit words: (1, 0, 3, 2).
        let [a, b] = self.0;
        // SAFETY: `self` exists, so the CPU has AVX2 (see the type).
        Avx2Lanes(unsafe { [_mm256_shuffle_epi32::<0xB1>(a), _mm256_shuffle_epi32::<0xB1>(b)] })
    }

    #[inline(always)]
    fn fold(self) -> Avx2Lanes {
        let [a, b] = self.0;
        // SAFETY: `self` exists, so the CPU has AVX2 (see the type).
        Avx2Lanes(unsafe {
            [
                _mm256_xor_si256(a, _mm256_srli_epi64::<32>(a)),
                _mm256_xor_si256(b, _mm256_srli_epi64::<32>(b)),
            ]
        })
    }
}
