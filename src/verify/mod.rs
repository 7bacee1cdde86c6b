//! The verifier (SPEC sections 4, 7, 9 and 10): the scheduler-side object
//! that collects every worker's record of a request, builds the producer's
//! payload, and judges a consumer's finished load against it.
//!
//! # Flow
//!
//! 1. [`Verifier::expect`] registers requests with the blocks they were
//!    scheduled with (per group: first position and block ids) and a role.
//! 2. [`Verifier::add_record`] takes each worker's record (bytes from
//!    `kvcs_result_encode`, possibly from another process) and keeps, per
//!    expected request, that worker's part. Requests not expected are
//!    ignored: a record of none of them is accepted and changes nothing (not
//!    even the TP size records must agree on, which is pinned only while
//!    some record is held). A worker's later record of a request replaces its
//!    earlier one.
//! 3. Producer: [`Verifier::payload`] sums the `replica_index == 0` columns
//!    of all `num_workers` workers per group and position, with the group
//!    fingerprints summed over PP stages (one TP rank per stage).
//! 4. Consumer: [`Verifier::check`] forms the replica checks of SPEC section
//!    4 from every worker's columns and compares each with the payload,
//!    giving a [`Report`].
//! 5. Offload loads (SPEC section 8), which have no producer payload:
//!    [`Verifier::check_stored`] judges a load from every worker's
//!    load-check record (`Worker::check_stored`) alone.
//!
//! A request's state stays until [`Verifier::forget`] or a new `expect` of
//! the same id.
//!
//! # Parts
//!
//! `collect` keeps each worker's part of each request and reads the facts
//! all parts must agree on; `produce` builds the payload from them; `check`
//! judges a load group by group, with `compare` lining up positions of other
//! block sizes and naming differing layers, and `decoding` comparing how the
//! sides read a layer's bytes (SPEC section 7); `offload` judges an offload load
//! from load-check records; `report` is the verdict.
//!
//! # Locking
//!
//! One mutex inside guards all state: every method takes `&self`, so a
//! verifier can be shared across threads (`Arc<Verifier>`, or one C handle
//! used from several threads). A call holds the lock only to read or change
//! the state (in time proportional to what it adds or copies, never calling
//! out), so calls cannot deadlock and none waits on another's heavy work:
//! records are decoded and indexed before taking it, and payloads are built
//! and loads compared after it, on copies of the request's shared parts.

mod check;
mod collect;
mod compare;
mod decoding;
mod offload;
mod produce;
pub mod report;

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};

use crate::base::error::{err, Result};
use crate::inputs::blocks::BlockSet;
use crate::inputs::role::Role;
use crate::wire::payload::Payload;
use crate::wire::record::{GroupInfo, Record};

use collect::{check_rank, Pending, Unverified, WorkerPart};
use collect::{Load, Settings};
pub use report::{Finding, LayerDifference, Mismatch, Policy, Reason, Report, Uncompared, Verdict};

/// Collects worker records and verifies loads; see the module documentation.
#[derive(Debug)]
pub struct Verifier {
    num_workers: u32,
    state: Mutex<State>,
}

#[derive(Debug)]
struct State {
    settings: Settings,
    extension: bool,
    /// The TP size of the records held; every record added must agree. It
    /// is set by the first record kept and cleared when none is held.
    tp_size: Option<u32>,
    /// Worker parts held over all requests.
    parts_held: usize,
    requests: HashMap<String, Pending>,
}

impl Verifier {
    /// A verifier for an engine of `num_workers` workers (TP size x PP
    /// stages), fail-closed, without payload extension.
    pub fn new(num_workers: u32) -> Result<Verifier> {
        if num_workers == 0 {
            return Err(err!(InvalidArgument, "num_workers is 0"));
        }
        Ok(Verifier {
            num_workers,
            state: Mutex::new(State {
                settings: Settings {
                    policy: Policy::FailClosed,
                    producer_tp_size: None,
                    producer_block_sizes: Arc::new(HashMap::new()),
                    require_coverage: true,
                },
                extension: false,
                tp_size: None,
                parts_held: 0,
                requests: HashMap::new(),
            }),
        })
    }

    /// Workers per engine, as created.
    pub fn num_workers(&self) -> u32 {
        self.num_workers
    }

