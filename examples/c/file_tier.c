/*
 * kvcsum file tier: KV blocks offloaded to a file with their stored
 * checksums (docs/SPEC.md section 8, docs/storage-tiers.md), read back into
 * other block ids, and checked.
 *
 * Build and run: `make file-tier` (builds target/release/libkvcsum.so and
 * this file, then runs it; `make test` runs it under ASan/UBSan). By hand,
 * from the repository root:
 *   make lib   # cargo build --release --lib, plus the libkvcsum.so.2 link (its SONAME)
 *   gcc -std=c11 -Wall -Wextra -Wpedantic -Werror -Iinclude examples/c/file_tier.c \
 *       -Ltarget/release -lkvcsum -Wl,-rpath,$PWD/target/release -o file_tier && ./file_tier [FILE]
 *
 * The tier is two files: FILE (default `file_tier.kv` in the current
 * directory) holds the blocks, one after the other, each block's bytes of
 * every layer; FILE.sums is its sidecar, the 16 bytes kvcsum stored for each
 * block (KVCS_BLOCK_CHECKSUM_BYTES), in the same order. The 16 bytes are
 * copied as they are: the tier never reads or computes them.
 *
 * The model: 2 layers, 2 KV heads of size 64 in bf16 (128 bytes of K and 128
 * of V per head and token), HND blocks of 16 tokens ([blocks, heads, 16
 * tokens, K then V]) on one host worker; one request of 60 tokens (4 block
 * positions, the last one holding 12 tokens).
 * 1. Store: kvcs_worker_store writes each block's 16 bytes into the buffer
 *    registered with kvcs_worker_add_stored; the blocks and those bytes go to
 *    the files.
 * 2. Load into other block ids, with the 16 bytes into the buffer at the new
 *    ids; kvcs_worker_check_stored: every position matches, and the
 *    scheduler's verifier (kvcs_verifier_check_stored) says MATCH.
 * 3. One byte of the blocks file is flipped on disk; the same load: the load
 *    check fails at that block's position alone, and the verifier's MISMATCH
 *    names the position and its tokens.
 *
 * It exits 0 only when all of that holds (1 otherwise; 2 when a call or a
 * file operation fails).
 */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvcsum.h"

enum {
  LAYERS = 2,
  HEADS = 2,
  CELL_BYTES = 2 * 64 * 2, /* K then V, head size 64, bf16 */
  BLOCK_SIZE = 16,
  NUM_BLOCKS = 8,   /* block ids per layer of the cache */
  NUM_TOKENS = 60,  /* the request: 4 positions, the last with 12 tokens */
  POSITIONS = 4,
  HASH_BYTES = 32,  /* vLLM's block hashes are 32 bytes; kvcsum reads the first 8 */
  HEAD_STRIDE = BLOCK_SIZE * CELL_BYTES,
  BLOCK_BYTES = HEADS * HEAD_STRIDE, /* one block of one layer */
  LAYER_BYTES = NUM_BLOCKS * BLOCK_BYTES,
  CORRUPT_POSITION = 2,
};

#define REQ_ID "req-0"
#define GROUP_ID 0u

/* Calls a kvcsum function; on failure prints why and exits 2. */
#define CALL(expr)                                                                                       \
  do {                                                                                                   \
    kvcs_status status_ = (expr);                                                                        \
    if (status_ != KVCS_OK) {                                                                            \
      fprintf(stderr, "file_tier.c:%d: %s failed: %s: %s\n", __LINE__, #expr, kvcs_status_name(status_), \
              kvcs_last_error());                                                                        \
      exit(2);                                                                                           \
    }                                                                                                    \
  } while (0)

/* The cache (every layer, every block id) and the buffer of stored
 * checksums (16 bytes per block id), both memory the worker was given. */
static uint8_t cache[LAYERS * LAYER_BYTES];
static uint64_t stored[NUM_BLOCKS * KVCS_BLOCK_CHECKSUM_BYTES / 8]; /* 8-byte aligned, as kvcsum requires */

static uint64_t rng_state;

static uint64_t next_random(void) {
  rng_state ^= rng_state >> 12;
  rng_state ^= rng_state << 25;
  rng_state ^= rng_state >> 27;
  return rng_state * 0x2545F4914F6CDD1Dull;
}

static void fill_random(uint8_t *bytes, size_t n) {
  for (size_t i = 0; i < n; i++) {
    bytes[i] = (uint8_t)(next_random() >> 56);
  }
}

