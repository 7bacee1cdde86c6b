//! The verdict rule as a property: random producer/consumer pairs (and
//! store/load pairs of offloads) with intact KV, one piece of configuration
//! changed on one side (block size, TP size or rank, heads, replicas,
//! identities, aliases, split_known, role, layers, groups, skipped groups,
//! stored buffers; with and without the payload extension), judged through
//! the C ABI. Intact KV must never give MISMATCH; the same pairs unchanged
//! with one corrupted byte must give MISMATCH; a changed pair with a
//! corrupted byte the consumer reads must never give MATCH. The generator
//! is tests/it/verdict_property/generator.rs (also the fuzz target `verdicts`).
//!
//! A second property sweeps every pair of producer and consumer block
//! sizes from 1 to 64 (a token count per pair, half the time one under
//! which both sides hold as many positions): a plain payload that nobody
//! told the producer's block size is UNVERIFIED BLOCK_SIZE_UNKNOWN, intact
//! or not; told (set, or the extension), intact KV matches and a flipped
//! bit mismatches. `KVCS_TEST_SEED=<seed> KVCS_BLOCK_SIZE_PAIR=<a>,<b>`
//! reruns one pair.
//!
//! A fourth runs group placements (SPEC section 16) as the change
//! (tests/it/verdict_property/placement.rs): another DCP size or
//! interleave (MATCH intact), a DCP rank missing or claimed twice, one
//! worker's placement unlike its side's, another tokens_per_slot
//! (UNVERIFIED with a reason, or the producer's payload refused for it).
//!
//! Beside it, layouts whose cells alias (a real layout with one stride or
//! address changed, tests/it/verdict_property/aliasing.rs): every one whose
//! cells share a byte, by a naive reference, is refused at registration.
//!
//! `KVCS_PROPERTY_CASES` sets the number of cases (default 1000, about 2 s);
//! `KVCS_TEST_SEED=<seed> KVCS_PROPERTY_CASE=<i>` reruns one case. The table
//! of outcomes is printed on stderr: `cargo test --release --test
//! verdict_property -- --nocapture`.

#[path = "verdict_property/aliasing.rs"]
mod aliasing;
#[path = "verdict_property/configuration.rs"]
mod configuration;
#[path = "verdict_property/generator.rs"]
mod generator;
#[path = "verdict_property/placement.rs"]
mod placement;
use crate::support;

use std::collections::BTreeMap;

use generator::{run_block_size_pair, run_case, PairTally, Tally, SWEPT_BLOCK_SIZES};

fn env_u64(name: &str) -> Option<u64> {
    std::env::var(name).ok().map(|text| {
        text.trim()
            .parse()
            .unwrap_or_else(|_| panic!("{name} {text:?} is not a number"))
    })
}

#[test]
fn a_configuration_change_is_never_a_mismatch_and_corruption_never_a_match() {
    let seed = support::run_seed();
    eprintln!(
        "[verdict property] seed {seed}: rerun with KVCS_TEST_SEED={seed} cargo test --release --test it verdict_property:: -- --nocapture"
    );
    let indices: Vec<u64> = match env_u64("KVCS_PROPERTY_CASE") {
        Some(index) => vec![index],
        None => (0..env_u64("KVCS_PROPERTY_CASES").unwrap_or(1000)).collect(),
    };
    let mut tally = Tally::default();
    let mut violations = Vec::new();
    let mut by_kind: BTreeMap<(&str, &str), u64> = BTreeMap::new();
    let mut blind_spots: BTreeMap<(&str, &str), u64> = BTreeMap::new();
    for index in indices {
        let result = run_case(seed, index);
        tally.add(&result);
        if let Some(why) = result.blind_spot() {
            *blind_spots.entry((why, result.case.kind.name())).or_default() += 1;
        }
        for (rule, details) in result.violations() {
            *by_kind.entry((rule, result.case.kind.name())).or_default() += 1;
            violations.push(details);
        }
    }
    eprintln!("{}", tally.table(seed));
    eprintln!(
        "MISMATCH of intact KV where the SPEC states the limit (counted in the table, not violations): {}",
        blind_spots.values().sum::<u64>()
    );
    for ((why, kind), count) in &blind_spots {
        eprintln!("  {count:>6}  {why}: {kind}");
    }
    eprintln!("violations: {}", violations.len());
    for ((rule, kind), count) in &by_kind {
        eprintln!("  {count:>6}  {rule}: {kind}");
    }
    for violation in violations.iter().take(20) {
        eprintln!("VIOLATION {violation}");
    }
    assert!(
        violations.is_empty(),
        "{} violations of the rule in {} cases (seed {seed}); the first:\n{}",
        violations.len(),
        tally.cases,
        violations.first().map_or("", String::as_str)
    );
}

#[test]
fn every_pair_of_block_sizes_is_compared_only_where_the_producers_is_known() {
    let seed = support::run_seed();
    eprintln!(
        "[block-size pairs] seed {seed}: rerun with KVCS_TEST_SEED={seed} cargo test --release --test it verdict_property:: -- --nocapture"
    );
    let pairs: Vec<(u32, u32)> = match std::env::var("KVCS_BLOCK_SIZE_PAIR") {
        Ok(text) => {
            let sizes: Vec<u32> = text
                .split(',')
                .map(|s| {
                    s.trim()
                        .parse()
                        .unwrap_or_else(|_| panic!("KVCS_BLOCK_SIZE_PAIR {text:?} is not a,b"))
                })
                .collect();
            assert_eq!(sizes.len(), 2, "KVCS_BLOCK_SIZE_PAIR {text:?} is not a,b");
            vec![(sizes[0], sizes[1])]
        }
        Err(_) => SWEPT_BLOCK_SIZES
            .flat_map(|a| SWEPT_BLOCK_SIZES.map(move |b| (a, b)))
            .collect(),
    };
    let mut tally = PairTally::default();
    let mut violations = Vec::new();
    for (producer_size, consumer_size) in pairs {
        let result = run_block_size_pair(seed, producer_size, consumer_size);
        tally.add(&result);
        violations.extend(result.violations());
    }
    eprintln!("{}", tally.table(seed));
    eprintln!("violations: {}", violations.len());
    for violation in violations.iter().take(20) {
        eprintln!("VIOLATION {violation}");
    }
    assert!(
        violations.is_empty(),
        "{} violations in {} block-size pairs (seed {seed}); the first:\n{}",
        violations.len(),
        tally.pairs,
        violations.first().map_or("", String::as_str)
    );
}

