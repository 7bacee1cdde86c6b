#!/usr/bin/env python3
"""The host end-to-end test over Mooncake's Transfer Engine (`make e2e-test`,
part of `make test`).

The scenario of nixl_host.py (harness.py), with Mooncake as the agent:
producer TP=2 HND 16-token blocks -> consumer TP=4 NHD 32-token blocks in
host memory, moved by batch_transfer_sync_write (TCP transport, P2P
handshake) between per-rank engines in this process, the payload beside
the transfer on a loopback side channel (mooncake_agent.py); each side
checksummed with kvcsum, judged by the verifiers; then each fault injected
through the agent, localised, and repaired. First, the adapter must report
a failed write: one into memory the peer did not register raises
TransferError and delivers no notification. Prints each verdict; exits 1
when any expectation fails, and when Mooncake cannot be imported.
KVCS_E2E_SEED=N repeats a run.
"""

import sys
import time

import numpy as np

import harness
from agent import TransferError
from mooncake_agent import MooncakeAgent


def failed_write_is_reported() -> bool:
    """A write into the peer's unregistered memory: TransferError, no notification."""
    sender, receiver = MooncakeAgent("check-sender"), MooncakeAgent("check-receiver")
    source, registered, unregistered = (np.full(4096, i, dtype=np.uint8) for i in (7, 0, 0))
    sender.register([source])
    receiver.register([registered])
    peer = sender.connect(receiver.metadata())
    write = sender.write(peer, np.array([[source.ctypes.data, unregistered.ctypes.data, 256]], np.uint64), b"x")
    deadline, outcome = time.monotonic() + harness.WAIT_S, "did not finish"
    try:
        while time.monotonic() < deadline:
            if write.done():
                outcome = "succeeded"
                break
    except TransferError as error:
        outcome = f"TransferError ({error})"
    time.sleep(0.1)  # a notification, had one been sent, would be there by now
    heard = receiver.notifications()
    sender.close()
    receiver.close()
    ok = outcome.startswith("TransferError") and not heard and not unregistered.any()
    print(f"adapter check, write into unregistered memory: {outcome}; notifications {heard}: {'ok' if ok else 'FAILED'}")
    return ok


if __name__ == "__main__":
    if not failed_write_is_reported():
        sys.exit(1)
    sys.exit(harness.main(MooncakeAgent, "Mooncake Transfer Engine (TCP, host memory, the payload on a side channel)"))
