#!/usr/bin/env bash
# The install test (`make install-test`, part of `make test`): installs
# kvcsum into a temporary prefix and uses it as C and C++ projects would.
#
#   - the installed tree: SONAME links, the shared library without debug info
#     and under 2 MB, `nm` on the static library showing only kvcs_ global
#     symbols, every header call having its kvcs_<call>_fn type
#   - tests/install/consumer.c with pkg-config (one kvcsum.pc), against the
#     shared library, the static one (its `static_libs` variable) and fully
#     static (`cc -static`, `pkg-config --static`), then run; a shared
#     build without an rpath fails to start until LD_LIBRARY_PATH names
#     the prefix (docs/c-api.md says so)
#   - a second install with DESTDIR and GNUInstallDirs-style LIBDIR and
#     INCLUDEDIR, relocated: pkg-config and CMake find what it holds, and
#     `make uninstall` removes every file of it
#   - tests/install/consumer.cpp (kvcsum.hpp) with CMake find_package(kvcsum),
#     shared and static (KVCSUM_USE_STATIC_LIBS=ON), then run
#   - make dist-c's tarball unpacked: C (pkg-config) and C++ (CMake)
#     programs built from it with no cargo or rustc on PATH, and run
#   - KVCS_NO_PROTOTYPES: a program that defines it and calls kvcs_version()
#     directly fails to compile (implicit declaration), one that uses only
#     types, constants, kvcs_<call>_fn and the table kvcs_api compiles
#   - examples/c/dlopen_agent.c (built with KVCS_NO_PROTOTYPES, one symbol:
#     kvcs_api_get) against the installed library, and against paths that
#     must fail with a clear message: no file, no kvcs_api_get, another ABI
set -euo pipefail
cd "$(dirname "$0")/../.."

work=$(pwd)/build/install-test
prefix=$work/prefix
rm -rf "$work" && mkdir -p "$work"
strict=(-std=c11 -Wall -Wextra -Wpedantic -Werror)
failures=0
fail() { echo "install-test: FAIL: $*" >&2; failures=$((failures + 1)); }
pass() { echo "install-test: ok: $*"; }

scripts/install.sh "$prefix"
version=$(sed -n 's/^version = "\(.*\)"$/\1/p' Cargo.toml | head -n 1)
soversion=$(sed -n 's/^#define KVCS_ABI_VERSION \([0-9]*\)$/\1/p' include/kvcsum.h)  # docs/VERSIONING.md
lib=$prefix/lib

# --- The installed tree ------------------------------------------------------
[ "$(readlink "$lib/libkvcsum.so")" = "libkvcsum.so.$soversion" ] && pass "libkvcsum.so -> libkvcsum.so.$soversion" ||
    fail "libkvcsum.so does not point to libkvcsum.so.$soversion"
[ "$(readlink "$lib/libkvcsum.so.$soversion")" = "libkvcsum.so.$version" ] &&
    pass "libkvcsum.so.$soversion -> libkvcsum.so.$version" || fail "libkvcsum.so.$soversion does not point to .so.$version"
soname=$(readelf -d "$lib/libkvcsum.so.$version" | sed -n 's/.*Library soname: \[\(.*\)\]/\1/p')
[ "$soname" = "libkvcsum.so.$soversion" ] && pass "SONAME $soname" || fail "SONAME is '$soname'"
size=$(stat -c %s "$lib/libkvcsum.so.$version")
[ "$size" -lt $((2 * 1024 * 1024)) ] && pass "shared library is $size bytes (< 2 MiB)" ||
    fail "shared library is $size bytes, not under 2 MiB"
# docs/c-api.md says "about N MB": within a quarter of the size installed.
said=$(sed -n 's/.*without debug info (about \([0-9.]*\) MB.*/\1/p' docs/c-api.md)
if [ -n "$said" ] && awk -v s="$size" -v d="$said" 'BEGIN { m = s / 1e6; exit !(m > 0.75 * d && m < 1.25 * d) }'; then
    pass "docs/c-api.md says about $said MB for the shared library: $size bytes"
else
    fail "docs/c-api.md says about '${said}' MB for the shared library, which is $size bytes"
