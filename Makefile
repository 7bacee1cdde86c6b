# kvcsum: build, test and demo commands (see README.md).
#
#   make demo    build the library (release) and examples/c/demo.c, run it
#   make test    Rust tests, then the C tests and the demo under ASan/UBSan
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

.PHONY: all lib demo test rust-test c-test demo-test header bench clean FORCE

all: lib

lib: $(LIB)

# cargo decides whether the library is stale, so it is always asked; make
# relinks the C programs only when the file it leaves is newer than them.
$(LIB): FORCE
	$(CARGO) build --$(PROFILE) --lib

demo: $(BUILD)/demo
	$(BUILD)/demo

test: rust-test c-test demo-test

rust-test:
	$(CARGO) test --$(PROFILE)

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
