#!/usr/bin/env bash
# Builds the GPU test binary, the GPU benchmark and the host engine benchmark
# here (no GPU needed) and copies them, stripped, to .device/bin for the
# device machine (host_bench: `.device/bin/host_bench --gib 4 --threads
# 1,2,4,8,16`, see BENCHMARKS.md):
#   scripts/gpu-prepare.sh && (on the GPU machine) scripts/gpu-run.sh OUTDIR
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --release --example gpu_bench --example host_bench
test_binary=$(cargo test --release --test gpu --no-run --message-format=json 2>/dev/null |
  python3 -c 'import json,sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m["target"]["name"] == "gpu" and m.get("executable"):
        print(m["executable"])')
mkdir -p .device/bin
cp "$test_binary" .device/bin/gpu-tests
cp target/release/examples/gpu_bench .device/bin/gpu_bench
cp target/release/examples/host_bench .device/bin/host_bench
strip --strip-debug .device/bin/gpu-tests .device/bin/gpu_bench .device/bin/host_bench
# The commit these binaries were built from (gpu-run.sh puts it in run.txt,
# which scripts/bench-plots.py reads); "-dirty" when the tree had changes.
git describe --always --dirty --abbrev=7 > .device/bin/commit 2>/dev/null || echo unknown > .device/bin/commit
ls -la .device/bin
