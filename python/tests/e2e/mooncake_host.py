#!/usr/bin/env python3
"""The host end-to-end test over Mooncake's Transfer Engine (`make e2e-test`,
part of `make test`).

The scenario of nixl_host.py (harness.py), with Mooncake as the agent:
producer TP=2 HND 16-token blocks -> consumer TP=4 NHD 32-token blocks in
host memory, moved by batch_transfer_sync_write (TCP transport, P2P
handshake) between per-rank engines in this process, the payload beside
the transfer on a loopback side channel (mooncake_agent.py); each side
checksummed with kvcsum, judged by the verifiers; then each fault injected
through the agent, localised, and repaired. Prints each verdict; exits 1
when any expectation fails, and when Mooncake cannot be imported.
KVCS_E2E_SEED=N repeats a run.
"""

import sys

import harness
from mooncake_agent import MooncakeAgent

if __name__ == "__main__":
    sys.exit(harness.main(MooncakeAgent, "Mooncake Transfer Engine (TCP, host memory, the payload on a side channel)"))
