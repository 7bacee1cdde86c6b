//! Lining up two sides' block positions and naming differing layers.
//!
//! # Positions of different block sizes
//!
//! SPEC section 10 compares "only positions present on both sides with the
//! same number of valid tokens". With equal block sizes that is position by
//! position, comparing position `q` when both sides hold it and
//! `valid_tokens(num_tokens, block_size, q)` is the same for both (only a
//! last block can hold fewer tokens on one side).
//!
//! With block sizes `b_p` and `b_c`, positions are compared in runs of
//! `G = lcm(b_p, b_c)` tokens: run `Q` covers tokens `Q*G .. (Q+1)*G`, which
//! are whole blocks on both sides. By SPEC property 2 the checksums of
//! consecutive blocks add up to the checksum of the tokens they hold, so a
//! side's value of run `Q` is the sum of its blocks in the run that hold
//! valid tokens. Run `Q` is compared when each side holds all of those
//! blocks and both sides' valid tokens of the run, `min(G, max(0,
//! num_tokens - Q*G))`, are equal and not zero. With equal block sizes this
//! is exactly the position-by-position rule.

use std::collections::BTreeSet;

use crate::results::checksums::LayerPartial;
use crate::verify::report::LayerDifference;

/// One side's values of a group: block positions of its own block size.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Series<'a> {
    /// Tokens per block on this side.
    pub block_size: u32,
    /// Position of `values[0]`.
    pub first_position: u64,
    /// One value per block position.
    pub values: &'a [u64],
    /// This side's token count of the request.
    pub num_tokens: u64,
}

impl<'a> Series<'a> {
    /// The same positions with other values (a layer's, a check's).
    pub fn with_values(self, values: &'a [u64]) -> Series<'a> {
        Series { values, ..self }
    }

    /// This side's blocks of run `q` that hold valid tokens: `lo .. hi`.
    pub fn blocks_of_run(&self, run_tokens: u128, q: u128) -> (u128, u128) {
        let block_size = self.block_size as u128;
        let per_run = run_tokens / block_size;
        let lo = q * per_run;
        let valid_end = (self.num_tokens as u128).div_ceil(block_size);
        (lo, (lo + per_run).min(valid_end).max(lo))
    }

    /// The sum of this side's values over run `q`, if it holds every block
    /// of the run that holds valid tokens.
    pub fn run_value(&self, run_tokens: u128, q: u128) -> Option<u64> {
        let (lo, hi) = self.blocks_of_run(run_tokens, q);
        let start = self.first_position as u128;
        let end = start + self.values.len() as u128;
        if lo < start || hi > end {
            return None;
        }
        let slice = &self.values[(lo - start) as usize..(hi - start) as usize];
        Some(slice.iter().fold(0u64, |sum, &v| sum.wrapping_add(v)))
    }

    /// Valid tokens of run `q` on this side.
    pub fn run_valid_tokens(&self, run_tokens: u128, q: u128) -> u128 {
        (self.num_tokens as u128).saturating_sub(q * run_tokens).min(run_tokens)
    }

    /// The runs that may hold this side's positions: `q_lo .. q_hi`.
    pub fn runs(&self, run_tokens: u128) -> (u128, u128) {
        let block_size = self.block_size as u128;
        let start = self.first_position as u128 * block_size;
        let end = (self.first_position as u128 + self.values.len() as u128) * block_size;
        (start / run_tokens, end.div_ceil(run_tokens))
    }
}

/// `lcm(a, b)` of two positive block sizes.
pub(crate) fn run_tokens(a: u32, b: u32) -> u128 {
    let (mut x, mut y) = (a as u128, b as u128);
    while y != 0 {
        (x, y) = (y, x % y);
    }
    a as u128 / x * b as u128
}

/// A head range of one layer with its value at one run.
#[derive(Debug, Clone, Copy)]
pub(crate) struct HeadRange {
    pub layer_number: u32,
    pub first_head: u32,
    pub num_heads: u32,
    pub value: u64,
}

impl HeadRange {
    fn end(&self) -> u64 {
        self.first_head as u64 + self.num_heads as u64
    }
}

/// The producer's layer ranges at run `q` (`None` where a layer's blocks are
/// not all present, which cannot happen when the group's are).
pub(crate) fn producer_ranges(layers: &[LayerPartial], series: Series<'_>, run: u128, q: u128) -> Vec<HeadRange> {
    layers
        .iter()
        .filter_map(|layer| {
            Some(HeadRange {
                layer_number: layer.layer_number,
                first_head: layer.first_head,
                num_heads: layer.num_heads,
                value: series.with_values(&layer.values).run_value(run, q)?,
            })
        })
        .collect()
}

/// The consumer's layer ranges of check `check` at run `q`: each layer
/// partial whose replica key `(R, i)` has `i == check % R`, as the check
/// itself sums them (SPEC section 4).
pub(crate) fn consumer_ranges<'a>(
    layers: impl Iterator<Item = (&'a LayerPartial, Series<'a>)>,
    check: u32,
    run: u128,
    q: u128,
) -> Vec<HeadRange> {
    layers
        .filter(|(layer, _)| layer.replica.replica_index == check % layer.replica.replicas)
        .filter_map(|(layer, series)| {
            Some(HeadRange {
                layer_number: layer.layer_number,
                first_head: layer.first_head,
                num_heads: layer.num_heads,
                value: series.with_values(&layer.values).run_value(run, q)?,
            })
        })
        .collect()
}

