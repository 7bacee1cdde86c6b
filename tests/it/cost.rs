//! Cost bounds: inputs built to be quadratic (many groups, layers, columns,
//! requests, differing positions, heads) take time in proportion to their
//! size, through the `extern "C"` functions as C would call them. Each bound
//! is generous (seconds) where the quadratic code took many times longer;
//! naming differing layers never holds the verifier's lock.
//!
//! Reproduce a failure with the seed it printed:
//! `KVCS_TEST_SEED=<seed> cargo test --release --test it cost::<name>`.

use crate::support;

use std::ffi::CString;
use std::ptr::null_mut;
use std::time::{Duration, Instant};

use kvcsum::ffi::blocks::*;
use kvcsum::ffi::status::kvcs_status::*;
use kvcsum::ffi::topology::*;
use kvcsum::ffi::verifier::*;
use kvcsum::ffi::worker::*;
use support::hand_made_records::*;
use support::handles::*;
use support::Rng;

/// A generous bound on work the fixed code does in a small fraction of it;
/// the quadratic code took many times longer on the same input.
fn assert_fast(what: &str, elapsed: Duration, bound_s: f64) {
    assert!(
        elapsed.as_secs_f64() < bound_s,
        "{what} took {:.2} s (bound {bound_s} s): work is not linear in the input",
        elapsed.as_secs_f64()
    );
}

// ---------------------------------------------------------------------------
// Validating payloads and records

#[test]
fn a_payload_of_many_extension_groups_validates_in_linear_time() {
    let (verifier, _blocks) = consumer_with_record(&simple_record(vec![5], 16), 1, 16);
    let n = 160_000u32;
    // Plain groups ascending, extension groups descending: a search of the
    // plain groups per extension group walks most of them.
    let payload = TPayload {
        num_tokens: 16,
        groups: (0..n).map(|id| (id, 7, 0, vec![5])).collect(),
        extension: Some((1, (0..n).rev().map(|id| (id, 16, Vec::new())).collect())),
    }
    .encode();
    let start = Instant::now();
    let report = verifier.check("req", &payload).expect("check");
    assert_fast("checking a payload of 160k extension groups", start.elapsed(), 3.0);
    assert_eq!(report.verdict(), MATCH, "{}", report.message());
    // A duplicate extension group is still found.
    let mut duplicate = TPayload {
        num_tokens: 16,
        groups: (0..n).map(|id| (id, 7, 0, vec![5])).collect(),
        extension: Some((1, (0..n).rev().map(|id| (id, 16, Vec::new())).collect())),
    };
    duplicate.extension.as_mut().unwrap().1.push((n / 2, 16, Vec::new()));
    let report = verifier.check("req", &duplicate.encode()).expect("check");
    assert_eq!(reason_name(report.reason()), "KVCS_UNVERIFIED_INVALID_CHECKSUMS");
    assert!(
        report.message().contains(&format!("group {} appears twice", n / 2)),
        "{}",
        report.message()
    );
}

#[test]
fn a_record_of_many_columns_and_layers_validates_in_linear_time() {
    let n = 60_000u32;
    let record = TRecord {
        rank: (0, 1, 0),
        role: 1,
        detail: true,
        groups: vec![(0, 16, 7)],
        requests: vec![TRequest {
            req_id: "elsewhere".to_owned(),
            num_tokens: 0,
            groups: vec![TGroup {
                group_id: 0,
                first_position: 0,
                num_positions: 0,
                columns: (0..n).map(|i| ((n, i), Vec::new())).collect(),
                layers: (0..n).rev().map(|i| (n - 1 - i, 0, 1, (n, i), Vec::new())).collect(),
            }],
        }],
    };
    let verifier = CVerifier::new(1);
    let bytes = record.encode();
    let start = Instant::now();
    verifier.add(&bytes).expect("add_record");
    assert_fast("adding a record of 60k columns and 60k layers", start.elapsed(), 3.0);
    // A layer whose key no column has is still refused.
    let mut bad = record;
    bad.requests[0].groups[0].columns.pop();
    assert_eq!(status_of(&verifier.add(&bad.encode())), KVCS_ERR_MALFORMED);
    assert!(
        last_error().contains("no column has its replica key"),
        "{}",
        last_error()
    );
}

