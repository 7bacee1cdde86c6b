//! Where a group's tokens sit in a worker's cache (SPEC section 16): decode
//! context parallelism (DCP), which spreads each scheduler block's tokens
//! over `dcp_size` ranks, and compressed states, where one cache slot
//! summarises `tokens_per_slot` consecutive tokens. The checksum's
//! definition does not change: every slot is numbered by its place in the
//! request, so the ranks' partial sums add up to the block's value.

use crate::base::error::{err, Result};

/// The largest DCP size: a DCP group is part of a TP group, whose size is
/// at most `KVCS_MAX_TP_SIZE`.
pub(crate) const MAX_DCP_SIZE: u32 = 65536;

/// How a group's tokens are placed in this worker's cache (`kvcs_group_placement`).
///
/// A *unit* is what one cache slot holds: one token, or with
/// `tokens_per_slot = k > 1` the state of `k` consecutive tokens, unit `u`
/// summarising tokens `u*k .. (u+1)*k`. A scheduler block of `block_size`
/// tokens holds `U = block_size / k` units; with DCP they are spread over
/// the `D = dcp_size` ranks, `U / D` local slots each: the unit at in-block
/// offset `o` lives on rank `(o / I) % D` at local slot `(o / (D*I))*I + o % I`
/// (`I = interleave`), vLLM's `v1/worker/block_table.py`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct GroupPlacement {
    /// Ranks the group's tokens are spread over (vLLM's DCP size); 1 = none.
    pub dcp_size: u32,
    /// This worker's rank among them, below `dcp_size`.
    pub dcp_rank: u32,
    /// Consecutive units one rank holds before the next rank's (vLLM's
    /// `cp_kv_cache_interleave_size`); it divides the local block.
    pub interleave: u32,
    /// Tokens one slot summarises (vLLM's `tokens_per_state`); 1 = a slot per token.
    pub tokens_per_slot: u32,
}

impl Default for GroupPlacement {
    fn default() -> GroupPlacement {
        GroupPlacement::DEFAULT
    }
}

impl GroupPlacement {
    /// One token per slot, every token on this worker.
    pub const DEFAULT: GroupPlacement = GroupPlacement {
        dcp_size: 1,
        dcp_rank: 0,
        interleave: 1,
        tokens_per_slot: 1,
    };

    /// Whether this is [`GroupPlacement::DEFAULT`], the placement every
    /// engine's fast path assumes.
    pub fn is_default(&self) -> bool {
        *self == GroupPlacement::DEFAULT
    }

    /// Whether tokens are spread over several DCP ranks.
    pub fn is_spread(&self) -> bool {
        self.dcp_size > 1
    }

    /// Fails unless this placement fits a group of `block_size` tokens per
    /// scheduler block; the message names the argument and its value.
    pub fn check(&self, group_id: u32, block_size: u32) -> Result<()> {
        let GroupPlacement {
            dcp_size,
            dcp_rank,
            interleave,
            tokens_per_slot,
        } = *self;
        let at = format!("group_id {group_id}, block_size {block_size}");
        if dcp_size == 0 {
            return Err(err!(InvalidArgument, "placement.dcp_size is 0 ({at})"));
        }
        if dcp_size > MAX_DCP_SIZE {
            return Err(err!(
                InvalidArgument,
                "placement.dcp_size {dcp_size} is above the maximum {MAX_DCP_SIZE} ({at})"
            ));
        }
        if dcp_rank >= dcp_size {
            return Err(err!(
                InvalidArgument,
                "placement.dcp_rank {dcp_rank} is not below placement.dcp_size {dcp_size} ({at})"
            ));
        }
        if interleave == 0 {
            return Err(err!(InvalidArgument, "placement.interleave is 0 ({at})"));
        }
        if tokens_per_slot == 0 {
            return Err(err!(InvalidArgument, "placement.tokens_per_slot is 0 ({at})"));
        }
        if !block_size.is_multiple_of(tokens_per_slot) {
            return Err(err!(
                InvalidArgument,
                "block_size {block_size} of group_id {group_id} is not a multiple of placement.tokens_per_slot {tokens_per_slot}"
            ));
        }
        let units = block_size / tokens_per_slot;
        if !units.is_multiple_of(dcp_size) {
            return Err(err!(
                InvalidArgument,
                "block_size {block_size} of group_id {group_id} holds {units} slots, not a multiple of placement.dcp_size {dcp_size}: the scheduler block must split into equal local blocks"
            ));
        }
        let local = units / dcp_size;
        if !local.is_multiple_of(interleave) {
            return Err(err!(
                InvalidArgument,
                "placement.interleave {interleave} does not divide the local block of {local} slots (group_id {group_id}: block_size {block_size} / tokens_per_slot {tokens_per_slot} / dcp_size {dcp_size})"
            ));
        }
        Ok(())
    }

    /// Units (slots across all ranks) of a scheduler block of `block_size` tokens.
    pub fn units_per_block(&self, block_size: u32) -> u32 {
        block_size / self.tokens_per_slot
    }

    /// Local slots per block on this worker: what its cache's kernel blocks tile.
    pub fn local_slots(&self, block_size: u32) -> u32 {
        self.units_per_block(block_size) / self.dcp_size
    }

    /// The in-block unit offset of local slot `slot` on this rank:
    /// `(slot / I) * (D * I) + rank * I + slot % I`; `slot` itself without DCP.
    #[inline]
    pub fn unit_offset(&self, slot: u32) -> u64 {
        if self.dcp_size == 1 {
            return slot as u64;
        }
        let interleave = self.interleave as u64;
        let slot = slot as u64;
        (slot / interleave) * (self.dcp_size as u64 * interleave)
            + self.dcp_rank as u64 * interleave
            + slot % interleave
    }

