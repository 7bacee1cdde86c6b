/*
 * dlopen_agent: a transfer agent that loads kvcsum at run time, by path,
 * rather than linking it: it checks the library's ABI version against the
 * header's, resolves each call it uses through the header's function-
 * pointer types (kvcs_<call>_fn, so the compiler checks every call), and
 * checksums a small NHD layout of 1 layer, 2 heads, 2 blocks of 4 tokens.
 * When the library cannot be loaded, is another ABI, or lacks a symbol it
 * says which and exits 2; a wrong checksum exits 1; success exits 0.
 *
 * Build and run (`make test` runs it against the installed library, and
 * against paths that must fail):
 *   cargo build --release --lib
 *   gcc -std=c11 -Wall -Wextra -Wpedantic -Werror -Iinclude examples/c/dlopen_agent.c -ldl -o dlopen_agent
 *   ./dlopen_agent target/release/libkvcsum.so
 */
#include <dlfcn.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvcsum.h"

/* The calls this agent uses, resolved from the loaded library. */
struct kvcsum_api {
  kvcs_abi_version_fn abi_version;
  kvcs_version_fn version;
  kvcs_last_error_fn last_error;
  kvcs_status_name_fn status_name;
  kvcs_worker_create_fn worker_create;
  kvcs_worker_destroy_fn worker_destroy;
  kvcs_worker_add_region_fn worker_add_region;
  kvcs_worker_add_group_fn worker_add_group;
  kvcs_worker_add_layer_fn worker_add_layer;
  kvcs_worker_checksum_fn worker_checksum;
  kvcs_blocks_create_fn blocks_create;
  kvcs_blocks_destroy_fn blocks_destroy;
  kvcs_blocks_add_request_fn blocks_add_request;
  kvcs_blocks_add_group_fn blocks_add_group;
  kvcs_result_column_fn result_column;
  kvcs_result_destroy_fn result_destroy;
  kvcs_segment_size_fn segment_size;
  kvcs_layer_size_fn layer_size;
  kvcs_worker_options_size_fn worker_options_size;
};

/* dlsym gives `void *`; ISO C has no conversion from it to a function
 * pointer, POSIX guarantees the bytes are one, so they are copied. */
static int resolve(void *library, const char *path, const char *name, void *slot, size_t size) {
  dlerror();
  void *symbol = dlsym(library, name);
  const char *problem = dlerror();
  if (problem != NULL || symbol == NULL) {
    fprintf(stderr, "dlopen_agent: %s has no symbol %s (%s); is it kvcsum %d.x?\n", path, name,
            problem != NULL ? problem : "NULL", KVCS_ABI_VERSION);
    return -1;
  }
  memcpy(slot, &symbol, size);
  return 0;
}

