// Chooses f of the MIXED algorithm (docs/SPEC.md section 12): candidate
// mixers against structured faults on a bf16-like block of 2 heads x 16
// tokens x 64 pieces, by the exact change of the block checksum (linear in
// f(x_j)): delta = sum over changed pieces of m (2j + 1) (f(x') - f(x)).
// Run: rustc -O scripts/mix-select.rs -o /tmp/mix-select && /tmp/mix-select 1000000
// (the trials per class; the run recorded in docs/SPEC.md took 10^6).
const C1: u64 = 0x9E37_79B9_7F4A_7C15;
fn id(x: u64) -> u64 { x }
fn onemul(x: u64) -> u64 { let g = (x ^ (x >> 32)).wrapping_mul(C1); g ^ (g >> 32) }
fn onemul_nopre(x: u64) -> u64 { let g = x.wrapping_mul(C1); g ^ (g >> 32) }
fn onemul_nopost(x: u64) -> u64 { (x ^ (x >> 32)).wrapping_mul(C1) }
fn fmix(mut x: u64) -> u64 { x ^= x >> 33; x = x.wrapping_mul(0xff51afd7ed558ccd); x ^= x >> 33; x = x.wrapping_mul(0xc4ceb9fe1a85ec53); x ^ (x >> 33) }
struct R(u64);
impl R { fn n(&mut self) -> u64 { self.0 = self.0.wrapping_add(0x9E3779B97F4A7C15); let mut z = self.0; z = (z ^ (z >> 30)).wrapping_mul(0xBF58476D1CE4E5B9); z = (z ^ (z >> 27)).wrapping_mul(0x94D049BB133111EB); z ^ (z >> 31) }
  fn b(&mut self, n: u64) -> u64 { self.n() % n } }
// bf16-like piece: 4 elements, sign random, exponent 0x78..0x82, mantissa random
fn bf16(r: &mut R) -> u64 { let z = r.n(); let mut x = 0u64; for e in 0..4 { let w = z >> (16*e); let s = w & 1; let ex = 0x7A + ((w >> 1) & 7); let m = (w >> 4) & 127; x |= ((s << 15) | (ex << 7) | m) << (16*e); } x }
const H: usize = 2; const T: usize = 16; const P: usize = 64; const N: usize = H*T*P;
fn idx(h: usize, t: usize, p: usize) -> usize { (h*T + t)*P + p }
fn checksum(f: fn(u64)->u64, kv: &[u64], q: u64, layer: u64) -> u64 {
  let mut c = 0u64;
  for h in 0..H { let m = 2*(layer*65536 + h as u64)+1; let mut s = 0u64;
    for t in 0..T { for p in 0..P { let j = (q*T as u64 + t as u64)*P as u64 + p as u64; s = s.wrapping_add(f(kv[idx(h,t,p)]).wrapping_mul(2*j+1)); } }
    c = c.wrapping_add(m.wrapping_mul(s)); }
  c }
fn main() {
  let trials: u64 = std::env::args().nth(1).map(|s| s.parse().unwrap()).unwrap_or(100000);
  let cands: [(&str, fn(u64)->u64); 5] = [("weighted", id), ("onemul", onemul), ("onemul-nopre", onemul_nopre), ("onemul-nopost", onemul_nopost), ("fmix64", fmix)];
  let classes = ["single bit", "same bit two pieces", "even top-bit flips", "stuck bit63 lane slice", "stuck random bit lane", "byte lane garble", "top byte 8 pieces", "swap tokens high-bits-only", "swap pieces high-bits-only", "negate token"];
  let mut r = R(12345);
  let mut kv = vec![0u64; N];
  for (ci, class) in classes.iter().enumerate() {
    let mut missed = [0u64; 5];
    for _ in 0..trials {
      for v in kv.iter_mut() { *v = bf16(&mut r); }
      let q = r.b(64);
      let mut bad = kv.clone();
      match ci {
        0 => { let i = r.b(N as u64) as usize; bad[i] ^= 1 << r.b(64); }
        1 => { let b = r.b(64); let i = r.b(N as u64) as usize; let mut k = r.b(N as u64) as usize; while k == i { k = r.b(N as u64) as usize; } bad[i] ^= 1<<b; bad[k] ^= 1<<b; }
        2 => { let n = 2 * (1 + r.b(4)); let mut done = std::collections::HashSet::new(); while done.len() < n as usize { done.insert(r.b(N as u64) as usize); } for i in done { bad[i] ^= 1<<63; } }
        3 | 4 => { let b = if ci == 3 { 63 } else { r.b(64) }; let h = r.b(H as u64) as usize; loop { let v = r.b(2); for t in 0..T { for p in 0..P { let i = idx(h,t,p); bad[i] = (bad[i] & !(1<<b)) | (v<<b); } } if bad != kv { break; } } }
        5 => { let lane = r.b(8); let n = 2 + r.b(15) as usize; let s = r.b((N - n) as u64) as usize; for i in s..s+n { loop { let nb = r.b(256); let old = (bad[i] >> (8*lane)) & 255; if nb != old { bad[i] = (bad[i] & !(255 << (8*lane))) | (nb << (8*lane)); break; } } } }
        6 => { let s = r.b((N - 8) as u64) as usize; for i in s..s+8 { loop { let nb = r.b(256); if nb != bad[i] >> 56 { bad[i] = (bad[i] & !(255<<56)) | (nb<<56); break; } } } }
        7 => { let h = r.b(H as u64) as usize; let a = r.b(T as u64) as usize; let mut b = r.b(T as u64) as usize; while b == a { b = r.b(T as u64) as usize; }
               // token b's cell := token a's with only the top byte of each piece different
               for p in 0..P { let ia = idx(h,a,p); let ib = idx(h,b,p); let mut top = r.b(256); while top == kv[ia] >> 56 { top = r.b(256); } kv[ib] = (kv[ia] & !(255<<56)) | (top<<56); }
               bad = kv.clone(); for p in 0..P { bad.swap(idx(h,a,p), idx(h,b,p)); } }
        8 => { let i = r.b(N as u64) as usize; let mut k = r.b(N as u64) as usize; while k == i { k = r.b(N as u64) as usize; } kv[k] = (kv[i] & !(1<<63)) | (!kv[i] & (1<<63)); bad = kv.clone(); bad.swap(i,k); }
        _ => { let h = r.b(H as u64) as usize; let t = r.b(T as u64) as usize; for p in 0..P { bad[idx(h,t,p)] ^= 0x8000_8000_8000_8000; } }
      }
      let changed: Vec<usize> = (0..N).filter(|&i| kv[i] != bad[i]).collect();
      assert!(!changed.is_empty());
      for (k, (_, f)) in cands.iter().enumerate() {
        let mut d = 0u64;
        for &i in &changed { let h = i / (T*P); let t = (i / P) % T; let p = i % P; let m = 2*(3*65536 + h as u64)+1; let j = (q*T as u64 + t as u64)*P as u64 + p as u64;
          d = d.wrapping_add(m.wrapping_mul(2*j+1).wrapping_mul(f(bad[i]).wrapping_sub(f(kv[i])))); }
        if d == 0 { missed[k] += 1; } }
    }
    print!("{:28}", class); for (k, (name, _)) in cands.iter().enumerate() { print!(" {}:{}", name, missed[k]); } println!(" / {}", trials);
  }
}
