"""The Mooncake adapter of the end-to-end harness (agent.TransferAgent over
Mooncake's Transfer Engine: host memory, the TCP transport, peers found by
P2P handshake, so no metadata server).

Mooncake moves bytes; unlike NIXL it attaches no message to a write. Its
vLLM connector carries kv_transfer_params beside the transfer, over a ZMQ
side channel, and answers once batch_transfer_sync_write returned. This
adapter does the same with a loopback TCP socket per agent: a write runs
batch_transfer_sync_write on the agent's sender thread (as the connector
runs it in an executor), and once it returned 0 the notification goes to
the peer's side channel. `notify` sends on the side channel alone.

Each batch is cut into chunks of at most CHUNK descriptors, one chunk in
flight per agent: the TCP transport queues at most 1024 transfers per peer
(MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER) and fails the whole batch beyond
that.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import queue
import socket
import struct
import threading

import numpy as np

from agent import Transfer, TransferAgent, TransferError

# Errors only; each engine still logs one "Local segment descriptor not found"
# while it starts (before it publishes its own segment), which is harmless.
os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
try:
    from mooncake.engine import TransferEngine
except ImportError as error:  # the test must not pass by not running
    raise SystemExit(
        f"cannot import Mooncake's transfer engine ({error}); `make e2e-test` installs "
        "mooncake-transfer-engine-non-cuda into build/venv, and it needs the system's libibverbs1 "
        "(apt-get install --no-install-recommends libibverbs1; .ci/run installs it)"
    ) from error

#: Descriptors per batch_transfer_sync_write (the TCP transport's per-peer queue holds 1024).
CHUNK = 1024
HOST = "127.0.0.1"
#: How long Transfer.done() waits for a write before answering "not yet".
POLL_S = 0.001
#: The largest side-channel frame part accepted (a payload is a few KiB).
MAX_FRAME = 1 << 20
FRAME = struct.Struct("!II")  # sender name length, message length


class MooncakeTransfer(Transfer):
    """A write running on the agent's sender thread."""

    def __init__(self, future: concurrent.futures.Future, what: str):
        self._future, self._what = future, what

    def done(self) -> bool:
        # A short wait rather than a bare check: the engine's threads do the
        # work, and a caller polling in a loop would take their core.
        if concurrent.futures.wait([self._future], timeout=POLL_S).not_done:
            return False
        error = self._future.exception()
        if error is not None:
            raise TransferError(f"{self._what} failed: {error}") from error
        return True


class SideChannel:
    """A loopback listener whose frames, (sender name, message), land in a
    queue; a reader thread per connection."""

    def __init__(self, owner: str):
        self._owner = owner
        self._server = socket.create_server((HOST, 0))
        self.port = self._server.getsockname()[1]
        self.inbox: queue.SimpleQueue[tuple[str, bytes]] = queue.SimpleQueue()
        self.errors: list[str] = []
        self._connections: list[socket.socket] = []
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, name=f"{owner}-side-channel", daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                connection, _ = self._server.accept()
            except OSError:  # closed
                return
            with self._lock:
                self._connections.append(connection)
            threading.Thread(target=self._read, args=(connection,), daemon=True).start()

    def _read(self, connection: socket.socket) -> None:
        try:
            self._frames(connection)
        except OSError as error:  # a sender vanished mid-frame
            self.errors.append(f"{self._owner}: side channel: {error}")

    def _frames(self, connection: socket.socket) -> None:
        with connection, connection.makefile("rb") as stream:
            while header := stream.read(FRAME.size):
                if len(header) != FRAME.size:
                    self.errors.append(f"{self._owner}: side channel closed inside a frame header")
                    return
                name_len, message_len = FRAME.unpack(header)
                if name_len > MAX_FRAME or message_len > MAX_FRAME:
                    self.errors.append(f"{self._owner}: side-channel frame of {name_len} + {message_len} bytes refused")
                    return
                name, message = stream.read(name_len), stream.read(message_len)
                if len(name) != name_len or len(message) != message_len:
                    self.errors.append(f"{self._owner}: side channel closed inside a frame")
                    return
                self.inbox.put((name.decode(), message))

    def close(self) -> None:
        try:
            self._server.shutdown(socket.SHUT_RDWR)  # wakes the accepting thread
        except OSError:
            pass
        self._server.close()
        with self._lock:
            for connection in self._connections:
                try:
                    connection.shutdown(socket.SHUT_RDWR)  # ends its reader
                except OSError:
                    pass  # the peer closed it first
            self._connections.clear()


