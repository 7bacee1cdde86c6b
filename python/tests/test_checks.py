"""What the package checks before a call reaches C, and what it keeps
alive (defects P1-P8): the coverage option and the uncompared count,
handle types, close from several threads, the arrays behind a worker,
stored-checksum buffers, integer ranges, NUL in C strings, repair_plan's
and Completion.report's errors. Code that crashed the interpreter before
the fixes runs in a subprocess, so a crash fails the test instead of
killing pytest. Random data is seeded; the seed is printed (and named in
failures), and KVCS_SEED changes it."""

import os
import pathlib
import re
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import kvcsum
from kvcsum import _lib

ROOT = pathlib.Path(__file__).resolve().parents[2]
SEED = int(os.environ.get("KVCS_SEED", "0x636B73"), 0)
MASK = (1 << 64) - 1
TOKENS = 8


@pytest.fixture
def seed(request):
    value = SEED + sum(map(ord, request.node.name))
    print(f"random data seed {value:#x} (KVCS_SEED={SEED:#x})")
    return value


def run_python(code: str, *args) -> subprocess.CompletedProcess:
    """Runs `code` in a fresh interpreter that loads this package and
    library; a crash there is a return code here."""
    env = dict(os.environ)
    package_root = str(pathlib.Path(kvcsum.__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join([package_root] + [p for p in [env.get("PYTHONPATH")] if p])
    env["KVCSUM_LIBRARY"] = kvcsum.library().path
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code), *map(str, args)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def assert_clean_exit(done: subprocess.CompletedProcess, seed: int) -> None:
    assert done.returncode == 0, (
        f"seed {seed:#x}: the subprocess ended with {done.returncode} "
        f"(negative: killed by signal {-done.returncode})\n{done.stdout}\n{done.stderr}"
    )


def random_cache(rng, blocks, heads=2, pieces=4):
    """[blocks, heads, TOKENS, pieces] uint64 (HND), never zeros."""
    return rng.integers(1, 2**64, (blocks, heads, TOKENS, pieces), dtype=np.uint64, endpoint=False)


def checksum_record(cache, num_tokens, block_ids, role, identity=b"layer 0", group_id=0):
    with kvcsum.Worker(num_threads=1) as worker, kvcsum.Blocks() as blocks:
        worker.add_region_of(cache)
        worker.add_group(group_id, TOKENS)
        worker.add_layer(kvcsum.layer(cache, "HND", layer_number=0, group_id=group_id, identity=identity))
        blocks.add_request("req", num_tokens).add_group("req", group_id, block_ids)
        with worker.checksum(blocks, role) as result:
            return result.encode()


def producer_payload(cache, num_tokens, block_ids):
    with kvcsum.Verifier(1) as producer, kvcsum.Blocks() as blocks:
        blocks.add_request("req", num_tokens).add_group("req", 0, block_ids)
        producer.expect(blocks, kvcsum.PRODUCER)
        producer.add_record(checksum_record(cache, num_tokens, block_ids, kvcsum.PRODUCER))
        return producer.payload("req")


# --- P1: the coverage option, the uncompared count, the reason constants ----------


def test_reason_constants_are_the_headers():
    header = (ROOT / "include" / "kvcsum.h").read_text()
    reasons = dict(re.findall(r"^\s*KVCS_UNVERIFIED_(\w+) = (\d+),", header, flags=re.M))
    assert reasons, "no kvcs_unverified_reason in kvcsum.h"
    for name, value in reasons.items():
        if name != "NONE":
            assert getattr(kvcsum, name) == int(value), name
            assert name in kvcsum.__all__, name
    assert kvcsum.UNCOMPARED_POSITIONS == 11 and kvcsum.NOT_LOAD_CHECK == 12
    assert kvcsum.WHOLE_LOAD == 0xFFFFFFFF and "#define KVCS_WHOLE_LOAD UINT32_MAX" in header


def test_uncompared_positions_are_unverified_by_default_and_pass_only_when_opted_out(seed):
    rng = np.random.default_rng(seed)
    cache = random_cache(rng, 5)
    block_ids = [int(b) for b in rng.permutation(5)[:3]]
    # The producer sent 21 tokens, the consumer loaded 24: the last position
    # holds 5 tokens on one side and 8 on the other, so it is not compared.
    payload = producer_payload(cache, 2 * TOKENS + 5, block_ids)
    record = checksum_record(cache, 3 * TOKENS, block_ids, kvcsum.CONSUMER)
    # None: the default, which requires every loaded position compared.
    for require in (None, False, True):
        with kvcsum.Verifier(1) as consumer, kvcsum.Blocks() as scheduled:
            if require is not None:
                consumer.set_require_coverage(require)
            scheduled.add_request("req", 3 * TOKENS).add_group("req", 0, block_ids)
            consumer.expect(scheduled, kvcsum.CONSUMER)
            consumer.add_record(record)
            with consumer.check("req", payload) as report:
                assert (report.compared_positions, report.uncompared_positions) == (2, 1), f"seed {seed:#x}"
                if require is not False:
                    assert report.verdict == kvcsum.UNVERIFIED and not report.passed, report.message
                    assert "positions 2..3" in report.message, report.message
                    assert report.reason == kvcsum.UNCOMPARED_POSITIONS
                    assert [(f.reason, f.group_id) for f in report.findings] == [(kvcsum.UNCOMPARED_POSITIONS, 0)]
                else:
                    assert report.verdict == kvcsum.MATCH and report.passed, report.message
    # Everything loaded compared: nothing uncompared.
    with kvcsum.Verifier(1) as consumer, kvcsum.Blocks() as scheduled:
        consumer.set_require_coverage(True)
        scheduled.add_request("req", 2 * TOKENS + 5).add_group("req", 0, block_ids)
        consumer.expect(scheduled, kvcsum.CONSUMER)
        consumer.add_record(checksum_record(cache, 2 * TOKENS + 5, block_ids, kvcsum.CONSUMER))
        with consumer.check("req", payload) as report:
            assert report.verdict == kvcsum.MATCH and report.uncompared_positions == 0, report.message
        with pytest.raises(ValueError, match="on is 2"):
            consumer.set_require_coverage(2)


# --- P2: a handle of another type --------------------------------------------------


def test_a_handle_of_another_type_is_a_type_error_not_a_crash():
    done = run_python(
        """
        import kvcsum
        worker, verifier, blocks = kvcsum.Worker(), kvcsum.Verifier(1), kvcsum.Blocks()
        blocks.add_request("r", 4).add_group("r", 0, [0])
        calls = {
            "checksum": lambda: worker.checksum(verifier),
            "store": lambda: worker.store(worker),
            "check_stored": lambda: worker.check_stored(kvcsum.Completion(1)),
            "expect": lambda: verifier.expect(worker, kvcsum.CONSUMER),
            "expect_none": lambda: verifier.expect(None, kvcsum.CONSUMER),
            "add_layer": lambda: worker.add_layer(blocks),
            "add_state": lambda: worker.add_state(0, 0, [blocks], num_blocks=1),
            "add_remote": lambda: kvcsum.Topology(
                "a", tp_rank=0, tp_size=1, total_kv_heads=1, block_size=16
            ).add_remote("b", verifier),
        }
        for name, call in calls.items():
            try:
                call()
                print(name, "accepted")
            except TypeError as error:
                print(name, "TypeError", error)
        """
    )
    assert_clean_exit(done, 0)
    lines = dict(line.split(" ", 1) for line in done.stdout.splitlines())
    assert lines == {
        "checksum": "TypeError blocks must be a kvcsum.Blocks, got kvcsum.Verifier",
        "store": "TypeError blocks must be a kvcsum.Blocks, got kvcsum.Worker",
        "check_stored": "TypeError blocks must be a kvcsum.Blocks, got kvcsum.Completion",
        "expect": "TypeError scheduled must be a kvcsum.Blocks, got kvcsum.Worker",
        "expect_none": "TypeError scheduled must be a kvcsum.Blocks, got builtins.NoneType",
        "add_layer": "TypeError layer must be a kvcsum.Layer, got kvcsum.Blocks",
        "add_state": "TypeError tensors[0] must be a kvcsum.StateTensor, got kvcsum.Blocks",
        "add_remote": "TypeError remote must be a kvcsum.RemoteEngine, got kvcsum.Verifier",
    }, done.stdout


# --- P3: close from several threads --------------------------------------------------


def test_close_from_several_threads_frees_once_and_later_calls_raise(seed):
    done = run_python(
        """
        import sys, threading
        import numpy as np
        import kvcsum

        sys.setswitchinterval(1e-6)  # switch threads as often as possible
        rng = np.random.default_rng(int(sys.argv[1]))
        cache = rng.integers(1, 2**64, (4, 2, 8, 4), dtype=np.uint64, endpoint=False)
        THREADS = 4

        def together(work):
            barrier = threading.Barrier(THREADS)
            errors = []

            def run(i):
                barrier.wait()
                try:
                    work(i)
                except Exception as error:  # reported below; a crash ends the process
                    errors.append(repr(error))

            threads = [threading.Thread(target=run, args=(i,)) for i in range(THREADS)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            return errors

        # Every thread closes every handle of the round (before the fix this
        # freed a handle twice within the first hundred rounds or so).
        for _ in range(400):
            handles = [kvcsum.Blocks(), kvcsum.Verifier(1), kvcsum.Completion(1), kvcsum.Worker(num_threads=1)]
            errors = together(lambda i: [h.close() for h in handles])
            assert not errors, errors

        # One thread closes while the others call: each call succeeds or
        # raises "closed", and nothing is used after it was freed.
        closed = 0
        for _ in range(150):
            worker = kvcsum.Worker(num_threads=1)
            worker.add_region_of(cache)
            worker.add_group(0, 8)
            worker.add_layer(kvcsum.layer(cache, "HND", layer_number=0))
            blocks = kvcsum.Blocks().add_request("r", 20).add_group("r", 0, [2, 0, 3])

            def work(i):
                global closed
                if i == 0:
                    worker.close()
                    blocks.close()
                    return
                for k in range(5):
                    try:
                        with worker.checksum(blocks) as result:
                            assert result.column("r", 0).shape == (3,)
                        blocks.add_request(f"s{i}-{k}", 1)
                    except ValueError as error:
                        assert "is closed" in str(error), error
                        closed += 1

            errors = together(work)
            assert not errors, errors
        print("closed", closed)
        """,
        seed,
    )
    assert_clean_exit(done, seed)
    assert done.stdout.startswith("closed "), done.stdout


def test_a_call_after_close_raises_a_clear_error():
    worker, verifier = kvcsum.Worker(), kvcsum.Verifier(1)
    worker.close()
    verifier.close()
    with pytest.raises(ValueError, match="this Worker is closed"):
        worker.add_group(0, 8)
    with pytest.raises(ValueError, match="this Verifier is closed"):
        verifier.set_policy(kvcsum.FAIL_OPEN)
    with kvcsum.Blocks() as blocks:
        with pytest.raises(ValueError, match="this Worker is closed"):
            worker.checksum(blocks)
    with pytest.raises(ValueError, match="this Blocks is closed"):
        with kvcsum.Worker() as open_worker:
            open_worker.checksum(blocks)
    worker.close()  # again: a no-op


# --- P4: the arrays behind a worker stay alive ----------------------------------------


def test_the_worker_and_the_layer_keep_their_arrays(seed):
    done = run_python(
        """
        import gc, sys
        import numpy as np
        import kvcsum

        rng = np.random.default_rng(int(sys.argv[1]))
        SHAPE = (64, 2, 16, 64)  # [blocks, heads, tokens, pieces] uint64: 1 MiB, HND
        BLOCK_IDS = [int(b) for b in rng.permutation(64)[:6]]
        NUM_TOKENS = 5 * 16 + 7

        def fresh():
            return rng.integers(1, 2**64, SHAPE, dtype=np.uint64, endpoint=False)

        def churn():
            # Take the freed memory back and write other values over it.
            return [fresh() for _ in range(6)] + [rng.integers(1, 2**64, 64, dtype=np.uint64) for _ in range(64)]

        def blocks():
            blocks = kvcsum.Blocks().add_request("r", NUM_TOKENS).add_group("r", 0, BLOCK_IDS)
            hashes = [bytes(rng.integers(0, 256, 32, dtype=np.uint8)) for _ in BLOCK_IDS]
            return blocks.set_hashes("r", 0, hashes)

        def values(worker, request):
            with worker.checksum(request) as result:
                return result.column("r", 0)

        def expected_of(cache, request):
            with kvcsum.Worker(num_threads=1) as reference:
                reference.add_region_of(cache)
                reference.add_group(0, 16)
                reference.add_layer(kvcsum.layer(cache, "HND", layer_number=0))
                return values(reference, request)

        request = blocks()

        # add_region_of and the layer of kvcsum.layer(): the worker keeps the cache.
        cache = fresh()
        first_expected = expected_of(cache, request)
        worker = kvcsum.Worker(num_threads=1)
        worker.add_region_of(cache)
        worker.add_group(0, 16)
        worker.add_layer(kvcsum.layer(cache, "HND", layer_number=0))
        del cache
        gc.collect()
        kept = churn()
        assert (values(worker, request) == first_expected).all(), "add_region_of / add_layer"

        # A Layer keeps its array before it is added (the region is given as
        # an address, which the caller keeps; here the Layer does).
        cache = fresh()
        expected = expected_of(cache, request)
        second = kvcsum.Worker(num_threads=1)
        second.add_region(*kvcsum.region_of(cache))
        second.add_group(0, 16)
        layer = kvcsum.layer(cache, "HND", layer_number=0)
        del cache
        gc.collect()
        kept += churn()
        second.add_layer(layer)
        del layer
        gc.collect()
        kept += churn()
        assert (values(second, request) == expected).all(), "kvcsum.layer"

        # add_stored_of: the worker keeps the buffer it writes.
        stored = rng.integers(1, 2**64, (64, 2), dtype=np.uint64)  # value, stamp per block id
        worker.add_stored_of(0, stored)
        del stored
        gc.collect()
        small = [rng.integers(1, 2**64, 64, dtype=np.uint64) for _ in range(64)]
        worker.store(request).close()
        for array in small:  # other values over whatever reused the memory
            array[...] = rng.integers(1, 2**64, 64, dtype=np.uint64)
        with worker.check_stored(request) as result:
            outcomes = list(result.stored("r", 0))
        assert outcomes == [kvcsum.STORED_MATCHED] * len(BLOCK_IDS), outcomes

        # Closing the workers releases the arrays (and frees nothing twice).
        worker.close()
        second.close()
        del worker, second
        gc.collect()
        kept += churn()
        print("ok")
        """,
        seed,
    )
    assert_clean_exit(done, seed)
    assert done.stdout.strip() == "ok"


# --- P5: stored-checksum buffers ----------------------------------------------------------


def test_block_checksum_bytes_is_the_headers():
    header = (ROOT / "include" / "kvcsum.h").read_text()
    defined = re.search(r"^#define KVCS_BLOCK_CHECKSUM_BYTES (\d+)", header, flags=re.M)
    if defined:
        assert kvcsum.BLOCK_CHECKSUM_BYTES == int(defined.group(1))
    else:  # said in words by kvcs_worker_add_stored's documentation
        said = re.search(r"section 8\): (\d+) bytes per block id", header)
        assert said, "kvcsum.h states no bytes per block id for kvcs_worker_add_stored"
        assert kvcsum.BLOCK_CHECKSUM_BYTES == int(said.group(1))
    assert kvcsum.BLOCK_CHECKSUM_BYTES == _lib.BLOCK_CHECKSUM_BYTES


def test_add_stored_of_refuses_views_dtypes_and_sizes_that_do_not_fit(seed):
    rng = np.random.default_rng(seed)
    width = kvcsum.BLOCK_CHECKSUM_BYTES
    words = width // 8  # uint64 elements per block id
    kv = random_cache(rng, 6)
    hashes = [bytes(rng.integers(0, 256, 32, dtype=np.uint8)) for _ in range(3)]
    with kvcsum.Worker(num_threads=1) as worker, kvcsum.Blocks() as blocks:
        worker.add_region_of(kv)
        worker.add_group(0, TOKENS)
        worker.add_layer(kvcsum.layer(kv, "HND", layer_number=0, identity=b"layer 0"))
        big = rng.integers(1, 2**64, 12 * words, dtype=np.uint64)
        refused = [
            (big[::2], "not C-contiguous"),
            (big[::-1], "not C-contiguous"),
            (big.reshape(-1, 2)[:, 0], "not C-contiguous"),  # a column
            (rng.random(6 * words), "elements of float64"),
            (big.view(np.int64), "elements of int64"),
            (np.ones(6 * width, dtype=bool), "elements of bool"),
            (big.astype(">u8"), "elements of >u8"),
            (np.frombuffer(big.tobytes(), dtype=np.uint64), "read-only"),
            (np.ones(6 * width + 3, dtype=np.uint8), f"holds {6 * width + 3} bytes, not a whole number"),
        ]
        for array, message in refused:
            with pytest.raises(ValueError, match=f"^array .*{re.escape(message)}"):
                worker.add_stored_of(0, array)
        with pytest.raises(TypeError):
            worker.add_stored_of(0, [0] * 6)
        # Fitting buffers: uint64 words, and raw bytes of the same size.
        blocks.add_request("o", 3 * TOKENS).add_group("o", 0, [4, 0, 5]).set_hashes("o", 0, hashes)
        words_buffer = rng.integers(1, 2**64, 6 * words, dtype=np.uint64)
        worker.add_stored_of(0, words_buffer)
        worker.store(blocks).close()
        byte_buffer = rng.integers(1, 256, 6 * width, dtype=np.uint8)
        worker.add_stored_of(0, byte_buffer)
        worker.store(blocks).close()
        for block in (4, 0, 5):  # the same bytes where the store wrote
            written = words_buffer[block * words : (block + 1) * words].tobytes()
            assert byte_buffer[block * width : (block + 1) * width].tobytes() == written, f"seed {seed:#x}"
        with worker.check_stored(blocks) as result:
            assert list(result.stored("o", 0)) == [kvcsum.STORED_MATCHED] * 3


# --- P6: integers ---------------------------------------------------------------------


def test_integers_outside_their_c_type_are_refused_not_wrapped(seed):
    rng = np.random.default_rng(seed)
    cache = random_cache(rng, 4)
    outside = [
        (lambda: kvcsum.layer(cache, "HND", layer_number=2**32 + 3), "layer_number is 4294967299, outside uint32_t"),
        (lambda: kvcsum.layer(cache, "HND", layer_number=0, first_head=-1), "first_head is -1, outside uint32_t"),
        (lambda: kvcsum.Blocks().add_request("r", np.int64(-1)), "num_tokens is -1, outside uint64_t"),
        (lambda: kvcsum.Blocks().add_request("r", 2**64), "num_tokens is 18446744073709551616, outside uint64_t"),
        (
            lambda: kvcsum.Topology("local", tp_rank=0, tp_size=2**32 + 2, total_kv_heads=8, block_size=16),
            "tp_size is 4294967298, outside uint32_t",
        ),
        (lambda: kvcsum.Worker(tp_rank=2**32), "tp_rank is 4294967296, outside uint32_t"),
        (lambda: kvcsum.Worker(device=2**31), "device is 2147483648, outside int32_t"),
        (lambda: kvcsum.Verifier(-2), "num_workers is -2, outside uint32_t"),
        (lambda: kvcsum.Completion(np.int64(2**40)), "expected_workers is 1099511627776, outside uint32_t"),
        (lambda: kvcsum.tp_ratio(2**32 + 1, 1), "local_tp is 4294967297, outside uint32_t"),
        (lambda: kvcsum.rank_heads(0, 1, -8), "total_kv_heads is -8, outside uint32_t"),
        (lambda: _lib.Segment(bytes_per_token=-8), "bytes_per_token is -8, outside uint32_t"),
        (lambda: _lib.Segment(block_stride=2**63), "block_stride is 9223372036854775808, outside int64_t"),
        (
            lambda: kvcsum.Blocks().add_request("r", 1).add_group("r", 0, [1, 2**32]),
            r"block_ids must be in \[0, 2\*\*32\)",
        ),
        (lambda: kvcsum.Blocks().add_request("r", 1).add_group("r", 2**32, [1]), "group_id is 4294967296"),
    ]
    for call, message in outside:
        with pytest.raises(ValueError, match=message) as caught:
            call()
        assert not isinstance(caught.value, kvcsum.Error), "refused here, not by C"
    not_integers = [
        (lambda: kvcsum.Blocks().add_request("r", 4.0), "num_tokens must be an integer .*got float"),
        (lambda: kvcsum.Blocks().add_request("r", "4"), "num_tokens must be an integer .*got str"),
        (lambda: kvcsum.Worker(tp_size=True), r"tp_size must be an integer \(uint32_t\), got a bool"),
        (lambda: kvcsum.layer(cache, "HND", layer_number=np.bool_(True)), "layer_number must be an integer"),
        (lambda: kvcsum.Blocks().add_request("r", 1).add_group("r", 0, [1, False]), r"block_ids\[1\] is a bool"),
        (
            lambda: kvcsum.Blocks().add_request("r", 1).add_group("r", 0, [1.5]),
            "block_ids must be a 1-D sequence of integers",
        ),
        (lambda: kvcsum.Verifier(1).expect(kvcsum.Blocks(), None), "role must be an integer"),
        (lambda: kvcsum.Worker().add_alias(0, 1, 0, 7), "identity must be bytes-like, got int"),
        (lambda: kvcsum.Worker().block_tags(0, b"12345678"), "hashes must be a sequence of bytes objects"),
    ]
    for call, message in not_integers:
        with pytest.raises(TypeError, match=message):
            call()
    with kvcsum.Worker(num_threads=1) as worker, kvcsum.Blocks() as blocks:
        with pytest.raises(ValueError, match="cuda_stream is -1, outside uintptr_t"):
            worker.checksum(blocks, cuda_stream=-1)
        with pytest.raises(ValueError, match="address is -1, outside uint64_t"):
            worker.add_region(-1, 8)
        with pytest.raises(ValueError, match="element_size is 4294967298, outside uint32_t"):
            worker.add_state(0, 0, [kvcsum.StateTensor(cache.ctypes.data, 64, 8, 0, 1, 1, 8, 2**32 + 2)], num_blocks=4)
        with pytest.raises(ValueError, match="block_bytes is -1, outside uint64_t"):
            kvcsum.Topology("a", tp_rank=0, tp_size=1, total_kv_heads=1, block_size=16).add_remote(
                "b", kvcsum.RemoteEngine(tp_size=1, block_bytes=-1, block_size=16)
            )


def test_numpy_integers_give_what_python_ints_give(seed):
    rng = np.random.default_rng(seed)
    cache = random_cache(rng, 6)
    block_ids = [int(b) for b in rng.permutation(6)[:3]]

    def values(to):
        with kvcsum.Worker(tp_rank=to(0), tp_size=to(1), num_threads=to(1)) as worker, kvcsum.Blocks() as blocks:
            worker.add_region_of(cache)
            worker.add_group(to(2), to(TOKENS))
            worker.add_layer(kvcsum.layer(cache, "HND", layer_number=to(3), group_id=to(2), first_head=to(4)))
            blocks.add_request("r", to(2 * TOKENS + 3)).add_group("r", to(2), np.array(block_ids, dtype=np.int64))
            with worker.checksum(blocks, to(kvcsum.CONSUMER)) as result:
                return result.column("r", to(2), to(0))

    expected = values(int)
    assert expected.shape == (3,) and expected.any(), f"seed {seed:#x}"
    for numpy_type in (np.uint32, np.int64, np.uint64, np.int16):
        np.testing.assert_array_equal(values(numpy_type), expected, err_msg=f"{numpy_type} seed {seed:#x}")


# --- P7: NUL in C strings -------------------------------------------------------------------


def test_strings_holding_nul_are_refused_not_cut():
    with kvcsum.Blocks() as blocks:
        with pytest.raises(ValueError, match=r"req_id 'local\\x00A' holds a NUL"):
            blocks.add_request("local\0A", 4)
        blocks.add_request("local", 4)  # what C would have seen
        with pytest.raises(ValueError, match="req_id .* holds a NUL"):
            blocks.add_group("local\0B", 0, [1])
        with pytest.raises(TypeError, match="req_id must be a str, got bytes"):
            blocks.add_request(b"local", 4)
    with kvcsum.Worker() as worker, pytest.raises(ValueError, match="reason .* holds a NUL"):
        worker.skip_group(0, "mamba\0 state")
    with kvcsum.Verifier(1) as verifier:
        for call in (
            lambda: verifier.payload("r\0"),
            lambda: verifier.forget("\0"),
            lambda: verifier.check_stored("a\0b"),
            lambda: verifier.check("a\0b", None),
        ):
            with pytest.raises(ValueError, match="req_id .* holds a NUL"):
                call()
        with pytest.raises(ValueError, match="payload .* holds a NUL"):
            verifier.check("r", "kQE=\0garbage")
    with pytest.raises(ValueError, match="local_engine_id .* holds a NUL"):
        kvcsum.Topology("prefill\0x", tp_rank=0, tp_size=1, total_kv_heads=1, block_size=16)
    with kvcsum.Topology("decode", tp_rank=0, tp_size=1, total_kv_heads=1, block_size=16) as topology:
        with pytest.raises(ValueError, match="engine_id .* holds a NUL"):
            topology.add_remote("prefill\0A", kvcsum.RemoteEngine(tp_size=1, block_bytes=64, block_size=16))
    with kvcsum.Completion(1) as completion:
        with pytest.raises(ValueError, match=r"req_ids\[1\] .* holds a NUL"):
            completion.report(0, kvcsum.SENDING, ["a", "local\0A"])
        assert completion.reported(kvcsum.SENDING, "a") == 0  # nothing was counted
    with pytest.raises(ValueError, match="text .* holds a NUL"):
        kvcsum.base64_decode("AAAA\0AAAA")


# --- P8: repair_plan's and Completion.report's errors -----------------------------------------


def two_group_records(rng, consumer_identity_1):
    """A producer payload and a consumer record of one request in groups 0
    and 1 (separate caches), the consumer's group-1 layer named
    `consumer_identity_1`, one token of group 0 flipped on the consumer."""
    caches = [random_cache(rng, 5), random_cache(rng, 5)]
    block_ids = [int(b) for b in rng.permutation(5)[:3]]
    num_tokens = 2 * TOKENS + 5

    def record(caches, role, identity_1):
        with kvcsum.Worker(num_threads=1) as worker, kvcsum.Blocks() as blocks:
            blocks.add_request("req", num_tokens)
            for group, identity in ((0, b"layer 0"), (1, identity_1)):
                worker.add_region_of(caches[group])
                worker.add_group(group, TOKENS)
                worker.add_layer(
                    kvcsum.layer(caches[group], "HND", layer_number=group, group_id=group, identity=identity)
                )
                blocks.add_group("req", group, block_ids)
            with worker.checksum(blocks, role) as result:
                return result.encode()

    def verifier(role):
        verifier = kvcsum.Verifier(1)
        with kvcsum.Blocks() as blocks:
            blocks.add_request("req", num_tokens).add_group("req", 0, block_ids).add_group("req", 1, block_ids)
            verifier.expect(blocks, role)
        return verifier

    with verifier(kvcsum.PRODUCER) as producer:
        producer.add_record(record(caches, kvcsum.PRODUCER, b"layer 1"))
        payload = producer.payload("req")
    flipped = [caches[0].copy(), caches[1]]
    flipped[0][block_ids[1], 1, 3, 2] ^= np.uint64(1 << 33)  # position 1, token 11
    with verifier(kvcsum.CONSUMER) as consumer:
        consumer.add_record(record(flipped, kvcsum.CONSUMER, consumer_identity_1))
        return consumer.check("req", payload), block_ids


def test_repair_plan_refuses_a_mismatch_beside_an_unverified_group(seed):
    rng = np.random.default_rng(seed)
    report, block_ids = two_group_records(rng, b"layer 1")
    with report:
        assert report.verdict == kvcsum.MISMATCH and not report.findings, f"seed {seed:#x}: {report.message}"
        plan = kvcsum.repair_plan(report, {0: block_ids, 1: block_ids}, TOKENS)
        assert plan == {0: [kvcsum.RepairBlock(0, 1, block_ids[1], TOKENS, TOKENS)]}
    report, block_ids = two_group_records(rng, b"another layer 1")
    with report:
        assert report.verdict == kvcsum.MISMATCH, f"seed {seed:#x}: {report.message}"
        assert [(f.reason, f.group_id) for f in report.findings] == [(kvcsum.FINGERPRINT_DIFFERS, 1)]
        unverified = r"group 1 is unverified \(a group's fingerprint differs.*load the request again whole"
        with pytest.raises(ValueError, match=unverified):
            kvcsum.repair_plan(report, {0: block_ids, 1: block_ids}, TOKENS)
        # The entries alone carry no findings: the caller took that on.
        assert kvcsum.repair_plan(report.mismatches, {0: block_ids}, TOKENS)[0][0].block_id == block_ids[1]


def test_repair_plan_errors_are_value_errors_and_bools_are_refused(seed):
    rng = np.random.default_rng(seed)
    report, block_ids = two_group_records(rng, b"layer 1")
    with report:
        with pytest.raises(ValueError, match="group 0 differs but block_sizes has no entry for it"):
            kvcsum.repair_plan(report, {0: block_ids}, {1: TOKENS})
        with pytest.raises(TypeError, match="block_size of group 0 must be an integer .*got a bool"):
            kvcsum.repair_plan(report, {0: block_ids}, True)
        with pytest.raises(TypeError, match="block_size of group 0 must be an integer .*got float"):
            kvcsum.repair_plan(report, {0: block_ids}, 8.0)
        with pytest.raises(ValueError, match="block_size of group 0 is 0"):
            kvcsum.repair_plan(report, {0: block_ids}, {0: 0})
        negative = list(block_ids)
        negative[1] = -block_ids[1] - 1
        with pytest.raises(ValueError, match=rf"block_tables\[0\]\[1\] is {negative[1]}, outside uint32_t"):
            kvcsum.repair_plan(report, {0: negative}, TOKENS)
        with pytest.raises(TypeError, match=r"block_tables\[0\]\[1\] must be an integer .*got a bool"):
            kvcsum.repair_plan(report, {0: [block_ids[0], True, block_ids[2]]}, TOKENS)
        assert kvcsum.repair_plan(report, {0: np.array(block_ids, dtype=np.int32)}, np.int64(TOKENS)) == {
            0: [kvcsum.RepairBlock(0, 1, block_ids[1], TOKENS, TOKENS)]
        }


def test_completion_report_expected_workers():
    with kvcsum.Completion(2) as completion:
        # 0 (and None) mean no change, as vLLM's expected_finished_count 0.
        assert completion.report(0, kvcsum.SENDING, ["a"], expected_workers=0) == []
        assert completion.report(1, kvcsum.SENDING, ["a"], expected_workers=None) == ["a"]
        for refused, error in ((True, TypeError), (-1, ValueError), (2**32, ValueError), (1.0, TypeError)):
            with pytest.raises(error, match="expected_workers"):
                completion.report(0, kvcsum.SENDING, ["b"], expected_workers=refused)
            assert completion.reported(kvcsum.SENDING, "b") == 0, "a refused report counts nothing"
        # Another count applies from this report's new requests on.
        assert completion.report(0, kvcsum.SENDING, ["b"], expected_workers=np.uint32(1)) == ["b"]
        assert completion.report(0, kvcsum.RECEIVING, ["c"], expected_workers=3) == []
        assert completion.reported(kvcsum.RECEIVING, "c") == 1
        with pytest.raises(kvcsum.InvalidArgument):
            completion.set_expected(0)  # C's rule: at least 1
        with pytest.raises(TypeError, match="req_ids must be a sequence of str, got one str"):
            completion.report(0, kvcsum.SENDING, "abc")


# --- enum arguments and element types ------------------------------------------


def test_a_member_of_another_enum_is_refused_where_an_enum_is_taken(seed):
    """A member of another IntEnum is an int too: Verifier.set_policy(MATCH)
    meant FAIL_OPEN and checksum(role=WEIGHTED) meant CONSUMER. Every
    enum-taking argument refuses one with a TypeError naming the argument
    and the member; its own members and plain ints keep working."""
    rng = np.random.default_rng(seed)
    cache = random_cache(rng, 4)
    with kvcsum.Worker(num_threads=1) as worker, kvcsum.Blocks() as blocks, kvcsum.Verifier(1) as verifier:
        worker.add_region_of(cache)
        worker.add_group(0, TOKENS)
        worker.add_layer(kvcsum.layer(cache, "HND", layer_number=0))
        blocks.add_request("req", 2 * TOKENS).add_group("req", 0, [2, 0])
        completion = kvcsum.Completion(1)
        # (call with the argument, the argument's name, its own enum, a member of its own)
        takers = [
            (lambda value: worker.checksum(blocks, value).close(), "role", kvcsum.Role, kvcsum.CONSUMER),
            (lambda value: verifier.expect(blocks, value), "role", kvcsum.Role, kvcsum.PRODUCER),
            (verifier.set_policy, "policy", kvcsum.Policy, kvcsum.FAIL_OPEN),
            (lambda value: kvcsum.Worker(algorithm=value).close(), "algorithm", kvcsum.Algorithm, kvcsum.WEIGHTED),
            (lambda value: completion.report(0, value, ["r"]), "direction", kvcsum.Direction, kvcsum.SENDING),
            (lambda value: completion.reported(value, "r"), "direction", kvcsum.Direction, kvcsum.RECEIVING),
        ]
        others = [
            kvcsum.MATCH,
            kvcsum.UNVERIFIED,
            kvcsum.WEIGHTED,
            kvcsum.MIXED,
            kvcsum.CONSUMER,
            kvcsum.FAIL_CLOSED,
            kvcsum.SENDING,
            kvcsum.RECEIVING,
            kvcsum.Reason.NO_CHECKSUMS,
            kvcsum.StoredOutcome.MATCHED,
            kvcsum.Status.INVALID_ARGUMENT,
        ]
        for call, name, enum_type, own in takers:
            for other in others:
                if isinstance(other, enum_type):
                    continue
                message = rf"{name} must be a kvcsum\.{enum_type.__name__} \(or an int\), got {type(other).__name__}\.{other.name}"
                with pytest.raises(TypeError, match=message):
                    call(other)
            call(own)
            call(int(own))  # a plain int is still taken as the number it is
        with kvcsum.Worker(num_threads=1) as fresh:
            with pytest.raises(TypeError, match=r"algorithm must be a kvcsum\.Algorithm .*got Verdict\.MISMATCH"):
                fresh.set_algorithm(kvcsum.MISMATCH)
            fresh.set_algorithm(1)
            assert fresh._algorithm is kvcsum.WEIGHTED
        completion.close()


def test_layer_refuses_arrays_whose_elements_are_not_numbers(seed):
    """kvcsum.layer() of an object array checksummed the PyObject pointers;
    str, bytes, structured and void arrays hold no numbers either. Each
    raises TypeError naming the array and its dtype; numeric dtypes (and
    the same bytes viewed as integers) are accepted."""
    rng = np.random.default_rng(seed)
    shape = (4, TOKENS, 2, 8)
    numbers = rng.integers(1, 2**16, shape, dtype=np.uint16)
    refused = [
        (np.empty(shape, dtype=object), "object", "Python objects"),
        (np.full(shape, "kv", dtype="<U2"), "<U2", "str"),
        (np.full(shape, b"kv", dtype="S2"), "|S2", "bytes"),
        (np.zeros(shape, dtype=[("k", "<u2")]), r"\[\('k', '<u2'\)\]", "records"),
        (numbers.view("V2"), "|V2", "records"),
    ]
    for array, dtype, what in refused:
        with pytest.raises(TypeError, match=rf"cache has elements of dtype {dtype} \({what}"):
            kvcsum.layer(array, "NHD", layer_number=0)
        with pytest.raises(TypeError, match=rf"v has elements of dtype {dtype}"):
            kvcsum.layer(numbers, "NHD", layer_number=0, v=array)
    # Through the array interface alone (no ndarray), as other libraries hand it.
    class Interface:
        def __init__(self, array):
            self.__array_interface__ = array.__array_interface__
            self._keep = array

    with pytest.raises(TypeError, match=r"cache has elements of dtype object"):
        kvcsum.layer(Interface(np.empty(shape, dtype=object)), "NHD", layer_number=0)
    with pytest.raises(TypeError, match=r"cache has elements of dtype \[\('k', '<u2'\)\]"):
        kvcsum.layer(Interface(np.zeros(shape, dtype=[("k", "<u2")])), "NHD", layer_number=0)
    for dtype in (np.uint16, np.int16, np.float16, np.uint8, np.int8, np.float32, np.bool_, np.complex64):
        array = rng.integers(0, 2, shape).astype(dtype)
        layer = kvcsum.layer(array, "NHD", layer_number=0)
        assert layer.segments[0].bytes_per_token == 8 * array.itemsize
        kvcsum.layer(Interface(array), "NHD", layer_number=0)