static FILE *open_or_exit(const char *path, const char *mode) {
  FILE *file = fopen(path, mode);
  if (file == NULL) {
    perror(path);
    exit(2);
  }
  return file;
}

static void write_or_exit(const void *bytes, size_t n, FILE *file, const char *path) {
  if (fwrite(bytes, 1, n, file) != n) {
    perror(path);
    exit(2);
  }
}

static void read_or_exit(void *bytes, size_t n, FILE *file, const char *path) {
  if (fread(bytes, 1, n, file) != n) {
    fprintf(stderr, "%s: short read\n", path);
    exit(2);
  }
}

static void close_or_exit(FILE *file, const char *path) {
  if (fclose(file) != 0) {
    perror(path);
    exit(2);
  }
}

static uint8_t *block_of(uint32_t layer, uint32_t block_id) {
  return cache + (size_t)layer * LAYER_BYTES + (size_t)block_id * BLOCK_BYTES;
}

static uint8_t *stored_of(uint32_t block_id) {
  return (uint8_t *)stored + (size_t)block_id * KVCS_BLOCK_CHECKSUM_BYTES;
}

static const char *outcome_name(uint8_t outcome) {
  switch (outcome) {
    case KVCS_STORED_FAILED:
      return "FAILED";
    case KVCS_STORED_MATCHED:
      return "matched";
    case KVCS_STORED_NOT_CHECKED:
      return "not checked";
    case KVCS_STORED_OTHER_FINGERPRINT:
      return "other fingerprint";
    case KVCS_STORED_OTHER_ALGORITHM:
      return "other algorithm";
    default:
      return "?";
  }
}

/* Offload: the blocks at `block_ids`, every layer, to `path`, and their 16
 * stored bytes to the sidecar `sums_path`. */
static void write_tier(const char *path, const char *sums_path, const uint32_t *block_ids) {
  FILE *blocks_file = open_or_exit(path, "wb");
  FILE *sums_file = open_or_exit(sums_path, "wb");
  for (uint32_t q = 0; q < POSITIONS; q++) {
    for (uint32_t layer = 0; layer < LAYERS; layer++) {
      write_or_exit(block_of(layer, block_ids[q]), BLOCK_BYTES, blocks_file, path);
    }
    write_or_exit(stored_of(block_ids[q]), KVCS_BLOCK_CHECKSUM_BYTES, sums_file, sums_path);
  }
  close_or_exit(blocks_file, path);
  close_or_exit(sums_file, sums_path);
}

/* Load: the tier's blocks into `block_ids`, their 16 bytes into the stored
 * buffer at the same ids. The rest of the cache is overwritten with other
 * bytes first, so nothing of the store survives but what the files hold. */
static void read_tier(const char *path, const char *sums_path, const uint32_t *block_ids) {
  fill_random(cache, sizeof cache);
  memset(stored, 0xA5, sizeof stored);
  FILE *blocks_file = open_or_exit(path, "rb");
  FILE *sums_file = open_or_exit(sums_path, "rb");
  for (uint32_t q = 0; q < POSITIONS; q++) {
    for (uint32_t layer = 0; layer < LAYERS; layer++) {
      read_or_exit(block_of(layer, block_ids[q]), BLOCK_BYTES, blocks_file, path);
    }
    read_or_exit(stored_of(block_ids[q]), KVCS_BLOCK_CHECKSUM_BYTES, sums_file, sums_path);
  }
  close_or_exit(blocks_file, path);
  close_or_exit(sums_file, sums_path);
}

/* The load check of the worker after a load, and the scheduler's verdict
 * from the worker's record. Prints both; returns whether exactly the
 * positions in `expect_failed` (a flag per position) failed, and the
 * verdict agrees. */
