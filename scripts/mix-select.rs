// Chooses f of the MIXED algorithms (docs/SPEC.md section 12): candidate
// mixers measured three ways.
//
//   rustc -O scripts/mix-select.rs -o /tmp/mix-select
//   /tmp/mix-select differentials [random patterns, default 1000]
//   /tmp/mix-select faults [trials per class, default 100000]
//   /tmp/mix-select search
//
// differentials: for every 1- and 2-bit pattern e of a piece, every set of
// the sign bits of its 8-, 16- and 32-bit elements, every set of whole bytes
// and random patterns, the distinct values of f(x ^ e) - f(x) mod 2^32 over
// 65,536 random x (uniform gives about 65,535.5; MIXED2 must give >= 65,500,
// tests/it/avalanche.rs): the least per family and how many patterns fall below
// 65,500. MIXED's e = 0x8000000080000000 gives 1.
//
// faults: structured faults on a bf16-like block of 2 heads x 16 tokens x 64
// pieces, by the exact change of the block checksum (linear in f(x_j)):
// delta = sum over changed pieces of m (2j + 1) (f(x') - f(x)); the count of
// faults with delta = 0 per candidate. Includes the fixed-pattern faults
// (fp32 sign flips at head sizes 4 and 8, every other bf16 element negated,
// a bit-31 line over a slice) that MIXED misses.
//
// search: every sequence of three rounds, each a 32x32->64 multiply-add
// round with (A) an add or (X) a XOR of the high half, and (m) or not a fold
// after, with or without a final fold, whose AVX2 cost (instructions per
// four pieces: A 3, X 4, fold +2) is at most 14, each under three sets of
// multipliers: PASS when every structured pattern and 200 random ones give
// >= 65,500. The cheapest that passes under all three sets, A,Am,Am (13),
// is MIXED2. Host speed: BENCHMARKS.md, "Mixing function choice (MIXED2)".

const C1: u64 = 0x9E37_79B9_7F4A_7C15;
const HI: u64 = 0xFFFF_FFFF_0000_0000;
const K: [u32; 4] = [0x9E37_79B1, 0x85EB_CA77, 0xC2B2_AE3D, 0x27D4_EB2F];

fn id(x: u64) -> u64 { x }
/// MIXED (algorithm 2).
fn mixed(x: u64) -> u64 { let g = (x ^ (x >> 32)).wrapping_mul(C1); g ^ (g >> 32) }
/// murmur3's finaliser.
fn fmix64(mut x: u64) -> u64 { x ^= x >> 33; x = x.wrapping_mul(0xff51afd7ed558ccd); x ^= x >> 33; x = x.wrapping_mul(0xc4ceb9fe1a85ec53); x ^ (x >> 33) }
/// splitmix64's finaliser.
fn splitmix(mut z: u64) -> u64 { z = (z ^ (z >> 30)).wrapping_mul(0xBF58476D1CE4E5B9); z = (z ^ (z >> 27)).wrapping_mul(0x94D049BB133111EB); z ^ (z >> 31) }
/// A product before MIXED.
fn mul_then_mixed(x: u64) -> u64 { mixed(x.wrapping_mul(0xD6E8_FEB8_6659_FD93)) }
fn fold(v: u64) -> u64 { v ^ (v >> 32) }
/// The XOR round: (lo, hi) -> (hi ^ high32(lo K), low32(lo K)).
fn round_x(v: u64, k: u32) -> u64 { let p = (v as u32 as u64) * k as u64; (p ^ (v & HI)).rotate_left(32) }
/// The add round (MIXED2's): (lo, hi) -> (hi + high32(lo K), low32(lo K)).
fn round_a(v: u64, k: u32) -> u64 { let p = (v as u32 as u64) * k as u64; (p.wrapping_add(v & HI)).rotate_left(32) }
/// Three XOR rounds.
fn xor3(x: u64) -> u64 { round_x(round_x(round_x(x, K[0]), K[1]), K[2]) }
/// Four XOR rounds.
fn xor4(x: u64) -> u64 { round_x(xor3(x), K[3]) }
/// MIXED2 (algorithm 3).
fn mixed2(x: u64) -> u64 { fold(round_a(fold(round_a(round_a(x, K[0]), K[1])), K[2])) }

const CANDIDATES: [(&str, fn(u64) -> u64); 9] = [
    ("weighted", id), ("mixed", mixed), ("mixed2", mixed2), ("fmix64", fmix64), ("splitmix", splitmix),
    ("mul+mixed", mul_then_mixed), ("xor3", xor3), ("xor4", xor4), ("xor3+fold", |x| fold(xor3(x))),
];

