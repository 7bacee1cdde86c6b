//! What a verification says (SPEC section 10): match, mismatch (the groups
//! and block positions that differ, with the layers in detail mode), or
//! unverified with its reasons, and whether the load passes under the
//! verifier's policy.

use std::fmt::Write as _;

use crate::results::record_facts::Rank;

/// The outcome of comparing a finished load with the producer's checksums.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// Every compared block position is equal.
    Match,
    /// Some compared block position differs.
    Mismatch,
    /// The load could not be compared (see the findings' reasons).
    Unverified,
}

/// Why a load, or one of its groups, could not be compared (SPEC section 10).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Reason {
    /// The producer sent no checksums.
    NoChecksums,
    /// The producer's checksums do not decode.
    InvalidChecksums,
    /// Not every worker reported its checksums of the request.
    WorkersMissing,
    /// A worker checksummed other blocks (or tokens) than scheduled.
    OtherBlocks,
    /// A group is checksummed by one side only.
    OneSidedGroup,
    /// A group's fingerprint differs between the sides (or between the TP
    /// ranks of one stage).
    FingerprintDiffers,
    /// No block position is present on both sides with the same valid tokens.
    NoCommonPosition,
    /// A replica copy was not checksummed, so a check misses it.
    ReplicaMissing,
    /// Shard-keyed state checksummed under different (or unknown) TP sizes.
    StateTpDiffers,
    /// A worker computed its record in the other role than the request is
    /// expected in (a configuration error).
    RoleDiffers,
    /// Loaded positions were not compared (the default; a verifier may opt
    /// out, [`crate::verify::Verifier::set_require_coverage`]).
    UncomparedPositions,
    /// An offload load was judged from records that are not load checks
    /// (a worker sent a plain checksum call's record, which says nothing
    /// about stored checksums).
    NotLoadCheck,
    /// The checksums were computed with different algorithms (SPEC section
    /// 12): between the workers of one side, or between the consumer's
    /// workers and the producer's payload. A configuration difference,
    /// never corrupt data.
    AlgorithmDiffers,
    /// The producer's block size of an attention group is unknown (a plain
    /// payload, and none set), so its positions cannot be lined up with the
    /// consumer's.
    BlockSizeUnknown,
    /// No worker of one side registered a cache of the group: nothing of it
    /// was read.
    NothingRead,
    /// The two sides checksummed other layers or heads (the coverage sent
    /// in the extension differs from the consumer's).
    CoverageDiffers,
    /// The sides declare that they read a layer's bytes differently (SPEC
    /// section 7: another element type, head size or K or V scale), so
    /// equal checksums would not mean equal KV.
    DecodingDiffers,
    /// The sides' caches of a layer have another geometry (SPEC section 7,
    /// "Geometry": its heads, a cell's bytes or K's bytes), as
    /// registrations tell without any call: engines wired with another
    /// head size or element width. A configuration difference, never
    /// corrupt data.
    GeometryDiffers,
}

impl Reason {
    /// The reason in words, as SPEC section 10 lists it.
    pub fn describe(self) -> &'static str {
        match self {
            Reason::NoChecksums => "the producer sent no checksums",
            Reason::InvalidChecksums => "the producer's checksums are invalid",
            Reason::WorkersMissing => "not every worker reported its checksums",
            Reason::OtherBlocks => "a worker checksummed other blocks than scheduled",
            Reason::OneSidedGroup => "a group is checksummed by one side only",
            Reason::FingerprintDiffers => "a group's fingerprint differs",
            Reason::NoCommonPosition => "no block position in common",
            Reason::ReplicaMissing => "a replica was not checksummed",
            Reason::StateTpDiffers => "TP sizes differ for shard-keyed state",
            Reason::RoleDiffers => "a worker checksummed in the other role",
            Reason::UncomparedPositions => "loaded positions were not compared",
            Reason::NotLoadCheck => "a worker's record is not a load check",
            Reason::AlgorithmDiffers => "the checksum algorithms differ",
            Reason::BlockSizeUnknown => "the producer's block size is unknown",
            Reason::NothingRead => "no worker read any cache of a group",
            Reason::CoverageDiffers => "the sides checksummed other layers or heads",
            Reason::DecodingDiffers => "the sides decode a layer's bytes differently",
            Reason::GeometryDiffers => "the sides' caches of a layer have another geometry",
        }
    }
}

