//! Tests of the transfer topology helpers and the completion counter
//! (docs/SPEC.md#11-transfer-topology-for-transfer-agents): every rule
//! against a naive reference (tables built head by head and rank by rank),
//! and every error. A unit-test module of `topology`, so that it does not
//! depend on what the crate makes public.

use super::{
    block_size_ratio, head_sources, local_kv_replicated, rank_heads, remote_kv_replicated, remote_ranks, tp_ratio,
    Completion, Direction, HeadRange, HeadSource, LocalEngine, RemoteEngine, Topology, MAX_TP_SIZE,
};
use crate::base::error::Error;

/// Naive: which ranks hold head `head`, by handing heads out one at a time.
fn naive_holders(tp: u32, heads: u32, is_mla: bool) -> Vec<Vec<u32>> {
    let mut holders = vec![Vec::new(); heads as usize];
    if is_mla {
        holders[0] = (0..tp).collect();
    } else if tp <= heads {
        let per_rank = heads / tp;
        let mut rank = 0;
        let mut given = 0;
        for holder in holders.iter_mut() {
            holder.push(rank);
            given += 1;
            if given == per_rank {
                rank += 1;
                given = 0;
            }
        }
    } else {
        let copies = tp / heads;
        for rank in 0..tp {
            holders[(rank / copies) as usize].push(rank);
        }
    }
    holders
}

/// Naive: the remote ranks a local rank reads from, by matching ranks.
fn naive_remote_ranks(rank: u32, local_tp: u32, remote_tp: u32) -> Vec<u32> {
    if local_tp >= remote_tp {
        // Local ranks are spread evenly over the remote ones in order.
        let share = local_tp / remote_tp;
        (0..remote_tp)
            .filter(|r| r * share <= rank && rank < (r + 1) * share)
            .collect()
    } else {
        let share = remote_tp / local_tp;
        (0..remote_tp).filter(|r| r / share == rank).collect()
    }
}

fn is_invalid(result: Result<impl std::fmt::Debug, Error>, needle: &str) {
    match result {
        Err(Error::InvalidArgument(message)) => {
            assert!(message.contains(needle), "message {message:?} does not name {needle:?}")
        }
        other => panic!("expected InvalidArgument naming {needle:?}, got {other:?}"),
    }
}

#[test]
fn tp_ratio_signs_and_errors() {
    for local in 1..=16u32 {
        for remote in 1..=16u32 {
            let result = tp_ratio(local, remote);
            if local >= remote && local % remote == 0 {
                assert_eq!(result, Ok(i64::from(local / remote)));
            } else if local < remote && remote % local == 0 {
                assert_eq!(result, Ok(-i64::from(remote / local)));
            } else {
                is_invalid(result, "is not a multiple of");
            }
        }
    }
    is_invalid(tp_ratio(0, 4), "local_tp is 0");
    is_invalid(tp_ratio(4, 0), "remote_tp is 0");
    assert_eq!(tp_ratio(MAX_TP_SIZE, 1), Ok(i64::from(MAX_TP_SIZE)));
    assert_eq!(tp_ratio(1, MAX_TP_SIZE), Ok(-i64::from(MAX_TP_SIZE)));
}

#[test]
fn tp_sizes_above_the_largest_are_errors_everywhere() {
    let over = MAX_TP_SIZE + 1;
    let named = "65537 is above the largest TP size, 65536";
    is_invalid(tp_ratio(over, 1), &format!("local_tp {named}"));
    is_invalid(tp_ratio(1, u32::MAX), "remote_tp 4294967295 is above");
    is_invalid(remote_ranks(0, 1, over), &format!("remote_tp {named}"));
    is_invalid(head_sources(0, 1, over, over, false), &format!("remote_tp {named}"));
    is_invalid(rank_heads(0, over, 1, false), &format!("tp {named}"));
    is_invalid(remote_kv_replicated(over, 8), &format!("remote_tp {named}"));
    is_invalid(local_kv_replicated(over, 8, true), &format!("tp {named}"));
    is_invalid(
        Topology::new(
            "decode-0",
            LocalEngine {
                tp_rank: 0,
                tp_size: over,
                ..local(0)
            },
        ),
        &format!("tp {named}"),
    );
    let mut topology = Topology::new("decode-0", local(0)).unwrap();
    is_invalid(
        topology.add_remote("prefill", remote(1 << 31, 16)),
        "tp_size 2147483648 is above",
    );
    assert!(matches!(topology.remote("prefill"), Err(Error::NotFound(_))));
    // The largest works, with as many remote ranks.
    assert_eq!(remote_ranks(0, 1, MAX_TP_SIZE).unwrap().len(), MAX_TP_SIZE as usize);
}

