"""The topology helpers and completion counter through the Python package:
every rule against a naive reference written here, and every error."""

import pytest

import kvcsum


def naive_holders(tp, heads, is_mla=False):
    """{head: [ranks holding it]}, by handing heads out one at a time."""
    if is_mla:
        return {0: list(range(tp))}
    holders = {h: [] for h in range(heads)}
    if tp <= heads:
        for h in range(heads):
            holders[h].append(h // (heads // tp))
    else:
        for rank in range(tp):
            holders[rank // (tp // heads)].append(rank)
    return holders


def naive_reads(rank, local_tp, remote_tp):
    if local_tp >= remote_tp:
        return [rank // (local_tp // remote_tp)]
    share = remote_tp // local_tp
    return [r for r in range(remote_tp) if r // share == rank]


SIZES = [1, 2, 4, 8]


def test_tp_ratio_and_ranks():
    for local in SIZES:
        for remote in SIZES:
            want = local // remote if local >= remote else -(remote // local)
            assert kvcsum.tp_ratio(local, remote) == want
            for rank in range(local):
                assert kvcsum.remote_ranks(rank, local, remote) == naive_reads(rank, local, remote)
                assert kvcsum.handshake_targets(rank, local, remote) == naive_reads(rank, local, remote)
    with pytest.raises(kvcsum.InvalidArgument, match="local_tp 3 is not a multiple of remote_tp 2"):
        kvcsum.tp_ratio(3, 2)
    with pytest.raises(kvcsum.InvalidArgument, match="remote_tp 6 is not a multiple of local_tp 4"):
        kvcsum.remote_ranks(0, 4, 6)
    with pytest.raises(kvcsum.InvalidArgument, match="local_tp is 0"):
        kvcsum.tp_ratio(0, 1)
    with pytest.raises(kvcsum.OutOfBounds, match="local_rank 2"):
        kvcsum.handshake_targets(2, 2, 4)


def test_block_size_ratio_and_replication():
    assert kvcsum.block_size_ratio(64, 16) == 4
    with pytest.raises(kvcsum.InvalidArgument, match="not a multiple"):
        kvcsum.block_size_ratio(16, 64)
    with pytest.raises(kvcsum.InvalidArgument, match="remote_block_size is 0"):
        kvcsum.block_size_ratio(16, 0)
    for tp in SIZES:
        for heads in SIZES:
            assert kvcsum.remote_kv_replicated(tp, heads) == (tp > heads)
            assert kvcsum.local_kv_replicated(tp, heads) == (tp > heads)
            assert kvcsum.local_kv_replicated(tp, heads, is_mla=True)
    with pytest.raises(kvcsum.InvalidArgument, match="total_kv_heads is 0"):
        kvcsum.remote_kv_replicated(2, 0)


def test_heads_and_head_sources():
    for heads in SIZES:
        for tp in SIZES:
            holders = naive_holders(tp, heads)
            for rank in range(tp):
                assert list(kvcsum.rank_heads(rank, tp, heads)) == [h for h in range(heads) if rank in holders[h]]
    for is_mla, head_counts in ((False, SIZES), (True, [1])):
        for heads in head_counts:
            for local in SIZES:
                for remote in SIZES:
                    local_holders = naive_holders(local, heads, is_mla)
                    remote_holders = naive_holders(remote, heads, is_mla)
                    for rank in range(local):
                        mine = [h for h in sorted(local_holders) if rank in local_holders[h]]
                        reads = naive_reads(rank, local, remote)
                        covered = []
                        for source in kvcsum.head_sources(rank, local, remote, heads, is_mla):
                            for h in range(source.first_head, source.first_head + source.num_heads):
                                assert source.remote_rank == next(r for r in reads if r in remote_holders[h])
                                covered.append(h)
                            assert source.local_offset == source.first_head - mine[0]
                        assert covered == mine
    with pytest.raises(kvcsum.InvalidArgument, match="MLA"):
        kvcsum.rank_heads(0, 2, 4, is_mla=True)
    with pytest.raises(kvcsum.InvalidArgument, match="total_kv_heads 6 is not a multiple of tp 4"):
        kvcsum.head_sources(0, 2, 4, 6)


def test_topology_object():
    with kvcsum.Topology("decode", tp_rank=1, tp_size=2, total_kv_heads=8, block_size=32) as topology:
        assert topology.add_remote("prefill", kvcsum.RemoteEngine(tp_size=4, block_bytes=8192, block_size=16))
        assert not topology.add_remote("prefill", kvcsum.RemoteEngine(tp_size=1, block_bytes=1, block_size=32))
        assert topology.remote("prefill") == kvcsum.RemoteEngine(4, 8192, 16, 1)
        assert topology.tp_ratio("prefill") == -2
        assert topology.block_size_ratio("prefill") == 2
        assert topology.remote_ranks("prefill") == [2, 3]
        assert not topology.remote_kv_replicated("prefill")
        assert topology.head_sources("prefill") == kvcsum.head_sources(1, 2, 4, 8)
        with pytest.raises(kvcsum.InvalidArgument, match="own id"):
            topology.add_remote("decode", kvcsum.RemoteEngine(2, 1, 16))
        with pytest.raises(kvcsum.InvalidArgument, match="kernel_blocks 3"):
            topology.add_remote("other", kvcsum.RemoteEngine(2, 1, 16, kernel_blocks=3))
        with pytest.raises(kvcsum.NotFound, match="other"):
            topology.remote("other")
    with pytest.raises(kvcsum.OutOfBounds):
        kvcsum.Topology("decode", tp_rank=2, tp_size=2, total_kv_heads=8, block_size=16)


def test_completion():
    with kvcsum.Completion(2) as completion:
        assert completion.report(0, kvcsum.SENDING, ["a", "b"]) == []
        assert completion.reported(kvcsum.SENDING, "a") == 1
        with pytest.raises(kvcsum.InvalidArgument, match='worker 0 already reported request "a"'):
            completion.report(0, kvcsum.SENDING, ["a"])
        assert completion.report(1, kvcsum.SENDING, ["b", "a"]) == ["b", "a"]
        assert completion.report(1, kvcsum.RECEIVING, ["a"]) == []
        completion.set_expected(3)
        assert completion.report(0, kvcsum.RECEIVING, ["a"]) == ["a"]  # "a" kept its count of 2
        assert completion.report(0, kvcsum.RECEIVING, ["c"]) == []
        assert completion.report(0, kvcsum.RECEIVING, ["d"], expected_workers=1) == ["d"]
        completion.set_expected(3)
        assert completion.report(1, kvcsum.RECEIVING, ["c"]) == []
        assert completion.report(2, kvcsum.RECEIVING, ["c"]) == ["c"]
        with pytest.raises(kvcsum.InvalidArgument, match="direction 7"):
            completion.report(0, 7, ["x"])
        with pytest.raises(kvcsum.InvalidArgument, match="expected_workers is 0"):
            completion.set_expected(0)
        completion.add_invalid_blocks([5, 2])
        completion.add_invalid_blocks([2, 9])
        assert completion.invalid_blocks() == {2, 5, 9}
        completion.clear_invalid_blocks()
        assert completion.invalid_blocks() == set()