// ---------------------------------------------------------------------------
// Naming differing layers, outside the lock

/// A detail-mode consumer record and a payload with the extension whose
/// layer `q % num_layers` differs at each position `q`.
fn every_position_differs_in_one_layer(rng: &mut Rng, num_layers: u32, positions: u64) -> (TRecord, Vec<u8>) {
    let layer_values: Vec<Vec<u64>> = (0..num_layers)
        .map(|_| (0..positions).map(|_| rng.next_u64()).collect())
        .collect();
    let sum = |layers: &[Vec<u64>]| -> Vec<u64> {
        (0..positions as usize)
            .map(|q| layers.iter().fold(0u64, |s, l| s.wrapping_add(l[q])))
            .collect()
    };
    let mut sent = layer_values.clone();
    for q in 0..positions as usize {
        let layer = &mut sent[q % num_layers as usize][q];
        *layer = layer.wrapping_add(1 + rng.below(1000));
    }
    let record = TRecord {
        rank: (0, 1, 0),
        role: 1,
        detail: true,
        groups: vec![(0, 16, 7)],
        requests: vec![TRequest {
            req_id: "req".to_owned(),
            num_tokens: positions * 16,
            groups: vec![TGroup {
                group_id: 0,
                first_position: 0,
                num_positions: positions,
                columns: vec![((1, 0), sum(&layer_values))],
                layers: layer_values
                    .iter()
                    .enumerate()
                    .map(|(l, values)| (l as u32, 0, 1, (1, 0), values.clone()))
                    .collect(),
            }],
        }],
    };
    let payload = TPayload {
        num_tokens: positions * 16,
        groups: vec![(0, 7, 0, sum(&sent))],
        extension: Some((
            1,
            vec![(
                0,
                16,
                sent.into_iter()
                    .enumerate()
                    .map(|(l, values)| (l as u32, 0, 1, values))
                    .collect(),
            )],
        )),
    };
    (record, payload.encode())
}

#[test]
fn naming_differing_layers_is_linear_and_never_holds_the_lock() {
    let mut rng = Rng::for_test("naming_differing_layers_is_linear_and_never_holds_the_lock");
    let seed = rng.seed();
    let (num_layers, positions) = (3000u32, 100u64);
    let (record, payload) = every_position_differs_in_one_layer(&mut rng, num_layers, positions);
    let (verifier, _blocks) = consumer_with_record(&record, positions as u32, positions * 16);
    let start = Instant::now();
    let (report, longest_wait) = std::thread::scope(|scope| {
        let checking = scope.spawn(|| verifier.check("req", &payload).expect("check"));
        // set_policy from another thread, while the check runs.
        let mut longest = Duration::ZERO;
        while !checking.is_finished() {
            let asked = Instant::now();
            assert_eq!(kvcs_verifier_set_policy(verifier.0, 1), KVCS_OK);
            longest = longest.max(asked.elapsed());
            std::thread::sleep(Duration::from_millis(1));
        }
        (checking.join().unwrap(), longest)
    });
    assert_fast(
        "a detail-mode check with every position differing",
        start.elapsed(),
        5.0,
    );
    assert!(
        longest_wait < Duration::from_millis(500),
        "kvcs_verifier_set_policy waited {longest_wait:?} for a check"
    );
    assert_eq!(report.verdict(), MISMATCH, "seed {seed}");
    let mismatches = report.mismatches();
    assert_eq!(mismatches.len() as u64, positions, "seed {seed}");
    for (i, mismatch) in mismatches.iter().enumerate() {
        assert_eq!(mismatch.localised, 1, "seed {seed}");
        let q = mismatch.first_position;
        let layers = report.layer_differences(i, mismatch.num_layers);
        assert_eq!(
            layers,
            vec![((q % num_layers as u64) as u32, 0, 1, 0)],
            "seed {seed}: position {q}"
        );
    }
}