fi
if readelf -SW "$lib/libkvcsum.so.$version" | grep -q '\.debug_'; then
    fail "the installed shared library has debug sections"
else
    pass "no debug sections in the shared library"
fi
# Every global symbol the static library defines is a kvcs_ one, and it
# defines every call of the header.
others=$(nm -g --defined-only "$lib/libkvcsum.a" | awk 'NF == 3 && $3 !~ /^kvcs_/' | head -n 5)
defined=$(nm -g --defined-only "$lib/libkvcsum.a" | awk 'NF == 3 && $3 ~ /^kvcs_/ { print $3 }' | sort -u)
calls=$(sed -nE 's/^[a-zA-Z_][a-zA-Z0-9_ *]*[ *](kvcs_[a-z0-9_]+)\(.*/\1/p' include/kvcsum.h | sort -u)
if [ -n "$others" ]; then
    fail "libkvcsum.a defines global symbols other than kvcs_ ones: $others"
elif [ "$defined" != "$calls" ]; then
    fail "libkvcsum.a's kvcs_ symbols differ from the header's calls: $(diff <(echo "$defined") <(echo "$calls") | head)"
else
    pass "nm: libkvcsum.a defines only kvcs_ globals, the $(echo "$calls" | wc -l) calls of the header"
fi
dynamic=$(nm -D --defined-only "$lib/libkvcsum.so.$version" | awk 'NF == 3 && $3 ~ /^kvcs_/ { print $3 }' | sort -u)
[ "$dynamic" = "$calls" ] && pass "the shared library exports exactly the header's calls" ||
    fail "the shared library's kvcs_ exports differ from the header's calls"
# Each call has its function-pointer type, and the type is the call's.
{
    echo '#include <kvcsum.h>'
    echo 'int main(void) {'
    for call in $calls; do echo "  kvcs_${call#kvcs_}_fn ${call}_p = ${call}; (void)${call}_p;"; done
    echo '  return 0;'
    echo '}'
} >"$work/typedefs.c"
if gcc "${strict[@]}" -I"$prefix/include" -c "$work/typedefs.c" -o "$work/typedefs.o"; then
    pass "every call has a kvcs_<call>_fn type equal to its own"
else
    fail "a call lacks its kvcs_<call>_fn type, or the type differs (see above)"
fi

# --- C with pkg-config -------------------------------------------------------
export PKG_CONFIG_PATH=$lib/pkgconfig
# shellcheck disable=SC2046
gcc "${strict[@]}" tests/install/consumer.c $(pkg-config --cflags --libs kvcsum) -Wl,-rpath,"$lib" \
    -o "$work/consumer_shared"
# shellcheck disable=SC2046
gcc "${strict[@]}" tests/install/consumer.c $(pkg-config --cflags kvcsum) $(pkg-config --variable=static_libs kvcsum) \
    -o "$work/consumer_static"
# shellcheck disable=SC2046
gcc "${strict[@]}" -static tests/install/consumer.c $(pkg-config --static --cflags --libs kvcsum) \
    -o "$work/consumer_full_static" 2>"$work/full_static.log" || { cat "$work/full_static.log"; fail "cc -static with pkg-config --static"; }
if [ -x "$work/consumer_full_static" ] && ! readelf -d "$work/consumer_full_static" | grep -q NEEDED; then
    "$work/consumer_full_static" && pass "C, cc -static \$(pkg-config --static --libs kvcsum): no shared library needed" ||
        fail "the -static C program"
else
    fail "the -static C program needs shared libraries"
fi
if [ -f "$lib/pkgconfig/kvcsum-static.pc" ]; then
    fail "kvcsum-static.pc is installed: one kvcsum.pc is"
fi
# A custom prefix without an rpath: the loader does not look there.
# shellcheck disable=SC2046
gcc "${strict[@]}" tests/install/consumer.c $(pkg-config --cflags --libs kvcsum) -o "$work/consumer_no_rpath"
if env -u LD_LIBRARY_PATH "$work/consumer_no_rpath" >"$work/no_rpath.log" 2>&1; then
    fail "a program without an rpath found libkvcsum.so.$soversion in $lib by itself"
