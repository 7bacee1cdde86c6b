"""The NIXL adapter of the end-to-end harness (agent.TransferAgent over
nixl_cu12, host memory, the UCX backend)."""

from __future__ import annotations

import os
import time

import numpy as np

from agent import TransferAgent, TransferError

os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
try:
    from nixl_cu12._api import nixl_agent, nixl_agent_config
except ImportError as error:  # the test must not pass by not running
    raise SystemExit(
        f"cannot import NIXL ({error}); `make e2e-test` installs nixl-cu12 into build/venv "
        "(pip install --no-deps nixl-cu12==1.5.1 numpy)"
    ) from error

#: How long a write may take before it counts as failed.
TIMEOUT_S = 30.0


class NixlAgent(TransferAgent):
    """A NIXL agent with the UCX backend, moving host memory ("DRAM")."""

    def __init__(self, name: str):
        super().__init__(name)
        self._agent = nixl_agent(name, nixl_agent_config(backends=["UCX"]))
        self._registered = []

    def register(self, arrays: list[np.ndarray]) -> None:
        regions = []
        for array in arrays:
            if not array.flags.c_contiguous:
                raise ValueError(f"{self.name}: register contiguous arrays, got strides {array.strides}")
            regions.append((array.ctypes.data, array.nbytes, 0, ""))
        self._registered.append(self._agent.register_memory(regions, "DRAM"))

    def metadata(self) -> bytes:
        return self._agent.get_agent_metadata()

    def connect(self, metadata: bytes) -> str:
        peer = self._agent.add_remote_agent(metadata)
        return peer.decode() if isinstance(peer, bytes) else peer

    def write(self, peer: str, descriptors: np.ndarray, notification: bytes) -> None:
        descriptors = np.asarray(descriptors, dtype=np.uint64)
        if descriptors.ndim != 2 or descriptors.shape[1] != 3 or not len(descriptors):
            raise ValueError(f"{self.name}: descriptors must be a non-empty N x 3 array, got {descriptors.shape}")
        zeros = np.zeros(len(descriptors), dtype=np.uint64)  # device id: 0 for host memory
        source = np.ascontiguousarray(np.stack([descriptors[:, 0], descriptors[:, 2], zeros], axis=1))
        target = np.ascontiguousarray(np.stack([descriptors[:, 1], descriptors[:, 2], zeros], axis=1))
        handle = self._agent.initialize_xfer(
            "WRITE",
            self._agent.get_xfer_descs(source, "DRAM"),
            self._agent.get_xfer_descs(target, "DRAM"),
            peer,
            notification,
        )
        try:
            state = self._agent.transfer(handle)
            deadline = time.monotonic() + TIMEOUT_S
            while state == "PROC" and time.monotonic() < deadline:
                state = self._agent.check_xfer_state(handle)
            if state != "DONE":
                raise TransferError(f"{self.name} -> {peer}: {len(descriptors)} descriptors ended in state {state}")
        finally:
            handle.release()

    def notify(self, peer: str, notification: bytes) -> None:
        self._agent.send_notif(peer, notification)

    def notifications(self) -> list[tuple[str, bytes]]:
        return [(sender, message) for sender, messages in self._agent.get_new_notifs().items() for message in messages]

    def close(self) -> None:
        for registered in self._registered:
            self._agent.deregister_memory(registered)
        self._registered.clear()
