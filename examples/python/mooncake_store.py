#!/usr/bin/env python3
"""A verified storage tier over Mooncake Store, from a connector's point of
view.

A worker (4 layers, 8 KV heads, 16-token blocks, host memory) offloads one
request's 4 blocks to Mooncake Store as one object, the way an offload
connector keeps a chunk of blocks under one key: the 16-byte stored
checksum of each block (kvcsum's Worker.store, SPEC section 8) first, then
the blocks. It loads them back into other block ids and checks the load
(Worker.check_stored, judged by the Verifier): MATCH. Then one byte of the
object is flipped where the store keeps it (the replica's memory), and the
load check names the damaged block's position and tokens. Last, a range
read (get_into_ranges: one block and its 16 bytes out of the object, the
read Mooncake's own object CRC cannot check) is checked on its own.

Everything runs on this machine: a mooncake_master on 127.0.0.1 (from the
mooncake-transfer-engine-non-cuda wheel; its HTTP metadata server too),
started and stopped here, and one store client (TCP). Run from the
repository root (`make e2e-test` sets up build/venv; the wheel needs the
system's libibverbs1; `make lib` builds the library):

    PYTHONPATH=python build/venv/bin/python examples/python/mooncake_store.py

python/tests/e2e/mooncake_store_host.py is the test: faults at random
places, every verdict against a byte comparison.
"""

from __future__ import annotations

import ctypes
import os
import socket
import subprocess
import sys
import tempfile
import time

import numpy as np

os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
os.environ.setdefault("GLOG_minloglevel", "2")
import mooncake  # noqa: E402
from mooncake.store import MooncakeDistributedStore  # noqa: E402

import kvcsum  # noqa: E402

LAYERS, HEADS, HEAD_DIM, BLOCK = 4, 8, 64, 16
NUM_BLOCKS = 16
ENTRY = kvcsum.BLOCK_CHECKSUM_BYTES  # 16
START_S = 20.0  # the master must answer within this


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Master:
    """mooncake_master on 127.0.0.1 with its HTTP metadata server, in a
    process of its own, stopped on exit (terminate, then kill)."""

    def __init__(self):
        binary = os.path.join(os.path.dirname(mooncake.__file__), "mooncake_master")
        self.rpc, self.http, metrics = free_port(), free_port(), free_port()
        self.log = tempfile.NamedTemporaryFile(prefix="kvcsum-mooncake-master-", suffix=".log", delete=False)
        self.process = subprocess.Popen(
            [
                binary,
                "--rpc_address=127.0.0.1", f"--rpc_port={self.rpc}",
                "--enable_http_metadata_server=true", "--http_metadata_server_host=127.0.0.1",
                f"--http_metadata_server_port={self.http}",
                "--metrics_host=127.0.0.1", f"--metrics_port={metrics}", "--enable_metric_reporting=false",
            ],
            stdout=self.log, stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + START_S
        for port in (self.rpc, self.http):
            while True:
                if self.process.poll() is not None:
                    raise RuntimeError(f"mooncake_master exited with {self.process.returncode}; log {self.log.name}")
                try:
                    socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
                    break
                except OSError:
                    if time.monotonic() > deadline:
                        self.stop()
                        raise RuntimeError(f"mooncake_master not listening on 127.0.0.1:{port} after {START_S} s")
                    time.sleep(0.05)

    def client(self) -> MooncakeDistributedStore:
        store = MooncakeDistributedStore()
        status = store.setup(
            "127.0.0.1", f"http://127.0.0.1:{self.http}/metadata", 64 << 20, 16 << 20, "tcp", "", f"127.0.0.1:{self.rpc}"
        )
        if status != 0:
            raise RuntimeError(f"MooncakeDistributedStore.setup returned {status}")
        return store

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)
        self.log.close()
        os.unlink(self.log.name)