elif grep -q "libkvcsum.so.$soversion: cannot open shared object file" "$work/no_rpath.log" &&
    LD_LIBRARY_PATH=$lib "$work/consumer_no_rpath" >/dev/null; then
    pass "without -Wl,-rpath the program does not start (libkvcsum.so.$soversion not found); LD_LIBRARY_PATH=$lib starts it"
else
    fail "a program without an rpath: $(cat "$work/no_rpath.log")"
fi
if readelf -d "$work/consumer_shared" | grep -q "NEEDED.*\[libkvcsum.so.$soversion\]"; then
    pass "the shared C program needs libkvcsum.so.$soversion"
else
    fail "the shared C program does not record libkvcsum.so.$soversion"
fi
if readelf -d "$work/consumer_static" | grep -q 'libkvcsum'; then
    fail "the static C program still needs a libkvcsum shared library"
else
    pass "the static C program needs no libkvcsum shared library"
fi
"$work/consumer_shared" && pass "C, pkg-config kvcsum (shared)" || fail "C program against the shared library"
"$work/consumer_static" && pass "C, pkg-config --variable=static_libs kvcsum (static libkvcsum)" ||
    fail "C program against the static library"

# --- DESTDIR, LIBDIR, INCLUDEDIR, relocated, uninstalled ----------------------
# Staged under DESTDIR with Debian's multiarch LIBDIR and an INCLUDEDIR
# of its own, as a package would; then moved where DESTDIR pointed, as
# the package manager does.
stage=$work/stage
custom=/opt/kvcsum-test
multiarch=$custom/lib/x86_64-linux-gnu
make --no-print-directory install PREFIX=$custom LIBDIR=$multiarch INCLUDEDIR=$custom/include/kvcsum \
    DESTDIR="$stage" >"$work/custom-install.log" 2>&1 || { cat "$work/custom-install.log"; fail "make install DESTDIR LIBDIR INCLUDEDIR"; }
if [ -e "$custom" ]; then
    fail "make install with DESTDIR wrote outside it ($custom exists)"
fi
staged=$(cd "$stage" && find . -type f -o -type l | sort)
want_files=$(printf '%s\n' ".$custom/include/kvcsum/kvcsum.h" ".$custom/include/kvcsum/kvcsum.hpp" \
    ".$multiarch/cmake/kvcsum/kvcsumConfig.cmake" ".$multiarch/cmake/kvcsum/kvcsumConfigVersion.cmake" \
    ".$multiarch/libkvcsum.a" ".$multiarch/libkvcsum.so" ".$multiarch/libkvcsum.so.$soversion" \
    ".$multiarch/libkvcsum.so.$version" ".$multiarch/pkgconfig/kvcsum.pc" | sort)
[ "$staged" = "$want_files" ] && pass "DESTDIR, LIBDIR, INCLUDEDIR: $(echo "$staged" | wc -l) files where they belong" ||
    fail "the staged install holds: $staged"
pc=$stage$multiarch/pkgconfig/kvcsum.pc
grep -qx "libdir=\${prefix}/lib/x86_64-linux-gnu" "$pc" && grep -qx "includedir=\${prefix}/include/kvcsum" "$pc" &&
    grep -qx "prefix=$custom" "$pc" && pass "kvcsum.pc names PREFIX, LIBDIR and INCLUDEDIR (not DESTDIR)" ||
    fail "kvcsum.pc: $(cat "$pc")"