#[test]
fn remote_ranks_match_the_naive_matching() {
    for local_tp in [1u32, 2, 4, 8, 16] {
        for remote_tp in [1u32, 2, 4, 8, 16] {
            for rank in 0..local_tp {
                let naive = naive_remote_ranks(rank, local_tp, remote_tp);
                assert_eq!(
                    remote_ranks(rank, local_tp, remote_tp).unwrap(),
                    naive,
                    "{rank} {local_tp} {remote_tp}"
                );
            }
            // Every remote rank is read by some local rank.
            let mut read: Vec<u32> = (0..local_tp)
                .flat_map(|rank| remote_ranks(rank, local_tp, remote_tp).unwrap())
                .collect();
            read.sort_unstable();
            read.dedup();
            assert_eq!(read, (0..remote_tp).collect::<Vec<_>>());
        }
    }
    assert!(matches!(remote_ranks(4, 4, 2), Err(Error::OutOfBounds(m)) if m.contains("local_rank 4")));
    is_invalid(remote_ranks(0, 3, 2), "not a multiple");
    is_invalid(remote_ranks(0, 0, 2), "local_tp is 0");
}

#[test]
fn block_size_ratio_divides_or_fails() {
    assert_eq!(block_size_ratio(64, 16), Ok(4));
    assert_eq!(block_size_ratio(16, 16), Ok(1));
    is_invalid(
        block_size_ratio(16, 64),
        "local_block_size 16 is not a multiple of remote_block_size 64",
    );
    is_invalid(block_size_ratio(48, 32), "not a multiple");
    is_invalid(block_size_ratio(0, 16), "local_block_size is 0");
    is_invalid(block_size_ratio(16, 0), "remote_block_size is 0");
}

#[test]
fn replication_predicates() {
    for tp in 1..=16u32 {
        for heads in 1..=16u32 {
            assert_eq!(remote_kv_replicated(tp, heads), Ok(tp > heads));
            assert_eq!(local_kv_replicated(tp, heads, false), Ok(tp > heads));
            assert_eq!(local_kv_replicated(tp, heads, true), Ok(true));
        }
    }
    is_invalid(remote_kv_replicated(0, 8), "remote_tp is 0");
    is_invalid(remote_kv_replicated(8, 0), "total_kv_heads is 0");
    is_invalid(local_kv_replicated(0, 8, true), "tp is 0");
    is_invalid(local_kv_replicated(8, 0, false), "total_kv_heads is 0");
}

#[test]
fn rank_heads_match_the_naive_table() {
    for tp in [1u32, 2, 4, 8, 16] {
        for heads in [1u32, 2, 4, 8, 16] {
            let holders = naive_holders(tp, heads, false);
            for rank in 0..tp {
                let held: Vec<u32> = (0..heads).filter(|&h| holders[h as usize].contains(&rank)).collect();
                let range = rank_heads(rank, tp, heads, false).unwrap();
                assert_eq!(
                    (range.first..range.first + range.count).collect::<Vec<_>>(),
                    held,
                    "{rank}/{tp} {heads}"
                );
            }
        }
        for rank in 0..tp {
            assert_eq!(rank_heads(rank, tp, 1, true), Ok(HeadRange { first: 0, count: 1 }));
        }
    }
    is_invalid(rank_heads(0, 3, 8, false), "total_kv_heads 8 is not a multiple of tp 3");
    is_invalid(
        rank_heads(0, 12, 8, false),
        "tp 12 is not a multiple of total_kv_heads 8",
    );
    is_invalid(rank_heads(0, 4, 8, true), "MLA");
    is_invalid(rank_heads(0, 0, 8, false), "tp is 0");
    is_invalid(rank_heads(0, 4, 0, false), "total_kv_heads is 0");
    assert!(matches!(rank_heads(4, 4, 8, false), Err(Error::OutOfBounds(m)) if m.contains("rank 4")));
}