#define RESOLVE(field, name)                                                        \
  if (resolve(library, path, #name, &api->field, sizeof api->field) != 0) return -1

static int load(void *library, const char *path, struct kvcsum_api *api) {
  /* The version first: with another ABI nothing else may be trusted. */
  RESOLVE(abi_version, kvcs_abi_version);
  uint32_t abi = api->abi_version();
  if (abi != KVCS_ABI_VERSION) {
    fprintf(stderr, "dlopen_agent: %s has ABI version %" PRIu32 ", this agent was built for %d\n", path, abi,
            KVCS_ABI_VERSION);
    return -1;
  }
  RESOLVE(version, kvcs_version);
  RESOLVE(last_error, kvcs_last_error);
  RESOLVE(status_name, kvcs_status_name);
  RESOLVE(worker_create, kvcs_worker_create);
  RESOLVE(worker_destroy, kvcs_worker_destroy);
  RESOLVE(worker_add_region, kvcs_worker_add_region);
  RESOLVE(worker_add_group, kvcs_worker_add_group);
  RESOLVE(worker_add_layer, kvcs_worker_add_layer);
  RESOLVE(worker_checksum, kvcs_worker_checksum);
  RESOLVE(blocks_create, kvcs_blocks_create);
  RESOLVE(blocks_destroy, kvcs_blocks_destroy);
  RESOLVE(blocks_add_request, kvcs_blocks_add_request);
  RESOLVE(blocks_add_group, kvcs_blocks_add_group);
  RESOLVE(result_column, kvcs_result_column);
  RESOLVE(result_destroy, kvcs_result_destroy);
  RESOLVE(segment_size, kvcs_segment_size);
  RESOLVE(layer_size, kvcs_layer_size);
  RESOLVE(worker_options_size, kvcs_worker_options_size);
  /* The structs this agent passes must have the library's shape. */
  if (api->segment_size() != sizeof(kvcs_segment) || api->layer_size() != sizeof(kvcs_layer) ||
      api->worker_options_size() != sizeof(kvcs_worker_options)) {
    fprintf(stderr, "dlopen_agent: %s's structs differ from this header's (kvcs_layer: %zu vs %zu bytes)\n", path,
            api->layer_size(), sizeof(kvcs_layer));
    return -1;
  }
  return 0;
}

enum { HEADS = 2, TOKENS = 4, BLOCKS = 2, PIECES = 2 };

/* f of SPEC section 12 for the default algorithm, KVCS_ALGORITHM_MIXED. */
static uint64_t mix(uint64_t x) {
  uint64_t g = (x ^ (x >> 32)) * 0x9E3779B97F4A7C15ull;
  return g ^ (g >> 32);
}

/* The checksum of block position `q` by SPEC, loops over logical indices
 * (layer 0, heads 0 and 1, all tokens valid). */
static uint64_t reference(const uint64_t cache[BLOCKS][TOKENS][HEADS][PIECES], uint32_t block_id, uint64_t q) {
  uint64_t total = 0;
  for (uint64_t head = 0; head < HEADS; head++) {
    uint64_t slice = 0;
    for (uint64_t t = 0; t < TOKENS; t++) {
      for (uint64_t p = 0; p < PIECES; p++) {
        uint64_t j = (q * TOKENS + t) * PIECES + p;
        slice += mix(cache[block_id][t][head][p]) * (2 * j + 1);
      }
    }
    total += (2 * head + 1) * slice;
  }
  return total;
}

static int report(const struct kvcsum_api *api, const char *call, kvcs_status status) {
  fprintf(stderr, "dlopen_agent: %s failed: %s: %s\n", call, api->status_name(status), api->last_error());
  return 1;
}

static int checksum(const struct kvcsum_api *api) {
  /* NHD: [blocks][tokens][heads][cell], cells of 16 bytes; x86-64 and the
   * other targets kvcsum runs on are little-endian, so a uint64_t is a
   * piece as SPEC reads it. */
  static uint64_t cache[BLOCKS][TOKENS][HEADS][PIECES];
  uint64_t state = 0x61676e74u;
  for (size_t b = 0; b < BLOCKS; b++)
    for (size_t t = 0; t < TOKENS; t++)
      for (size_t h = 0; h < HEADS; h++)
        for (size_t p = 0; p < PIECES; p++) cache[b][t][h][p] = (state = state * 6364136223846793005u + 1442695040888963407u);

  kvcs_worker_options options = {.tp_rank = 0, .tp_size = 1, .pp_rank = 0, .device = KVCS_HOST, .num_threads = 1};
  kvcs_worker *worker = NULL;
  kvcs_status status = api->worker_create(&options, &worker);
  if (status != KVCS_OK) return report(api, "kvcs_worker_create", status);
  int failed = 0;
  kvcs_blocks *blocks = NULL;
  kvcs_result *result = NULL;
  kvcs_segment cell = {.address = (uint64_t)(uintptr_t)cache, .block_stride = sizeof cache[0],
                       .kernel_block_stride = 0, .head_stride = sizeof cache[0][0][0],
                       .token_stride = sizeof cache[0][0], .bytes_per_token = sizeof cache[0][0][0]};
  kvcs_layer layer = {.group_id = 0, .layer_number = 0, .first_head = 0, .num_heads = HEADS, .replicas = 1,
                      .replica_index = 0, .num_blocks = BLOCKS, .kernel_blocks = 1,
                      .tokens_per_kernel_block = TOKENS, .num_segments = 1, .segments = &cell,
                      .identity = NULL, .identity_len = 0};
  const uint32_t block_ids[2] = {1, 0};
  uint64_t values[2] = {0, 0};
  if ((status = api->worker_add_region(worker, (uint64_t)(uintptr_t)cache, sizeof cache)) != KVCS_OK) {
    failed = report(api, "kvcs_worker_add_region", status);
  } else if ((status = api->worker_add_group(worker, 0, TOKENS)) != KVCS_OK) {
    failed = report(api, "kvcs_worker_add_group", status);
  } else if ((status = api->worker_add_layer(worker, &layer)) != KVCS_OK) {
    failed = report(api, "kvcs_worker_add_layer", status);
  } else if ((status = api->blocks_create(&blocks)) != KVCS_OK) {
    failed = report(api, "kvcs_blocks_create", status);
  } else if ((status = api->blocks_add_request(blocks, "req", BLOCKS * TOKENS)) != KVCS_OK) {
    failed = report(api, "kvcs_blocks_add_request", status);
  } else if ((status = api->blocks_add_group(blocks, "req", 0, 0, block_ids, 2)) != KVCS_OK) {
    failed = report(api, "kvcs_blocks_add_group", status);
  } else if ((status = api->worker_checksum(worker, blocks, KVCS_ROLE_PRODUCER, NULL, &result)) != KVCS_OK) {
    failed = report(api, "kvcs_worker_checksum", status);
  } else if ((status = api->result_column(result, "req", 0, 0, NULL, NULL, values)) != KVCS_OK) {
    failed = report(api, "kvcs_result_column", status);
  } else {
    for (uint64_t q = 0; q < 2; q++) {
      uint64_t want = reference((const uint64_t(*)[TOKENS][HEADS][PIECES])cache, block_ids[q], q);
      printf("position %" PRIu64 " (block %" PRIu32 "): %#018" PRIx64 " %s\n", q, block_ids[q], values[q],
             values[q] == want ? "= reference" : "DIFFERS from the reference");
      if (values[q] != want) failed = 1;
    }
  }
  api->result_destroy(result);
  api->blocks_destroy(blocks);
  api->worker_destroy(worker);
  return failed;
}

int main(int argc, char **argv) {
  if (argc != 2) {
    fprintf(stderr, "usage: dlopen_agent PATH/TO/libkvcsum.so\n");
    return 2;
  }
  const char *path = argv[1];
  void *library = dlopen(path, RTLD_NOW | RTLD_LOCAL);
  if (library == NULL) {
    fprintf(stderr, "dlopen_agent: cannot load %s: %s\n", path, dlerror());
    return 2;
  }
  struct kvcsum_api api;
  if (load(library, path, &api) != 0) {
    dlclose(library);
    return 2;
  }
  printf("dlopen_agent: loaded kvcsum %s (ABI %" PRIu32 ") from %s\n", api.version(), api.abi_version(), path);
  int failed = checksum(&api);
  dlclose(library);
  if (!failed) printf("dlopen_agent: OK\n");
  return failed;
}