/// A detail-mode consumer record whose `r` replica copies each hold one
/// layer (key `(r, i)` holds layer `i`), and a payload whose value differs
/// from every check: each of the `r` checks fails, and naming its layers
/// compares all `r` producer layers. The report's size would be `r * r`.
fn every_check_differs(rng: &mut Rng, r: u32) -> (TRecord, Vec<u8>) {
    let values: Vec<u64> = (0..r).map(|_| rng.next_u64()).collect();
    let record = TRecord {
        rank: (0, 1, 0),
        role: 1,
        detail: true,
        groups: vec![(0, 16, 7)],
        requests: vec![TRequest {
            req_id: "req".to_owned(),
            num_tokens: 16,
            groups: vec![TGroup {
                group_id: 0,
                first_position: 0,
                num_positions: 1,
                columns: (0..r).map(|i| ((r, i), vec![values[i as usize]])).collect(),
                layers: (0..r).map(|i| (i, 0, 1, (r, i), vec![values[i as usize]])).collect(),
            }],
        }],
    };
    let differs = values.iter().fold(1u64, |s, &v| s.wrapping_add(v));
    let payload = TPayload {
        num_tokens: 16,
        groups: vec![(0, 7, 0, vec![differs])],
        extension: Some((
            1,
            vec![(0, 16, (0..r).map(|i| (i, 0, 1, vec![values[i as usize]])).collect())],
        )),
    };
    (record, payload.encode())
}

#[test]
fn naming_layers_of_many_failing_replica_checks_is_bounded_by_the_input() {
    let mut rng = Rng::for_test("naming_layers_of_many_failing_replica_checks_is_bounded_by_the_input");
    let seed = rng.seed();
    // Small: every check names the other copies' layers.
    let (record, payload) = every_check_differs(&mut rng, 8);
    let (verifier, _blocks) = consumer_with_record(&record, 1, 16);
    let report = verifier.check("req", &payload).expect("check");
    let mismatches = report.mismatches();
    assert_eq!(mismatches.len(), 1, "seed {seed}: {}", report.message());
    assert_eq!(
        (mismatches[0].num_failed_checks, mismatches[0].localised),
        (8, 1),
        "seed {seed}"
    );
    let layers = report.layer_differences(0, mismatches[0].num_layers);
    assert_eq!(layers.len(), 8 * 7, "seed {seed}");
    for check in 0..8u32 {
        let named: Vec<u32> = layers.iter().filter(|d| d.3 == check).map(|d| d.0).collect();
        let others: Vec<u32> = (0..8).filter(|&l| l != check).collect();
        assert_eq!(named, others, "seed {seed}: check {check}");
    }
    // Large: the mismatch is reported, without naming r * r layers.
    let r = 5000;
    let (record, payload) = every_check_differs(&mut rng, r);
    let (verifier, _blocks) = consumer_with_record(&record, 1, 16);
    let start = Instant::now();
    let report = verifier.check("req", &payload).expect("check");
    assert_fast("a check with 5000 failing replica checks", start.elapsed(), 5.0);
    let mismatches = report.mismatches();
    assert_eq!(mismatches.len(), 1, "seed {seed}");
    assert_eq!(mismatches[0].num_failed_checks, r as usize, "seed {seed}");
    assert_eq!(
        (mismatches[0].localised, mismatches[0].num_layers),
        (0, 0),
        "seed {seed}"
    );
}

// ---------------------------------------------------------------------------
// Registration and lookups on the fast path

#[test]
fn adding_many_layers_takes_linear_time() {
    let mut rng = Rng::for_test("adding_many_layers_takes_linear_time");
    let layers = 16_000u32;
    let worker = HostWorker::new(&mut rng, layers, 1, 1);
    assert_eq!(kvcs_worker_add_group(worker.handle, 0, 1), KVCS_OK);
    let start = Instant::now();
    // Registered in a scattered order of layer numbers.
    for slot in 0..layers {
        let layer_number = (slot as u64 * 7919 % layers as u64) as u32;
        assert_eq!(
            worker.add_layer(0, layer_number, slot, 1, 1),
            KVCS_OK,
            "{}",
            last_error()
        );
    }
    assert_fast("adding 16k layers", start.elapsed(), 5.0);
    // Overlapping heads are still refused, naming the range registered before.
    assert_eq!(worker.add_layer(0, 4321, 0, 1, 1), KVCS_ERR_INVALID_ARGUMENT);
    assert!(
        last_error().contains("heads 0..1 of layer_number 4321 overlap heads 0..1 registered before"),
        "{}",
        last_error()
    );
}

