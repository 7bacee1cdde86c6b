#!/bin/sh
# cargo, as setuptools-rust runs it for `make python-wheel` (through $CARGO):
# the build itself (`cargo rustc`) goes through cargo-zigbuild, which links
# libkvcsum against glibc $KVCSUM_GLIBC_VERSION's symbols (zig's copy of that
# glibc's stubs), so that the wheel is manylinux_$KVCSUM_GLIBC_VERSION
# whatever glibc this machine has; every other command (metadata, version)
# is cargo's own. cargo-zigbuild and zig come from PyPI into build/wheel-tools
# (Makefile).
set -eu
if [ "${1-}" = rustc ]; then
  shift
  exec cargo-zigbuild rustc --target "$(uname -m)-unknown-linux-gnu.${KVCSUM_GLIBC_VERSION:?}" "$@"
fi
exec cargo "$@"