struct R(u64);
impl R {
    fn n(&mut self) -> u64 { self.0 = self.0.wrapping_add(0x9E3779B97F4A7C15); splitmix(self.0) }
    fn b(&mut self, n: u64) -> u64 { self.n() % n }
}

fn distinct(v: &mut Vec<u32>) -> usize { v.sort_unstable(); v.dedup(); v.len() }

fn families(r: &mut R, random: usize) -> Vec<(&'static str, Vec<u64>)> {
    let mut bits1 = Vec::new(); let mut bits2 = Vec::new(); let mut signs = Vec::new(); let mut bytes = Vec::new(); let mut rand = Vec::new();
    for i in 0..64 { bits1.push(1u64 << i); for j in i + 1..64 { bits2.push((1u64 << i) | (1u64 << j)); } }
    for w in [8u32, 16, 32] { let n = 64 / w; for s in 1u64..(1 << n) { signs.push((0..n).filter(|k| s >> k & 1 == 1).fold(0, |e, k| e | 1u64 << (k * w + w - 1))); } }
    for s in 1u64..256 { bytes.push((0..8).filter(|k| s >> k & 1 == 1).fold(0, |e, k| e | 0xFFu64 << (8 * k))); }
    for _ in 0..random { rand.push(r.n() | 1); }
    vec![("1-bit", bits1), ("2-bit", bits2), ("sign bits", signs), ("byte lanes", bytes), ("random", rand)]
}

fn differentials(random: usize) {
    let mut r = R(0x5eed);
    let fams = families(&mut r, random);
    let xs: Vec<u64> = (0..65536).map(|_| r.n()).collect();
    let mut v = Vec::with_capacity(65536);
    for (name, f) in CANDIDATES.iter().skip(1) {
        print!("{name:10}");
        for (family, patterns) in &fams {
            let (mut least, mut weak) = (usize::MAX, 0);
            for &e in patterns {
                v.clear(); v.extend(xs.iter().map(|&x| f(x ^ e).wrapping_sub(f(x)) as u32));
                let d = distinct(&mut v); least = least.min(d); weak += (d < 65_500) as usize;
            }
            print!(" | {family}: least {least}, {weak} below 65,500");
        }
        println!();
    }
}

fn bf16(r: &mut R) -> u64 { let z = r.n(); (0..4).fold(0, |x, e| { let w = z >> (16 * e); x | ((w & 1) << 15 | (0x7A + ((w >> 1) & 7)) << 7 | (w >> 4) & 127) << (16 * e) }) }

fn faults(trials: u64) {
    const H: usize = 2; const T: usize = 16; const P: usize = 64; const N: usize = H * T * P;
    let idx = |h: usize, t: usize, p: usize| (h * T + t) * P + p;
    let classes = ["the same bit in two pieces", "bit 63 of 2, 4, 6 or 8 pieces", "bit 63 stuck over a slice",
        "two tokens differing only in their top bytes, swapped", "one token negated (bf16)",
        "fp32 token negated, head size 4", "fp32 token negated, head size 8", "odd bf16 elements of a token negated, head size 8",
        "a bit-31 line over a slice", "a bit-15 line over a slice"];
    let mut r = R(12345);
    let mut kv = vec![0u64; N];
    println!("{:55} {}", "fault", CANDIDATES.map(|c| c.0).join(" "));
    for (ci, class) in classes.iter().enumerate() {
        let mut missed = [0u64; CANDIDATES.len()];
        for _ in 0..trials {
            for v in kv.iter_mut() { *v = bf16(&mut r); }
            let q = r.b(64);
            let mut bad = kv.clone();
            let (h, t) = (r.b(H as u64) as usize, r.b(T as u64) as usize);
            // A head of `pieces` pieces of K and as many of V inside the 64-piece cell: pieces 0.. and 32...
            let cell = |bad: &mut Vec<u64>, pieces: usize, e: u64| for p in (0..pieces).chain(32..32 + pieces) { bad[idx(h, t, p)] ^= e; };
            match ci {
                0 => { let b = r.b(64); let i = r.b(N as u64) as usize; let mut k = i; while k == i { k = r.b(N as u64) as usize; } bad[i] ^= 1 << b; bad[k] ^= 1 << b; }
                1 => { let n = 2 * (1 + r.b(4)) as usize; let mut done = Vec::new(); while done.len() < n { let i = r.b(N as u64) as usize; if !done.contains(&i) { done.push(i); } } for i in done { bad[i] ^= 1 << 63; } }
                2 => loop { let v = r.b(2); for t in 0..T { for p in 0..P { let i = idx(h, t, p); bad[i] = (bad[i] & !(1 << 63)) | (v << 63); } } if bad != kv { break; } },
                3 => { let mut b = r.b(T as u64) as usize; while b == t { b = r.b(T as u64) as usize; }
                       for p in 0..P { let (ia, ib) = (idx(h, t, p), idx(h, b, p)); let mut top = r.b(256); while top == kv[ia] >> 56 { top = r.b(256); } kv[ib] = (kv[ia] & !(255 << 56)) | (top << 56); }
                       bad = kv.clone(); for p in 0..P { bad.swap(idx(h, t, p), idx(h, b, p)); } }
                4 => cell(&mut bad, 32, 0x8000_8000_8000_8000),
                5 => cell(&mut bad, 2, 0x8000_0000_8000_0000),
                6 => cell(&mut bad, 4, 0x8000_0000_8000_0000),
                7 => cell(&mut bad, 2, 0x8000_0000_8000_0000),
                8 | _ => { let e = if ci == 8 { 0x8000_0000_8000_0000 } else { 0x0000_8000_0000_8000 }; for t in 0..T { for p in 0..P { bad[idx(h, t, p)] ^= e; } } }
            }
            let changed: Vec<usize> = (0..N).filter(|&i| kv[i] != bad[i]).collect();
            for (k, (_, f)) in CANDIDATES.iter().enumerate() {
                let d = changed.iter().fold(0u64, |d, &i| {
                    let (h, t, p) = (i / (T * P), (i / P) % T, i % P);
                    let w = (2 * (3 * 65536 + h as u64) + 1).wrapping_mul(2 * ((q * T as u64 + t as u64) * P as u64 + p as u64) + 1);
                    d.wrapping_add(w.wrapping_mul(f(bad[i]).wrapping_sub(f(kv[i]))))
                });
                missed[k] += (d == 0) as u64;
            }
        }
        println!("{class:55} {} / {trials}", missed.map(|m| m.to_string()).join(" "));
    }
}