#[test]
fn result_columns_are_found_in_constant_time() {
    let mut rng = Rng::for_test("result_columns_are_found_in_constant_time");
    let seed = rng.seed();
    let worker = HostWorker::new(&mut rng, 1, 4, 16);
    assert_eq!(kvcs_worker_add_group(worker.handle, 0, 16), KVCS_OK);
    assert_eq!(worker.add_layer(0, 0, 0, 4, 16), KVCS_OK);
    let requests = 40_000u32;
    let names: Vec<CString> = (0..requests)
        .map(|i| CString::new(format!("request-{i}")).unwrap())
        .collect();
    let mut handle = null_mut();
    assert_eq!(kvcs_blocks_create(&mut handle), KVCS_OK);
    let scheduled = CBlocks(handle);
    for (i, name) in names.iter().enumerate() {
        assert_eq!(kvcs_blocks_add_request(scheduled.0, name.as_ptr(), 16), KVCS_OK);
        let block = [(i % 4) as u32];
        assert_eq!(
            kvcs_blocks_add_group(scheduled.0, name.as_ptr(), 0, 0, block.as_ptr(), 1),
            KVCS_OK
        );
    }
    let result = worker.checksum(&scheduled, CONSUMER).expect("checksum");
    let first: Vec<Vec<u64>> = (0..4).map(|i| result.column(&names[i], 0, 0, 1).unwrap()).collect();
    assert!(first.iter().all(|c| c[0] != 0), "seed {seed}");
    let start = Instant::now();
    for (i, name) in names.iter().enumerate().rev() {
        assert_eq!(
            result.column(name, 0, 0, 1).unwrap(),
            first[i % 4],
            "seed {seed}: request {i}"
        );
    }
    assert_fast("40k kvcs_result_column calls", start.elapsed(), 3.0);
}

#[test]
fn registering_many_layers_in_detail_mode_takes_linear_time() {
    let rng = Rng::for_test("registering_many_layers_in_detail_mode_takes_linear_time");
    let seed = rng.seed();
    let (layers, num_blocks, block_size) = (4000u32, 2u32, 4u32);
    // Three workers over the same bytes (each cache drawn from one state).
    let data = rng.clone();
    let new_worker = || HostWorker::new(&mut data.clone(), layers, num_blocks, block_size);
    let scheduled = blocks(&[("req", 6, vec![(0, 0, vec![1, 0])])]);
    // Detail on first; a checksum half-way, then the other half: the
    // shadow each detail result comes from must follow the layout.
    let detail_first = new_worker();
    assert_eq!(kvcs_worker_set_detail(detail_first.handle, 1), KVCS_OK);
    assert_eq!(kvcs_worker_add_group(detail_first.handle, 0, block_size), KVCS_OK);
    let mut registering = Duration::ZERO;
    for half in [0..layers / 2, layers / 2..layers] {
        let start = Instant::now();
        for layer in half {
            assert_eq!(
                detail_first.add_layer(0, layer, layer, num_blocks, block_size),
                KVCS_OK,
                "{}",
                last_error()
            );
        }
        registering += start.elapsed();
        assert!(detail_first.record(&scheduled, CONSUMER).is_ok(), "seed {seed}");
    }
    assert_fast("registering 4000 layers in detail mode", registering, 1.0);
    // Detail on last, and never.
    let detail_last = new_worker();
    let plain = new_worker();
    for worker in [&detail_last, &plain] {
        assert_eq!(kvcs_worker_add_group(worker.handle, 0, block_size), KVCS_OK);
        for layer in 0..layers {
            assert_eq!(worker.add_layer(0, layer, layer, num_blocks, block_size), KVCS_OK);
        }
    }
    assert_eq!(kvcs_worker_set_detail(detail_last.handle, 1), KVCS_OK);
    let first = detail_first.record(&scheduled, CONSUMER).unwrap();
    let last = detail_last.record(&scheduled, CONSUMER).unwrap();
    let without = plain.record(&scheduled, CONSUMER).unwrap();
    assert!(
        first == last,
        "seed {seed}: detail records differ with the order of registration"
    );
    // Each record carries 4000 layers' partials (2 positions of 8 bytes).
    assert!(
        first.len() > without.len() + layers as usize * 16,
        "seed {seed}: {} bytes with detail, {} without",
        first.len(),
        without.len()
    );
    // Off again: the plain record.
    assert_eq!(kvcs_worker_set_detail(detail_first.handle, 0), KVCS_OK);
    assert!(
        detail_first.record(&scheduled, CONSUMER).unwrap() == without,
        "seed {seed}"
    );
}
// ---------------------------------------------------------------------------
// Topology: head sources per run, not per head

