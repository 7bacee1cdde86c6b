use super::*;

#[test]
fn runs_are_the_lcm_of_block_sizes() {
    assert_eq!(run_tokens(16, 16), 16);
    assert_eq!(run_tokens(16, 32), 32);
    assert_eq!(run_tokens(12, 8), 24);
    assert_eq!(
        run_tokens(u32::MAX, u32::MAX - 1),
        u32::MAX as u128 * (u32::MAX - 1) as u128
    );
}

#[test]
fn a_run_needs_every_block_with_valid_tokens() {
    let values = [1u64, 2, 3, 4, 5];
    // Blocks of 16 at positions 1..6, 70 tokens: position 4 holds 6 tokens, 5 none.
    let series = Series {
        block_size: 16,
        first_position: 1,
        values: &values,
        num_tokens: 70,
    };
    assert_eq!(series.run_value(32, 0), None, "position 0 is missing");
    assert_eq!(series.run_value(32, 1), Some(2 + 3));
    assert_eq!(series.run_value(32, 2), Some(4), "position 5 holds no valid tokens");
    assert_eq!(series.run_valid_tokens(32, 2), 6);
    assert_eq!(series.runs(32), (0, 3));
}

/// The definition of [`differing_ranges`], quadratic: every window
/// scans every range of its layer.
fn naive_differing_ranges(producer: &[HeadRange], consumer: &[HeadRange], check: u32) -> Vec<LayerDifference> {
    let layers: BTreeSet<u32> = producer.iter().chain(consumer).map(|r| r.layer_number).collect();
    let mut differences = Vec::new();
    for layer_number in layers {
        let p: Vec<&HeadRange> = producer.iter().filter(|r| r.layer_number == layer_number).collect();
        let c: Vec<&HeadRange> = consumer.iter().filter(|r| r.layer_number == layer_number).collect();
        let bounds = |side: &[&HeadRange]| -> BTreeSet<u64> {
            side.iter().flat_map(|r| [r.first_head as u64, r.end()]).collect()
        };
        let common: Vec<u64> = bounds(&p).intersection(&bounds(&c)).copied().collect();
        let mut seen = vec![false; p.len() + c.len()];
        for window in common.windows(2) {
            let (lo, hi) = (window[0], window[1]);
            let mut sums = [0u64; 2];
            let mut any = false;
            for (i, (side, range)) in p.iter().map(|r| (0, r)).chain(c.iter().map(|r| (1, r))).enumerate() {
                if range.first_head as u64 >= lo && range.end() <= hi {
                    sums[side] = sums[side].wrapping_add(range.value);
                    seen[i] = true;
                    any = true;
                }
            }
            if any && sums[0] != sums[1] {
                differences.push(LayerDifference {
                    layer_number,
                    first_head: lo as u32,
                    num_heads: (hi - lo) as u32,
                    check,
                });
            }
        }
        for (i, range) in p.iter().chain(c.iter()).enumerate() {
            if !seen[i] {
                differences.push(LayerDifference {
                    layer_number,
                    first_head: range.first_head,
                    num_heads: range.num_heads,
                    check,
                });
            }
        }
    }
    differences
}

#[test]
fn differing_ranges_agree_with_the_naive_definition() {
    let mut state = 0x9e37_79b9_7f4a_7c15u64;
    let mut next = |n: u64| {
        state = state
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (state >> 33) % n
    };
    for round in 0..2000 {
        let (pc, cc) = (next(8), next(8));
        let mut side = |count: u64| -> Vec<HeadRange> {
            (0..count)
                .map(|_| HeadRange {
                    layer_number: next(4) as u32,
                    first_head: next(12) as u32,
                    num_heads: 1 + next(5) as u32,
                    value: next(3),
                })
                .collect()
        };
        let producer = side(pc);
        let consumer = side(cc);
        let mut fast = differing_ranges(&producer, &consumer, 0);
        let mut naive = naive_differing_ranges(&producer, &consumer, 0);
        let key = |d: &LayerDifference| (d.layer_number, d.first_head, d.num_heads);
        fast.sort_by_key(key);
        naive.sort_by_key(key);
        assert_eq!(fast, naive, "round {round}: {producer:?} / {consumer:?}");
    }
}

#[test]
fn differing_ranges_line_up_other_head_splits() {
    let range = |layer_number, first_head, num_heads, value| HeadRange {
        layer_number,
        first_head,
        num_heads,
        value,
    };
    // Producer: heads 0..4 and 4..8 of layer 3; consumer: four ranges of two.
    let producer = [range(3, 0, 4, 10), range(3, 4, 4, 20)];
    let consumer = [
        range(3, 0, 2, 4),
        range(3, 2, 2, 6),
        range(3, 4, 2, 5),
        range(3, 6, 2, 16),
    ];
    let differences = differing_ranges(&producer, &consumer, 1);
    assert_eq!(
        differences,
        vec![LayerDifference {
            layer_number: 3,
            first_head: 4,
            num_heads: 4,
            check: 1
        }]
    );
    // A layer on one side only is reported whole.
    let differences = differing_ranges(&producer, &[], 0);
    assert_eq!(differences.len(), 2);
}