    /// Units of the request whose every token is below `num_tokens`: a slot
    /// is read only once all of its tokens have KV.
    pub fn complete_units(&self, num_tokens: u64) -> u64 {
        num_tokens / self.tokens_per_slot as u64
    }

    /// The request number of the first unit of block position `position`.
    pub fn first_unit(&self, block_size: u32, position: u64) -> u64 {
        position.wrapping_mul(self.units_per_block(block_size) as u64)
    }

    /// Valid local slots of block position `position` on this rank: those
    /// whose unit lies below the request's complete units, a prefix of the
    /// local block (`unit_offset` grows with the slot).
    pub fn valid_slots(&self, block_size: u32, num_tokens: u64, position: u64) -> u32 {
        let units = self.units_per_block(block_size) as u64;
        let valid_units = self
            .complete_units(num_tokens)
            .saturating_sub(position.saturating_mul(units))
            .min(units);
        self.local_prefix(valid_units) as u32
    }

    /// How many of this rank's local slots have a unit offset below `units`.
    fn local_prefix(&self, units: u64) -> u64 {
        if self.dcp_size == 1 {
            return units;
        }
        let interleave = self.interleave as u64;
        let cycle = self.dcp_size as u64 * interleave;
        let rest = (units % cycle)
            .saturating_sub(self.dcp_rank as u64 * interleave)
            .min(interleave);
        units / cycle * interleave + rest
    }

    /// The step between the request numbers of consecutive local slots of
    /// one run (see [`GroupPlacement::run_length`]): `dcp_size` where each
    /// rank holds one unit at a time (interleave 1), else 1.
    pub fn unit_step(&self) -> u64 {
        if self.dcp_size > 1 && self.interleave == 1 {
            self.dcp_size as u64
        } else {
            1
        }
    }

    /// How many of the `count` local slots from `slot` on have request
    /// numbers `first, first + step, ...` (`step` = [`GroupPlacement::unit_step`]):
    /// all of them without DCP or with interleave 1, else up to the end of
    /// the interleave run `slot` lies in.
    #[inline]
    pub fn run_length(&self, slot: u32, count: u32) -> u32 {
        if self.dcp_size == 1 || self.interleave == 1 {
            count
        } else {
            count.min(self.interleave - slot % self.interleave)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The placement's maps against vLLM's forward map, counted naively:
    /// every in-block offset lands on exactly one (rank, slot), the
    /// inverse gives it back, and the valid slots are those below the
    /// complete units.
    #[test]
    fn slots_invert_the_forward_map_and_valid_slots_are_a_prefix() {
        for dcp_size in [1u32, 2, 3, 4] {
            for interleave in [1u32, 2, 4] {
                for k in [1u32, 2, 4] {
                    let local = 8u32;
                    let block_size = local * dcp_size * k;
                    if !local.is_multiple_of(interleave) {
                        continue;
                    }
                    let units = block_size / k;
                    let mut seen = vec![false; units as usize];
                    for rank in 0..dcp_size {
                        let p = GroupPlacement {
                            dcp_size,
                            dcp_rank: rank,
                            interleave,
                            tokens_per_slot: k,
                        };
                        p.check(0, block_size).unwrap();
                        assert_eq!(p.local_slots(block_size), local);
                        for slot in 0..local {
                            let o = p.unit_offset(slot);
                            assert!(o < units as u64);
                            // vLLM's forward map.
                            assert_eq!((o / interleave as u64) % dcp_size as u64, rank as u64);
                            assert_eq!(
                                (o / (dcp_size * interleave) as u64) * interleave as u64 + o % interleave as u64,
                                slot as u64
                            );
                            assert!(!seen[o as usize]);
                            seen[o as usize] = true;
                        }
                        for num_tokens in 0..3 * block_size as u64 {
                            for position in 0..3u64 {
                                let naive = (0..local)
                                    .filter(|&s| position * units as u64 + p.unit_offset(s) < num_tokens / k as u64)
                                    .count() as u32;
                                assert_eq!(p.valid_slots(block_size, num_tokens, position), naive);
                            }
                        }
                    }
                    assert!(seen.iter().all(|&s| s));
                }
            }
        }
    }

    #[test]
    fn bad_placements_name_the_argument() {
        let p = |dcp_size, dcp_rank, interleave, tokens_per_slot| GroupPlacement {
            dcp_size,
            dcp_rank,
            interleave,
            tokens_per_slot,
        };
        let message = |placement: GroupPlacement, block_size| placement.check(7, block_size).unwrap_err().to_string();
        assert!(message(p(0, 0, 1, 1), 16).contains("dcp_size is 0"));
        assert!(message(p(2, 2, 1, 1), 16).contains("dcp_rank 2 is not below placement.dcp_size 2"));
        assert!(message(p(1, 0, 0, 1), 16).contains("interleave is 0"));
        assert!(message(p(1, 0, 1, 0), 16).contains("tokens_per_slot is 0"));
        assert!(message(p(1, 0, 1, 3), 16).contains("not a multiple of placement.tokens_per_slot 3"));
        assert!(message(p(3, 0, 1, 1), 16).contains("not a multiple of placement.dcp_size 3"));
        assert!(message(p(2, 0, 3, 1), 16).contains("interleave 3 does not divide the local block of 8 slots"));
        p(2, 1, 8, 1).check(7, 16).unwrap();
    }
}