#[test]
fn head_sources_cover_every_local_head_once_from_a_holder() {
    for is_mla in [false, true] {
        let head_counts: &[u32] = if is_mla { &[1] } else { &[1, 2, 4, 8] };
        for &heads in head_counts {
            for local_tp in [1u32, 2, 4, 8, 16] {
                for remote_tp in [1u32, 2, 4, 8, 16] {
                    let local_holders = naive_holders(local_tp, heads, is_mla);
                    let remote_holders = naive_holders(remote_tp, heads, is_mla);
                    for rank in 0..local_tp {
                        let sources = head_sources(rank, local_tp, remote_tp, heads, is_mla).unwrap();
                        let read_from = naive_remote_ranks(rank, local_tp, remote_tp);
                        let local_heads: Vec<u32> = (0..heads)
                            .filter(|&h| local_holders[h as usize].contains(&rank))
                            .collect();
                        let mut covered = Vec::new();
                        for source in &sources {
                            assert!(read_from.contains(&source.remote_rank));
                            let remote_first = (0..heads)
                                .find(|&h| remote_holders[h as usize].contains(&source.remote_rank))
                                .unwrap();
                            assert_eq!(source.remote_offset, source.heads.first - remote_first);
                            assert_eq!(source.local_offset, source.heads.first - local_heads[0]);
                            for head in source.heads.first..source.heads.first + source.heads.count {
                                // The lowest rank read from that holds it.
                                let lowest = read_from
                                    .iter()
                                    .copied()
                                    .find(|r| remote_holders[head as usize].contains(r))
                                    .unwrap();
                                assert_eq!(source.remote_rank, lowest, "head {head}");
                                covered.push(head);
                            }
                        }
                        assert_eq!(
                            covered, local_heads,
                            "rank {rank} {local_tp}->{remote_tp} heads {heads}"
                        );
                    }
                }
            }
        }
    }
    // Local TP 2, remote TP 4, 8 heads: rank 1 (heads 4..8) reads 4..6 from
    // remote rank 2 and 6..8 from remote rank 3.
    let sources = head_sources(1, 2, 4, 8, false).unwrap();
    assert_eq!(sources.len(), 2);
    assert_eq!(
        (sources[0].remote_rank, sources[0].heads),
        (2, HeadRange { first: 4, count: 2 })
    );
    assert_eq!((sources[0].local_offset, sources[0].remote_offset), (0, 0));
    assert_eq!(
        (sources[1].remote_rank, sources[1].heads),
        (3, HeadRange { first: 6, count: 2 })
    );
    assert_eq!((sources[1].local_offset, sources[1].remote_offset), (2, 0));
    is_invalid(
        head_sources(0, 2, 4, 6, false),
        "total_kv_heads 6 is not a multiple of tp 4",
    );
}

