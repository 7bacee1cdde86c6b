#!/usr/bin/env python3
"""Kept so that `python3 scripts/gen-bindings.py` still works: the bindings
are now written by `make header` (tools/bindgen, which reads src/ffi once
with syn; the code is tests/it/header_gen). This runs that; it parses
nothing itself."""

import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent

if __name__ == "__main__":
    if sys.argv[1:] not in ([], ["--check"]):
        print(__doc__, file=sys.stderr)
        sys.exit(2)
    if sys.argv[1:] == ["--check"]:
        command = ["cargo", "test", "--release", "--test", "it", "header::"]
    else:
        command = ["cargo", "run", "--release", "--quiet", "-p", "kvcsum-bindgen"]
    sys.exit(subprocess.call(command, cwd=ROOT))
