#!/usr/bin/env bash
# Installs kvcsum like a C library, run by `make install` after the release
# build:
#
#   scripts/install.sh PREFIX [DESTDIR [LIBDIR [INCLUDEDIR]]]
#   scripts/install.sh --uninstall PREFIX [DESTDIR [LIBDIR [INCLUDEDIR]]]
#
# LIBDIR defaults to PREFIX/lib, INCLUDEDIR to PREFIX/include (absolute
# paths; GNUInstallDirs' lib/x86_64-linux-gnu, say); DESTDIR is prepended
# to every path written (a staging root for packaging), never to the paths
# written into the pkg-config and CMake files. KVCSUM_RELOCATABLE=1 (make
# dist) writes those files relative to where they lie instead of PREFIX.
#
#   LIBDIR/libkvcsum.so.X.Y.Z    the shared library without debug info (crate version)
#   LIBDIR/libkvcsum.so.N        its SONAME, N = KVCS_ABI_VERSION (a link), what programs load
#   LIBDIR/libkvcsum.so          the link name for -lkvcsum
#   LIBDIR/libkvcsum.a           a static library whose only global
#                                symbols are the kvcs_ calls
#   INCLUDEDIR/kvcsum.h, kvcsum.hpp
#   LIBDIR/pkgconfig/kvcsum.pc   shared by default; `pkg-config --static`
#                                adds Libs.private for a -static program;
#                                its variable static_libs is the static
#                                library and what it needs
#   LIBDIR/cmake/kvcsum/         find_package(kvcsum): kvcsum::kvcsum
#
# --uninstall removes exactly these (and the directories it made, where
# empty). The debug info stripped from the shared library is kept in
# build/dist/libkvcsum.so.X.Y.Z.debug (linked by .gnu_debuglink).
set -euo pipefail

uninstall=0
if [ "${1:-}" = --uninstall ]; then
    uninstall=1
    shift
fi
usage="usage: scripts/install.sh [--uninstall] PREFIX [DESTDIR [LIBDIR [INCLUDEDIR]]]"
prefix=${1:?$usage}
destdir=${2:-}
libdir=${3:-$prefix/lib}
includedir=${4:-$prefix/include}
for dir in "$prefix" "$libdir" "$includedir"; do
    case $dir in
    /*) ;;
    *) echo "install.sh: '$dir' is not an absolute path ($usage)" >&2; exit 1 ;;
    esac
done
cd "$(dirname "$0")/.."

version=$(sed -n 's/^version = "\(.*\)"$/\1/p' Cargo.toml | head -n 1)
soversion=$(sed -n 's/^#define KVCS_ABI_VERSION \([0-9]*\)$/\1/p' include/kvcsum.h)  # docs/VERSIONING.md
so=libkvcsum.so.$version

if [ "$uninstall" = 1 ]; then
    lib=$destdir$libdir
    inc=$destdir$includedir
    rm -f "$lib/$so" "$lib/libkvcsum.so.$soversion" "$lib/libkvcsum.so" "$lib/libkvcsum.a" \
        "$lib/pkgconfig/kvcsum.pc" "$lib/pkgconfig/kvcsum-static.pc" \
        "$lib/cmake/kvcsum/kvcsumConfig.cmake" "$lib/cmake/kvcsum/kvcsumConfigVersion.cmake" \
        "$inc/kvcsum.h" "$inc/kvcsum.hpp"
    rmdir "$lib/cmake/kvcsum" 2>/dev/null || true
    for dir in "$lib/cmake" "$lib/pkgconfig"; do rmdir "$dir" 2>/dev/null || true; done
    echo "uninstalled kvcsum $version from $lib and $inc"
    exit 0
fi
release=target/release
dist=build/dist
rm -rf "$dist" && mkdir -p "$dist"

# Shared library: debug info split off, symbol table of internals dropped
# (the dynamic symbols, the kvcs_ calls, stay).
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
# `rustc --print native-static-libs` names for this target, but -lgcc_s:
# gcc's driver links libgcc_s, or libgcc_eh under -static, by itself, and
# an explicit -lgcc_s makes a -static link fail).
static_deps="-lutil -lrt -lpthread -lm -ldl -lc"
cmake_deps=$(echo "$static_deps" | sed -e 's/-l//g' -e 's/ /;/g')

# The pkg-config and CMake files name LIBDIR and INCLUDEDIR: as absolute
# paths, or (KVCSUM_RELOCATABLE=1) relative to the file's own directory.
relative() { realpath -m --relative-to="$1" "$2"; }
if [ "${KVCSUM_RELOCATABLE:-0}" = 1 ]; then
    pc_prefix="\${pcfiledir}/$(relative "$libdir/pkgconfig" "$prefix")"
else
    pc_prefix=$prefix
fi
pc_path() {  # $1 below PREFIX as ${prefix}/..., else absolute
    case $1 in
    "$prefix") echo '${prefix}' ;;
    "$prefix"/*) echo "\${prefix}/${1#"$prefix"/}" ;;
    *) echo "$1" ;;
    esac
}
cmake_dir=$libdir/cmake/kvcsum
sed -e "s|@PREFIX@|$pc_prefix|g" -e "s|@LIBDIR@|$(pc_path "$libdir")|g" -e "s|@INCLUDEDIR@|$(pc_path "$includedir")|g" \
    -e "s|@VERSION@|$version|g" -e "s|@STATIC_DEPS@|$static_deps|g" cmake/kvcsum.pc.in >"$dist/kvcsum.pc"
sed -e "s|@VERSION@|$version|g" -e "s|@SOVERSION@|$soversion|g" -e "s|@STATIC_DEPS@|$cmake_deps|g" \
    -e "s|@LIBDIR_FROM_CONFIG@|$(relative "$cmake_dir" "$libdir")|g" \
    -e "s|@INCLUDEDIR_FROM_CONFIG@|$(relative "$cmake_dir" "$includedir")|g" \
    cmake/kvcsumConfig.cmake.in >"$dist/kvcsumConfig.cmake"
sed -e "s|@VERSION@|$version|g" cmake/kvcsumConfigVersion.cmake.in >"$dist/kvcsumConfigVersion.cmake"

lib=$destdir$libdir
inc=$destdir$includedir
install -d "$lib/pkgconfig" "$lib/cmake/kvcsum" "$inc"
install -m 0755 "$dist/$so" "$lib/$so"
ln -sfn "$so" "$lib/libkvcsum.so.$soversion"
ln -sfn "libkvcsum.so.$soversion" "$lib/libkvcsum.so"
install -m 0644 "$dist/libkvcsum.a" "$lib/libkvcsum.a"
install -m 0644 include/kvcsum.h include/kvcsum.hpp "$inc/"
install -m 0644 "$dist/kvcsum.pc" "$lib/pkgconfig/"
install -m 0644 "$dist/kvcsumConfig.cmake" "$dist/kvcsumConfigVersion.cmake" "$lib/cmake/kvcsum/"
echo "installed kvcsum $version under $destdir$prefix (libraries in $lib, headers in $inc)"
