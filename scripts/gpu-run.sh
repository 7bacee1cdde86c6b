#!/usr/bin/env bash
# Runs on the GPU machine, from the repository root, after gpu-prepare.sh:
# every GPU test, compute-sanitizer (memcheck, racecheck) on the test
# binary, and the benchmark. Logs go to $1 (default ./gpu-logs).
set -uo pipefail
out=${1:-gpu-logs}
mkdir -p "$out"
status=0
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv | tee "$out/gpu.txt"
# What BENCHMARKS.md's table names (scripts/bench-plots.py reads it beside bench.md).
{
  echo "card: $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | head -n 1 | sed 's/, / (driver /; s/$/)/')"
  echo "date: $(date -u +%Y-%m-%d)"
  echo "commit: $(cat .device/bin/commit 2>/dev/null || echo unknown)"
} > "$out/run.txt"
echo "== GPU tests" | tee -a "$out/summary.txt"
.device/bin/gpu-tests --include-ignored --test-threads=1 2>&1 | tee "$out/tests.log" || status=1
tail -3 "$out/tests.log" >> "$out/summary.txt"
# device_worker_rejects_memory_it_cannot_read and device_stored_rejects_bad_buffers
# ask CUDA about a host pointer on purpose, and
# device_stored_refuses_a_buffer_too_small_for_num_blocks about an address
# past the end of an allocation, which the sanitizer reports as CUDA API
# errors (cuPointerGetAttribute); they run above.
# Under the sanitizers the device catalogue runs one 512-block batch per
# class (its 36 classes x 3 algorithms at the default 4096 faults would not
# fit the timeout); the plain run above runs it in full.
for tool in memcheck racecheck; do
  echo "== compute-sanitizer $tool" | tee -a "$out/summary.txt"
  KVCS_CATALOGUE_ENGINE_TRIALS=512 timeout 240 compute-sanitizer --tool "$tool" --error-exitcode 9 \
    .device/bin/gpu-tests --include-ignored --test-threads=1 \
    --skip device_worker_rejects_memory_it_cannot_read --skip device_stored_rejects_bad_buffers \
    --skip device_stored_refuses_a_buffer_too_small_for_num_blocks 2>&1 | tee "$out/$tool.log" || status=1
  tail -4 "$out/$tool.log" >> "$out/summary.txt"
done
echo "== benchmark" | tee -a "$out/summary.txt"
.device/bin/gpu_bench 2>&1 | tee "$out/bench.md" || status=1
if [ -n "${KVCS_BENCH_VARIANTS:-}" ]; then
  # Tuning runs: the same benchmark with kernel compile options, e.g.
  # KVCS_BENCH_VARIANTS="-DKVCS_BATCH=8;-DKVCS_BATCH=2"
  IFS=';' read -ra variants <<< "$KVCS_BENCH_VARIANTS"
  for v in "${variants[@]}"; do
    echo "== benchmark with $v" | tee -a "$out/summary.txt"
    KVCSUM_NVRTC_OPTIONS="$v" .device/bin/gpu_bench 2>&1 | tee -a "$out/variants.md"
  done
fi
cat "$out/summary.txt"
exit $status
