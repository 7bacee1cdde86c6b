#!/usr/bin/env bash
# The C release tarball (`make dist`, `make dist-c`): what a C or C++
# program needs, with no Rust toolchain, unpacked anywhere.
#
#   scripts/dist.sh OUTDIR
#
# OUTDIR/kvcsum-X.Y.Z-ARCH-linux-gnu.tar.gz holds kvcsum-X.Y.Z-ARCH-linux-gnu/:
#   include/kvcsum.h, include/kvcsum.hpp
#   lib/libkvcsum.so.X.Y.Z (+ the SONAME and link-name links), lib/libkvcsum.a
#   lib/pkgconfig/kvcsum.pc         relocatable (prefix=${pcfiledir}/../..)
#   lib/cmake/kvcsum/               relocatable (paths from its own place)
#   LICENSE, README (what it is, the glibc it needs, how to use it)
# The layout is `make install`'s (scripts/install.sh, KVCSUM_RELOCATABLE=1).
# The oldest glibc it runs on is the newest GLIBC_ symbol version the shared
# library needs, found here and written into README.
set -euo pipefail
out=${1:?usage: scripts/dist.sh OUTDIR}
cd "$(dirname "$0")/.."

version=$(sed -n 's/^version = "\(.*\)"$/\1/p' Cargo.toml | head -n 1)
name=kvcsum-$version-$(uname -m)-linux-gnu
stage=build/dist-stage
rm -rf "$stage" && mkdir -p "$stage" "$out"
KVCSUM_RELOCATABLE=1 scripts/install.sh "/$name" "$(pwd)/$stage" >/dev/null
root=$stage/$name
install -m 0644 LICENSE "$root/LICENSE"
glibc=$(objdump -T "$root/lib/libkvcsum.so.$version" | sed -n 's/.*GLIBC_\([0-9.]*\).*/\1/p' | sort -uV | tail -n 1)
cat >"$root/README" <<README
kvcsum $version, the C library, built for $(uname -m) Linux with glibc $glibc or newer.

  include/      kvcsum.h (C11), kvcsum.hpp (C++17)
  lib/          libkvcsum.so.$version (SONAME $(readelf -d "$root/lib/libkvcsum.so.$version" | sed -n 's/.*Library soname: \[\(.*\)\]/\1/p')), libkvcsum.a
  lib/pkgconfig/kvcsum.pc, lib/cmake/kvcsum/  relocatable: use them where unpacked

  export PKG_CONFIG_PATH=\$PWD/lib/pkgconfig
  cc -std=c11 app.c \$(pkg-config --cflags --libs kvcsum) -Wl,-rpath,\$(pkg-config --variable=libdir kvcsum)
  cmake -DCMAKE_PREFIX_PATH=\$PWD ...   # find_package(kvcsum) -> kvcsum::kvcsum

The documentation: docs/c-api.md of the source at the same version.
README
tar -C "$stage" --owner=0 --group=0 --numeric-owner --sort=name -czf "$out/$name.tar.gz" "$name"
echo "$out/$name.tar.gz (glibc $glibc or newer)"