#[test]
fn head_sources_take_time_linear_in_the_heads() {
    // Local TP 1 holding 262,144 heads; remote TP 65,536 holding 4 each.
    // Finding each head's rank among the ranks read from was quadratic.
    let (heads, remote_tp) = (262_144u32, 65_536u32);
    let start = Instant::now();
    let sources = head_sources_of(|buf, cap, len| kvcs_head_sources(0, 1, remote_tp, heads, 0, buf, cap, len));
    assert_fast(
        "kvcs_head_sources of 262,144 heads on 65,536 ranks",
        start.elapsed(),
        1.0,
    );
    assert_eq!(sources.len(), remote_tp as usize);
    for (i, source) in sources.iter().enumerate() {
        let i = i as u32;
        assert_eq!(fields(source), (i, 4 * i, 4, 4 * i, 0), "run {i}");
    }
    // The remote engine replicates: 32,768 heads on 65,536 ranks, each head
    // read once, from the lower of its two ranks.
    let start = Instant::now();
    let sources = head_sources_of(|buf, cap, len| kvcs_head_sources(0, 1, remote_tp, 32_768, 0, buf, cap, len));
    assert_fast("kvcs_head_sources of 32,768 replicated heads", start.elapsed(), 1.0);
    assert_eq!(sources.len(), 32_768);
    for (i, source) in sources.iter().enumerate() {
        let i = i as u32;
        assert_eq!(fields(source), (2 * i, i, 1, i, 0), "run {i}");
    }
    // A topology checks the same runs when the handshake is recorded.
    let topology = topology(1, heads);
    let start = Instant::now();
    let mut added = 0u32;
    assert_eq!(
        kvcs_topology_add_remote(topology, c"prefill".as_ptr(), &remote_engine(remote_tp), &mut added),
        KVCS_OK,
        "{}",
        last_error()
    );
    let sources =
        head_sources_of(|buf, cap, len| kvcs_topology_head_sources(topology, c"prefill".as_ptr(), buf, cap, len));
    assert_fast(
        "kvcs_topology_add_remote and kvcs_topology_head_sources of 262,144 heads",
        start.elapsed(),
        1.0,
    );
    assert_eq!((added, sources.len()), (1, remote_tp as usize));
    kvcs_topology_destroy(topology);
    // The work is per run, not per head: 2^31 heads are 65,536 runs.
    let start = Instant::now();
    let sources = head_sources_of(|buf, cap, len| kvcs_head_sources(0, 1, remote_tp, 1 << 31, 0, buf, cap, len));
    assert_fast("kvcs_head_sources of 2^31 heads", start.elapsed(), 1.0);
    assert_eq!(sources.len(), remote_tp as usize);
    let last = sources.last().unwrap();
    assert_eq!(
        fields(last),
        (remote_tp - 1, (1 << 31) - (1 << 15), 1 << 15, (1 << 31) - (1 << 15), 0)
    );
}