static int check_load(kvcs_worker *worker, const kvcs_blocks *loaded, const int *expect_failed) {
  kvcs_result *result;
  uint8_t outcomes[POSITIONS];
  CALL(kvcs_worker_check_stored(worker, loaded, NULL, &result));
  CALL(kvcs_result_stored(result, REQ_ID, GROUP_ID, outcomes));
  int ok = 1;
  int any_failed = 0;
  for (uint32_t q = 0; q < POSITIONS; q++) {
    uint32_t first = q * BLOCK_SIZE;
    uint32_t end = first + BLOCK_SIZE < NUM_TOKENS ? first + BLOCK_SIZE : NUM_TOKENS;
    int failed = outcomes[q] == KVCS_STORED_FAILED;
    int expected = expect_failed[q] ? failed : outcomes[q] == KVCS_STORED_MATCHED;
    printf("  position %u (tokens %u..%u): %s%s\n", q, first, end, outcome_name(outcomes[q]),
           expected ? "" : "  <- NOT AS EXPECTED");
    ok &= expected;
    any_failed |= failed;
  }

  /* The scheduler judges the load from the workers' records alone. */
  size_t record_len = 0;
  if (kvcs_result_encode(result, NULL, 0, &record_len) != KVCS_ERR_BUFFER_TOO_SMALL) {
    fprintf(stderr, "kvcs_result_encode did not ask for a buffer: %s\n", kvcs_last_error());
    exit(2);
  }
  uint8_t *record = malloc(record_len);
  if (record == NULL) {
    fprintf(stderr, "out of memory\n");
    exit(2);
  }
  CALL(kvcs_result_encode(result, record, record_len, &record_len));
  kvcs_result_destroy(result);
  kvcs_verifier *verifier;
  CALL(kvcs_verifier_create(/*num_workers=*/1, &verifier));
  CALL(kvcs_verifier_expect(verifier, loaded, KVCS_ROLE_CONSUMER));
  CALL(kvcs_verifier_add_record(verifier, record, record_len));
  free(record);
  kvcs_report *report;
  CALL(kvcs_verifier_check_stored(verifier, REQ_ID, &report));
  uint32_t verdict;
  const char *message;
  size_t num_mismatches;
  CALL(kvcs_report_verdict(report, &verdict));
  CALL(kvcs_report_message(report, &message));
  CALL(kvcs_report_num_mismatches(report, &num_mismatches));
  printf("  verifier: %s: %s\n", kvcs_verdict_name(verdict), message);
  ok &= verdict == (any_failed ? KVCS_VERDICT_MISMATCH : KVCS_VERDICT_MATCH);
  for (size_t i = 0; i < num_mismatches; i++) {
    kvcs_mismatch mismatch;
    CALL(kvcs_report_mismatch(report, i, &mismatch));
    printf("  verifier names group %" PRIu32 " position %" PRIu64 " (tokens %" PRIu64 "..%" PRIu64 ")\n",
           mismatch.group_id, mismatch.first_position, mismatch.first_token,
           mismatch.first_token + mismatch.num_tokens);
    ok &= mismatch.num_positions == 1 && mismatch.first_position < POSITIONS && expect_failed[mismatch.first_position];
  }
  ok &= num_mismatches == (size_t)any_failed;
  kvcs_report_destroy(report);
  kvcs_verifier_destroy(verifier);
  return ok;
}

