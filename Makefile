# kvcsum: build, test and demo commands (see README.md).
#
#   make demo    build the library (release) and examples/c/demo.c, run it
#   make test    every test: Rust tests, the kernel compile test (NVRTC from
#                PyPI), the C tests and the demo under ASan/UBSan, and a
#                bounded fuzz run of the decoders; installs what they need
#   make header  regenerate include/kvcsum.h from src/ffi (cbindgen)
#   make bench   the host engine benchmark (BENCHMARKS.md)
#   make clean   remove build/ (the C programs); `cargo clean` removes target/
#
# C programs are built in build/ against target/release/libkvcsum.so, found
# at run time through an rpath, so nothing needs installing.

CARGO ?= cargo
ifeq ($(origin CC),default)
CC := gcc
endif

PROFILE := release
LIB_DIR := $(abspath target/$(PROFILE))
LIB := $(LIB_DIR)/libkvcsum.so
BUILD := build
HEADER := include/kvcsum.h

# Every C file compiles cleanly in strict C11.
STRICT := -std=c11 -Wall -Wextra -Wpedantic -Werror
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
CARGO_FUZZ_VERSION := 0.13.2
FUZZ_SECONDS ?= 30

.PHONY: all lib demo test test-deps rust-test kernel-test c-test demo-test fuzz header bench clean FORCE

all: lib

lib: $(LIB)

# cargo decides whether the library is stale, so it is always asked; make
# relinks the C programs only when the file it leaves is newer than them.
$(LIB): FORCE
	$(CARGO) build --$(PROFILE) --lib

demo: $(BUILD)/demo
	$(BUILD)/demo

test: test-deps rust-test kernel-test c-test demo-test fuzz

# What the tests need beyond the toolchain: msgspec for the payload
# compatibility test, NVRTC for the kernel compile test.
test-deps: $(NVRTC_LIB)/libnvrtc.so.13
	python3 -c 'import msgspec' 2>/dev/null || python3 -m pip install --quiet msgspec==$(MSGSPEC_VERSION) \
	  || python3 -m pip install --quiet --break-system-packages msgspec==$(MSGSPEC_VERSION)

$(NVRTC_LIB)/libnvrtc.so.13: | $(BUILD)
	rm -rf $(NVRTC_DIR) && mkdir -p $(NVRTC_DIR)
	python3 -m pip download --quiet --no-deps --only-binary=:all: -d $(NVRTC_DIR) nvidia-cuda-nvrtc==$(NVRTC_VERSION)
	python3 -m zipfile -e $(NVRTC_DIR)/nvidia_cuda_nvrtc-*.whl $(NVRTC_DIR)

rust-test:
	$(CARGO) test --$(PROFILE)

# The GPU tests stay ignored here (no device); the kernels must still compile.
kernel-test: $(NVRTC_LIB)/libnvrtc.so.13
	LD_LIBRARY_PATH=$(NVRTC_LIB) $(CARGO) test --$(PROFILE) --test kernels -- --ignored

# The record and payload decoders under libFuzzer, FUZZ_SECONDS per target.
fuzz:
	cargo fuzz --version >/dev/null 2>&1 || $(CARGO) install cargo-fuzz --locked --version $(CARGO_FUZZ_VERSION)
	scripts/fuzz.sh $(FUZZ_SECONDS)

c-test: $(BUILD)/c_tests
	$(ASAN_ENV) $(BUILD)/c_tests

demo-test: $(BUILD)/demo_asan
	$(ASAN_ENV) $(BUILD)/demo_asan

header:
	KVCS_BLESS=1 $(CARGO) test --test header

bench:
	$(CARGO) run --$(PROFILE) --example host_bench

clean:
	rm -rf $(BUILD)

$(BUILD):
	mkdir -p $@

$(BUILD)/c_tests: $(C_TEST_SOURCES) $(C_TEST_HEADERS) $(HEADER) $(LIB) | $(BUILD)
	$(CC) $(STRICT) $(SANITIZE) -Iinclude -Itests/c $(C_TEST_SOURCES) $(LINK) -o $@

$(BUILD)/demo: examples/c/demo.c $(HEADER) $(LIB) | $(BUILD)
	$(CC) $(STRICT) -O2 -g -Iinclude $< $(LINK) -o $@

$(BUILD)/demo_asan: examples/c/demo.c $(HEADER) $(LIB) | $(BUILD)
	$(CC) $(STRICT) $(SANITIZE) -Iinclude $< $(LINK) -o $@