class Engine:
    """One worker's cache ([layers][blocks, 2 (K, V), heads, 16, 64], 2-byte
    elements), its buffer of 16-byte stored checksums per block id, and
    its kvcsum worker."""

    def __init__(self, rng: np.random.Generator):
        self.cache = rng.integers(0, 1 << 16, (LAYERS, NUM_BLOCKS, 2, HEADS, BLOCK, HEAD_DIM), dtype=np.uint16)
        self.sums = np.zeros((NUM_BLOCKS, 2), dtype=np.uint64)  # value, stamp per block id
        self.worker = kvcsum.Worker()
        self.worker.add_region_of(self.cache)
        self.worker.add_group(0, BLOCK)
        for layer in range(LAYERS):
            self.worker.add_layer(kvcsum.layer(self.cache[layer], "BKHTD", layer_number=layer))
        self.worker.add_stored_of(0, self.sums)

    def block_bytes(self, block_id: int) -> bytes:
        return np.ascontiguousarray(self.cache[:, block_id]).tobytes()

    def set_block(self, block_id: int, data: bytes) -> None:
        self.cache[:, block_id] = np.frombuffer(data, dtype=np.uint16).reshape(self.cache[:, block_id].shape)

    def close(self) -> None:
        self.worker.close()


BLOCK_BYTES = LAYERS * 2 * HEADS * BLOCK * HEAD_DIM * 2


def blocks_of(req_id: str, num_tokens: int, block_ids, hashes, first_position: int = 0) -> kvcsum.Blocks:
    blocks = kvcsum.Blocks().add_request(req_id, num_tokens)
    blocks.add_group(req_id, 0, block_ids, first_position)
    blocks.set_hashes(req_id, 0, hashes)
    return blocks


def put_chunk(store, key: str, engine: Engine, req_id: str, num_tokens: int, block_ids, hashes) -> None:
    """Offloads the blocks as one object: their 16-byte stored checksums
    (Worker.store), then the blocks."""
    with blocks_of(req_id, num_tokens, block_ids, hashes) as blocks:
        engine.worker.store(blocks).close()
    entries = b"".join(engine.sums[b].tobytes() for b in block_ids)
    status = store.put_parts(key, entries, b"".join(engine.block_bytes(b) for b in block_ids))
    if status != 0:
        raise RuntimeError(f"put_parts({key!r}) returned {status}")


def check_load(engine: Engine, req_id: str, num_tokens: int, block_ids, hashes, first_position: int = 0):
    """The load check of blocks just loaded with their 16 bytes: each
    position's outcome, the verifier's verdict and its message."""
    with blocks_of(req_id, num_tokens, block_ids, hashes, first_position) as blocks:
        with engine.worker.check_stored(blocks) as result, kvcsum.Verifier(1) as verifier:
            outcomes = list(result.stored(req_id, 0))
            verifier.expect(blocks, kvcsum.CONSUMER)
            verifier.add_record(result.encode())
            with verifier.check_stored(req_id) as report:
                return outcomes, report.verdict, report.message


def get_chunk(store, key: str, engine: Engine, block_ids) -> None:
    """Loads a whole object into `block_ids` and their 16 bytes."""
    data = store.get(key)
    n = len(block_ids)
    if len(data) != n * (ENTRY + BLOCK_BYTES):
        raise RuntimeError(f"get({key!r}) gave {len(data)} bytes, want {n * (ENTRY + BLOCK_BYTES)}")
    for i, b in enumerate(block_ids):
        engine.sums[b] = np.frombuffer(data[i * ENTRY : (i + 1) * ENTRY], dtype=np.uint64)
        start = n * ENTRY + i * BLOCK_BYTES
        engine.set_block(b, data[start : start + BLOCK_BYTES])


