/*
 * dlopen_agent: a transfer agent that loads kvcsum at run time, by path,
 * rather than linking it. It is built with KVCS_NO_PROTOTYPES, so the
 * header declares no call and a direct call (kvcs_version(), say) does not
 * compile; it resolves the one symbol kvcs_api_get, which gives the table
 * of every call for the header's ABI version (kvcs_api, each entry typed
 * kvcs_<call>_fn, so the compiler checks every call), checks the structs it
 * passes against the library's layout, and checksums a small NHD layout of
 * 1 layer, 2 heads, 2 blocks of 4 tokens. When the library cannot be
 * loaded, lacks kvcs_api_get, or is another ABI, it says which and exits
 * 2; a wrong checksum exits 1; success exits 0.
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

#define KVCS_NO_PROTOTYPES
#include "kvcsum.h"

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

/* The entries this agent calls; a library older than the header may lack
 * the newest ones. */
#define USES(X)                                                                                          \
  X(kvcs_abi_version) X(kvcs_version) X(kvcs_last_error) X(kvcs_status_name) X(kvcs_struct_layout)        \
  X(kvcs_worker_create) X(kvcs_worker_destroy) X(kvcs_worker_add_region) X(kvcs_worker_add_group)         \
  X(kvcs_worker_add_layer) X(kvcs_worker_checksum) X(kvcs_blocks_create) X(kvcs_blocks_destroy)           \
  X(kvcs_blocks_add_request) X(kvcs_blocks_add_group) X(kvcs_result_column) X(kvcs_result_destroy)
#define MISSING(entry) if (!KVCS_API_HAS(table, entry)) missing = #entry;

/* Whether the library lays out `name` in `size` bytes as this header does. */
static int same_size(const kvcs_api *api, const char *path, const char *name, size_t size) {
  size_t theirs = 0;
  kvcs_status status = api->kvcs_struct_layout(name, &theirs, NULL);
  if (status != KVCS_OK || theirs != size) {
    fprintf(stderr, "dlopen_agent: %s's %s differs from this header's (%zu vs %zu bytes; %s)\n", path, name, theirs,
            size, api->kvcs_status_name(status));
    return 0;
  }
  return 1;
}

static const kvcs_api *load(void *library, const char *path) {
  kvcs_api_get_fn api_get;
  if (resolve(library, path, "kvcs_api_get", &api_get, sizeof api_get) != 0) return NULL;
  const kvcs_api *table = NULL;
  kvcs_status status = api_get(KVCS_ABI_VERSION, &table);
  if (status != KVCS_OK) {
    /* Another ABI: nothing else may be trusted, but its version may be
     * named (the one call every version has). */
    kvcs_abi_version_fn abi_version;
    dlerror();
    void *symbol = dlsym(library, "kvcs_abi_version");
    if (symbol != NULL) {
      memcpy(&abi_version, &symbol, sizeof abi_version);
      fprintf(stderr, "dlopen_agent: %s has ABI version %" PRIu32 ", this agent was built for %d\n", path,
              abi_version(), KVCS_ABI_VERSION);
    } else {
      fprintf(stderr, "dlopen_agent: %s does not give ABI version %d (status %u)\n", path, KVCS_ABI_VERSION,
              (unsigned)status);
    }
    return NULL;
  }
  const char *missing = NULL;
  USES(MISSING)
  if (table->abi_version != KVCS_ABI_VERSION || missing != NULL) {
    fprintf(stderr, "dlopen_agent: %s's table (ABI %" PRIu32 ", %zu bytes) lacks %s\n", path, table->abi_version,
            table->size, missing != NULL ? missing : "this ABI version");
    return NULL;
  }
  /* The structs this agent passes must have the library's shape. */
  if (!same_size(table, path, "kvcs_segment", sizeof(kvcs_segment)) ||
      !same_size(table, path, "kvcs_layer", sizeof(kvcs_layer)) ||
      !same_size(table, path, "kvcs_worker_options", sizeof(kvcs_worker_options)))
    return NULL;
  return table;
}