/// What the verifier does with an unverified load.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Policy {
    /// Unverified loads pass, with the report's message as a warning.
    FailOpen,
    /// Unverified loads fail like mismatches.
    FailClosed,
}

/// One reason a load or a group could not be compared.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Finding {
    /// The reason.
    pub reason: Reason,
    /// The group concerned; `None` for the whole load.
    pub group_id: Option<u32>,
    /// The details: which worker, group, positions or values.
    pub message: String,
}

/// A layer whose partial checksums differ at a mismatching position (detail
/// mode): heads `first_head .. first_head + num_heads` of `layer_number`, in
/// replica check `check`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LayerDifference {
    /// Model-wide layer number.
    pub layer_number: u32,
    /// Global number of the first head of the range compared.
    pub first_head: u32,
    /// Heads in the range.
    pub num_heads: u32,
    /// The replica check (SPEC section 4) that differs.
    pub check: u32,
}

/// Block positions of one group whose checksums differ.
///
/// Positions are the consumer's block positions. Where the two sides' block
/// sizes differ, positions are compared in runs of `lcm` tokens, so one
/// mismatch can span several consumer positions. For an offload load
/// ([`crate::verify::Verifier::check_stored`]) a mismatch is one position
/// whose stored checksum failed on some worker: `failed_workers` names them
/// and `failed_checks` is empty (each worker checks the sum of its own
/// columns, not a replica check).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Mismatch {
    /// The group.
    pub group_id: u32,
    /// The consumer's first block position that differs.
    pub first_position: u64,
    /// Consecutive consumer positions covered (1 with equal block sizes).
    pub num_positions: u64,
    /// The request position of the first token compared; 0 for a state
    /// group.
    pub first_token: u64,
    /// Tokens compared. A state group's position holds the state after
    /// the request's tokens `0..num_tokens` (SPEC section 6), so it is the
    /// request's token count, which may be 0.
    pub num_tokens: u64,
    /// Whether the group is a state group (SPEC section 6): its one
    /// position holds the request's state, whatever its token count.
    pub state: bool,
    /// The consumer's tokens per block of the group, in which the
    /// positions are counted (the repair plan refuses any other).
    pub block_size: u32,
    /// The replica checks that differ, ascending.
    pub failed_checks: Vec<u32>,
    /// Whether both sides sent per-layer partials and the verifier named the
    /// differing layers, so `layers` is meaningful. Naming layers is bounded
    /// by work in proportion to the input; past that bound mismatches are
    /// reported without layers.
    pub localised: bool,
    /// Detail mode: the layer (head) ranges that differ.
    pub layers: Vec<LayerDifference>,
    /// An offload load's mismatch: the workers whose stored check failed at
    /// the position, by (PP stage, TP rank); empty for a comparison with a
    /// producer's payload.
    pub failed_workers: Vec<Rank>,
}

/// Consumer block positions of one group that were loaded (holding valid
/// tokens) but that no compared position covers, so a verdict says nothing
/// about them: `first_position .. first_position + num_positions`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Uncompared {
    /// The group.
    pub group_id: u32,
    /// The consumer's first uncompared block position of the range.
    pub first_position: u64,
    /// Consecutive consumer positions in the range (at least 1).
    pub num_positions: u64,
}

/// The verdict on one finished load and everything behind it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Report {
    /// The request judged.
    pub req_id: String,
    /// Match, mismatch or unverified.
    pub verdict: Verdict,
    /// The policy it was judged under.
    pub policy: Policy,
    /// Whether the load may proceed: a match, or unverified under fail-open.
    pub passed: bool,
    /// Block positions compared (in the compared granularity), all groups.
    pub compared_positions: u64,
    /// The consumer's loaded block positions (holding valid tokens, in the
    /// groups compared) that no compared position covers: a leading partial
    /// run where block sizes differ, positions past the producer's tokens.
    /// They make the load unverified unless the verifier opted out
    /// (`Verifier::set_require_coverage(false)`); a match then says nothing
    /// about them. The sum of `uncompared`'s ranges.
    pub uncompared_positions: u64,
    /// Where those positions are: ranges per group, ascending by position
    /// within a group, groups in the order the load scheduled them.
    pub uncompared: Vec<Uncompared>,
    /// Positions that differ, by group.
    pub mismatches: Vec<Mismatch>,
    /// Why the load or some groups could not be compared. A mismatch wins
    /// over these, but they are still listed.
    pub unverified: Vec<Finding>,
    /// One line for a log.
    pub message: String,
}

