//! The host engine's AVX-512F form: the detection token [`Avx512`], the
//! lane type [`Avx512Lanes`] (eight `u64`s in one 512-bit register) and
//! the AVX-512F build of [`item_checksum`].

use std::arch::x86_64::{
    __m512i, _mm512_add_epi64, _mm512_mul_epu32, _mm512_rol_epi64, _mm512_set1_epi64, _mm512_srli_epi64,
    _mm512_xor_si512,
};

use super::avx2::Avx2;
use super::lanes::Lanes;
use super::walk::{item_checksum, RowSums};
use crate::base::checksum::PieceFn;
use crate::inputs::layout::Layer;
use crate::plan::Row;

/// Proof that the CPU has AVX-512F and AVX2: [`Avx512::new`], the only way
/// to make one, gives one only when the CPU reports both.
#[derive(Clone, Copy, Debug)]
pub(super) struct Avx512 {
    avx2: Avx2,
}

impl Avx512 {
    /// The token, where this CPU has AVX-512F and AVX2.
    pub(super) fn new() -> Option<Avx512> {
        let avx2 = Avx2::new()?;
        std::arch::is_x86_feature_detected!("avx512f").then_some(Avx512 { avx2 })
    }

    /// The CPU's AVX2 token (it has AVX2 too).
    pub(super) fn avx2(self) -> Avx2 {
        self.avx2
    }

    /// [`item_checksum`] of `row` in `layer` under `f`, built for AVX-512F.
    pub(super) fn item_checksum<F: PieceFn>(self, f: F, row: &Row, layer: &Layer, scratch: &mut Vec<RowSums>) -> u64 {
        // SAFETY: `self` exists, so the CPU has AVX-512F (see the type).
        unsafe { item_checksum_avx512(f, row, layer, scratch) }
    }
}

#[target_feature(enable = "avx512f")]
fn item_checksum_avx512<F: PieceFn>(f: F, row: &Row, layer: &Layer, scratch: &mut Vec<RowSums>) -> u64 {
    item_checksum(f, row, layer, scratch)
}

/// Eight `u64` lanes in one 512-bit register. A value exists only where
/// the CPU has AVX-512F: it is made only from an [`Avx512`].
#[derive(Clone, Copy)]
pub(super) struct Avx512Lanes(__m512i);

impl Lanes for Avx512Lanes {
    type Isa = Avx512;

    #[inline(always)]
    fn load(_: Avx512, pieces: [u64; 8]) -> Avx512Lanes {
        // SAFETY: `[u64; 8]` and `__m512i` are 64 bytes, and every bit
        // pattern is valid for both; a value, so that it stays in a register.
        Avx512Lanes(unsafe { std::mem::transmute::<[u64; 8], __m512i>(pieces) })
    }

    #[inline(always)]
    fn splat(_: Avx512, x: u64) -> Avx512Lanes {
        // SAFETY: the `Avx512` argument exists, so the CPU has AVX-512F.
        Avx512Lanes(unsafe { _mm512_set1_epi64(x as i64) })
    }

    #[inline(always)]
    fn store(self) -> [u64; 8] {
        // SAFETY: as in `load`, the other way.
        unsafe { std::mem::transmute::<__m512i, [u64; 8]>(self.0) }
    }

    #[inline(always)]
    fn add(self, other: Avx512Lanes) -> Avx512Lanes {
        // SAFETY: `self` exists, so the CPU has AVX-512F (see the type).
        Avx512Lanes(unsafe { _mm512_add_epi64(self.0, other.0) })
    }

    #[inline(always)]
    fn mul_low(self, other: Avx512Lanes) -> Avx512Lanes {
        // SAFETY: `self` exists, so the CPU has AVX-512F (see the type).
        Avx512Lanes(unsafe { _mm512_mul_epu32(self.0, other.0) })
    }

    #[inline(always)]
    fn swap_halves(self) -> Avx512Lanes {
        // SAFETY: `self` exists, so the CPU has AVX-512F (see the type).
        Avx512Lanes(unsafe { _mm512_rol_epi64::<32>(self.0) })
    }

    #[inline(always)]
    fn fold(self) -> Avx512Lanes {
        // SAFETY: `self` exists, so the CPU has AVX-512F (see the type).
        Avx512Lanes(unsafe { _mm512_xor_si512(self.0, _mm512_srli_epi64::<32>(self.0)) })
    }
}
