#!/usr/bin/env bash
# Fuzzes the record and payload decoders with cargo-fuzz (libFuzzer): on
# bytes (targets record and payload) and on generated records and payloads
# with large declared lengths and many elements (target shapes), each for a
# bounded time, and fails on any crash, hang, oversized allocation or
# decoder error that is not Malformed (the targets assert that). Target
# verdicts seeds the generator of tests/it/verdict_property.rs (the verdict
# rule: a configuration change never gives MISMATCH, corrupted KV that is
# read never MATCH) with its input and fails on any violation.
#
#   scripts/fuzz.sh [SECONDS_PER_TARGET]      (default 60)
#
# Needs cargo-fuzz (`cargo install cargo-fuzz --locked`). cargo-fuzz passes
# -Z flags to rustc; on a stable toolchain this script sets RUSTC_BOOTSTRAP=1
# so that they are accepted. Targets run with AddressSanitizer unless
# KVCS_FUZZ_SANITIZER says otherwise (e.g. `none`). Seeds come from
# fuzz/seeds/<target>; the growing corpus stays in fuzz/corpus/<target> and
# crashing inputs land in fuzz/artifacts/<target> (both git-ignored).
set -euo pipefail

seconds="${1:-60}"
sanitizer="${KVCS_FUZZ_SANITIZER:-address}"
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"

if ! cargo fuzz --version >/dev/null 2>&1; then
    echo "fuzz.sh: cargo-fuzz is not installed: cargo install cargo-fuzz --locked" >&2
    exit 1
fi
if ! rustc --version | grep -q nightly; then
    export RUSTC_BOOTSTRAP=1
fi

# A single allocation above 256 MiB (or 1 GiB in all) is a failure: inputs
# are at most 64 KiB, and decoders allocate in proportion to their input.
# The shapes target turns its input into a generated record or payload of up
# to 16 MiB (large declared lengths, many elements): the same limits then
# catch reserving by declared length, and the timeout quadratic validation.
limits=(-max_total_time="$seconds" -timeout=10 -max_len=65536 -malloc_limit_mb=256 -rss_limit_mb=1024 -print_final_stats=1)

for target in record payload shapes verdicts; do
    mkdir -p "fuzz/corpus/$target"
    cp -n fuzz/seeds/"$target"/* "fuzz/corpus/$target/" 2>/dev/null || true
    echo "== fuzzing $target for ${seconds}s (sanitizer: $sanitizer)"
    status=0
    cargo fuzz run --sanitizer "$sanitizer" --release "$target" "fuzz/corpus/$target" -- "${limits[@]}" \
        >"fuzz/last-$target.log" 2>&1 || status=$?
    grep -E '^(#[0-9]+ +DONE|stat::|==[0-9]+==|SUMMARY|thread .* panicked|Done [0-9]+ runs)' "fuzz/last-$target.log" || true
    if [ "$status" -ne 0 ]; then
        tail -n 30 "fuzz/last-$target.log" >&2
        echo "fuzz.sh: $target failed (status $status); see fuzz/last-$target.log and fuzz/artifacts/$target" >&2
        exit 1
    fi
done
echo "fuzz.sh: no crash, hang or oversized allocation in ${seconds}s per target"
