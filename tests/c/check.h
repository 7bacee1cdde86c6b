/*
 * The checks shared by the C tests in tests/c: each check counts as
 * passed or failed, a failure prints where and why, and main.c prints the
 * final "N passed, M failed" line that CI reads.
 */
#ifndef KVCSUM_TEST_CHECK_H
#define KVCSUM_TEST_CHECK_H

#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include "kvcsum.h"

/* Counters, defined in main.c. */
extern int checks_passed;
extern int checks_failed;

/* Records one check: `ok` passed or not; `what` says what was checked. */
void check_record(int ok, const char *file, int line, const char *what);

/* Records that `got` is `want` and, when `want` is an error, that
 * kvcs_last_error() contains `needle` (the argument it must name). */
void check_status(kvcs_status got, kvcs_status want, const char *needle, const char *file, int line,
                  const char *call);

/* CHECK(condition): a plain condition. */
#define CHECK(cond) check_record((cond) ? 1 : 0, __FILE__, __LINE__, #cond)

/* EXPECT(call, KVCS_ERR_..., "argument"): the call fails with that status
 * and its message names the argument. EXPECT_OK(call): the call succeeds. */
#define EXPECT(call, want, needle) check_status((call), (want), (needle), __FILE__, __LINE__, #call)
#define EXPECT_OK(call) check_status((call), KVCS_OK, NULL, __FILE__, __LINE__, #call)

/* The test groups, one per file. */
void test_errors(void);
void test_checksums(uint64_t seed);
void test_verify(uint64_t seed);
void test_ownership(void);
void test_features(void);
void test_topology(void);
void test_layout_repair(uint64_t seed);
void test_payload(uint64_t seed);

#endif /* KVCSUM_TEST_CHECK_H */
