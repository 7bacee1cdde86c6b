/*
 * The cost of building a request block set through the C ABI: 256 requests
 * of 16 blocks each (one group, 32-byte block hashes), added one request
 * at a time (kvcs_blocks_add_request + kvcs_blocks_add_group +
 * kvcs_blocks_set_hashes) against one kvcs_blocks_add_arrays call from the
 * same arrays. Each way builds a fresh set (kvcs_blocks_create ..
 * kvcs_blocks_destroy) per round; the median of the rounds is printed.
 *
 * Build and run: `make block-set-bench`. By hand, from the repository root:
 *   make lib
 *   gcc -std=c11 -O2 -Wall -Wextra -Wpedantic -Werror -Iinclude benches/block_set_build.c \
 *       -Ltarget/release -lkvcsum -Wl,-rpath,$PWD/target/release -o block_set_build && ./block_set_build
 */
#define _POSIX_C_SOURCE 199309L
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "kvcsum.h"

enum { REQUESTS = 256, BLOCKS = 16, HASH_BYTES = 32, ROUNDS = 201 };

static char req_ids[REQUESTS * 16];
static size_t req_id_ends[REQUESTS];
static uint64_t num_tokens[REQUESTS];
static size_t group_ends[REQUESTS];
static uint32_t group_ids[REQUESTS];
static uint64_t first_positions[REQUESTS];
static size_t block_ends[REQUESTS];
static uint32_t block_ids[REQUESTS * BLOCKS];
static uint8_t hashes[REQUESTS * BLOCKS * HASH_BYTES];
static char names[REQUESTS][16];

static double now_us(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (double)t.tv_sec * 1e6 + (double)t.tv_nsec / 1e3;
}

static int compare(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return (x > y) - (x < y);
}

static void must(kvcs_status status, const char *call) {
  if (status != KVCS_OK) {
    fprintf(stderr, "%s failed: %s\n", call, kvcs_last_error());
    exit(1);
  }
}

static void per_request(void) {
  kvcs_blocks *blocks = NULL;
  must(kvcs_blocks_create(&blocks), "kvcs_blocks_create");
  for (int r = 0; r < REQUESTS; r++) {
    must(kvcs_blocks_add_request(blocks, names[r], num_tokens[r]), "kvcs_blocks_add_request");
    must(kvcs_blocks_add_group(blocks, names[r], 0, 0, block_ids + r * BLOCKS, BLOCKS), "kvcs_blocks_add_group");
    must(kvcs_blocks_set_hashes(blocks, names[r], 0, hashes + (size_t)r * BLOCKS * HASH_BYTES, HASH_BYTES, BLOCKS),
         "kvcs_blocks_set_hashes");
  }
  kvcs_blocks_destroy(blocks);
}

static void from_arrays(void) {
  kvcs_blocks *blocks = NULL;
  must(kvcs_blocks_create(&blocks), "kvcs_blocks_create");
  must(kvcs_blocks_add_arrays(blocks, REQUESTS, req_ids, req_id_ends, num_tokens, group_ends, REQUESTS, group_ids,
                              first_positions, block_ends, REQUESTS * BLOCKS, block_ids, hashes, HASH_BYTES),
       "kvcs_blocks_add_arrays");
  kvcs_blocks_destroy(blocks);
}

static double median_us(void (*build)(void)) {
  static double samples[ROUNDS];
  for (int i = 0; i < ROUNDS; i++) {
    double start = now_us();
    build();
    samples[i] = now_us() - start;
  }
  qsort(samples, ROUNDS, sizeof samples[0], compare);
  return samples[ROUNDS / 2];
}

int main(void) {
  size_t end = 0;
  uint64_t state = 0x9E3779B97F4A7C15u;
  for (int r = 0; r < REQUESTS; r++) {
    int length = snprintf(names[r], sizeof names[r], "req-%d", r);
    memcpy(req_ids + end, names[r], (size_t)length);
    end += (size_t)length;
    req_id_ends[r] = end;
    num_tokens[r] = BLOCKS * 16;
    group_ends[r] = (size_t)r + 1;
    group_ids[r] = 0;
    first_positions[r] = 0;
    block_ends[r] = (size_t)(r + 1) * BLOCKS;
  }
  for (size_t i = 0; i < sizeof block_ids / sizeof block_ids[0]; i++) block_ids[i] = (uint32_t)i;
  for (size_t i = 0; i < sizeof hashes; i++) {
    state = state * 6364136223846793005u + 1442695040888963407u;
    hashes[i] = (uint8_t)(state >> 56);
  }
  per_request();  /* warm */
  from_arrays();
  double calls = median_us(per_request), arrays = median_us(from_arrays);
  printf("block set of %d requests x %d blocks (32-byte hashes), median of %d rounds:\n", REQUESTS, BLOCKS, ROUNDS);
  printf("  per request (add_request + add_group + set_hashes, %d calls): %8.1f us\n", 3 * REQUESTS, calls);
  printf("  kvcs_blocks_add_arrays (1 call):                              %8.1f us\n", arrays);
  printf("  ratio: %.1fx\n", calls / arrays);
  return 0;
}
