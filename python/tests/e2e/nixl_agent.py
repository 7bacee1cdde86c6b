"""The NIXL adapter of the end-to-end harness (agent.TransferAgent over
nixl_cu12: host memory, the UCX backend, no progress thread: polling a
write or the notifications makes progress)."""

from __future__ import annotations

import os

import numpy as np

from agent import Transfer, TransferAgent, TransferError

os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
try:
    from nixl_cu12._api import nixl_agent, nixl_agent_config
except ImportError as error:  # the test must not pass by not running
    raise SystemExit(
        f"cannot import NIXL ({error}); `make e2e-test` installs nixl-cu12 into build/venv "
        "(pip install --no-deps nixl-cu12==1.5.1 numpy)"
    ) from error


class NixlTransfer(Transfer):
    """A posted NIXL transfer request."""

    def __init__(self, agent, handle, state: str, what: str):
        self._agent, self._handle, self._state, self._what = agent, handle, state, what

    def done(self) -> bool:
        if self._state == "PROC":
            self._state = self._agent.check_xfer_state(self._handle)
        if self._state == "ERR":
            self._handle.release()
            raise TransferError(f"{self._what} failed")
        if self._state == "DONE" and self._handle is not None:
            self._handle.release()
            self._handle = None
        return self._state == "DONE"


class NixlAgent(TransferAgent):
    """A NIXL agent with the UCX backend, moving host memory ("DRAM")."""

    def __init__(self, name: str):
        super().__init__(name)
        self._agent = nixl_agent(name, nixl_agent_config(enable_prog_thread=False, backends=["UCX"]))
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

    def write(self, peer: str, descriptors: np.ndarray, notification: bytes) -> Transfer:
        descriptors = np.asarray(descriptors, dtype=np.uint64)
        if descriptors.ndim != 2 or descriptors.shape[1] != 3 or not len(descriptors):
            raise ValueError(f"{self.name}: descriptors must be a non-empty N x 3 array, got {descriptors.shape}")
        device = np.zeros(len(descriptors), dtype=np.uint64)  # 0 for host memory
        source = np.ascontiguousarray(np.stack([descriptors[:, 0], descriptors[:, 2], device], axis=1))
        target = np.ascontiguousarray(np.stack([descriptors[:, 1], descriptors[:, 2], device], axis=1))
        handle = self._agent.initialize_xfer(
            "WRITE",
            self._agent.get_xfer_descs(source, "DRAM"),
            self._agent.get_xfer_descs(target, "DRAM"),
            peer,
            notification,
        )
        state = self._agent.transfer(handle)
        what = f"{self.name} -> {peer}: WRITE of {len(descriptors)} descriptors"
        return NixlTransfer(self._agent, handle, state, what)

    def notify(self, peer: str, notification: bytes) -> None:
        self._agent.send_notif(peer, notification)

    def notifications(self) -> list[tuple[str, bytes]]:
        return [(sender, message) for sender, messages in self._agent.get_new_notifs().items() for message in messages]

    def close(self) -> None:
        for registered in self._registered:
            self._agent.deregister_memory(registered)
        self._registered.clear()
