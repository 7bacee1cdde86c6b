use super::*;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

/// Spins until `flag` is set or a few seconds pass; whether it was set.
fn wait_for(flag: &AtomicBool) -> bool {
    let start = Instant::now();
    while !flag.load(Ordering::Acquire) {
        if start.elapsed() > Duration::from_secs(10) {
            return false;
        }
        std::thread::yield_now();
    }
    true
}

fn on_helper() -> bool {
    std::thread::current()
        .name()
        .is_some_and(|n| n.starts_with("pool-test-"))
}

#[test]
fn every_participant_runs_the_job_and_all_finish_before_run_returns() {
    let pool = Pool::new(3, "pool-test");
    assert_eq!(pool.helpers(), 3);
    for _ in 0..200 {
        let next = AtomicUsize::new(0);
        let done = AtomicUsize::new(0);
        pool.run(3, &|| loop {
            let item = next.fetch_add(1, Ordering::Relaxed);
            if item >= 1000 {
                break;
            }
            done.fetch_add(1, Ordering::Relaxed);
        });
        assert_eq!(done.load(Ordering::Relaxed), 1000);
    }
}

#[test]
fn helpers_do_join_a_job() {
    let pool = Pool::new(2, "pool-test");
    let helped = AtomicBool::new(false);
    pool.run(2, &|| {
        if on_helper() {
            helped.store(true, Ordering::Release);
        } else {
            assert!(wait_for(&helped), "no helper joined the job");
        }
    });
}

#[test]
fn a_helper_panic_reaches_the_caller_and_the_pool_still_works() {
    let pool = Pool::new(2, "pool-test");
    for round in 0..3 {
        let helped = AtomicBool::new(false);
        let outcome = panic::catch_unwind(AssertUnwindSafe(|| {
            pool.run(2, &|| {
                if on_helper() {
                    helped.store(true, Ordering::Release);
                    panic!("helper failed in round {round}");
                }
                assert!(wait_for(&helped), "no helper joined the job");
            })
        }));
        let payload = outcome.expect_err("the helper's panic was lost");
        let message = payload.downcast_ref::<String>().cloned().unwrap_or_default();
        assert_eq!(message, format!("helper failed in round {round}"));
        // Both helpers are alive and take work again.
        let count = AtomicUsize::new(0);
        let seen = Mutex::new(Vec::new());
        pool.run(2, &|| {
            count.fetch_add(1, Ordering::Relaxed);
            seen.lock()
                .unwrap()
                .push(std::thread::current().name().map(str::to_owned));
            // Keep the caller busy until both helpers have come.
            let start = Instant::now();
            while count.load(Ordering::Relaxed) < 3 && start.elapsed() < Duration::from_secs(10) {
                std::thread::yield_now();
            }
        });
        assert_eq!(
            count.load(Ordering::Relaxed),
            3,
            "round {round}: {:?}",
            seen.lock().unwrap()
        );
    }
    assert_eq!(pool.helpers(), 2);
}

#[test]
fn a_caller_panic_waits_for_the_helpers() {
    let pool = Pool::new(1, "pool-test");
    let helper_finished = AtomicBool::new(false);
    let helped = AtomicBool::new(false);
    let outcome = panic::catch_unwind(AssertUnwindSafe(|| {
        pool.run(1, &|| {
            if on_helper() {
                helped.store(true, Ordering::Release);
                std::thread::sleep(Duration::from_millis(50));
                helper_finished.store(true, Ordering::Release);
            } else {
                assert!(wait_for(&helped), "no helper joined the job");
                panic!("caller failed");
            }
        })
    }));
    assert!(outcome.is_err());
    assert!(
        helper_finished.load(Ordering::Acquire),
        "run unwound before its helper finished"
    );
}

#[test]
fn concurrent_callers_each_get_their_job_done() {
    let pool = Pool::new(3, "pool-test");
    std::thread::scope(|scope| {
        for caller in 0..4u64 {
            let pool = &pool;
            scope.spawn(move || {
                for round in 0..100u64 {
                    let next = AtomicUsize::new(0);
                    let sum = std::sync::atomic::AtomicU64::new(0);
                    pool.run(3, &|| loop {
                        let item = next.fetch_add(1, Ordering::Relaxed) as u64;
                        if item >= 500 {
                            break;
                        }
                        sum.fetch_add(item * (caller + round + 1), Ordering::Relaxed);
                    });
                    assert_eq!(sum.load(Ordering::Relaxed), 499 * 500 / 2 * (caller + round + 1));
                }
            });
        }
    });
}

#[test]
fn an_empty_pool_runs_on_the_caller() {
    let pool = Pool::new(0, "pool-test");
    let runs = AtomicUsize::new(0);
    pool.run(4, &|| {
        assert!(!on_helper());
        runs.fetch_add(1, Ordering::Relaxed);
    });
    assert_eq!(runs.load(Ordering::Relaxed), 1);
}
