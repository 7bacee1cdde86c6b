//! Issue 18's rule as a property: random producer/consumer pairs (and
//! store/load pairs of offloads) with intact KV, one piece of configuration
//! changed on one side (block size, TP size or rank, heads, replicas,
//! identities, aliases, split_known, role, layers, groups, skipped groups,
//! stored buffers; with and without the payload extension), judged through
//! the C ABI. Intact KV must never give MISMATCH; the same pairs unchanged
//! with one corrupted byte must give MISMATCH; a changed pair with a
//! corrupted byte the consumer reads must never give MATCH. The generator
//! is tests/verdict_support/generator.rs (also the fuzz target `verdicts`).
//!
//! Beside it, layouts whose cells alias (a real layout with one stride or
//! address changed, tests/verdict_support/aliasing.rs): every one whose
//! cells share a byte, by a naive reference, is refused at registration.
//!
//! `KVCS_PROPERTY_CASES` sets the number of cases (default 1000, about 2 s);
//! `KVCS_TEST_SEED=<seed> KVCS_PROPERTY_CASE=<i>` reruns one case. The table
//! of outcomes is printed on stderr: `cargo test --release --test
//! verdict_property -- --nocapture`.

#[path = "verdict_support/aliasing.rs"]
mod aliasing;
#[path = "verdict_support/cabi.rs"]
mod cabi;
#[path = "verdict_support/generator.rs"]
mod generator;
mod support;

use std::collections::BTreeMap;

use generator::{run_case, Tally};

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
        "[verdict property] seed {seed}: rerun with KVCS_TEST_SEED={seed} cargo test --release --test verdict_property -- --nocapture"
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
fn a_layout_whose_cells_share_bytes_is_always_refused_at_registration() {
    let seed = support::run_seed();
    eprintln!(
        "[aliasing property] seed {seed}: rerun with KVCS_TEST_SEED={seed} cargo test --release --test verdict_property -- --nocapture"
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