def get_block_range(store, key: str, engine: Engine, chunk_blocks: int, index: int, block_id: int, staging) -> None:
    """A range read: block `index` of the object and its 16 bytes only,
    into `staging` (registered with the store), then into `block_id`."""
    sizes = [ENTRY, BLOCK_BYTES]
    sources = [index * ENTRY, chunk_blocks * ENTRY + index * BLOCK_BYTES]
    done = store.get_into_ranges([staging.ctypes.data], [[key]], [[[0, ENTRY]]], [[sources]], [[sizes]])
    if done != [[sizes]]:
        raise RuntimeError(f"get_into_ranges({key!r}) gave {done}, want {[[sizes]]}")
    engine.sums[block_id] = staging[:ENTRY].view(np.uint64)
    engine.set_block(block_id, staging[ENTRY : ENTRY + BLOCK_BYTES].tobytes())


def flip_in_store(store, key: str, offset: int, bit: int) -> None:
    """Flips one bit of the object where the store keeps it: the memory
    replica's buffer, in the segment this process's client mounted."""
    [replica] = [r for r in store.get_replica_desc(key) if r.is_memory_replica()]
    descriptor = replica.get_memory_descriptor().buffer_descriptor
    if not 0 <= offset < descriptor.size:
        raise ValueError(f"offset {offset} outside the object's {descriptor.size} bytes")
    byte = ctypes.c_uint8.from_address(descriptor.buffer_address + offset)
    byte.value ^= 1 << bit


def main() -> int:
    seed = int(os.environ.get("KVCS_EXAMPLE_SEED") or 2024)
    rng = np.random.default_rng(seed)
    req, num_tokens = "req-0", 60  # 4 blocks, the last one 12 tokens
    stored_ids, loaded_ids = [5, 2, 7, 0], [1, 6, 3, 4]
    hashes = [rng.bytes(32) for _ in stored_ids]  # the blocks' hashes, as the engine computes them
    key = f"kv/{hashes[-1].hex()}/tp0"
    master = Master()
    ok = True
    try:
        store = master.client()
        engine = Engine(rng)
        print(f"kvcsum {kvcsum.__version__}, Mooncake Store (mooncake_master on 127.0.0.1:{master.rpc}), seed {seed}")
        put_chunk(store, key, engine, req, num_tokens, stored_ids, hashes)
        print(f"stored blocks {stored_ids} with their 16-byte stored checksums as one object of "
              f"{store.get_size(key)} bytes under {key[:16]}...")

        get_chunk(store, key, engine, loaded_ids)
        outcomes, verdict, message = check_load(engine, req, num_tokens, loaded_ids, hashes)
        print(f"loaded into blocks {loaded_ids}, intact: {verdict.name}: {message}")
        ok &= verdict == kvcsum.MATCH

        position, layer, head, token = 2, 1, 3, 5
        offset = (len(stored_ids) * ENTRY + position * BLOCK_BYTES
                  + ((layer * 2 * HEADS + head) * BLOCK + token) * HEAD_DIM * 2 + 9)
        flip_in_store(store, key, offset, 4)
        print(f"flipped bit 4 of byte {offset} of the object in the store (position {position}, layer {layer}, "
              f"head {head}, token {token})")
        get_chunk(store, key, engine, loaded_ids)
        outcomes, verdict, message = check_load(engine, req, num_tokens, loaded_ids, hashes)
        print(f"loaded again: {verdict.name}: {message}")
        failed = [p for p, o in enumerate(outcomes) if o == kvcsum.STORED_FAILED]
        ok &= verdict == kvcsum.MISMATCH and failed == [position]

        staging = np.zeros(ENTRY + BLOCK_BYTES, dtype=np.uint8)
        store.register_buffer(staging.ctypes.data, staging.nbytes)
        for index in (1, position):
            get_block_range(store, key, engine, len(stored_ids), index, 9, staging)
            _, verdict, message = check_load(engine, req, num_tokens, [9], [hashes[index]], first_position=index)
            print(f"range read of position {index} alone (block 9): {verdict.name}: {message}")
            ok &= verdict == (kvcsum.MISMATCH if index == position else kvcsum.MATCH)
        store.unregister_buffer(staging.ctypes.data)
        store.remove(key, force=True)
        store.close()
        engine.close()
    finally:
        master.stop()
    print("Mooncake Store tier: every load check as expected" if ok else "Mooncake Store tier: FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
