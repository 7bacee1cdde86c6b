//! The host engine's threads: values are the naive reference's whatever the
//! thread count; a worker starts its helper threads once and reuses them;
//! concurrent calls on one worker each get their own values; dropping a
//! worker joins its threads; the thread count's default and bounds.
//!
//! Calls here read more than 4 MiB of KV per thread, so that the engine
//! really splits them (smaller calls run on the calling thread alone). The
//! tests take one lock each, so that counting the helper threads (by name,
//! in `/proc/self/task`) and setting `KVCS_HOST_THREADS` see no other test's
//! workers.

#[path = "it/support/mod.rs"]
mod support;

use std::collections::BTreeSet;
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

use kvcsum::{Error, ReplicaKey, Role, Worker, WorkerOptions};
use support::*;

const UNREPLICATED: ReplicaKey = ReplicaKey {
    replicas: 1,
    replica_index: 0,
};

/// What the helper threads are called (`kvcsum-host-<i>`).
const HELPER_PREFIX: &str = "kvcsum-host-";

static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());

fn one_at_a_time() -> MutexGuard<'static, ()> {
    ONE_AT_A_TIME.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// The ids of this process's threads named as host helpers.
fn helper_threads() -> BTreeSet<u64> {
    let mut ids = BTreeSet::new();
    for entry in std::fs::read_dir("/proc/self/task").expect("/proc/self/task") {
        let entry = entry.expect("task entry");
        // A thread may exit between the listing and the read.
        let Ok(name) = std::fs::read_to_string(entry.path().join("comm")) else {
            continue;
        };
        if name.starts_with(HELPER_PREFIX) {
            ids.insert(entry.file_name().to_string_lossy().parse().expect("task id"));
        }
    }
    ids
}

