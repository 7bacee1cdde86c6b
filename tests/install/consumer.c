/*
 * A C program built against an installed kvcsum (tests/install/run.sh):
 * with `pkg-config kvcsum` (shared), its `static_libs` variable (a static
 * libkvcsum) and `pkg-config --static` (a -static program). It checksums a seeded random HND cache of 2 layers x 4 heads
 * through the C API and compares every block position with a naive
 * reference of docs/SPEC.md written here (loops over logical indices), and
 * calls a topology helper. Prints "consumer.c: OK" and exits 0 when all
 * agree.
 *
 *   cc -std=c11 -Wall -Wextra -Wpedantic -Werror consumer.c \
 *      $(pkg-config --cflags --libs kvcsum) -o consumer && ./consumer [SEED]
 */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <kvcsum.h>

enum { LAYERS = 2, HEADS = 4, BLOCK = 16, BLOCKS = 6, CELL = 32, PIECES = CELL / 8 };

static uint64_t rng_state;

static uint64_t next_random(void) {
  /* splitmix64 */
  uint64_t z = (rng_state += 0x9e3779b97f4a7c15u);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9u;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebu;
  return z ^ (z >> 31);
}

static uint64_t load_le(const uint8_t *bytes) {
  uint64_t value = 0;
  for (int i = 7; i >= 0; i--) {
    value = (value << 8) | bytes[i];
  }
  return value;
}

static int fail(const char *what, kvcs_status status) {
  fprintf(stderr, "consumer.c: %s failed: %s: %s\n", what, kvcs_status_name(status), kvcs_last_error());
  return 1;
}

int main(int argc, char **argv) {
  uint64_t seed = argc > 1 ? strtoull(argv[1], NULL, 0) : 0x636f6e73u;
  rng_state = seed;
  if (kvcs_abi_version() != KVCS_ABI_VERSION) {
    fprintf(stderr, "consumer.c: library ABI %u, header %u\n", kvcs_abi_version(), KVCS_ABI_VERSION);
    return 1;
  }
  static uint8_t cache[LAYERS][BLOCKS][HEADS][BLOCK][CELL];
  for (size_t i = 0; i < sizeof cache; i += 8) {
    uint64_t value = next_random();
    memcpy((uint8_t *)cache + i, &value, 8);
  }
  const uint32_t block_ids[4] = {3, 0, 5, 1};
  const uint64_t num_tokens = 3 * BLOCK + 5;

  kvcs_worker_options options = {.tp_rank = 0, .tp_size = 1, .pp_rank = 0, .device = KVCS_HOST, .num_threads = 1};
  kvcs_worker *worker = NULL;
  kvcs_status status = kvcs_worker_create(&options, &worker);
  if (status != KVCS_OK) return fail("kvcs_worker_create", status);
  if ((status = kvcs_worker_add_region(worker, (uint64_t)(uintptr_t)cache, sizeof cache)) != KVCS_OK)
    return fail("kvcs_worker_add_region", status);
  if ((status = kvcs_worker_add_group(worker, 0, BLOCK)) != KVCS_OK) return fail("kvcs_worker_add_group", status);
  for (uint32_t l = 0; l < LAYERS; l++) {
    kvcs_segment cell = {.address = (uint64_t)(uintptr_t)cache[l],
                         .block_stride = HEADS * BLOCK * CELL,
                         .kernel_block_stride = 0,
                         .head_stride = BLOCK * CELL,
                         .token_stride = CELL,
                         .bytes_per_token = CELL};
    kvcs_layer layer = {.group_id = 0, .layer_number = 7 + l, .first_head = 0, .num_heads = HEADS,
                        .replicas = 1, .replica_index = 0, .num_blocks = BLOCKS, .kernel_blocks = 1,
                        .tokens_per_kernel_block = BLOCK, .num_segments = 1, .segments = &cell,
                        .identity = NULL, .identity_len = 0};
    if ((status = kvcs_worker_add_layer(worker, &layer)) != KVCS_OK) return fail("kvcs_worker_add_layer", status);
  }
  kvcs_blocks *blocks = NULL;
  if ((status = kvcs_blocks_create(&blocks)) != KVCS_OK) return fail("kvcs_blocks_create", status);
  if ((status = kvcs_blocks_add_request(blocks, "req", num_tokens)) != KVCS_OK)
    return fail("kvcs_blocks_add_request", status);
  if ((status = kvcs_blocks_add_group(blocks, "req", 0, 0, block_ids, 4)) != KVCS_OK)
    return fail("kvcs_blocks_add_group", status);
  kvcs_result *result = NULL;
  if ((status = kvcs_worker_checksum(worker, blocks, KVCS_ROLE_PRODUCER, NULL, &result)) != KVCS_OK)
    return fail("kvcs_worker_checksum", status);
  uint64_t values[4];
  if ((status = kvcs_result_column(result, "req", 0, 0, NULL, NULL, values)) != KVCS_OK)
    return fail("kvcs_result_column", status);

  int failures = 0;
  for (uint64_t q = 0; q < 4; q++) {
    uint64_t want = 0;
    for (uint32_t l = 0; l < LAYERS; l++) {
      for (uint32_t h = 0; h < HEADS; h++) {
        uint64_t slice = 0;
        for (uint64_t t = 0; t < BLOCK && q * BLOCK + t < num_tokens; t++) {
          for (uint64_t p = 0; p < PIECES; p++) {
            uint64_t j = (q * BLOCK + t) * PIECES + p;
            /* f of SPEC section 12 (the default algorithm, MIXED2:
             * three multiply-add rounds on the halves, two folds), then
             * the weight. */
            uint64_t v = load_le(&cache[l][block_ids[q]][h][t][p * 8]);
            const uint32_t k[3] = {KVCS_MIX2_MULTIPLIER_1, KVCS_MIX2_MULTIPLIER_2, KVCS_MIX2_MULTIPLIER_3};
            for (int round = 0; round < 3; round++) {
              uint64_t sum = (v & 0xFFFFFFFF00000000ull) + (v & 0xFFFFFFFFull) * k[round];
              v = (sum << 32) | (sum >> 32);
              if (round > 0) {
                v ^= v >> 32;
              }
            }
            slice += v * (2 * j + 1);
          }
        }
        want += (2 * ((uint64_t)(7 + l) * KVCS_MAX_KV_HEADS_PER_LAYER + h) + 1) * slice;
      }
    }
    if (values[q] != want) {
      fprintf(stderr, "consumer.c: position %" PRIu64 ": library %#" PRIx64 ", reference %#" PRIx64 "\n", q,
              values[q], want);
      failures++;
    }
  }
  int64_t ratio = 0;
  if ((status = kvcs_tp_ratio(2, 8, &ratio)) != KVCS_OK) return fail("kvcs_tp_ratio", status);
  if (ratio != -4) {
    fprintf(stderr, "consumer.c: kvcs_tp_ratio(2, 8) gave %" PRId64 "\n", ratio);
    failures++;
  }
  kvcs_result_destroy(result);
  kvcs_blocks_destroy(blocks);
  kvcs_worker_destroy(worker);
  if (failures != 0) {
    fprintf(stderr, "consumer.c: %d failures (seed %#" PRIx64 ")\n", failures, seed);
    return 1;
  }
  printf("consumer.c: OK (kvcsum %s, 4 positions equal to the reference)\n", kvcs_version());
  return 0;
}