int main(int argc, char **argv) {
  const char *path = argc > 1 ? argv[1] : "file_tier.kv";
  char sums_path[4096];
  if (snprintf(sums_path, sizeof sums_path, "%s.sums", path) >= (int)sizeof sums_path) {
    fprintf(stderr, "%s: path too long\n", path);
    return 2;
  }
  const char *seed_text = getenv("KVCS_EXAMPLE_SEED");
  uint64_t seed = seed_text != NULL ? strtoull(seed_text, NULL, 0) : 0x6b76637366696c65ull;
  rng_state = seed | 1;
  printf("kvcsum %s, file tier %s and %s (KVCS_EXAMPLE_SEED=%" PRIu64 ")\n", kvcs_version(), path, sums_path,
         seed);

  /* One host worker over the whole cache, and the buffer of stored checksums. */
  kvcs_worker_options options = {.tp_rank = 0, .tp_size = 1, .pp_rank = 0, .device = KVCS_HOST, .num_threads = 1};
  kvcs_worker *worker;
  CALL(kvcs_worker_create(&options, &worker));
  CALL(kvcs_worker_add_region(worker, (uint64_t)(uintptr_t)cache, sizeof cache));
  CALL(kvcs_worker_add_region(worker, (uint64_t)(uintptr_t)stored, sizeof stored));
  CALL(kvcs_worker_add_group(worker, GROUP_ID, BLOCK_SIZE));
  for (uint32_t layer = 0; layer < LAYERS; layer++) {
    kvcs_segment cell = {.address = (uint64_t)(uintptr_t)block_of(layer, 0),
                         .block_stride = BLOCK_BYTES,
                         .kernel_block_stride = 0,
                         .head_stride = HEAD_STRIDE,
                         .token_stride = CELL_BYTES,
                         .bytes_per_token = CELL_BYTES};
    kvcs_layer spec = {.group_id = GROUP_ID, .layer_number = layer, .first_head = 0, .num_heads = HEADS,
                       .replicas = 1, .replica_index = 0, .num_blocks = NUM_BLOCKS, .kernel_blocks = 1,
                       .tokens_per_kernel_block = BLOCK_SIZE, .num_segments = 1, .segments = &cell};
    CALL(kvcs_worker_add_layer(worker, &spec));
  }
  CALL(kvcs_worker_add_stored(worker, GROUP_ID, (uint64_t)(uintptr_t)stored, NUM_BLOCKS));

  /* The request's blocks, with the hashes that name them (stand-ins for
   * vLLM's block hashes): where they are stored, and where they come back. */
  uint8_t hashes[POSITIONS * HASH_BYTES];
  fill_random(hashes, sizeof hashes);
  const uint32_t stored_ids[POSITIONS] = {5, 2, 7, 0};
  const uint32_t loaded_ids[POSITIONS] = {1, 6, 3, 4};
  kvcs_blocks *offloaded;
  kvcs_blocks *loaded;
  CALL(kvcs_blocks_create(&offloaded));
  CALL(kvcs_blocks_add_request(offloaded, REQ_ID, NUM_TOKENS));
  CALL(kvcs_blocks_add_group(offloaded, REQ_ID, GROUP_ID, 0, stored_ids, POSITIONS));
  CALL(kvcs_blocks_set_hashes(offloaded, REQ_ID, GROUP_ID, hashes, HASH_BYTES, POSITIONS));
  CALL(kvcs_blocks_create(&loaded));
  CALL(kvcs_blocks_add_request(loaded, REQ_ID, NUM_TOKENS));
  CALL(kvcs_blocks_add_group(loaded, REQ_ID, GROUP_ID, 0, loaded_ids, POSITIONS));
  CALL(kvcs_blocks_set_hashes(loaded, REQ_ID, GROUP_ID, hashes, HASH_BYTES, POSITIONS));

  /* 1. Store, and offload to the files. */
  fill_random(cache, sizeof cache);
  kvcs_result *result;
  CALL(kvcs_worker_store(worker, offloaded, NULL, &result));
  kvcs_result_destroy(result);
  write_tier(path, sums_path, stored_ids);
  printf("stored blocks [5, 2, 7, 0] with their %d-byte stored checksums; wrote %d blocks of %d bytes and the sidecar\n",
         KVCS_BLOCK_CHECKSUM_BYTES, POSITIONS, LAYERS * BLOCK_BYTES);

  /* 2. Load intact into other block ids. */
  int ok = 1;
  int none_failed[POSITIONS] = {0};
  read_tier(path, sums_path, loaded_ids);
  printf("loaded into blocks [1, 6, 3, 4], intact:\n");
  ok &= check_load(worker, loaded, none_failed);

  /* 3. One byte goes bad on disk: position 2, layer 1, head 1, token 3, a V byte. */
  long offset = (long)(((size_t)CORRUPT_POSITION * LAYERS + 1) * BLOCK_BYTES + HEAD_STRIDE + 3 * CELL_BYTES + 200);
  FILE *blocks_file = open_or_exit(path, "r+b");
  uint8_t byte;
  if (fseek(blocks_file, offset, SEEK_SET) != 0) {
    perror(path);
    return 2;
  }
  read_or_exit(&byte, 1, blocks_file, path);
  byte ^= 0x10;
  if (fseek(blocks_file, offset, SEEK_SET) != 0) {
    perror(path);
    return 2;
  }
  write_or_exit(&byte, 1, blocks_file, path);
  close_or_exit(blocks_file, path);
  printf("flipped bit 4 of byte %ld of %s (position %d, layer 1, head 1, token 3)\n", offset, path,
         CORRUPT_POSITION);
  int corrupt_failed[POSITIONS] = {0};
  corrupt_failed[CORRUPT_POSITION] = 1;
  read_tier(path, sums_path, loaded_ids);
  printf("loaded again:\n");
  ok &= check_load(worker, loaded, corrupt_failed);

  kvcs_blocks_destroy(loaded);
  kvcs_blocks_destroy(offloaded);
  kvcs_worker_destroy(worker);
  if (remove(path) != 0 || remove(sums_path) != 0) {
    perror("removing the tier's files");
    return 2;
  }
  printf("%s\n", ok ? "file tier: every load check as expected" : "file tier: FAILED");
  return ok ? 0 : 1;
}
