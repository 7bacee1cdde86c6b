"""The examples of docs/python.md run as written: each is taken from the
page (so an edit of the page is what is tested) and executed, and what it
computes is checked against a naive reference of docs/SPEC.md written
again here (loops over logical indices, Python integers mod 2**64)."""

import pathlib
import re

import numpy as np

import kvcsum

from test_checksums import MASK, mix2

DOCS = pathlib.Path(__file__).resolve().parents[2] / "docs"


def python_blocks(page: str, section: str) -> list[str]:
    """The ```python blocks of `section` (a "## " heading) of docs/`page`."""
    text = (DOCS / page).read_text()
    start = text.index(f"\n## {section}\n")
    end = text.find("\n## ", start + 1)
    body = text[start : end if end != -1 else len(text)]
    return re.findall(r"```python\n(.*?)```", body, flags=re.S)


def reference_column(kv_caches, block_ids, num_tokens, block_size, first_head=0):
    """c(q) of SPEC sections 2-3 under MIXED2 for FlashAttention caches
    [2, blocks, tokens, heads, D]: a cell's pieces are K's u64 words then
    V's, layer i has layer_number i."""
    out = []
    for q, block in enumerate(block_ids):
        total = 0
        for layer_number, cache in enumerate(kv_caches):
            words = cache.view(np.uint64)  # [2, blocks, tokens, heads, D / 4]
            heads = words.shape[3]
            pieces = 2 * words.shape[4]
            for h in range(heads):
                s = 0
                for i in range(block_size):
                    t = q * block_size + i
                    if t >= num_tokens:
                        break
                    cell = [int(x) for x in words[0, block, i, h]] + [int(x) for x in words[1, block, i, h]]
                    for p, x in enumerate(cell):
                        s += mix2(x) * (2 * (t * pieces + p) + 1)
                total = (total + (2 * (layer_number * 65536 + first_head + h) + 1) * s) & MASK
        out.append(total)
    return np.array(out, dtype=np.uint64)


def test_python_md_numpy_example_runs_and_gives_the_reference():
    blocks = python_blocks("python.md", "Checksums from numpy arrays and torch tensors")
    assert blocks, "docs/python.md has no python example in that section"
    scope: dict = {}
    exec(compile(blocks[0], "docs/python.md", "exec"), scope)  # noqa: S102 - the page's own example
    values, record = scope["values"], scope["record"]
    assert values.dtype == np.uint64 and len(values) == 3
    want = reference_column(scope["kv_caches"], [3, 1, 6], 40, scope["block_size"])
    np.testing.assert_array_equal(values, want)
    assert isinstance(record, bytes) and len(record) > 0


ROOT = DOCS.parent
C_PRELUDE = r"""
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include "kvcsum.h"
int main(int argc, char **argv) {
  (void)argc;
  const uint32_t rank = 0, tp = 1, heads = 2, num_layers = 2, num_blocks = 8;
  const uint64_t layer_bytes = (uint64_t)num_blocks * heads * 16 * 512;
  const uint32_t block_ids[7] = {5, 0, 7, 2, 1, 6, 3};
  uint8_t *cache = aligned_alloc(64, num_layers * layer_bytes);
  FILE *in = fopen(argv[1], "rb");
  if (cache == NULL || in == NULL || fread(cache, 1, num_layers * layer_bytes, in) != num_layers * layer_bytes) {
    return 2;
  }
  fclose(in);
"""
C_EPILOGUE = r"""
  for (size_t q = 0; q < num_values; q++) {
    printf("%llu\n", (unsigned long long)values[q]);
  }
  free(cache);
  return 0;
}
"""


