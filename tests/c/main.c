/*
 * The C test program of kvcsum, about the C ABI: every call's error paths
 * (errors.c, verify.c), ownership, copies, lifetimes and output buffers
 * (ownership.c), state layers, aliases and stored checksums (features.c),
 * checksums against a naive reference through the C layout
 * structs (checksums.c), one end-to-end verification (verify.c), and layers
 * from layout strings with a repair plan (layout_repair.c). What
 * the engine computes in each case is the Rust tests' business.
 *
 * Build and run: `make test` (or `make c-test` once the library is built);
 * it compiles with -std=c11 -Wall -Wextra -Wpedantic -Werror and
 * AddressSanitizer/UBSan. Usage: c_tests [SEED] (a hex or decimal seed for
 * the random data; the default is printed on failure so a run can be
 * repeated). Exit status 0 only when every check passed; the last line is
 * "N passed, M failed".
 */
#include <inttypes.h>
#include <stdlib.h>

#include "check.h"

int checks_passed;
int checks_failed;

void check_record(int ok, const char *file, int line, const char *what) {
  if (ok) {
    checks_passed++;
  } else {
    checks_failed++;
    fprintf(stderr, "FAIL %s:%d: %s\n", file, line, what);
  }
}

void check_status(kvcs_status got, kvcs_status want, const char *needle, const char *file, int line,
                  const char *call) {
  if (got != want) {
    checks_failed++;
    fprintf(stderr, "FAIL %s:%d: %s gave %s, expected %s (last error: %s)\n", file, line, call,
            kvcs_status_name(got), kvcs_status_name(want), kvcs_last_error());
    return;
  }
  if (want != KVCS_OK && needle != NULL && strstr(kvcs_last_error(), needle) == NULL) {
    checks_failed++;
    fprintf(stderr, "FAIL %s:%d: %s: message \"%s\" does not name \"%s\"\n", file, line, call,
            kvcs_last_error(), needle);
    return;
  }
  checks_passed++;
}

int main(int argc, char **argv) {
  uint64_t seed = 0x6b766373u;
  if (argc > 1) {
    seed = strtoull(argv[1], NULL, 0);
  }
  /* Before any call on this thread failed, the message says so. */
  CHECK(strcmp(kvcs_last_error(), "no error") == 0);

  test_errors();
  test_checksums(seed);
  test_verify(seed);
  test_ownership();
  test_features();
  test_topology();
  test_layout_repair(seed);
  test_payload(seed);

  if (checks_failed != 0) {
    fprintf(stderr, "random data seed: %#" PRIx64 " (rerun: c_tests %#" PRIx64 ")\n", seed, seed);
  }
  printf("%d passed, %d failed\n", checks_passed, checks_failed);
  return checks_failed == 0 ? EXIT_SUCCESS : EXIT_FAILURE;
}
