use super::*;

#[test]
fn weighted_run_is_the_plain_sum() {
    let mut state = 0x9E37_79B9_7F4A_7C15u64;
    for len in 0..70usize {
        let pieces: Vec<u64> = (0..len)
            .map(|_| {
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                state
            })
            .collect();
        let first = state >> 3;
        for algorithm in Algorithm::all() {
            let f = |x: u64| algorithm.piece(x);
            let plain = pieces.iter().enumerate().fold(0u64, |acc, (i, &x)| {
                acc.wrapping_add(f(x).wrapping_mul(piece_weight(first.wrapping_add(i as u64))))
            });
            assert_eq!(
                weighted_run(&pieces, first, algorithm),
                plain,
                "len {len}, {algorithm:?}"
            );
        }
    }
}

/// `mix` undoes step by step: it is a bijection (SPEC section 12).
#[test]
fn mix_is_a_bijection() {
    // The inverse of the odd multiplier modulo 2^64, by Newton's iteration.
    let mut inverse = MIX_MULTIPLIER;
    for _ in 0..6 {
        inverse = inverse.wrapping_mul(2u64.wrapping_sub(MIX_MULTIPLIER.wrapping_mul(inverse)));
    }
    assert_eq!(MIX_MULTIPLIER.wrapping_mul(inverse), 1);
    let unmix = |f: u64| {
        // x ^ (x >> 32) is its own inverse.
        let g = f ^ (f >> 32);
        let u = g.wrapping_mul(inverse);
        u ^ (u >> 32)
    };
    let mut state = 0x0123_4567_89ab_cdefu64;
    for _ in 0..10_000 {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        assert_eq!(unmix(mix(state)), state);
    }
    assert_eq!(mix(0), 0);
}

/// `mix2` undoes round by round: it is a bijection with `f(0) = 0`
/// (SPEC section 12).
#[test]
fn mix2_is_a_bijection() {
    // The inverse of an odd 32-bit multiplier modulo 2^32, by Newton's iteration.
    let inverse = |k: u32| {
        let mut inv = k;
        for _ in 0..5 {
            inv = inv.wrapping_mul(2u32.wrapping_sub(k.wrapping_mul(inv)));
        }
        assert_eq!(k.wrapping_mul(inv), 1);
        inv
    };
    let unround = |w: u64, k: u32| {
        // The round's sum (hi << 32) + lo * k, before the swap.
        let q = w.rotate_right(32);
        let lo = (q as u32).wrapping_mul(inverse(k)) as u64;
        let hi = ((q >> 32) as u32).wrapping_sub(((lo * k as u64) >> 32) as u32) as u64;
        (hi << 32) | lo
    };
    let [k1, k2, k3] = MIX2_MULTIPLIERS;
    let unmix2 = |f: u64| {
        let v = unround(f ^ (f >> 32), k3);
        let v = unround(v ^ (v >> 32), k2);
        unround(v, k1)
    };
    let mut state = 0x0123_4567_89ab_cdefu64;
    for _ in 0..10_000 {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        assert_eq!(unmix2(mix2(state)), state, "x {state:#018x}");
        assert_eq!(mix2(unmix2(state)), state, "f {state:#018x}");
    }
    assert_eq!(mix2(0), 0);
    for k in MIX2_MULTIPLIERS {
        assert_eq!(k % 2, 1, "multiplier {k:#x} is odd");
    }
}

/// A round is `(hi << 32) + lo * K` with its halves swapped, as SPEC
/// section 12 writes it, computed here from the halves.
#[test]
fn mix2_round_is_the_spec_round() {
    let mut state = 0x2545_F491_4F6C_DD1Du64;
    for _ in 0..1000 {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        let (lo, hi) = (state as u32, (state >> 32) as u32);
        for k in MIX2_MULTIPLIERS {
            let p = lo as u64 * k as u64;
            let new_lo = hi.wrapping_add((p >> 32) as u32);
            let new_hi = p as u32;
            assert_eq!(mix2_round(state, k), ((new_hi as u64) << 32) | new_lo as u64);
        }
    }
}

#[test]
fn weights_are_odd() {
    assert_eq!(slice_weight(0, 0), 1);
    assert_eq!(slice_weight(1, 0), 2 * 65536 + 1);
    assert_eq!(slice_weight(3, 7) % 2, 1);
    assert_eq!(piece_weight(5), 11);
}