class MooncakeAgent(TransferAgent):
    """A Mooncake TransferEngine (TCP) with a side channel for notifications."""

    def __init__(self, name: str):
        super().__init__(name)
        self._engine = TransferEngine()
        status = self._engine.initialize(HOST, "P2PHANDSHAKE", "tcp", "")
        if status != 0:
            raise TransferError(f"{name}: TransferEngine.initialize({HOST!r}, 'P2PHANDSHAKE', 'tcp') returned {status}")
        self._segment = f"{HOST}:{self._engine.get_rpc_port()}"
        self._side = SideChannel(name)
        self._peers: dict[str, tuple[str, int]] = {}  # name -> (segment, side-channel port)
        self._senders: dict[str, socket.socket] = {}  # name -> connection to its side channel
        self._send_lock = threading.Lock()
        self._sender = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=f"{name}-sender")
        self._registered: list[int] = []

    def register(self, arrays: list[np.ndarray]) -> None:
        for array in arrays:
            if not array.flags.c_contiguous:
                raise ValueError(f"{self.name}: register contiguous arrays, got strides {array.strides}")
            status = self._engine.register_memory(array.ctypes.data, array.nbytes)
            if status != 0:
                raise TransferError(f"{self.name}: register_memory of {array.nbytes} bytes returned {status}")
            self._registered.append(array.ctypes.data)

    def metadata(self) -> bytes:
        return json.dumps({"name": self.name, "segment": self._segment, "side_channel": self._side.port}).encode()

    def connect(self, metadata: bytes) -> str:
        peer = json.loads(metadata)
        self._peers[peer["name"]] = (peer["segment"], int(peer["side_channel"]))
        return peer["name"]

    def _send(self, peer: str, notification: bytes) -> None:
        """One side-channel frame to `peer` (any thread)."""
        name = self.name.encode()
        with self._send_lock:
            connection = self._senders.get(peer)
            if connection is None:
                connection = socket.create_connection((HOST, self._peers[peer][1]))
                self._senders[peer] = connection
            connection.sendall(FRAME.pack(len(name), len(notification)) + name + notification)

    def _write(self, peer: str, descriptors: np.ndarray, notification: bytes) -> None:
        segment = self._peers[peer][0]
        for start in range(0, len(descriptors), CHUNK):
            chunk = descriptors[start : start + CHUNK]
            sources, targets, lengths = (chunk[:, i].tolist() for i in range(3))
            status = self._engine.batch_transfer_sync_write(segment, sources, targets, lengths)
            if status != 0:
                raise TransferError(
                    f"batch_transfer_sync_write of descriptors {start}..{start + len(chunk) - 1} "
                    f"to {segment} returned {status}"
                )
        self._send(peer, notification)  # the bytes are there: tell the peer

    def write(self, peer: str, descriptors: np.ndarray, notification: bytes) -> Transfer:
        descriptors = np.asarray(descriptors, dtype=np.uint64)
        if descriptors.ndim != 2 or descriptors.shape[1] != 3 or not len(descriptors):
            raise ValueError(f"{self.name}: descriptors must be a non-empty N x 3 array, got {descriptors.shape}")
        if peer not in self._peers:
            raise ValueError(f"{self.name}: unknown peer {peer!r} (connect it first)")
        what = f"{self.name} -> {peer}: write of {len(descriptors)} descriptors"
        return MooncakeTransfer(self._sender.submit(self._write, peer, descriptors, notification), what)

    def notify(self, peer: str, notification: bytes) -> None:
        if peer not in self._peers:
            raise ValueError(f"{self.name}: unknown peer {peer!r} (connect it first)")
        self._send(peer, notification)

    def notifications(self) -> list[tuple[str, bytes]]:
        if self._side.errors:
            raise TransferError("; ".join(self._side.errors))
        out = []
        while True:
            try:
                out.append(self._side.inbox.get_nowait())
            except queue.Empty:
                return out

    def close(self) -> None:
        self._sender.shutdown(wait=True)
        for connection in self._senders.values():
            connection.close()
        self._senders.clear()
        self._side.close()
        for address in self._registered:
            self._engine.unregister_memory(address)
        self._registered.clear()