/// The head ranges whose sums differ between the sides, per layer.
///
/// The two sides may split a layer's heads differently (other TP sizes).
/// Head boundaries present on both sides cut each layer into the finest
/// ranges both can sum; a range whose sums differ is reported. Heads that
/// only one side covers are reported as they are.
///
/// Work is `O(n log n)` in the ranges given: both sides are sorted by
/// layer, and each range is placed in the one window (between consecutive
/// common boundaries) that can hold it by a binary search.
pub(crate) fn differing_ranges(producer: &[HeadRange], consumer: &[HeadRange], check: u32) -> Vec<LayerDifference> {
    let sorted = |side: &[HeadRange]| {
        let mut side = side.to_vec();
        side.sort_by_key(|r| (r.layer_number, r.first_head));
        side
    };
    let (producer, consumer) = (sorted(producer), sorted(consumer));
    let mut differences = Vec::new();
    let (mut p, mut c) = (0, 0);
    while p < producer.len() || c < consumer.len() {
        let layer_number = match (producer.get(p), consumer.get(c)) {
            (Some(a), Some(b)) => a.layer_number.min(b.layer_number),
            (Some(a), None) => a.layer_number,
            (None, Some(b)) => b.layer_number,
            (None, None) => unreachable!("loop condition"),
        };
        let p_end = p + producer[p..].partition_point(|r| r.layer_number == layer_number);
        let c_end = c + consumer[c..].partition_point(|r| r.layer_number == layer_number);
        differences.extend(layer_differences(
            layer_number,
            &producer[p..p_end],
            &consumer[c..c_end],
            check,
        ));
        (p, c) = (p_end, c_end);
    }
    differences
}

/// [`differing_ranges`] of one layer.
fn layer_differences(layer_number: u32, p: &[HeadRange], c: &[HeadRange], check: u32) -> Vec<LayerDifference> {
    let bounds =
        |side: &[HeadRange]| -> BTreeSet<u64> { side.iter().flat_map(|r| [r.first_head as u64, r.end()]).collect() };
    let common: Vec<u64> = bounds(p).intersection(&bounds(c)).copied().collect();
    let windows = common.len().saturating_sub(1);
    // Per window: (producer sum, consumer sum, whether any range lies in it).
    let mut sums = vec![(0u64, 0u64, false); windows];
    let mut uncovered = Vec::new();
    for (side, range) in p.iter().map(|r| (0, r)).chain(c.iter().map(|r| (1, r))) {
        // The window holding the range starts at the last common bound at
        // or below its first head; it holds it if its end is not past.
        let start = common.partition_point(|&b| b <= range.first_head as u64);
        let window = start
            .checked_sub(1)
            .filter(|&w| w < windows && range.end() <= common[w + 1]);
        match window {
            Some(w) => {
                let sum = if side == 0 { &mut sums[w].0 } else { &mut sums[w].1 };
                *sum = sum.wrapping_add(range.value);
                sums[w].2 = true;
            }
            None => uncovered.push((side, range)),
        }
    }
    let mut differences: Vec<LayerDifference> = sums
        .iter()
        .enumerate()
        .filter(|(_, &(sum_p, sum_c, any))| any && sum_p != sum_c)
        .map(|(w, _)| LayerDifference {
            layer_number,
            first_head: common[w] as u32,
            num_heads: (common[w + 1] - common[w]) as u32,
            check,
        })
        .collect();
    // Producer's uncovered ranges first, then the consumer's.
    uncovered.sort_by_key(|&(side, _)| side);
    differences.extend(uncovered.into_iter().map(|(_, range)| LayerDifference {
        layer_number,
        first_head: range.first_head,
        num_heads: range.num_heads,
        check,
    }));
    differences
}

#[cfg(test)]
mod tests;