impl Report {
    /// Judges the comparison's outcome under `policy`.
    pub fn new(
        req_id: &str,
        policy: Policy,
        (compared_positions, uncompared): (u64, Vec<Uncompared>),
        mismatches: Vec<Mismatch>,
        unverified: Vec<Finding>,
    ) -> Report {
        let uncompared_positions = uncompared.iter().map(|range| range.num_positions).sum::<u64>();
        let verdict = if !mismatches.is_empty() {
            Verdict::Mismatch
        } else if !unverified.is_empty() {
            Verdict::Unverified
        } else {
            Verdict::Match
        };
        let passed = match verdict {
            Verdict::Match => true,
            Verdict::Mismatch => false,
            Verdict::Unverified => policy == Policy::FailOpen,
        };
        let mut message = String::new();
        match verdict {
            Verdict::Match => {
                let _ = write!(
                    message,
                    "req_id {req_id:?}: match ({compared_positions} block positions compared"
                );
                if uncompared_positions > 0 {
                    let _ = write!(message, "; {uncompared_positions} loaded positions not compared");
                }
                message.push(')');
            }
            Verdict::Mismatch => {
                let _ = write!(message, "req_id {req_id:?}: KV checksum mismatch:");
                for (index, mismatch) in mismatches.iter().enumerate() {
                    let _ = write!(
                        message,
                        "{} {}",
                        if index == 0 { "" } else { ";" },
                        describe_mismatch(mismatch)
                    );
                }
            }
            Verdict::Unverified => {
                let _ = write!(message, "req_id {req_id:?}: KV checksums not verified");
            }
        }
        for finding in &unverified {
            let _ = write!(message, "; unverified: {}", finding.reason.describe());
            if let Some(group_id) = finding.group_id {
                let _ = write!(message, " (group {group_id})");
            }
            let _ = write!(message, ": {}", finding.message);
        }
        if verdict == Verdict::Unverified {
            let _ = write!(
                message,
                "; {}",
                match policy {
                    Policy::FailOpen => "fail-open: the load passes (warning)",
                    Policy::FailClosed => "fail-closed: the load fails",
                }
            );
        }
        Report {
            req_id: req_id.to_owned(),
            verdict,
            policy,
            passed,
            compared_positions,
            uncompared_positions,
            uncompared,
            mismatches,
            unverified,
            message,
        }
    }

    /// The reason of the first finding, if any.
    pub fn reason(&self) -> Option<Reason> {
        self.unverified.first().map(|f| f.reason)
    }
}

/// "group 0 position 2 (tokens 32..48, replica check 1; check 1: layer 3
/// heads 0..1)"; a state group's position "(the state after 100 tokens,
/// ...)".
fn describe_mismatch(mismatch: &Mismatch) -> String {
    let mut text = format!("group {} ", mismatch.group_id);
    if mismatch.num_positions == 1 {
        let _ = write!(text, "position {}", mismatch.first_position);
    } else {
        let _ = write!(
            text,
            "positions {}..{}",
            mismatch.first_position,
            mismatch.first_position + mismatch.num_positions
        );
    }
    if mismatch.state {
        let _ = write!(text, " (the state after {} tokens, ", mismatch.num_tokens);
    } else {
        let _ = write!(
            text,
            " (tokens {}..{}, ",
            mismatch.first_token,
            mismatch.first_token.saturating_add(mismatch.num_tokens)
        );
    }
    if mismatch.failed_workers.is_empty() {
        let checks: Vec<String> = mismatch.failed_checks.iter().map(u32::to_string).collect();
        let _ = write!(text, "replica check {}", checks.join(","));
    } else {
        let workers: Vec<String> = mismatch
            .failed_workers
            .iter()
            .map(|rank| format!("(pp_rank {}, tp_rank {})", rank.pp_rank, rank.tp_rank))
            .collect();
        let _ = write!(text, "stored checksum failed on worker {}", workers.join(", "));
    }
    if mismatch.localised {
        for layer in &mismatch.layers {
            let _ = write!(
                text,
                "; check {}: layer {} heads {}..{}",
                layer.check,
                layer.layer_number,
                layer.first_head,
                layer.first_head as u64 + layer.num_heads as u64
            );
        }
    }
    text.push(')');
    text
}