fn search() {
    let sets: [[u32; 3]; 3] = [[K[0], K[1], K[2]], [0xD6E8_FEB9, 0xA4D9_4A4B, 0x27D4_EB2F], [0x2545_F491, 0x8A5C_D789, 0x6C07_8965]];
    let mut r = R(0x5eed);
    let patterns: Vec<u64> = families(&mut r, 200).into_iter().flat_map(|(_, p)| p).collect();
    let xs: Vec<u64> = (0..65536).map(|_| r.n()).collect();
    let mut v = Vec::with_capacity(65536);
    // Kinds: bit 0 XOR (else add), bit 1 a fold after the round.
    for code in 0..64u32 {
        for end_fold in [false, true] {
            let kinds: Vec<u32> = (0..3).map(|i| (code >> (2 * i)) & 3).collect();
            let cost: u32 = kinds.iter().map(|k| 3 + (k & 1) + 2 * (k >> 1)).sum::<u32>() + 2 * end_fold as u32;
            if cost > 14 || (end_fold && kinds[2] >= 2) { continue; } // a fold twice is none
            let name: Vec<String> = kinds.iter().map(|k| format!("{}{}", if k & 1 == 1 { "X" } else { "A" }, if k >> 1 == 1 { "m" } else { "" })).collect();
            let mut verdicts = Vec::new();
            for set in &sets {
                let f = |x: u64| {
                    let mut y = x;
                    for (i, &k) in kinds.iter().enumerate() { y = if k & 1 == 1 { round_x(y, set[i]) } else { round_a(y, set[i]) }; if k >> 1 == 1 { y = fold(y); } }
                    if end_fold { fold(y) } else { y }
                };
                let mut least = usize::MAX;
                for &e in &patterns {
                    v.clear(); v.extend(xs.iter().map(|&x| f(x ^ e).wrapping_sub(f(x)) as u32));
                    least = least.min(distinct(&mut v));
                    if least < 65_500 { break; }
                }
                verdicts.push(least);
            }
            let pass = verdicts.iter().all(|&l| l >= 65_500);
            println!("{}{} cost {cost}: {} (least per multiplier set, stopping at the first below 65,500: {verdicts:?})", name.join(","), if end_fold { "+fold" } else { "" }, if pass { "PASS" } else { "fail" });
        }
    }
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let count = |default| args.get(2).map(|s| s.parse().expect("a count")).unwrap_or(default);
    match args.get(1).map(String::as_str) {
        Some("differentials") => differentials(count(1000) as usize),
        Some("faults") => faults(count(100_000)),
        Some("search") => search(),
        _ => eprintln!("usage: mix-select differentials [random] | faults [trials] | search"),
    }
}