/// Naive: the runs of head_sources built head by head, each head from the
/// lowest rank read from that holds it, adjacent heads of one rank merged.
fn naive_head_sources(rank: u32, local_tp: u32, remote_tp: u32, heads: u32, is_mla: bool) -> Vec<HeadSource> {
    let local_holders = naive_holders(local_tp, heads, is_mla);
    let remote_holders = naive_holders(remote_tp, heads, is_mla);
    let read_from = naive_remote_ranks(rank, local_tp, remote_tp);
    let local_heads: Vec<u32> = (0..heads)
        .filter(|&h| local_holders[h as usize].contains(&rank))
        .collect();
    let mut sources: Vec<HeadSource> = Vec::new();
    for &head in &local_heads {
        let remote_rank = read_from
            .iter()
            .copied()
            .find(|r| remote_holders[head as usize].contains(r))
            .unwrap();
        match sources.last_mut() {
            Some(last) if last.remote_rank == remote_rank => last.heads.count += 1,
            _ => {
                let remote_first = (0..heads)
                    .find(|&h| remote_holders[h as usize].contains(&remote_rank))
                    .unwrap();
                sources.push(HeadSource {
                    remote_rank,
                    heads: HeadRange { first: head, count: 1 },
                    local_offset: head - local_heads[0],
                    remote_offset: head - remote_first,
                });
            }
        }
    }
    sources
}

#[test]
fn head_sources_are_the_naive_runs_on_many_sizes() {
    let sizes = [1u32, 2, 3, 4, 6, 8, 12, 16, 24, 48];
    let mut compared = 0;
    for is_mla in [false, true] {
        let head_counts: &[u32] = if is_mla { &[1] } else { &sizes };
        for &heads in head_counts {
            for local_tp in sizes {
                for remote_tp in sizes {
                    let divides = |tp: u32| is_mla || heads % tp == 0 || tp.is_multiple_of(heads);
                    let ratio_ok = local_tp % remote_tp == 0 || remote_tp % local_tp == 0;
                    if !(divides(local_tp) && divides(remote_tp) && ratio_ok) {
                        assert!(head_sources(0, local_tp, remote_tp, heads, is_mla).is_err());
                        continue;
                    }
                    for rank in 0..local_tp {
                        assert_eq!(
                            head_sources(rank, local_tp, remote_tp, heads, is_mla).unwrap(),
                            naive_head_sources(rank, local_tp, remote_tp, heads, is_mla),
                            "rank {rank} {local_tp}->{remote_tp} heads {heads} mla {is_mla}"
                        );
                        compared += 1;
                    }
                }
            }
        }
    }
    assert!(compared > 1000, "{compared}");
}

fn local(rank: u32) -> LocalEngine {
    LocalEngine {
        tp_rank: rank,
        tp_size: 2,
        total_kv_heads: 8,
        is_mla: false,
        block_size: 32,
    }
}

fn remote(tp_size: u32, block_size: u32) -> RemoteEngine {
    RemoteEngine {
        tp_size,
        block_bytes: 4096,
        block_size,
        kernel_blocks: 1,
    }
}

