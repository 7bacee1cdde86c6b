"""HostCopySpec: vLLM's own CPU offloading spec (CPUOffloadingSpec: its
manager, which decides what is stored, evicted and loaded, by block hash)
with a worker that copies on the host, so that vLLM 0.33.0's
OffloadingConnector runs in the vLLM test without a GPU. vLLM's own worker
for this spec copies with CUDA; only that part is replaced. Loaded through
the connector's `spec_module_path`, as any out-of-tree spec is.

Fault injection, set by the test in FAULT: {"flip": chunk} flips one bit
of that CPU chunk as it is loaded back (FAULT["done"] counts it).
"""

from __future__ import annotations

import torch

from vllm.v1.kv_offload.base import OffloadingWorker, TransferResult
from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec

#: Fault injection (see the module's doc).
FAULT: dict = {}


class HostCopyWorker(OffloadingWorker):
    """Copies the canonical KV pages of GPU blocks (here CPU tensors) to and
    from CPU chunks, at once; every transfer is reported done at the next
    get_finished."""

    def __init__(self, kv_caches, blocks_per_chunk: int, num_chunks: int):
        self._tensors = [t.tensor for t in kv_caches.tensors]
        self._blocks_per_chunk = blocks_per_chunk
        self._host = [torch.zeros((num_chunks * blocks_per_chunk,) + tuple(t.shape[1:]), dtype=t.dtype) for t in self._tensors]
        self._done: list = []
        self.stores = self.loads = 0

    def _slots(self, chunk_ids) -> list:
        per = self._blocks_per_chunk
        return [int(c) * per + k for c in chunk_ids for k in range(per)]

    def submit_store(self, job_id, src_spec, dst_spec) -> bool:
        blocks = [int(b) for b in src_spec.block_ids]
        slots = self._slots(dst_spec.block_ids)[: len(blocks)]
        for tensor, host in zip(self._tensors, self._host):
            host[slots] = tensor[blocks]
        self.stores += 1
        self._done.append(TransferResult(job_id, True))
        return True

    def submit_load(self, job_id, src_spec, dst_spec, expedited: bool = False) -> bool:
        blocks = [int(b) for b in dst_spec.block_ids]
        chunks = [int(c) for c in src_spec.block_ids]
        slots = self._slots(chunks)[: len(blocks)]
        for index, (tensor, host) in enumerate(zip(self._tensors, self._host)):
            pages = host[slots].clone()
            flip = FAULT.get("flip")
            if index == 0 and flip is not None and flip in chunks:
                pages[chunks.index(flip)].view(-1).view(torch.uint8)[9] ^= 0x02
                FAULT["done"] = FAULT.get("done", 0) + 1
            tensor[blocks] = pages
        self.loads += 1
        self._done.append(TransferResult(job_id, True))
        return True

    def get_finished(self) -> list:
        done, self._done = self._done, []
        return done

    def wait(self, job_ids) -> None:
        return


class HostCopySpec(CPUOffloadingSpec):
    """CPUOffloadingSpec whose worker copies on the host."""

    def get_worker(self, kv_caches):
        if not self._worker:
            self._worker = HostCopyWorker(kv_caches, self.blocks_per_chunk, self.num_chunks)
        return self._worker