    fn lock(&self) -> Result<MutexGuard<'_, State>> {
        self.state
            .lock()
            .map_err(|_| err!(Internal, "the verifier's lock is poisoned by an earlier panic"))
    }

    /// What unverified loads do (default: fail-closed).
    pub fn set_policy(&self, policy: Policy) -> Result<()> {
        self.lock()?.settings.policy = policy;
        Ok(())
    }

    /// Producer: whether payloads carry the kvcsum extension (TP size, block
    /// sizes, the algorithm, and per-layer partials where every record has
    /// them). Off by default: the plain payload is what vLLM reads. A
    /// payload of values that are not weighted (SPEC section 12) carries the
    /// extension whatever this says, since a plain payload means weighted.
    pub fn set_extension(&self, on: bool) -> Result<()> {
        self.lock()?.extension = on;
        Ok(())
    }

    /// Consumer: the producer's TP size, where payloads do not say it (plain
    /// payloads); needed to compare shard-keyed state groups.
    pub fn set_producer_tp_size(&self, tp_size: u32) -> Result<()> {
        if tp_size == 0 {
            return Err(err!(InvalidArgument, "tp_size is 0"));
        }
        self.lock()?.settings.producer_tp_size = Some(tp_size);
        Ok(())
    }

    /// Consumer: the producer's block size of `group_id`, where payloads do
    /// not say it (plain payloads). A plain payload says nothing of it, so
    /// without it (or the extension) the group is unverified
    /// ([`Reason::BlockSizeUnknown`]) whatever the consumer's block size;
    /// the value is trusted as given.
    pub fn set_producer_block_size(&self, group_id: u32, block_size: u32) -> Result<()> {
        if block_size == 0 {
            return Err(err!(InvalidArgument, "block_size is 0 (group_id {group_id})"));
        }
        let mut state = self.lock()?;
        Arc::make_mut(&mut state.settings.producer_block_sizes).insert(group_id, block_size);
        Ok(())
    }

    /// Consumer: whether a load must compare every loaded position to
    /// verify. On (the default), a load whose report counts uncompared
    /// positions (see [`Report::uncompared_positions`]) and no mismatch is
    /// unverified ([`Reason::UncomparedPositions`]), the finding naming
    /// each group's uncompared ranges: positions nobody compared never
    /// count as passed. Off is the explicit opt-out of a consumer that
    /// handles [`Report::uncompared`] itself (reloads or recomputes those
    /// blocks, as the vLLM connector does): such a load is then judged on
    /// its compared positions alone.
    pub fn set_require_coverage(&self, on: bool) -> Result<()> {
        self.lock()?.settings.require_coverage = on;
        Ok(())
    }

    /// Registers every request of `scheduled` in `role`, with the blocks its
    /// workers were scheduled to checksum. A request expected before starts
    /// over (its records are dropped).
    pub fn expect(&self, scheduled: &BlockSet, role: Role) -> Result<()> {
        let mut state = self.lock()?;
        for request in scheduled.requests() {
            let replaced = state
                .requests
                .insert(request.req_id.clone(), Pending::new(role, request.clone()));
            state.release(replaced);
        }
        Ok(())
    }

    /// Drops a request's state; whether it was there.
    pub fn forget(&self, req_id: &str) -> Result<bool> {
        let mut state = self.lock()?;
        let removed = state.requests.remove(req_id);
        let found = removed.is_some();
        state.release(removed);
        Ok(found)
    }

    /// Decodes a worker's record (`Error::Malformed` for bad bytes) and adds it.
    pub fn add_record(&self, bytes: &[u8]) -> Result<()> {
        let record = Record::decode(bytes)?;
        self.add(record)
    }

    /// Adds a decoded record: each expected request's part is kept for its
    /// worker. Fails, keeping nothing, when the record does not validate,
    /// its rank does not fit this engine, or its TP size differs from the
    /// records held. A record of no expected request is accepted and
    /// changes nothing (`Ok`): a worker's batch may hold other requests.
    pub fn add(&self, record: Record) -> Result<()> {
        record.validate()?;
        let rank = record.rank;
        check_rank(rank, self.num_workers)?;
        // Index the parts before taking the lock.
        let groups: Arc<[GroupInfo]> = record.groups.into();
        let parts: Vec<Arc<WorkerPart>> = record
            .requests
            .into_iter()
            .map(|request| {
                Arc::new(WorkerPart::new(
                    rank,
                    (record.role, record.detail, record.algorithm),
                    groups.clone(),
                    request,
                ))
            })
            .collect();
        let mut state = self.lock()?;
        let expected: Vec<Arc<WorkerPart>> = parts
            .into_iter()
            .filter(|part| state.requests.contains_key(&part.request.req_id))
            .collect();
        if expected.is_empty() {
            return Ok(());
        }
        match state.tp_size {
            Some(tp_size) if tp_size != rank.tp_size => {
                return Err(err!(
                    InvalidArgument,
                    "record of tp_size {} differs from tp_size {tp_size} of the records held",
                    rank.tp_size
                ));
            }
            _ => state.tp_size = Some(rank.tp_size),
        }
        for part in expected {
            let pending = state.requests.get_mut(&part.request.req_id).expect("filtered above");
            if pending.reports.insert((rank.pp_rank, rank.tp_rank), part).is_none() {
                state.parts_held += 1;
            }
        }
        Ok(())
    }

    /// Producer: the payload of `req_id` (encode it with
    /// [`Payload::encode`]). `NotReady` until every worker reported it;
    /// `InvalidArgument` when the records cannot make a payload (a worker
    /// checksummed other blocks than scheduled, fingerprints or block sizes
    /// of one stage disagree); `NotFound` for a request not expected.
    pub fn payload(&self, req_id: &str) -> Result<Payload> {
        let (pending, extension) = {
            let state = self.lock()?;
            (state.pending(req_id)?.clone(), state.extension)
        };
        if pending.role != Role::Producer {
            return Err(err!(
                InvalidArgument,
                "req_id {req_id:?} is expected as a consumer; payloads are built for producers"
            ));
        }
        if let Err(Unverified(reason, message)) = pending.check_complete(self.num_workers) {
            return Err(err!(
                NotReady,
                "no payload for req_id {req_id:?}: {}: {message}",
                reason.describe()
            ));
        }
        let algorithm = pending.check_roles().and_then(|()| pending.algorithm());
        let algorithm = match algorithm {
            Ok(algorithm) => algorithm,
            Err(Unverified(reason, message)) => {
                return Err(err!(
                    InvalidArgument,
                    "no payload for req_id {req_id:?}: {}: {message}",
                    reason.describe()
                ))
            }
        };
        let tp_size = pending.tp_size().unwrap_or(1);
        produce::build_payload(req_id, &pending, extension, tp_size, algorithm)
    }

    /// Consumer: judges the finished load of `req_id` against the producer's
    /// payload bytes (`None`: the producer sent none). Bad payload bytes make
    /// the load unverified, not an error; `NotFound` for a request not
    /// expected, `InvalidArgument` for one expected as a producer.
    pub fn check(&self, req_id: &str, payload: Option<&[u8]>) -> Result<Report> {
        self.check_decoded(req_id, payload.map(Payload::decode))
    }

    /// Like [`Verifier::check`], with the payload as the base64 text of
    /// `kv_transfer_params["kv_checksums"]`; text that is not standard padded
    /// base64 makes the load unverified (invalid checksums).
    pub fn check_base64(&self, req_id: &str, text: &[u8]) -> Result<Report> {
        let decoded = crate::wire::payload::decode_base64(text).and_then(|bytes| Payload::decode(&bytes));
        self.check_decoded(req_id, Some(decoded))
    }

    /// Consumer: judges the finished offload load of `req_id` (SPEC section
    /// 8) from its workers' load-check records alone (`Worker::check_stored`,
    /// added with [`Verifier::add_record`]): a match when every worker
    /// matched at every position it checked; a mismatch naming each group
    /// and block position (with its tokens and workers) whose stored
    /// checksum failed on some worker; unverified when not every worker
    /// reported, or a record is not a load check's
    /// ([`Reason::NotLoadCheck`]). `NotFound` for a request not expected,
    /// `InvalidArgument` for one expected as a producer.
    pub fn check_stored(&self, req_id: &str) -> Result<Report> {
        Ok(self.load(req_id)?.judge_stored())
    }

    fn check_decoded(&self, req_id: &str, decoded: Option<Result<Payload>>) -> Result<Report> {
        Ok(self.load(req_id)?.judge(decoded))
    }

    /// The consumer's load of `req_id`: copies (of shared parts) taken under
    /// the lock, for judging outside it. `InvalidArgument` for a request
    /// expected as a producer.
    fn load<'a>(&self, req_id: &'a str) -> Result<Load<'a>> {
        let (pending, settings) = {
            let state = self.lock()?;
            (state.pending(req_id)?.clone(), state.settings.clone())
        };
        if pending.role != Role::Consumer {
            return Err(err!(
                InvalidArgument,
                "req_id {req_id:?} is expected as a producer; loads are checked for consumers"
            ));
        }
        Ok(Load {
            req_id,
            settings,
            pending,
            num_workers: self.num_workers,
        })
    }
}

impl State {
    /// Accounts for a request's state that was dropped; with no part held,
    /// the TP size is free again.
    fn release(&mut self, dropped: Option<Pending>) {
        if let Some(dropped) = dropped {
            self.parts_held -= dropped.reports.len();
            if self.parts_held == 0 {
                self.tp_size = None;
            }
        }
    }

    fn pending(&self, req_id: &str) -> Result<&Pending> {
        self.requests
            .get(req_id)
            .ok_or_else(|| err!(NotFound, "req_id {req_id:?} is not expected by this verifier"))
    }
}