# Where DESTDIR pointed is not writable here: the pkg-config file is read
# with its prefix redefined, as for an unpacked package.
# shellcheck disable=SC2046
gcc "${strict[@]}" tests/install/consumer.c \
    $(PKG_CONFIG_PATH=$stage$multiarch/pkgconfig pkg-config --define-variable=prefix="$stage$custom" --cflags --libs kvcsum) \
    -Wl,-rpath,"$stage$multiarch" -o "$work/consumer_custom" && "$work/consumer_custom" >/dev/null &&
    pass "C against the LIBDIR/INCLUDEDIR install (pkg-config)" || fail "C against the LIBDIR/INCLUDEDIR install"
{
    cmake -S tests/install -B "$work/cmake-custom" -DCMAKE_PREFIX_PATH="$stage$custom" -DCMAKE_BUILD_TYPE=Release \
        -DCMAKE_LIBRARY_ARCHITECTURE=x86_64-linux-gnu >"$work/cmake-custom.log" 2>&1 &&
        cmake --build "$work/cmake-custom" >>"$work/cmake-custom.log" 2>&1 && "$work/cmake-custom/consumer_cpp" >/dev/null &&
        pass "C++ against the LIBDIR/INCLUDEDIR install (CMake, relocated)" ||
        { cat "$work/cmake-custom.log"; fail "C++ against the LIBDIR/INCLUDEDIR install"; }
}
make --no-print-directory uninstall PREFIX=$custom LIBDIR=$multiarch INCLUDEDIR=$custom/include/kvcsum \
    DESTDIR="$stage" >"$work/custom-uninstall.log" 2>&1 || fail "make uninstall"
left=$(cd "$stage" && find . -type f -o -type l)
[ -z "$left" ] && pass "make uninstall removed every file it installed" || fail "make uninstall left: $left"

# --- The release tarball, unpacked, with no Rust toolchain --------------------
# make dist-c's tarball unpacked in a directory of its own, then C
# (pkg-config) and C++ (CMake) programs built from it alone, in an
# environment whose PATH has no cargo or rustc (env -i: nothing of this
# shell's either), and run.
make --no-print-directory dist-c >"$work/dist.log" 2>&1 || { cat "$work/dist.log"; fail "make dist-c"; }
tarball=$(ls build/release/kvcsum-"$version"-*-linux-gnu.tar.gz 2>/dev/null | head -n 1)
unpacked=$work/unpacked
mkdir -p "$unpacked"
if [ -n "$tarball" ] && tar -C "$unpacked" -xzf "$tarball"; then
    tree=$(ls -d "$unpacked"/kvcsum-"$version"-*)
    for want in include/kvcsum.h include/kvcsum.hpp "lib/libkvcsum.so.$version" "lib/libkvcsum.so.$soversion" \
        lib/libkvcsum.so lib/libkvcsum.a lib/pkgconfig/kvcsum.pc lib/cmake/kvcsum/kvcsumConfig.cmake \
        lib/cmake/kvcsum/kvcsumConfigVersion.cmake LICENSE README; do
        [ -e "$tree/$want" ] || fail "the tarball lacks $want"
    done
    no_rust_path=$(echo "$PATH" | tr : '\n' | while read -r dir; do
        [ -n "$dir" ] && [ ! -x "$dir/cargo" ] && [ ! -x "$dir/rustc" ] && echo "$dir"; done | paste -sd:)
    mkdir -p "$work/from-tarball"
    cp tests/install/consumer.c tests/install/consumer.cpp tests/install/CMakeLists.txt "$work/from-tarball/"
    cat >"$work/from-tarball/build.sh" <<'BUILD'
set -eu
if command -v cargo >/dev/null || command -v rustc >/dev/null; then echo "a Rust toolchain is on PATH"; exit 1; fi
cd "$(dirname "$0")"
export PKG_CONFIG_PATH=$1/lib/pkgconfig
gcc -std=c11 -Wall -Wextra -Wpedantic -Werror consumer.c $(pkg-config --cflags --libs kvcsum) \
    -Wl,-rpath,"$(pkg-config --variable=libdir kvcsum)" -o consumer_c
./consumer_c
cmake -S . -B cmake-build -DCMAKE_PREFIX_PATH="$1" -DCMAKE_BUILD_TYPE=Release >cmake.log 2>&1 || { cat cmake.log; exit 1; }
cmake --build cmake-build >>cmake.log 2>&1 || { cat cmake.log; exit 1; }
./cmake-build/consumer_cpp
BUILD
    if env -i HOME="$HOME" PATH="$no_rust_path" bash "$work/from-tarball/build.sh" "$tree" >"$work/from-tarball.log" 2>&1; then
        pass "$(basename "$tarball"): C (pkg-config) and C++ (CMake) programs built and run from it, no cargo or rustc on PATH"
    else
        fail "programs from the unpacked tarball: $(cat "$work/from-tarball.log")"
    fi
    readelf -d "$work/from-tarball/consumer_c" 2>/dev/null | grep -q "RUNPATH.*$tree/lib\|RPATH.*$tree/lib" ||
        fail "the C program from the tarball does not load the tarball's library"