#[test]
fn topology_keeps_each_remote_engine_and_answers_for_it() {
    let mut topology = Topology::new("decode-0", local(1)).unwrap();
    assert_eq!(topology.add_remote("prefill-0", remote(4, 16)), Ok(true));
    // A second handshake of the same engine keeps the first.
    assert_eq!(topology.add_remote("prefill-0", remote(1, 32)), Ok(false));
    assert_eq!(topology.remote("prefill-0"), Ok(remote(4, 16)));
    assert_eq!(topology.tp_ratio("prefill-0"), Ok(-2));
    assert_eq!(topology.block_size_ratio("prefill-0"), Ok(2));
    assert_eq!(topology.remote_ranks("prefill-0"), Ok(vec![2, 3]));
    assert_eq!(topology.remote_kv_replicated("prefill-0"), Ok(false));
    assert_eq!(topology.head_sources("prefill-0"), head_sources(1, 2, 4, 8, false));
    assert_eq!(topology.add_remote("prefill-1", remote(1, 32)), Ok(true));
    assert_eq!(topology.tp_ratio("prefill-1"), Ok(2));
    assert_eq!(topology.remote_ranks("prefill-1"), Ok(vec![0]));
    assert!(matches!(topology.remote("nobody"), Err(Error::NotFound(m)) if m.contains("\"nobody\"")));
    assert!(matches!(topology.tp_ratio("nobody"), Err(Error::NotFound(_))));

    is_invalid(topology.add_remote("decode-0", remote(2, 16)), "local engine's own id");
    is_invalid(topology.add_remote("", remote(2, 16)), "engine_id is empty");
    is_invalid(topology.add_remote("bad-tp", remote(3, 16)), "not a multiple");
    is_invalid(topology.add_remote("bad-block", remote(2, 64)), "local_block_size 32");
    is_invalid(
        topology.add_remote(
            "bad-kernel",
            RemoteEngine {
                kernel_blocks: 3,
                ..remote(2, 16)
            },
        ),
        "kernel_blocks 3",
    );
    is_invalid(
        topology.add_remote(
            "no-kernel",
            RemoteEngine {
                kernel_blocks: 0,
                ..remote(2, 16)
            },
        ),
        "kernel_blocks is 0",
    );
    is_invalid(
        topology.add_remote(
            "no-bytes",
            RemoteEngine {
                block_bytes: 0,
                ..remote(2, 16)
            },
        ),
        "block_bytes is 0",
    );
    let mut six_heads = Topology::new(
        "decode-0",
        LocalEngine {
            total_kv_heads: 6,
            ..local(0)
        },
    )
    .unwrap();
    is_invalid(
        six_heads.add_remote("bad-heads", remote(4, 16)),
        "total_kv_heads 6 is not a multiple of tp 4",
    );
    // A refused engine is not registered.
    assert!(matches!(topology.remote("bad-tp"), Err(Error::NotFound(_))));

    is_invalid(Topology::new("", local(0)), "local_engine_id is empty");
    assert!(matches!(Topology::new("x", local(2)), Err(Error::OutOfBounds(_))));
    is_invalid(
        Topology::new(
            "x",
            LocalEngine {
                block_size: 0,
                ..local(0)
            },
        ),
        "block_size is 0",
    );
}

#[test]
fn completion_counts_distinct_workers_per_request_and_direction() {
    let mut completion = Completion::new(3).unwrap();
    assert_eq!(
        completion.report(0, Direction::Sending, &["a", "b"]),
        Ok(vec![false, false])
    );
    assert_eq!(completion.report(1, Direction::Sending, &["a"]), Ok(vec![false]));
    assert_eq!(completion.report(0, Direction::Receiving, &["a"]), Ok(vec![false]));
    assert_eq!(completion.reported(Direction::Sending, "a"), 2);
    // Worker 1 again: an error, and "b" is not counted either.
    is_invalid(
        completion.report(1, Direction::Sending, &["b", "a"]),
        "worker 1 already reported request \"a\"",
    );
    assert_eq!(completion.reported(Direction::Sending, "b"), 1);
    is_invalid(completion.report(2, Direction::Sending, &["b", "b"]), "listed twice");
    is_invalid(completion.report(2, Direction::Sending, &[""]), "req_ids[0] is empty");
    assert_eq!(completion.report(2, Direction::Sending, &["a"]), Ok(vec![true]));
    assert_eq!(completion.reported(Direction::Sending, "a"), 0);
    // Receiving counts apart.
    assert_eq!(completion.reported(Direction::Receiving, "a"), 1);

    // A new expected count applies to requests first reported after it.
    completion.set_expected(1).unwrap();
    assert_eq!(completion.expected(), 1);
    assert_eq!(
        completion.report(5, Direction::Sending, &["c", "b"]),
        Ok(vec![true, false])
    );
    assert_eq!(completion.report(7, Direction::Sending, &["b"]), Ok(vec![true]));
    is_invalid(completion.set_expected(0), "expected_workers is 0");
    is_invalid(Completion::new(0), "expected_workers is 0");

    completion.add_invalid_blocks(&[9, 3, 9]);
    completion.add_invalid_blocks(&[1, 3]);
    assert_eq!(completion.invalid_blocks(), vec![1, 3, 9]);
    completion.clear_invalid_blocks();
    assert!(completion.invalid_blocks().is_empty());
}