def test_c_api_md_c_example_compiles_and_gives_the_reference(tmp_path):
    import os
    import subprocess

    text = (DOCS / "c-api.md").read_text()
    start = text.index("\n## Using it from C\n")
    snippet = re.search(r"```c\n(.*?)```", text[start:], flags=re.S).group(1)
    snippet = snippet.replace('#include "kvcsum.h"\n', "")
    source = tmp_path / "c_api_example.c"
    source.write_text(C_PRELUDE + snippet + C_EPILOGUE)
    library = pathlib.Path(os.environ.get("KVCSUM_LIBRARY") or ROOT / "target/release/libkvcsum.so").resolve()
    program = tmp_path / "c_api_example"
    subprocess.run(
        ["gcc", "-std=c11", "-Wall", "-Wextra", "-Wpedantic", "-Werror", "-Wno-unused-variable",
         f"-I{ROOT / 'include'}", str(source), str(library), f"-Wl,-rpath,{library.parent}", "-o", str(program)],
        check=True,
    )
    seed = 0x6361706931
    print(f"random data seed {seed:#x}")
    rng = np.random.default_rng(seed)
    # [layer][block][head][token][64 words of the 512-byte cell], HND.
    kv = rng.integers(0, 2**64, (2, 8, 2, 16, 64), dtype=np.uint64, endpoint=False)
    data = tmp_path / "cache.bin"
    data.write_bytes(kv.tobytes())
    out = subprocess.run([str(program), str(data)], check=True, capture_output=True, text=True).stdout
    got = [int(line) for line in out.split()]
    block_ids, num_tokens = [5, 0, 7, 2, 1, 6, 3], 100
    want = []
    for q, block in enumerate(block_ids):
        total = 0
        for layer in range(2):
            for h in range(2):
                s = 0
                for i in range(16):
                    t = q * 16 + i
                    if t >= num_tokens:
                        break
                    for p in range(64):
                        s += mix2(int(kv[layer, block, h, i, p])) * (2 * (t * 64 + p) + 1)
                total = (total + (2 * (layer * 65536 + h) + 1) * s) & MASK
        want.append(total)
    assert got == want


CONFIGURATION_REASONS = {
    "FINGERPRINT_DIFFERS", "ALGORITHM_DIFFERS", "STATE_TP_DIFFERS", "ONE_SIDED_GROUP", "ROLE_DIFFERS",
    "DECODING_DIFFERS", "BLOCK_SIZE_UNKNOWN", "COVERAGE_DIFFERS",
}


def alert_rules() -> dict:
    """{alert name: its text} of docs/metrics.md's rules file."""
    text = (DOCS / "metrics.md").read_text()
    block = re.search(r"```yaml\n(groups:.*?)```", text, flags=re.S).group(1)
    parts = re.split(r"\n\s+- alert: ", block)[1:]
    return {part.split("\n", 1)[0].strip(): part for part in parts}


def test_metrics_md_alerts_name_only_metrics_the_connector_exports():
    exported = set(re.findall(r'"(vllm:kvcsum_[a-z_]+)"', (ROOT / "python/kvcsum/vllm/metrics.py").read_text()))
    assert len(exported) > 10
    for name, rule in alert_rules().items():
        for metric in re.findall(r"(vllm:kvcsum_[a-z_]+?)(?:_total)?\b", rule):
            assert metric in exported, (name, metric)


def test_metrics_md_alerts_cover_every_configuration_reason_and_missing_checksums():
    rules = alert_rules()
    config = rules["KvcsumEnginesConfiguredDifferently"]
    for reason in CONFIGURATION_REASONS:
        assert reason in config, reason
        assert reason in kvcsum.Reason.__members__, reason
    missing = rules["KvcsumNoChecksums"]
    assert 'reason="NO_CHECKSUMS"' in missing and "vllm:kvcsum_payloads_missing_total" in missing


def test_metrics_md_pages_on_pd_mismatches_only_and_keeps_tier_mismatches_apart():
    rules = alert_rules()
    page = rules["KvcsumKVMismatch"]
    assert 'path="pd"' in page and "severity: page" in page and 'path="tier"' not in page
    tier = rules["KvcsumTierKVMismatch"]
    assert 'path="tier"' in tier and "severity: ticket" in tier


def test_c_api_md_cpp_walk_compiles_and_runs_under_asan(tmp_path):
    import os
    import subprocess

    text = (DOCS / "c-api.md").read_text()
    start = text.index("\n## C++\n")
    snippet = re.search(r"```cpp\n(#include <kvcsum.hpp>.*?)```", text[start:], flags=re.S).group(1)
    source = tmp_path / "cpp_walk.cpp"
    source.write_text(snippet)
    library = pathlib.Path(os.environ.get("KVCSUM_LIBRARY") or ROOT / "target/release/libkvcsum.so").resolve()
    program = tmp_path / "cpp_walk"
    subprocess.run(
        ["g++", "-std=c++17", "-Wall", "-Wextra", "-Wpedantic", "-Werror", "-fsanitize=address,undefined",
         "-fno-sanitize-recover=undefined", f"-I{ROOT / 'include'}", str(source), str(library),
         f"-Wl,-rpath,{library.parent}", "-o", str(program)],
        check=True,
    )
    env = dict(os.environ, ASAN_OPTIONS="detect_leaks=1")
    env.pop("LD_PRELOAD", None)
    out = subprocess.run([str(program)], capture_output=True, text=True, env=env)
    assert out.returncode == 0, (out.stdout, out.stderr)
    assert out.stdout.strip() == (
        "KVCS_VERDICT_MATCH, then KVCS_VERDICT_MISMATCH: load block 6 again (tokens 16..32)"
    ), out.stdout