else
    fail "no tarball from make dist-c ($(cat "$work/dist.log"))"
fi

# --- C++ with CMake find_package ----------------------------------------------
for variant in shared static; do
    use_static=OFF
    [ "$variant" = static ] && use_static=ON
    cmake -S tests/install -B "$work/cmake-$variant" -DCMAKE_PREFIX_PATH="$prefix" \
        -DKVCSUM_USE_STATIC_LIBS=$use_static -DCMAKE_BUILD_TYPE=Release >"$work/cmake-$variant.log" 2>&1 ||
        { cat "$work/cmake-$variant.log"; fail "cmake configure ($variant)"; continue; }
    cmake --build "$work/cmake-$variant" >>"$work/cmake-$variant.log" 2>&1 ||
        { cat "$work/cmake-$variant.log"; fail "cmake build ($variant)"; continue; }
    needs=$(readelf -d "$work/cmake-$variant/consumer_cpp" | grep -c 'libkvcsum' || true)
    if { [ "$variant" = shared ] && [ "$needs" -eq 1 ]; } || { [ "$variant" = static ] && [ "$needs" -eq 0 ]; }; then
        pass "C++ program ($variant) links the $variant library"
    else
        fail "C++ program ($variant): libkvcsum NEEDED entries: $needs"
    fi
    "$work/cmake-$variant/consumer_cpp" && pass "C++17, CMake find_package(kvcsum) ($variant)" ||
        fail "C++ program ($variant)"
done

# --- KVCS_NO_PROTOTYPES -------------------------------------------------------
# The same direct call compiles without the macro and not with it: the
# header then declares no function, and C11 has no implicit declarations.
printf '%s\n' '#include <kvcsum.h>' 'int main(void) { return kvcs_version() == 0; }' >"$work/direct_call.c"
printf '%s\n' '#define KVCS_NO_PROTOTYPES' '#include <kvcsum.h>' \
    'int main(void) { return kvcs_version() == 0; }' >"$work/no_prototypes.c"
if ! gcc "${strict[@]}" -I"$prefix/include" -c "$work/direct_call.c" -o "$work/direct_call.o"; then
    fail "a direct call to kvcs_version() does not compile even without KVCS_NO_PROTOTYPES"
elif gcc "${strict[@]}" -I"$prefix/include" -c "$work/no_prototypes.c" -o "$work/no_prototypes.o" \
    2>"$work/no_prototypes.log"; then
    fail "a direct call to kvcs_version() compiles under KVCS_NO_PROTOTYPES"
elif grep -q "error: implicit declaration of function .kvcs_version." "$work/no_prototypes.log"; then
    pass "KVCS_NO_PROTOTYPES: a direct call fails to compile: $(grep -m 1 'error:' "$work/no_prototypes.log" |
        sed 's/.*error: //')"
else
    fail "under KVCS_NO_PROTOTYPES the direct call failed for another reason: $(cat "$work/no_prototypes.log")"
fi
# Without -Werror (docs/c-api.md says so): gcc 12 in C11 only warns, and
# the link of a program not linked with -lkvcsum fails.
if gcc -std=c11 -I"$prefix/include" "$work/no_prototypes.c" -o "$work/no_prototypes" >"$work/no_prototypes_plain.log" 2>&1; then
    fail "a direct call under KVCS_NO_PROTOTYPES, without -Werror or -lkvcsum, linked"
elif grep -q "implicit declaration of function .kvcs_version." "$work/no_prototypes_plain.log" &&
    grep -q "undefined reference to .kvcs_version." "$work/no_prototypes_plain.log"; then
    pass "KVCS_NO_PROTOTYPES without -Werror: an implicit-declaration diagnostic and a link error"
