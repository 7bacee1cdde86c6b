//! A persistent pool of helper threads for the host engine.
//!
//! The threads are started once and parked on a condition variable between
//! calls, so a call costs a wake-up, not an OS thread per helper. A call
//! ([`Pool::run`]) posts a job, a shared `Fn` that each participant runs
//! once; the calling thread runs it too, so a job finishes even when every
//! helper is busy elsewhere. Jobs are independent: several callers may post
//! at once, and a free helper joins the oldest job that still wants one.
//! A job's work therefore has to split itself (the host engine hands out
//! items from an atomic counter), and every participant's share must be
//! welcome whenever it arrives.
//!
//! A panic in a helper is caught there, handed to the caller, and re-raised
//! on the caller's thread when the job ends; the helper lives on. The pool's
//! lock is never held while a job runs, so no panic can poison it.
//!
//! This module is low level: it knows nothing of layouts or checksums.

use std::any::Any;
use std::panic::{self, AssertUnwindSafe};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::thread::JoinHandle;

/// A job's work with its lifetime erased.
///
/// [`Pool::run`] does not return, not even by unwinding, before every
/// helper that took the job has finished it, so the pointee outlives each
/// use, as with `std::thread::scope`.
#[derive(Clone, Copy)]
struct WorkRef(*const (dyn Fn() + Sync));

// SAFETY: the pointee is `Sync` (so `&` to it may be used from any thread)
// and outlives every use (see `WorkRef`).
unsafe impl Send for WorkRef {}

/// A posted job as the pool's state tracks it.
struct Job {
    /// Tells jobs apart.
    id: u64,
    work: WorkRef,
    /// Helpers that may still join it.
    wanted: usize,
    /// Helpers running it now.
    running: usize,
    /// The first panic a helper caught while running it.
    panic: Option<Box<dyn Any + Send>>,
}

/// What the pool's lock guards.
#[derive(Default)]
struct State {
    /// Posted jobs, oldest first.
    jobs: Vec<Job>,
    next_id: u64,
    /// Set when the pool is dropped: helpers leave.
    shutdown: bool,
}

/// What the helpers and the pool share.
#[derive(Default)]
struct Shared {
    state: Mutex<State>,
    /// Signalled when a job is posted or the pool shuts down.
    posted: Condvar,
    /// Signalled when the last running helper of a job finishes it.
    finished: Condvar,
}

impl Shared {
    /// The state. The lock is never held across a job or anything else
    /// that may panic, so a poisoned lock still guards consistent state.
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// Helper threads parked between jobs; joined when dropped.
pub struct Pool {
    shared: Arc<Shared>,
    helpers: Vec<JoinHandle<()>>,
}

impl Pool {
    /// A pool of up to `helpers` threads, named `{name}-{i}`. Threads that
    /// the system refuses to start are left out: the pool then has fewer
    /// (maybe none), and jobs still run, on fewer threads.
    pub fn new(helpers: usize, name: &str) -> Pool {
        let shared = Arc::new(Shared::default());
        let mut handles = Vec::with_capacity(helpers);
        for index in 0..helpers {
            let thread_shared = Arc::clone(&shared);
            let spawned = std::thread::Builder::new()
                .name(format!("{name}-{index}"))
                .spawn(move || helper_loop(&thread_shared));
            match spawned {
                Ok(handle) => handles.push(handle),
                Err(_) => break,
            }
        }
        Pool {
            shared,
            helpers: handles,
        }
    }

    /// Helper threads running.
    pub fn helpers(&self) -> usize {
        self.helpers.len()
    }

    /// Runs `work` on the calling thread and on up to `helpers` helper
    /// threads at once, and returns when every one of them has finished.
    /// A helper may start late (after the caller's own run has returned) or
    /// not at all when the pool is busy. A panic in any of them is raised
    /// again here, after all have finished.
    pub fn run(&self, helpers: usize, work: &(dyn Fn() + Sync)) {
        let helpers = helpers.min(self.helpers.len());
        if helpers == 0 {
            work();
            return;
        }
        let erased: *const (dyn Fn() + Sync + '_) = work;
        // SAFETY: only the lifetime changes (same fat pointer); `Posted`
        // below withdraws the job and waits for its helpers before this
        // function returns or unwinds, so `work` outlives every use.
        let work_ref = WorkRef(unsafe {
            std::mem::transmute::<*const (dyn Fn() + Sync + '_), *const (dyn Fn() + Sync + 'static)>(erased)
        });
        let id = {
            let mut state = self.shared.lock();
            let id = state.next_id;
            state.next_id += 1;
            state.jobs.push(Job {
                id,
                work: work_ref,
                wanted: helpers,
                running: 0,
                panic: None,
            });
            id
        };
        if helpers >= self.helpers.len() {
            self.shared.posted.notify_all();
        } else {
            for _ in 0..helpers {
                self.shared.posted.notify_one();
            }
        }
        let posted = Posted { pool: self, id };
        work();
        if let Some(payload) = posted.finish() {
            panic::resume_unwind(payload);
        }
    }
}

/// A posted job; finishing it (or dropping it, when the caller's own run
/// panicked) stops further helpers joining and waits for the running ones.
struct Posted<'a> {
    pool: &'a Pool,
    id: u64,
}

impl Posted<'_> {
    /// Waits for the job's helpers, removes it, and gives a helper's panic.
    fn finish(self) -> Option<Box<dyn Any + Send>> {
        let panic = self.withdraw();
        std::mem::forget(self);
        panic
    }

    fn withdraw(&self) -> Option<Box<dyn Any + Send>> {
        let shared = &self.pool.shared;
        let mut state = shared.lock();
        loop {
            let at = state
                .jobs
                .iter()
                .position(|job| job.id == self.id)
                .expect("a posted job stays listed until its caller withdraws it");
            let job = &mut state.jobs[at];
            job.wanted = 0;
            if job.running == 0 {
                return state.jobs.remove(at).panic;
            }
            state = shared.finished.wait(state).unwrap_or_else(PoisonError::into_inner);
        }
    }
}

impl Drop for Posted<'_> {
    fn drop(&mut self) {
        // The caller's own run panicked; that panic wins over a helper's.
        drop(self.withdraw());
    }
}

impl Drop for Pool {
    fn drop(&mut self) {
        self.shared.lock().shutdown = true;
        self.shared.posted.notify_all();
        for handle in self.helpers.drain(..) {
            // A helper catches every job's panic, so joining cannot fail;
            // were it to, there is nothing left to clean up.
            let _ = handle.join();
        }
    }
}

/// A helper thread: runs posted jobs until the pool shuts down.
fn helper_loop(shared: &Shared) {
    let mut state = shared.lock();
    loop {
        if state.shutdown {
            return;
        }
        let Some(job) = state.jobs.iter_mut().find(|job| job.wanted > 0) else {
            state = shared.posted.wait(state).unwrap_or_else(PoisonError::into_inner);
            continue;
        };
        job.wanted -= 1;
        job.running += 1;
        let (id, work) = (job.id, job.work);
        drop(state);
        // SAFETY: the job is listed with `running > 0`, so its caller is
        // still inside `Pool::run` and `work` is alive (see `WorkRef`).
        let outcome = panic::catch_unwind(AssertUnwindSafe(|| unsafe { (*work.0)() }));
        state = shared.lock();
        if let Some(job) = state.jobs.iter_mut().find(|job| job.id == id) {
            job.running -= 1;
            if let Err(payload) = outcome {
                job.panic.get_or_insert(payload);
            }
            if job.running == 0 {
                shared.finished.notify_all();
            }
        }
    }
}

#[cfg(test)]
mod tests;