/// tests/verdict_property/configuration.rs: geometry changes with no
/// identity (intact: never MISMATCH, always GeometryDiffers), uncompared
/// positions (never MATCH by default, counted as the naive rule says) and
/// kept entries against stores under changed decodings, geometry and
/// marks (the same bytes, the same outcomes, never a match across a
/// configuration change). `KVCS_CONFIGURATION_CASES` (default 400).
#[test]
fn configuration_changes_are_never_a_mismatch_nor_a_match_without_help() {
    let seed = support::run_seed();
    eprintln!(
        "[configuration property] seed {seed}: rerun with KVCS_TEST_SEED={seed} cargo test --release --test it verdict_property:: -- --nocapture"
    );
    let indices: Vec<u64> = match env_u64("KVCS_PROPERTY_CASE") {
        Some(index) => vec![index],
        None => (0..env_u64("KVCS_CONFIGURATION_CASES").unwrap_or(400)).collect(),
    };
    let mut tally = configuration::ConfigTally::default();
    let mut violations = Vec::new();
    for &index in &indices {
        let result = configuration::run_configuration_case(seed, index);
        tally.add(&result);
        if let Some(violation) = result.violation {
            violations.push(format!("case {index}: {violation}"));
        }
    }
    eprintln!("{}", tally.table(seed));
    eprintln!("violations: {}", violations.len());
    for violation in violations.iter().take(20) {
        eprintln!("VIOLATION {violation}");
    }
    assert!(
        violations.is_empty(),
        "{} violations in {} cases (seed {seed}); the first:\n{}",
        violations.len(),
        tally.cases,
        violations.first().map_or("", String::as_str)
    );
}

/// tests/it/verdict_property/placement.rs: group placements (DCP size,
/// rank, interleave, tokens per slot) changed on one side; the naive rule
/// and the naive reference of each worker's values.
/// `KVCS_PLACEMENT_CASES` (default 300).
#[test]
fn placement_changes_are_never_a_mismatch_and_corruption_never_a_match() {
    let seed = support::run_seed();
    eprintln!(
        "[placement property] seed {seed}: rerun with KVCS_TEST_SEED={seed} cargo test --release --test it verdict_property:: -- --nocapture"
    );
    let indices: Vec<u64> = match env_u64("KVCS_PROPERTY_CASE") {
        Some(index) => vec![index],
        None => (0..env_u64("KVCS_PLACEMENT_CASES").unwrap_or(300)).collect(),
    };
    let mut tally = placement::PlacementTally::default();
    let mut violations = Vec::new();
    let mut by_rule: BTreeMap<&str, u64> = BTreeMap::new();
    for &index in &indices {
        let result = placement::run_placement_case(seed, index);
        tally.add(&result);
        for (rule, details) in result.violations() {
            *by_rule.entry(rule).or_default() += 1;
            violations.push(details);
        }
    }
    eprintln!("{}", tally.table(seed));
    eprintln!("violations: {}", violations.len());
    for (rule, count) in &by_rule {
        eprintln!("  {count:>6}  {rule}");
    }
    for violation in violations.iter().take(20) {
        eprintln!("VIOLATION {violation}");
    }
    assert!(
        violations.is_empty(),
        "{} violations in {} placement cases (seed {seed}); the first:\n{}",
        violations.len(),
        tally.cases,
        violations.first().map_or("", String::as_str)
    );
}

#[test]
fn a_layout_whose_cells_share_bytes_is_always_refused_at_registration() {
    let seed = support::run_seed();
    eprintln!(
        "[aliasing property] seed {seed}: rerun with KVCS_TEST_SEED={seed} cargo test --release --test it verdict_property:: -- --nocapture"
    );
    let indices: Vec<u64> = match env_u64("KVCS_PROPERTY_CASE") {
        Some(index) => vec![index],
        None => (0..env_u64("KVCS_PROPERTY_CASES").unwrap_or(1000)).collect(),
    };
    let mut tally = aliasing::AliasingTally::default();
    let mut violations = Vec::new();
    for &index in &indices {
        let result = aliasing::run_aliasing_case(seed, index);
        tally.add(&result);
        violations.extend(result.violations);
    }
    eprintln!("{}", tally.table(seed));
    for violation in violations.iter().take(20) {
        eprintln!("VIOLATION {violation}");
    }
    assert!(
        violations.is_empty(),
        "{} violations in {} cases (seed {seed}); the first:\n{}",
        violations.len(),
        indices.len(),
        violations.first().map_or("", String::as_str)
    );
    // The changes must make cells alias often enough to test the rule.
    if indices.len() >= 100 {
        assert!(
            tally.aliasing() * 2 > indices.len() as u64,
            "only {} of {} cases alias (seed {seed})",
            tally.aliasing(),
            indices.len()
        );
    }
}