else
    fail "KVCS_NO_PROTOTYPES without -Werror: $(cat "$work/no_prototypes_plain.log")"
fi
# What a plugin needs stays: types, constants, kvcs_<call>_fn, the table.
cat >"$work/plugin_types.c" <<'EOF'
#define KVCS_NO_PROTOTYPES
#include <kvcsum.h>
int main(void) {
  kvcs_api_get_fn api_get = 0;
  kvcs_worker_create_fn worker_create = 0;
  kvcs_api table = {.size = sizeof(kvcs_api), .abi_version = KVCS_ABI_VERSION};
  kvcs_layer layer = {.num_segments = 1};
  const kvcs_api *api = &table;
  return (api_get != 0) + (worker_create != 0) + !KVCS_API_HAS(api, kvcs_worker_create) + (int)layer.group_id +
         (KVCS_ERR_NOT_FOUND != 4);
}
EOF
if gcc "${strict[@]}" -I"$prefix/include" "$work/plugin_types.c" -o "$work/plugin_types" && "$work/plugin_types"; then
    pass "KVCS_NO_PROTOTYPES keeps the types, constants, kvcs_<call>_fn and kvcs_api"
else
    fail "a program using only types, constants and the table under KVCS_NO_PROTOTYPES"
fi
printf '%s\n' '#define KVCS_NO_PROTOTYPES' '#include <kvcsum.h>' 'int main() { return 0; }' >"$work/no_prototypes.cpp"
if g++ -std=c++17 -Wall -Wextra -Wpedantic -Werror -I"$prefix/include" -fsyntax-only "$work/no_prototypes.cpp"; then
    pass "the header under KVCS_NO_PROTOTYPES compiles as C++17"
else
    fail "the header under KVCS_NO_PROTOTYPES does not compile as C++17"
fi

# --- dlopen ------------------------------------------------------------------
gcc "${strict[@]}" -I"$prefix/include" examples/c/dlopen_agent.c -ldl -o "$work/dlopen_agent"
"$work/dlopen_agent" "$lib/libkvcsum.so.$soversion" && pass "dlopen_agent on the installed library" ||
    fail "dlopen_agent on the installed library"
expect_refusal() {
    local path=$1 needle=$2 rc=0
    "$work/dlopen_agent" "$path" >"$work/dlopen.out" 2>&1 || rc=$?
    if [ "$rc" -eq 2 ] && grep -q "$needle" "$work/dlopen.out"; then
        pass "dlopen_agent refuses $path: $(head -n 1 "$work/dlopen.out")"
    else
        fail "dlopen_agent on $path: exit $rc, output: $(cat "$work/dlopen.out")"
    fi
}
expect_refusal "$work/no-such-libkvcsum.so" "cannot load"
expect_refusal "$(gcc -print-file-name=libgcc_s.so.1)" "has no symbol kvcs_api_get"
# A library of the next ABI version, which gives no table for this one.
abi=$(sed -n 's/^#define KVCS_ABI_VERSION \([0-9]*\)$/\1/p' "$prefix/include/kvcsum.h")
cat >"$work/other_abi.c" <<'EOF'
#define KVCS_NO_PROTOTYPES
#include <kvcsum.h>
uint32_t kvcs_abi_version(void);
kvcs_status kvcs_api_get(uint32_t abi_version, const kvcs_api **out);
uint32_t kvcs_abi_version(void) { return KVCS_ABI_VERSION + 1; }
kvcs_status kvcs_api_get(uint32_t abi_version, const kvcs_api **out) {
  (void)out;
  return abi_version == KVCS_ABI_VERSION + 1 ? KVCS_ERR_INTERNAL : KVCS_ERR_UNSUPPORTED;
}
EOF
gcc "${strict[@]}" -shared -fPIC -I"$prefix/include" "$work/other_abi.c" -o "$work/libkvcsum-other-abi.so"
expect_refusal "$work/libkvcsum-other-abi.so" "has ABI version $((abi + 1)), this agent was built for $abi"

if [ "$failures" -ne 0 ]; then
    echo "install-test: $failures failed" >&2
    exit 1
fi
echo "install-test: all passed"
