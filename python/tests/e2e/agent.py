"""The transfer agent interface the end-to-end harness drives.

A transfer agent here is one worker's endpoint: it registers that worker's
KV memory, tells its peers how to reach it (metadata), writes batches of
(source address, destination address, length) descriptors into a peer's
registered memory with a notification attached (or sends a notification
alone), and hands over the notifications it received. Nothing blocks: the
harness polls writes and notifications, as an engine's agent loop does.
Two implementations: NIXL (nixl_agent.py), whose WRITE carries the
notification, and Mooncake's Transfer Engine (mooncake_agent.py), whose
notification travels beside the write on a side channel. The harness
(harness.py) runs unchanged over either; a third agent is a third subclass.
"""

from __future__ import annotations

import abc

import numpy as np


class TransferError(RuntimeError):
    """A transfer failed or did not finish in time."""


class Transfer(abc.ABC):
    """A write in flight."""

    @abc.abstractmethod
    def done(self) -> bool:
        """True once the write finished (polling also makes progress);
        raises TransferError when it failed."""


class TransferAgent(abc.ABC):
    """One worker's transfer endpoint (see the module docstring)."""

    def __init__(self, name: str):
        self.name = name

    @abc.abstractmethod
    def register(self, arrays: list[np.ndarray]) -> None:
        """Registers the host memory of `arrays` (contiguous numpy arrays)
        as the memory peers may write into or this agent writes from."""

    @abc.abstractmethod
    def metadata(self) -> bytes:
        """What a peer needs to write to this agent (after register)."""

    @abc.abstractmethod
    def connect(self, metadata: bytes) -> str:
        """Learns a peer from its metadata; returns the peer's name."""

    @abc.abstractmethod
    def write(self, peer: str, descriptors: np.ndarray, notification: bytes) -> Transfer:
        """Starts writing each (source address, destination address, length)
        row of `descriptors` (uint64, N x 3) from this agent's memory into
        `peer`'s; `notification` reaches the peer once the bytes are there.
        Nothing is waited for: the caller polls the Transfer (and the peer's
        notifications), so that an agent needs no progress thread of its own."""

    @abc.abstractmethod
    def notify(self, peer: str, notification: bytes) -> None:
        """Delivers `notification` to `peer` without writing anything."""

    @abc.abstractmethod
    def notifications(self) -> list[tuple[str, bytes]]:
        """The (sender, message) notifications received since the last call
        (polling also makes progress)."""

    def close(self) -> None:
        """Releases what the agent holds."""
