#!/usr/bin/env bash
# Installs kvcsum like a C library: `scripts/install.sh PREFIX [DESTDIR]`,
# run by `make install PREFIX=... [DESTDIR=...]` after the release build.
#
#   PREFIX/lib/libkvcsum.so.X.Y.Z    the shared library without debug info (crate version)
#   PREFIX/lib/libkvcsum.so.N        its SONAME, N = KVCS_ABI_VERSION (a link), what programs load
#   PREFIX/lib/libkvcsum.so          the link name for -lkvcsum
#   PREFIX/lib/libkvcsum.a           a static library whose only global
#                                    symbols are the kvcs_ calls
#   PREFIX/include/kvcsum.h, kvcsum.hpp
#   PREFIX/lib/pkgconfig/kvcsum.pc, kvcsum-static.pc
#   PREFIX/lib/cmake/kvcsum/         find_package(kvcsum): kvcsum::kvcsum
#
# The debug info stripped from the shared library is kept in
# build/dist/libkvcsum.so.X.Y.Z.debug (linked by .gnu_debuglink).
set -euo pipefail

prefix=${1:?usage: scripts/install.sh PREFIX [DESTDIR]}
destdir=${2:-}
cd "$(dirname "$0")/.."

version=$(sed -n 's/^version = "\(.*\)"$/\1/p' Cargo.toml | head -n 1)
soversion=$(sed -n 's/^#define KVCS_ABI_VERSION \([0-9]*\)$/\1/p' include/kvcsum.h)  # docs/VERSIONING.md
release=target/release
dist=build/dist
rm -rf "$dist" && mkdir -p "$dist"

# Shared library: debug info split off, symbol table of internals dropped
# (the dynamic symbols, the kvcs_ calls, stay).
so=libkvcsum.so.$version
objcopy --only-keep-debug "$release/libkvcsum.so" "$dist/$so.debug"
objcopy --strip-debug --strip-unneeded --remove-section=.comment \
    --add-gnu-debuglink="$dist/$so.debug" "$release/libkvcsum.so" "$dist/$so"
soname=$(readelf -d "$dist/$so" | sed -n 's/.*Library soname: \[\(.*\)\]/\1/p')
if [ "$soname" != "libkvcsum.so.$soversion" ]; then
    echo "install.sh: $release/libkvcsum.so has SONAME '$soname', expected libkvcsum.so.$soversion (build.rs sets it)" >&2
    exit 1
fi

# Static library: Rust's staticlib holds the whole standard library with
# thousands of global symbols that would clash with another Rust library
# in the same program. One relocatable link keeps what the kvcs_ calls
# reach, then every global symbol but those is made local. The standard
# library's objects carry LLVM bitcode (.llvmbc) that no C linker needs.
readelf -sW "$release/libkvcsum.a" 2>/dev/null |
    awk '$5 == "GLOBAL" && $7 != "UND" && $8 ~ /^kvcs_/ { print $8 }' | sort -u >"$dist/exports.txt"
if [ ! -s "$dist/exports.txt" ]; then
    echo "install.sh: no kvcs_ symbol in $release/libkvcsum.a" >&2
    exit 1
fi
ld -r --gc-sections $(sed 's/^/-u /' "$dist/exports.txt") "$release/libkvcsum.a" -o "$dist/kvcsum-full.o"
objcopy --strip-debug --remove-section=.llvmbc --remove-section=.llvmcmd --remove-section=.comment \
    --keep-global-symbols="$dist/exports.txt" "$dist/kvcsum-full.o" "$dist/kvcsum.o"
rm -f "$dist/kvcsum-full.o" "$dist/libkvcsum.a"
ar rcs "$dist/libkvcsum.a" "$dist/kvcsum.o"
rm -f "$dist/kvcsum.o"

# What a program linking the static library needs besides it (what
# `rustc --print native-static-libs` names for this target).
static_deps="-lgcc_s -lutil -lrt -lpthread -lm -ldl -lc"
cmake_deps=$(echo "$static_deps" | sed -e 's/-l//g' -e 's/ /;/g')

sed -e "s|@PREFIX@|$prefix|g" -e "s|@VERSION@|$version|g" -e "s|@STATIC_DEPS@|$static_deps|g" \
    cmake/kvcsum.pc.in >"$dist/kvcsum.pc"
sed -e "s|@PREFIX@|$prefix|g" -e "s|@VERSION@|$version|g" -e "s|@STATIC_DEPS@|$static_deps|g" \
    cmake/kvcsum-static.pc.in >"$dist/kvcsum-static.pc"
sed -e "s|@VERSION@|$version|g" -e "s|@SOVERSION@|$soversion|g" -e "s|@STATIC_DEPS@|$cmake_deps|g" \
    cmake/kvcsumConfig.cmake.in >"$dist/kvcsumConfig.cmake"
sed -e "s|@VERSION@|$version|g" cmake/kvcsumConfigVersion.cmake.in >"$dist/kvcsumConfigVersion.cmake"

root=$destdir$prefix
install -d "$root/lib/pkgconfig" "$root/lib/cmake/kvcsum" "$root/include"
install -m 0755 "$dist/$so" "$root/lib/$so"
ln -sfn "$so" "$root/lib/libkvcsum.so.$soversion"
ln -sfn "libkvcsum.so.$soversion" "$root/lib/libkvcsum.so"
install -m 0644 "$dist/libkvcsum.a" "$root/lib/libkvcsum.a"
install -m 0644 include/kvcsum.h include/kvcsum.hpp "$root/include/"
install -m 0644 "$dist/kvcsum.pc" "$dist/kvcsum-static.pc" "$root/lib/pkgconfig/"
install -m 0644 "$dist/kvcsumConfig.cmake" "$dist/kvcsumConfigVersion.cmake" "$root/lib/cmake/kvcsum/"
echo "installed kvcsum $version under $root"