/// Waits (a few seconds at most) until `count` helper threads are listed: a
/// joined thread can stay listed for a moment after `join` returns, and a
/// new one names itself only once it runs.
fn settle_helper_threads(count: usize) -> BTreeSet<u64> {
    let start = Instant::now();
    loop {
        let threads = helper_threads();
        if threads.len() == count || start.elapsed() > Duration::from_secs(5) {
            return threads;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Random KV of about `mib` MiB: 4 layers, 4 heads, `head_bytes` of K and
/// of V.
fn kv_of_mib(rng: &mut Rng, mib: u64, head_bytes: u32) -> LogicalKv {
    let token_bytes = 4 * 4 * 2 * head_bytes as u64;
    let tokens = mib * (1 << 20) / token_bytes + rng.below(200);
    LogicalKv::random(rng, KvShape::gqa(4, 4, head_bytes, tokens))
}

/// A placement of `kv` (one worker holding everything) in `kind` with
/// 16-token blocks, `kv` written at scattered block ids, and the request.
fn placed(rng: &mut Rng, kv: &LogicalKv, kind: LayoutKind) -> (Placement, TestRequest) {
    let block_size = 16;
    let num_positions = positions_for(kv.num_tokens(), block_size, 0, 0);
    let num_blocks = num_positions as u32 + 8;
    let table = GroupTable {
        group_id: 0,
        first_position: 0,
        block_ids: BlockAllocator::new(rng, num_blocks).take(num_positions),
    };
    let whole = shard(kv, 0, 1, 0, 1);
    let mut placement = Placement::for_shard(rng, kv, &whole, kind, 0, block_size, num_blocks);
    placement.write_request(kv, 0, &table.block_ids);
    let request = TestRequest {
        req_id: "r".to_owned(),
        num_tokens: kv.num_tokens(),
        tables: vec![table],
    };
    (placement, request)
}

fn worker_of(placement: &Placement, num_threads: u32) -> Worker {
    let mut worker = host_worker(0, 1, 0, num_threads);
    register_host(&mut worker, placement);
    worker
}

/// The single column of `req_id`'s group 0.
fn only_column(result: &kvcsum::Checksums, req_id: &str) -> Vec<u64> {
    let mut columns = columns_of(result, req_id, 0);
    assert_eq!(columns.keys().copied().collect::<Vec<_>>(), vec![UNREPLICATED]);
    columns.remove(&UNREPLICATED).unwrap()
}

fn helpers_started(worker: &Worker) -> usize {
    let description = worker.engine_description();
    let (_, tail) = description
        .split_once('(')
        .unwrap_or_else(|| panic!("engine description {description:?}"));
    tail.split(' ').next().unwrap().parse().expect("helper count")
}

#[test]
fn every_thread_count_gives_the_reference() {
    let _serial = one_at_a_time();
    let mut rng = Rng::for_test("every_thread_count_gives_the_reference");
    let seed = rng.seed();
    // 36+ MiB: 8 threads get at least 4 MiB each. Every walk of the engine:
    // a head's tokens as one run (HND), heads outer and tokens outer
    // (prefetching) over rows of whole lanes (K/V split, kernel blocks, NHD),
    // and rows that do not fill whole lanes (48-byte cells).
    let cases = [
        (LayoutKind::Hnd, 256),
        (LayoutKind::Nhd, 256),
        (LayoutKind::KvSplit, 256),
        (LayoutKind::KernelBlocks { kernel_blocks: 2 }, 256),
        (LayoutKind::Padded, 24),
        (LayoutKind::Nhd, 24),
    ];
    for (kind, head_bytes) in cases {
        let kv = kv_of_mib(&mut rng, 36, head_bytes);
        let (placement, request) = placed(&mut rng, &kv, kind);
        let table = request.table(0);
        let expected = naive_full(&kv, 16, 0, table.block_ids.len());
        let blocks = block_set(std::slice::from_ref(&request));
        for threads in [1u32, 2, 3, 8] {
            let worker = worker_of(&placement, threads);
            for call in 0..2 {
                let values = only_column(&checksum(&worker, &blocks, Role::Producer), "r");
                assert_eq!(
                    values, expected,
                    "seed {seed}, {kind:?}, {head_bytes}-byte heads, {threads} threads, call {call}"
                );
            }
            assert_eq!(
                helpers_started(&worker),
                threads as usize - 1,
                "seed {seed}, {kind:?}: {threads} threads did not all work"
            );
        }
    }
}

#[test]
fn helper_threads_start_once_and_are_joined_on_drop() {
    let _serial = one_at_a_time();
    let mut rng = Rng::for_test("helper_threads_start_once_and_are_joined_on_drop");
    let seed = rng.seed();
    assert!(settle_helper_threads(0).is_empty(), "helpers of another test are alive");
    let kv = kv_of_mib(&mut rng, 20, 256);
    let (placement, request) = placed(&mut rng, &kv, LayoutKind::Hnd);
    let expected = naive_full(&kv, 16, 0, request.table(0).block_ids.len());
    let blocks = block_set(std::slice::from_ref(&request));
    let worker = worker_of(&placement, 4);
    assert!(helper_threads().is_empty(), "helpers started before any call");
    assert_eq!(helpers_started(&worker), 0);
    // A small call (one block) runs on the calling thread: no helpers yet.
    let mut small = block_set(&[]);
    small.add_request("small", 16).expect("request");
    small
        .add_group("small", 0, 0, &request.table(0).block_ids[..1])
        .expect("group");
    checksum(&worker, &small, Role::Producer);
    assert!(helper_threads().is_empty(), "a small call started helpers");
    assert_eq!(helpers_started(&worker), 0);

    let values = only_column(&checksum(&worker, &blocks, Role::Producer), "r");
    assert_eq!(values, expected, "seed {seed}");
    let helpers = settle_helper_threads(3);
    assert_eq!(helpers.len(), 3, "4 threads = the caller and 3 helpers");
    for call in 0..50 {
        let values = only_column(&checksum(&worker, &blocks, Role::Consumer), "r");
        assert_eq!(values, expected, "seed {seed}, call {call}");
    }
    assert_eq!(helper_threads(), helpers, "the same 3 threads after 50 more calls");
    drop(worker);
    assert!(
        settle_helper_threads(0).is_empty(),
        "dropping the worker left helpers alive"
    );

    // A second worker starts its own, and joins them too.
    let worker = worker_of(&placement, 2);
    let values = only_column(&checksum(&worker, &blocks, Role::Producer), "r");
    assert_eq!(values, expected, "seed {seed}, second worker");
    assert_eq!(settle_helper_threads(1).len(), 1);
    drop(worker);
    assert!(
        settle_helper_threads(0).is_empty(),
        "dropping the second worker left helpers alive"
    );
}

#[test]
fn concurrent_calls_on_one_worker_each_get_their_values() {
    let _serial = one_at_a_time();
    let mut rng = Rng::for_test("concurrent_calls_on_one_worker_each_get_their_values");
    let seed = rng.seed();
    // Two requests in one cache, each 16+ MiB; callers ask for one, the
    // other, or both, so that a mixed-up job would show.
    let first = kv_of_mib(&mut rng, 16, 256);
    let mut second_shape = first.shape;
    second_shape.num_tokens = first.num_tokens() + 16 * 40 + rng.below(16);
    let second = LogicalKv::random(&mut rng, second_shape);
    let block_size = 16;
    let first_positions = positions_for(first.num_tokens(), block_size, 0, 0);
    let second_positions = positions_for(second.num_tokens(), block_size, 0, 0);
    let num_blocks = (first_positions + second_positions) as u32 + 4;
    let mut allocator = BlockAllocator::new(&mut rng, num_blocks);
    let tables = [first_positions, second_positions].map(|positions| GroupTable {
        group_id: 0,
        first_position: 0,
        block_ids: allocator.take(positions),
    });
    let whole = shard(&first, 0, 1, 0, 1);
    let mut placement = Placement::for_shard(&mut rng, &first, &whole, LayoutKind::Nhd, 0, block_size, num_blocks);
    placement.write_request(&first, 0, &tables[0].block_ids);
    placement.write_request(&second, 0, &tables[1].block_ids);
    let requests = [
        TestRequest {
            req_id: "first".to_owned(),
            num_tokens: first.num_tokens(),
            tables: vec![tables[0].clone()],
        },
        TestRequest {
            req_id: "second".to_owned(),
            num_tokens: second.num_tokens(),
            tables: vec![tables[1].clone()],
        },
    ];
    let expected = [
        naive_full(&first, block_size, 0, first_positions),
        naive_full(&second, block_size, 0, second_positions),
    ];
    assert_ne!(
        expected[0][..8],
        expected[1][..8],
        "seed {seed}: the requests must differ"
    );
    let block_sets = [
        block_set(&requests[..1]),
        block_set(&requests[1..]),
        block_set(&requests),
    ];
    let worker = worker_of(&placement, 3);
    std::thread::scope(|scope| {
        for caller in 0..4usize {
            let (worker, block_sets, expected) = (&worker, &block_sets, &expected);
            scope.spawn(move || {
                for call in 0..8 {
                    let which = (caller + call) % 3;
                    let result = checksum(worker, &block_sets[which], Role::Producer);
                    let context = format!("seed {seed}, caller {caller}, call {call}, set {which}");
                    if which != 1 {
                        assert_eq!(only_column(&result, "first"), expected[0], "{context}");
                    }
                    if which != 0 {
                        assert_eq!(only_column(&result, "second"), expected[1], "{context}");
                    }
                }
            });
        }
    });
    assert_eq!(
        settle_helper_threads(2).len(),
        2,
        "3 threads = each caller and 2 shared helpers"
    );
    drop(worker);
    assert!(settle_helper_threads(0).is_empty());
}

fn options(num_threads: u32) -> WorkerOptions {
    WorkerOptions {
        tp_rank: 0,
        tp_size: 1,
        pp_rank: 0,
        device: None,
        num_threads,
    }
}

fn threads_of(worker: &Worker) -> usize {
    let description = worker.engine_description();
    description
        .strip_prefix("host engine, ")
        .and_then(|rest| rest.split(' ').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("engine description {description:?}"))
}

fn expect_invalid(outcome: kvcsum::Result<Worker>, needles: &[&str]) {
    match outcome {
        Err(Error::InvalidArgument(message)) => {
            for needle in needles {
                assert!(message.contains(needle), "{message:?} does not name {needle:?}");
            }
        }
        Err(other) => panic!("expected InvalidArgument naming {needles:?}, got {other:?}"),
        Ok(_) => panic!("expected InvalidArgument naming {needles:?}, got a worker"),
    }
}

#[test]
fn the_thread_count_default_and_bounds() {
    let _serial = one_at_a_time();
    // Only this test touches the variable, under the lock; restore it after.
    let saved = std::env::var_os("KVCS_HOST_THREADS");
    std::env::remove_var("KVCS_HOST_THREADS");
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let default = Worker::new(options(0)).expect("default worker");
    assert_eq!(threads_of(&default), (cores / 8).clamp(1, 4), "{cores} cores");

    std::env::set_var("KVCS_HOST_THREADS", "3");
    assert_eq!(threads_of(&Worker::new(options(0)).unwrap()), 3);
    assert_eq!(
        threads_of(&Worker::new(options(5)).unwrap()),
        5,
        "an explicit count wins"
    );
    std::env::set_var("KVCS_HOST_THREADS", " 256\n");
    assert_eq!(threads_of(&Worker::new(options(0)).unwrap()), 256);
    for bad in ["0", "257", "four", "-1", ""] {
        std::env::set_var("KVCS_HOST_THREADS", bad);
        expect_invalid(Worker::new(options(0)), &["KVCS_HOST_THREADS", &format!("{bad:?}")]);
    }
    std::env::remove_var("KVCS_HOST_THREADS");

    assert_eq!(threads_of(&Worker::new(options(256)).unwrap()), 256);
    expect_invalid(Worker::new(options(257)), &["num_threads 257", "256"]);
    expect_invalid(Worker::new(options(u32::MAX)), &["num_threads 4294967295"]);
    // Creating a worker starts no thread, however many it may use.
    assert!(helper_threads().is_empty());
    if let Some(value) = saved {
        std::env::set_var("KVCS_HOST_THREADS", value);
    }
}