enum { HEADS = 2, TOKENS = 4, BLOCKS = 2, PIECES = 2 };

/* One round of MIXED2's f: the low half times k as a 64-bit product, the
 * high half added to its high half, the halves swapped. */
static uint64_t mix2_round(uint64_t v, uint32_t k) {
  uint64_t sum = (v & 0xFFFFFFFF00000000ull) + (v & 0xFFFFFFFFull) * k;
  return (sum << 32) | (sum >> 32);
}

/* f of SPEC section 12 for the default algorithm, KVCS_ALGORITHM_MIXED2:
 * three rounds, the high half folded into the low one after the last two. */
static uint64_t mix(uint64_t x) {
  uint64_t v = mix2_round(mix2_round(x, 0x9E3779B1u), 0x85EBCA77u);
  v ^= v >> 32;
  v = mix2_round(v, 0xC2B2AE3Du);
  return v ^ (v >> 32);
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

static int report(const kvcs_api *api, const char *call, kvcs_status status) {
  fprintf(stderr, "dlopen_agent: %s failed: %s: %s\n", call, api->kvcs_status_name(status), api->kvcs_last_error());
  return 1;
}

static int checksum(const kvcs_api *api) {
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
  kvcs_status status = api->kvcs_worker_create(&options, &worker);
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
  if ((status = api->kvcs_worker_add_region(worker, (uint64_t)(uintptr_t)cache, sizeof cache)) != KVCS_OK) {
    failed = report(api, "kvcs_worker_add_region", status);
  } else if ((status = api->kvcs_worker_add_group(worker, 0, TOKENS)) != KVCS_OK) {
    failed = report(api, "kvcs_worker_add_group", status);
  } else if ((status = api->kvcs_worker_add_layer(worker, &layer)) != KVCS_OK) {
    failed = report(api, "kvcs_worker_add_layer", status);
  } else if ((status = api->kvcs_blocks_create(&blocks)) != KVCS_OK) {
    failed = report(api, "kvcs_blocks_create", status);
  } else if ((status = api->kvcs_blocks_add_request(blocks, "req", BLOCKS * TOKENS)) != KVCS_OK) {
    failed = report(api, "kvcs_blocks_add_request", status);
  } else if ((status = api->kvcs_blocks_add_group(blocks, "req", 0, 0, block_ids, 2)) != KVCS_OK) {
    failed = report(api, "kvcs_blocks_add_group", status);
  } else if ((status = api->kvcs_worker_checksum(worker, blocks, KVCS_ROLE_PRODUCER, NULL, &result)) != KVCS_OK) {
    failed = report(api, "kvcs_worker_checksum", status);
  } else if ((status = api->kvcs_result_column(result, "req", 0, 0, NULL, NULL, values)) != KVCS_OK) {
    failed = report(api, "kvcs_result_column", status);
  } else {
    for (uint64_t q = 0; q < 2; q++) {
      uint64_t want = reference((const uint64_t(*)[TOKENS][HEADS][PIECES])cache, block_ids[q], q);
      printf("position %" PRIu64 " (block %" PRIu32 "): %#018" PRIx64 " %s\n", q, block_ids[q], values[q],
             values[q] == want ? "= reference" : "DIFFERS from the reference");
      if (values[q] != want) failed = 1;
    }
  }
  api->kvcs_result_destroy(result);
  api->kvcs_blocks_destroy(blocks);
  api->kvcs_worker_destroy(worker);
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
  const kvcs_api *api = load(library, path);
  if (api == NULL) {
    dlclose(library);
    return 2;
  }
  printf("dlopen_agent: loaded kvcsum %s (ABI %" PRIu32 ", a table of %zu bytes) from %s\n", api->kvcs_version(),
         api->kvcs_abi_version(), api->size, path);
  int failed = checksum(api);
  dlclose(library);
  if (!failed) printf("dlopen_agent: OK\n");
  return failed;
}
