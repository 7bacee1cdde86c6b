/*
 * Every C API call's error paths: each status a call can give, that the
 * message names the argument and value, and that out-parameters stay as
 * they were on failure.
 */
#include <dlfcn.h>
#include <stdlib.h>
#include <threads.h>

#include "check.h"

/* Never dereferenced: an out-parameter's value before a failing call,
 * which must be unchanged after it. */
static char sentinel_byte;
#define SENTINEL ((void *)&sentinel_byte)

/* A small HND cache: 2 blocks x 2 heads x 4 tokens x 16 bytes. */
enum { BLOCK_SIZE = 4, NUM_BLOCKS = 2, NUM_HEADS = 2, CELL_BYTES = 16 };
enum { CACHE_BYTES = NUM_BLOCKS * NUM_HEADS * BLOCK_SIZE * CELL_BYTES };
static uint64_t cache[CACHE_BYTES / 8];

static kvcs_segment good_segment(void) {
  kvcs_segment segment = {
      .address = (uint64_t)(uintptr_t)cache,
      .block_stride = NUM_HEADS * BLOCK_SIZE * CELL_BYTES,
      .kernel_block_stride = 0,
      .head_stride = BLOCK_SIZE * CELL_BYTES,
      .token_stride = CELL_BYTES,
      .bytes_per_token = CELL_BYTES,
  };
  return segment;
}

/* A valid layer of group 0 over `cache`, its segment in `segment`. */
static kvcs_layer good_layer(const kvcs_segment *segment) {
  static const uint8_t identity[] = "model.layers.0.self_attn.attn";
  kvcs_layer layer = {
      .group_id = 0,
      .layer_number = 0,
      .first_head = 0,
      .num_heads = NUM_HEADS,
      .replicas = 1,
      .replica_index = 0,
      .num_blocks = NUM_BLOCKS,
      .kernel_blocks = 1,
      .tokens_per_kernel_block = BLOCK_SIZE,
      .num_segments = 1,
      .segments = segment,
      .identity = identity,
      .identity_len = sizeof identity - 1,
  };
  return layer;
}

static kvcs_worker_options host_options(void) {
  kvcs_worker_options options = {.tp_rank = 0, .tp_size = 1, .pp_rank = 0, .device = KVCS_HOST, .num_threads = 1};
  return options;
}

static void test_versions_and_names(void) {
  CHECK(kvcs_abi_version() == KVCS_ABI_VERSION);
  CHECK(kvcs_version() != NULL && strcmp(kvcs_version(), "0.3.0") == 0);
  /* The header's version is the library's (tests/it/docs.rs checks it is Cargo.toml's). */
  char header_version[32];
  snprintf(header_version, sizeof header_version, "%d.%d.%d", KVCS_VERSION_MAJOR, KVCS_VERSION_MINOR,
           KVCS_VERSION_PATCH);
  CHECK(strcmp(kvcs_version(), header_version) == 0);
  CHECK(KVCS_VERSION_NUMBER == KVCS_VERSION_MAJOR * 10000 + KVCS_VERSION_MINOR * 100 + KVCS_VERSION_PATCH);
#if KVCS_VERSION_NUMBER < 300
  CHECK(!"KVCS_VERSION_NUMBER is usable in #if");
#endif
  static const char *const names[] = {
      "KVCS_OK",          "KVCS_ERR_INVALID_ARGUMENT", "KVCS_ERR_OUT_OF_BOUNDS",    "KVCS_ERR_UNSUPPORTED",
      "KVCS_ERR_NOT_FOUND", "KVCS_ERR_MALFORMED",      "KVCS_ERR_NOT_READY",        "KVCS_ERR_DEVICE",
      "KVCS_ERR_BUFFER_TOO_SMALL", "KVCS_ERR_INTERNAL",
  };
  for (uint32_t code = 0; code < sizeof names / sizeof names[0]; code++) {
    CHECK(strcmp(kvcs_status_name(code), names[code]) == 0);
  }
  CHECK(KVCS_ERR_INTERNAL == 9 && KVCS_ERR_DEVICE == 7);
  CHECK(strcmp(kvcs_status_name(10), "unknown kvcs_status") == 0);
  CHECK(strcmp(kvcs_status_name(UINT32_MAX), "unknown kvcs_status") == 0);
}

/* Copies the thread's last error (which lives as long as the thread). */
static int thread_reads_last_error(void *arg) {
  char *message = arg;
  snprintf(message, 64, "%s", kvcs_last_error());
  return 0;
}

/* The last error belongs to the thread whose call failed. */
static void test_last_error_is_per_thread(void) {
  EXPECT(kvcs_worker_create(NULL, NULL), KVCS_ERR_INVALID_ARGUMENT, "options is NULL");
  char message[64] = "";
  thrd_t thread;
  CHECK(thrd_create(&thread, thread_reads_last_error, message) == thrd_success);
  CHECK(thrd_join(thread, NULL) == thrd_success);
  CHECK(strcmp(message, "no error") == 0);
  CHECK(strstr(kvcs_last_error(), "options is NULL") != NULL);
}

static int cuda_driver_present(void) {
  void *driver = dlopen("libcuda.so.1", RTLD_LAZY | RTLD_LOCAL);
  if (driver == NULL) {
    return 0;
  }
  dlclose(driver);
  return 1;
}

static void test_worker_create(void) {
  kvcs_worker_options options = host_options();
  kvcs_worker *worker = SENTINEL;
  EXPECT(kvcs_worker_create(NULL, &worker), KVCS_ERR_INVALID_ARGUMENT, "options");
  EXPECT(kvcs_worker_create(&options, NULL), KVCS_ERR_INVALID_ARGUMENT, "out");

  options.tp_size = 0;
  EXPECT(kvcs_worker_create(&options, &worker), KVCS_ERR_INVALID_ARGUMENT, "tp_size is 0");
  options = host_options();
  options.tp_rank = 2;
  options.tp_size = 2;
  EXPECT(kvcs_worker_create(&options, &worker), KVCS_ERR_INVALID_ARGUMENT, "tp_rank 2 is not below tp_size 2");
  options = host_options();
  options.device = -2;
  EXPECT(kvcs_worker_create(&options, &worker), KVCS_ERR_INVALID_ARGUMENT, "options.device -2");
  options = host_options();
  options.num_threads = KVCS_MAX_HOST_THREADS + 1;
  EXPECT(kvcs_worker_create(&options, &worker), KVCS_ERR_INVALID_ARGUMENT, "num_threads 257");

  /* No machine has this many devices: a device error with or without CUDA. */
  options = host_options();
  options.device = 9999;
  EXPECT(kvcs_worker_create(&options, &worker), KVCS_ERR_DEVICE, "device 9999");
  if (!cuda_driver_present()) {
    options.device = 0;
    EXPECT(kvcs_worker_create(&options, &worker), KVCS_ERR_DEVICE, "device 0");
  }
  CHECK(worker == SENTINEL);

  /* KVCS_WORKER_OPTIONS_INIT is a host worker of TP rank 0 of 1 (where
   * `{0}` is CUDA device 0 with tp_size 0), and creates one. */
  kvcs_worker_options init = KVCS_WORKER_OPTIONS_INIT;
  CHECK(init.device == KVCS_HOST && init.tp_rank == 0 && init.tp_size == 1 && init.pp_rank == 0 &&
        init.num_threads == 0);
  EXPECT_OK(kvcs_worker_create(&init, &worker));
  kvcs_worker_destroy(worker);
  worker = SENTINEL;
  kvcs_layer layer_init = KVCS_LAYER_INIT;
  CHECK(layer_init.replicas == 1 && layer_init.replica_index == 0 && layer_init.kernel_blocks == 1 &&
        layer_init.num_segments == 1 && layer_init.segments == NULL && layer_init.identity == NULL &&
        layer_init.identity_len == 0 && layer_init.group_id == 0 && layer_init.num_heads == 0);

  options = host_options();
  options.num_threads = 0; /* KVCS_HOST_THREADS, or a share of the cores */
  EXPECT_OK(kvcs_worker_create(&options, &worker));
  CHECK(worker != SENTINEL && worker != NULL);
  kvcs_worker_destroy(worker);
  kvcs_worker_destroy(NULL);
  CHECK(1); /* destroying NULL returned */
}

static void test_registration(void) {
  kvcs_worker_options options = host_options();
  kvcs_worker *worker = NULL;
  EXPECT_OK(kvcs_worker_create(&options, &worker));
  const uint64_t address = (uint64_t)(uintptr_t)cache;

  EXPECT(kvcs_worker_add_region(NULL, address, CACHE_BYTES), KVCS_ERR_INVALID_ARGUMENT, "worker");
  EXPECT(kvcs_worker_add_region(worker, address, 0), KVCS_ERR_INVALID_ARGUMENT, "length is 0");
  /* Memory that is not mapped: refused before any checksum reads it. */
  EXPECT(kvcs_worker_add_region(worker, 8, 64), KVCS_ERR_INVALID_ARGUMENT, "address 0x8 (region of length 64) is not mapped");
  EXPECT(kvcs_worker_add_region(worker, 0x100, 64), KVCS_ERR_INVALID_ARGUMENT, "address 0x100");
  /* A wrapping region, one at address 0, freed memory and a region running
     past its mapping: tests/ffi_boundary.rs. */

  EXPECT(kvcs_worker_add_group(NULL, 0, BLOCK_SIZE), KVCS_ERR_INVALID_ARGUMENT, "worker");
  EXPECT(kvcs_worker_add_group(worker, 0, 0), KVCS_ERR_INVALID_ARGUMENT, "block_size is 0");
  EXPECT_OK(kvcs_worker_add_group(worker, 0, BLOCK_SIZE));
  EXPECT(kvcs_worker_add_group(worker, 0, BLOCK_SIZE), KVCS_ERR_INVALID_ARGUMENT, "group_id 0 is already");

  EXPECT(kvcs_worker_skip_group(NULL, 5, "no reason"), KVCS_ERR_INVALID_ARGUMENT, "worker");
  EXPECT(kvcs_worker_skip_group(worker, 5, NULL), KVCS_ERR_INVALID_ARGUMENT, "reason is NULL");
  EXPECT(kvcs_worker_skip_group(worker, 5, ""), KVCS_ERR_INVALID_ARGUMENT, "reason is empty");
  EXPECT(kvcs_worker_skip_group(worker, 5, "\xff\xfe"), KVCS_ERR_INVALID_ARGUMENT, "reason is not UTF-8");
  EXPECT_OK(kvcs_worker_skip_group(worker, 5, "state layout unknown"));
  EXPECT(kvcs_worker_skip_group(worker, 5, "again"), KVCS_ERR_INVALID_ARGUMENT, "group_id 5 is already skipped");

  kvcs_segment segment = good_segment();
  kvcs_layer layer = good_layer(&segment);
  /* Before the region exists, the layer's bytes are unregistered memory. */
  EXPECT(kvcs_worker_add_layer(worker, &layer), KVCS_ERR_OUT_OF_BOUNDS, "no registered region");
  EXPECT_OK(kvcs_worker_add_region(worker, address, CACHE_BYTES));

  EXPECT(kvcs_worker_add_layer(NULL, &layer), KVCS_ERR_INVALID_ARGUMENT, "worker");
  EXPECT(kvcs_worker_add_layer(worker, NULL), KVCS_ERR_INVALID_ARGUMENT, "layer is NULL");

  kvcs_layer bad = layer;
  bad.num_segments = 0;
  EXPECT(kvcs_worker_add_layer(worker, &bad), KVCS_ERR_INVALID_ARGUMENT, "num_segments is 0");
  bad.num_segments = 3;
  EXPECT(kvcs_worker_add_layer(worker, &bad), KVCS_ERR_INVALID_ARGUMENT, "num_segments is 3");
  bad = layer;
  bad.segments = NULL;
  EXPECT(kvcs_worker_add_layer(worker, &bad), KVCS_ERR_INVALID_ARGUMENT, "layer.segments is NULL");
  bad = layer;
  bad.identity = NULL;
  EXPECT(kvcs_worker_add_layer(worker, &bad), KVCS_ERR_INVALID_ARGUMENT, "layer.identity is NULL");
  bad = layer;
  bad.group_id = 7;
  EXPECT(kvcs_worker_add_layer(worker, &bad), KVCS_ERR_NOT_FOUND, "group_id 7");
  bad = layer;
  bad.num_heads = 0;
  EXPECT(kvcs_worker_add_layer(worker, &bad), KVCS_ERR_INVALID_ARGUMENT, "num_heads is 0");
  bad = layer;
  bad.first_head = KVCS_MAX_KV_HEADS_PER_LAYER - 1; /* heads 65535 and 65536: one too many */
  EXPECT(kvcs_worker_add_layer(worker, &bad), KVCS_ERR_UNSUPPORTED, "exceeds 65536 heads");
  bad = layer;
  bad.replicas = 0;
  EXPECT(kvcs_worker_add_layer(worker, &bad), KVCS_ERR_INVALID_ARGUMENT, "replicas is 0");
  bad = layer;
  bad.replicas = 2;
  bad.replica_index = 2;
  EXPECT(kvcs_worker_add_layer(worker, &bad), KVCS_ERR_INVALID_ARGUMENT, "replica_index 2");
  bad = layer;
  bad.num_blocks = 0;
  EXPECT(kvcs_worker_add_layer(worker, &bad), KVCS_ERR_INVALID_ARGUMENT, "num_blocks is 0");
  bad = layer;
  bad.kernel_blocks = 3;
  EXPECT(kvcs_worker_add_layer(worker, &bad), KVCS_ERR_INVALID_ARGUMENT, "does not tile block_size 4");
  bad = layer;
  bad.kernel_blocks = 0;
  EXPECT(kvcs_worker_add_layer(worker, &bad), KVCS_ERR_INVALID_ARGUMENT, "kernel_blocks 0");
  bad = layer;
  bad.num_blocks = NUM_BLOCKS + 1; /* reaches past the registered region */
  EXPECT(kvcs_worker_add_layer(worker, &bad), KVCS_ERR_OUT_OF_BOUNDS, "no registered region");

  /* Segment fields: sizes are invalid, misalignment unsupported. */
  struct {
    kvcs_segment segment;
    kvcs_status want;
    const char *needle;
  } bad_segments[] = {
      {good_segment(), KVCS_ERR_INVALID_ARGUMENT, "segments[0].bytes_per_token 10"},
      {good_segment(), KVCS_ERR_INVALID_ARGUMENT, "segments[0].bytes_per_token 0"},
      {good_segment(), KVCS_ERR_UNSUPPORTED, "segments[0].address"},
      {good_segment(), KVCS_ERR_UNSUPPORTED, "segments[0].block_stride 132"},
      {good_segment(), KVCS_ERR_UNSUPPORTED, "segments[0].kernel_block_stride 4"},
      {good_segment(), KVCS_ERR_UNSUPPORTED, "segments[0].head_stride 68"},
      {good_segment(), KVCS_ERR_UNSUPPORTED, "segments[0].token_stride 20"},
  };
  /* 10 bytes: no whole number of 8- or 4-byte pieces (SPEC section 1). */
  bad_segments[0].segment.bytes_per_token = 10;
  bad_segments[1].segment.bytes_per_token = 0;
  bad_segments[2].segment.address += 4;
  bad_segments[3].segment.block_stride += 4;
  bad_segments[4].segment.kernel_block_stride = 4;
  bad_segments[5].segment.head_stride += 4;
  bad_segments[6].segment.token_stride += 4;
  for (size_t i = 0; i < sizeof bad_segments / sizeof bad_segments[0]; i++) {
    bad = layer;
    bad.segments = &bad_segments[i].segment;
    EXPECT(kvcs_worker_add_layer(worker, &bad), bad_segments[i].want, bad_segments[i].needle);
  }
  /* The second segment is checked too, and named by its index. */
  kvcs_segment two[2] = {good_segment(), good_segment()};
  two[0].bytes_per_token = 8;
  two[1].bytes_per_token = 8;
  two[1].address += 8;
  two[1].token_stride = 12;
  bad = layer;
  bad.num_segments = 2;
  bad.segments = two;
  EXPECT(kvcs_worker_add_layer(worker, &bad), KVCS_ERR_UNSUPPORTED, "segments[1].token_stride 12");

  EXPECT_OK(kvcs_worker_add_layer(worker, &layer));
  /* Heads 1..2 of layer 0 overlap heads 0..1 registered above. */
  bad = layer;
  bad.first_head = 1;
  EXPECT(kvcs_worker_add_layer(worker, &bad), KVCS_ERR_INVALID_ARGUMENT, "overlap");
  /* Other heads of the same layer are fine: (NULL, 0) identity too. */
  bad = layer;
  bad.first_head = NUM_HEADS;
  bad.identity = NULL;
  bad.identity_len = 0;
  EXPECT_OK(kvcs_worker_add_layer(worker, &bad));
  kvcs_worker_destroy(worker);
}

static void test_blocks(void) {
  kvcs_blocks *blocks = SENTINEL;
  EXPECT(kvcs_blocks_create(NULL), KVCS_ERR_INVALID_ARGUMENT, "out");
  EXPECT_OK(kvcs_blocks_create(&blocks));
  CHECK(blocks != SENTINEL && blocks != NULL);

  EXPECT(kvcs_blocks_add_request(NULL, "r", 4), KVCS_ERR_INVALID_ARGUMENT, "blocks");
  EXPECT(kvcs_blocks_add_request(blocks, NULL, 4), KVCS_ERR_INVALID_ARGUMENT, "req_id is NULL");
  EXPECT(kvcs_blocks_add_request(blocks, "", 4), KVCS_ERR_INVALID_ARGUMENT, "req_id is empty");
  EXPECT(kvcs_blocks_add_request(blocks, "\xc3\x28", 4), KVCS_ERR_INVALID_ARGUMENT, "req_id is not UTF-8");
  EXPECT_OK(kvcs_blocks_add_request(blocks, "r", 4));
  EXPECT(kvcs_blocks_add_request(blocks, "r", 4), KVCS_ERR_INVALID_ARGUMENT, "\"r\" is already");

  const uint32_t ids[] = {1, 0};
  EXPECT(kvcs_blocks_add_group(NULL, "r", 0, 0, ids, 2), KVCS_ERR_INVALID_ARGUMENT, "blocks");
  EXPECT(kvcs_blocks_add_group(blocks, NULL, 0, 0, ids, 2), KVCS_ERR_INVALID_ARGUMENT, "req_id is NULL");
  EXPECT(kvcs_blocks_add_group(blocks, "nope", 0, 0, ids, 2), KVCS_ERR_NOT_FOUND, "req_id \"nope\"");
  EXPECT(kvcs_blocks_add_group(blocks, "r", 0, 0, NULL, 2), KVCS_ERR_INVALID_ARGUMENT, "block_ids is NULL");
  EXPECT(kvcs_blocks_add_group(blocks, "r", 0, UINT64_MAX, ids, 2), KVCS_ERR_INVALID_ARGUMENT, "overflows");
  EXPECT_OK(kvcs_blocks_add_group(blocks, "r", 0, 0, ids, 1));
  EXPECT(kvcs_blocks_add_group(blocks, "r", 0, 0, ids, 1), KVCS_ERR_INVALID_ARGUMENT, "group_id 0 already");
  EXPECT_OK(kvcs_blocks_add_group(blocks, "r", 1, 0, NULL, 0)); /* (NULL, 0) is empty */
  kvcs_blocks_destroy(blocks);
  kvcs_blocks_destroy(NULL);
  CHECK(1); /* destroying NULL returned */
}

/* kvcs_blocks_add_arrays: each inconsistent array is refused naming it, and
 * a refused call adds nothing (request "a" can be added after it). */
static void test_blocks_add_arrays(void) {
  kvcs_blocks *blocks = NULL;
  EXPECT_OK(kvcs_blocks_create(&blocks));
  const char ids[] = "ab";
  const size_t id_ends[2] = {1, 2};
  const uint64_t tokens[2] = {20, 5};
  const size_t group_ends[2] = {2, 3};
  const uint32_t groups[3] = {0, 1, 0};
  const uint64_t firsts[3] = {0, 0, 0};
  const size_t block_ends[3] = {2, 4, 5};
  const uint32_t block_ids[5] = {1, 2, 3, 4, 5};
  uint8_t hashes[5 * 8] = {0};
#define ADD(req_ids_, id_ends_, group_ends_, groups_, firsts_, block_ends_, hashes_, hash_bytes_)                \
  kvcs_blocks_add_arrays(blocks, 2, (req_ids_), (id_ends_), tokens, (group_ends_), 3, (groups_), (firsts_),     \
                         (block_ends_), 5, block_ids, (hashes_), (hash_bytes_))
  EXPECT(kvcs_blocks_add_arrays(NULL, 0, NULL, NULL, NULL, NULL, 0, NULL, NULL, NULL, 0, NULL, NULL, 0),
         KVCS_ERR_INVALID_ARGUMENT, "blocks");
  EXPECT(ADD(ids, NULL, group_ends, groups, firsts, block_ends, NULL, 0), KVCS_ERR_INVALID_ARGUMENT,
         "req_id_ends is NULL");
  EXPECT(ADD(NULL, id_ends, group_ends, groups, firsts, block_ends, NULL, 0), KVCS_ERR_INVALID_ARGUMENT,
         "req_ids is NULL");
  EXPECT(ADD(ids, id_ends, group_ends, groups, firsts, NULL, NULL, 0), KVCS_ERR_INVALID_ARGUMENT,
         "block_ends is NULL");
  const size_t id_ends_down[2] = {2, 1};
  EXPECT(ADD(ids, id_ends_down, group_ends, groups, firsts, block_ends, NULL, 0), KVCS_ERR_INVALID_ARGUMENT,
         "req_id_ends[1] 1 is below");
  const size_t id_ends_empty[2] = {0, 2};
  EXPECT(ADD(ids, id_ends_empty, group_ends, groups, firsts, block_ends, NULL, 0), KVCS_ERR_INVALID_ARGUMENT,
         "req_ids[0] is empty");
  EXPECT(ADD("\xc3\x28", id_ends, group_ends, groups, firsts, block_ends, NULL, 0), KVCS_ERR_INVALID_ARGUMENT,
         "req_ids[0] is not UTF-8");
  EXPECT(ADD("a\0", id_ends, group_ends, groups, firsts, block_ends, NULL, 0), KVCS_ERR_INVALID_ARGUMENT,
         "req_ids[1] holds a NUL byte at 0");
  EXPECT(ADD("aa", id_ends, group_ends, groups, firsts, block_ends, NULL, 0), KVCS_ERR_INVALID_ARGUMENT,
         "req_ids[1] \"a\" is given twice");
  const size_t group_ends_short[2] = {1, 2};
  EXPECT(ADD(ids, id_ends, group_ends_short, groups, firsts, block_ends, NULL, 0), KVCS_ERR_INVALID_ARGUMENT,
         "group_ends ends at 2, but group_ids has 3");
  const size_t block_ends_long[3] = {2, 4, 6};
  EXPECT(ADD(ids, id_ends, group_ends, groups, firsts, block_ends_long, NULL, 0), KVCS_ERR_INVALID_ARGUMENT,
         "block_ends ends at 6, but block_ids has 5");
  const uint32_t groups_twice[3] = {1, 1, 0};
  EXPECT(ADD(ids, id_ends, group_ends, groups_twice, firsts, block_ends, NULL, 0), KVCS_ERR_INVALID_ARGUMENT,
         "group_ids[1] 1 is given twice for req_ids[0] \"a\"");
  const uint64_t firsts_over[3] = {0, 0, UINT64_MAX};
  EXPECT(ADD(ids, id_ends, group_ends, groups, firsts_over, block_ends, NULL, 0), KVCS_ERR_INVALID_ARGUMENT,
         "first_positions[2]");
  EXPECT(ADD(ids, id_ends, group_ends, groups, firsts, block_ends, hashes, 4), KVCS_ERR_INVALID_ARGUMENT,
         "hash_bytes is 4");
  EXPECT(kvcs_blocks_add_arrays(blocks, 2, ids, id_ends, tokens, group_ends, 3, groups, firsts, block_ends,
                                SIZE_MAX, block_ids, hashes, 8),
         KVCS_ERR_INVALID_ARGUMENT, "overflows");
  /* Request "b" already in the set: nothing of the call is added, "a" neither. */
  EXPECT_OK(kvcs_blocks_add_request(blocks, "b", 1));
  EXPECT(ADD(ids, id_ends, group_ends, groups, firsts, block_ends, hashes, 8), KVCS_ERR_INVALID_ARGUMENT,
         "req_ids[1] \"b\" is already in the block set");
  EXPECT_OK(kvcs_blocks_add_request(blocks, "a", 1));
  kvcs_blocks_destroy(blocks);
  /* The same arrays on a fresh set: added, with their groups. */
  EXPECT_OK(kvcs_blocks_create(&blocks));
  EXPECT_OK(ADD(ids, id_ends, group_ends, groups, firsts, block_ends, hashes, 8));
  EXPECT(kvcs_blocks_add_request(blocks, "a", 1), KVCS_ERR_INVALID_ARGUMENT, "\"a\" is already");
  EXPECT(kvcs_blocks_add_group(blocks, "a", 1, 0, block_ids, 1), KVCS_ERR_INVALID_ARGUMENT, "group_id 1 already");
  EXPECT_OK(kvcs_blocks_add_arrays(blocks, 0, NULL, NULL, NULL, NULL, 0, NULL, NULL, NULL, 0, NULL, NULL, 0));
#undef ADD
  kvcs_blocks_destroy(blocks);
}

static void test_checksum_and_result(void) {
  kvcs_worker_options options = host_options();
  kvcs_worker *worker = NULL;
  EXPECT_OK(kvcs_worker_create(&options, &worker));
  EXPECT_OK(kvcs_worker_add_region(worker, (uint64_t)(uintptr_t)cache, CACHE_BYTES));
  EXPECT_OK(kvcs_worker_add_group(worker, 0, BLOCK_SIZE));
  EXPECT_OK(kvcs_worker_add_group(worker, 1, BLOCK_SIZE));
  EXPECT_OK(kvcs_worker_skip_group(worker, 2, "mamba state layout not known"));
  kvcs_segment segment = good_segment();
  kvcs_layer layer = good_layer(&segment);
  EXPECT_OK(kvcs_worker_add_layer(worker, &layer));
  /* Group 1: one layer whose heads are the second copy of a replica pair,
   * so a producer computes no column for it and a consumer one. */
  layer.group_id = 1;
  layer.layer_number = 1;
  layer.replicas = 2;
  layer.replica_index = 1;
  EXPECT_OK(kvcs_worker_add_layer(worker, &layer));

  kvcs_blocks *blocks = NULL;
  const uint32_t ids[] = {1, 0};
  EXPECT_OK(kvcs_blocks_create(&blocks));
  EXPECT_OK(kvcs_blocks_add_request(blocks, "r", 6));
  EXPECT_OK(kvcs_blocks_add_group(blocks, "r", 0, 0, ids, 2));
  EXPECT_OK(kvcs_blocks_add_group(blocks, "r", 1, 0, ids, 2));
  EXPECT_OK(kvcs_blocks_add_group(blocks, "r", 2, 0, ids, 2));
  EXPECT_OK(kvcs_blocks_add_request(blocks, "empty", 0));
  EXPECT_OK(kvcs_blocks_add_group(blocks, "empty", 0, 3, NULL, 0));

  kvcs_result *result = SENTINEL;
  EXPECT(kvcs_worker_checksum(NULL, blocks, KVCS_ROLE_PRODUCER, NULL, &result), KVCS_ERR_INVALID_ARGUMENT,
         "worker");
  EXPECT(kvcs_worker_checksum(worker, NULL, KVCS_ROLE_PRODUCER, NULL, &result), KVCS_ERR_INVALID_ARGUMENT,
         "blocks");
  EXPECT(kvcs_worker_checksum(worker, blocks, KVCS_ROLE_PRODUCER, NULL, NULL), KVCS_ERR_INVALID_ARGUMENT, "out");
  EXPECT(kvcs_worker_checksum(worker, blocks, 2, NULL, &result), KVCS_ERR_INVALID_ARGUMENT, "role 2");
  EXPECT(kvcs_worker_checksum(worker, blocks, UINT32_MAX, NULL, &result), KVCS_ERR_INVALID_ARGUMENT,
         "role 4294967295");

  /* A block id at num_blocks fails the whole call. */
  kvcs_blocks *bad_blocks = NULL;
  const uint32_t bad_ids[] = {0, NUM_BLOCKS};
  EXPECT_OK(kvcs_blocks_create(&bad_blocks));
  EXPECT_OK(kvcs_blocks_add_request(bad_blocks, "r", 6));
  EXPECT_OK(kvcs_blocks_add_group(bad_blocks, "r", 0, 0, bad_ids, 2));
  EXPECT(kvcs_worker_checksum(worker, bad_blocks, KVCS_ROLE_PRODUCER, NULL, &result), KVCS_ERR_OUT_OF_BOUNDS,
         "block id 2 at position 1");
  kvcs_blocks_destroy(bad_blocks);
  /* A group the worker does not know. */
  EXPECT_OK(kvcs_blocks_create(&bad_blocks));
  EXPECT_OK(kvcs_blocks_add_request(bad_blocks, "r", 6));
  EXPECT_OK(kvcs_blocks_add_group(bad_blocks, "r", 9, 0, ids, 2));
  EXPECT(kvcs_worker_checksum(worker, bad_blocks, KVCS_ROLE_PRODUCER, NULL, &result), KVCS_ERR_NOT_FOUND,
         "group_id 9");
  kvcs_blocks_destroy(bad_blocks);
  CHECK(result == SENTINEL);

  EXPECT_OK(kvcs_worker_checksum(worker, blocks, KVCS_ROLE_PRODUCER, NULL, &result));
  EXPECT(kvcs_result_query(NULL), KVCS_ERR_INVALID_ARGUMENT, "result");
  EXPECT_OK(kvcs_result_query(result));
  EXPECT(kvcs_result_wait(NULL), KVCS_ERR_INVALID_ARGUMENT, "result");
  EXPECT_OK(kvcs_result_wait(result));

  uint64_t first_position = 77;
  size_t num_positions = 77, num_columns = 77;
  EXPECT(kvcs_result_group(NULL, "r", 0, &first_position, &num_positions, &num_columns), KVCS_ERR_INVALID_ARGUMENT,
         "result");
  EXPECT(kvcs_result_group(result, NULL, 0, &first_position, &num_positions, &num_columns),
         KVCS_ERR_INVALID_ARGUMENT, "req_id is NULL");
  EXPECT(kvcs_result_group(result, "nope", 0, &first_position, &num_positions, &num_columns), KVCS_ERR_NOT_FOUND,
         "req_id \"nope\"");
  EXPECT(kvcs_result_group(result, "r", 4, &first_position, &num_positions, &num_columns), KVCS_ERR_NOT_FOUND,
         "group_id 4");
  EXPECT(kvcs_result_group(result, "r", 2, &first_position, &num_positions, &num_columns), KVCS_ERR_NOT_FOUND,
         "mamba state layout not known");
  CHECK(first_position == 77 && num_positions == 77 && num_columns == 77);
  EXPECT_OK(kvcs_result_group(result, "r", 0, NULL, NULL, NULL));
  EXPECT_OK(kvcs_result_group(result, "r", 0, &first_position, &num_positions, &num_columns));
  CHECK(first_position == 0 && num_positions == 2 && num_columns == 1);
  /* The producer computes no column for a replica_index 1 layer. */
  EXPECT_OK(kvcs_result_group(result, "r", 1, &first_position, &num_positions, &num_columns));
  CHECK(num_positions == 2 && num_columns == 0);

  uint64_t values[2] = {77, 77};
  uint32_t replicas = 77, replica_index = 77;
  EXPECT(kvcs_result_column(NULL, "r", 0, 0, &replicas, &replica_index, values), KVCS_ERR_INVALID_ARGUMENT,
         "result");
  EXPECT(kvcs_result_column(result, NULL, 0, 0, &replicas, &replica_index, values), KVCS_ERR_INVALID_ARGUMENT,
         "req_id is NULL");
  EXPECT(kvcs_result_column(result, "nope", 0, 0, &replicas, &replica_index, values), KVCS_ERR_NOT_FOUND,
         "req_id \"nope\"");
  EXPECT(kvcs_result_column(result, "r", 4, 0, &replicas, &replica_index, values), KVCS_ERR_NOT_FOUND,
         "group_id 4");
  EXPECT(kvcs_result_column(result, "r", 2, 0, &replicas, &replica_index, values), KVCS_ERR_NOT_FOUND,
         "skipped");
  EXPECT(kvcs_result_column(result, "r", 0, 1, &replicas, &replica_index, values), KVCS_ERR_OUT_OF_BOUNDS,
         "column 1 is not below num_columns 1");
  EXPECT(kvcs_result_column(result, "r", 1, 0, &replicas, &replica_index, values), KVCS_ERR_OUT_OF_BOUNDS,
         "column 0 is not below num_columns 0");
  EXPECT(kvcs_result_column(result, "r", 0, 0, &replicas, &replica_index, NULL), KVCS_ERR_INVALID_ARGUMENT,
         "values is NULL");
  CHECK(values[0] == 77 && values[1] == 77 && replicas == 77 && replica_index == 77);
  EXPECT_OK(kvcs_result_column(result, "r", 0, 0, NULL, NULL, values));
  EXPECT_OK(kvcs_result_column(result, "r", 0, 0, &replicas, &replica_index, values));
  CHECK(replicas == 1 && replica_index == 0);
  /* An all-zero cache checksums to zero; the random-data tests are in checksums.c. */
  CHECK(values[0] == 0 && values[1] == 0);
  /* The capacity-taking form: the buffer convention. */
  uint64_t buf_values[3] = {77, 77, 77};
  size_t len = 77;
  replicas = 77;
  replica_index = 77;
  EXPECT(kvcs_result_column_buf(NULL, "r", 0, 0, &replicas, &replica_index, buf_values, 3, &len),
         KVCS_ERR_INVALID_ARGUMENT, "result");
  EXPECT(kvcs_result_column_buf(result, "r", 0, 0, &replicas, &replica_index, buf_values, 3, NULL),
         KVCS_ERR_INVALID_ARGUMENT, "len is NULL");
  EXPECT(kvcs_result_column_buf(result, NULL, 0, 0, &replicas, &replica_index, buf_values, 3, &len),
         KVCS_ERR_INVALID_ARGUMENT, "req_id is NULL");
  EXPECT(kvcs_result_column_buf(result, "r", 4, 0, &replicas, &replica_index, buf_values, 3, &len),
         KVCS_ERR_NOT_FOUND, "group_id 4");
  EXPECT(kvcs_result_column_buf(result, "r", 0, 1, &replicas, &replica_index, buf_values, 3, &len),
         KVCS_ERR_OUT_OF_BOUNDS, "column 1 is not below num_columns 1");
  EXPECT(kvcs_result_column_buf(result, "r", 0, 0, &replicas, &replica_index, NULL, 3, &len),
         KVCS_ERR_INVALID_ARGUMENT, "values is NULL with cap 3");
  CHECK(len == 77 && buf_values[0] == 77 && replicas == 77 && replica_index == 77);
  EXPECT(kvcs_result_column_buf(result, "r", 0, 0, &replicas, &replica_index, buf_values, 1, &len),
         KVCS_ERR_BUFFER_TOO_SMALL, "cap 1 is below the 2 values needed");
  CHECK(len == 2 && buf_values[0] == 77 && buf_values[1] == 77 && replicas == 77 && replica_index == 77);
  len = 77;
  EXPECT(kvcs_result_column_buf(result, "r", 0, 0, NULL, NULL, NULL, 0, &len), KVCS_ERR_BUFFER_TOO_SMALL, "cap 0");
  CHECK(len == 2);
  EXPECT_OK(kvcs_result_column_buf(result, "r", 0, 0, &replicas, &replica_index, buf_values, 3, &len));
  CHECK(len == 2 && buf_values[0] == values[0] && buf_values[1] == values[1] && buf_values[2] == 77);
  CHECK(replicas == 1 && replica_index == 0);
  EXPECT_OK(kvcs_result_column_buf(result, "empty", 0, 0, NULL, NULL, NULL, 0, &len));
  CHECK(len == 0);
  /* A group with no positions: values may be NULL. */
  EXPECT_OK(kvcs_result_group(result, "empty", 0, &first_position, &num_positions, &num_columns));
  CHECK(first_position == 3 && num_positions == 0 && num_columns == 1);
  EXPECT_OK(kvcs_result_column(result, "empty", 0, 0, &replicas, &replica_index, NULL));
  kvcs_result_destroy(result);

  /* The consumer computes every column, the second copy's too. */
  EXPECT_OK(kvcs_worker_checksum(worker, blocks, KVCS_ROLE_CONSUMER, NULL, &result));
  EXPECT_OK(kvcs_result_group(result, "r", 1, &first_position, &num_positions, &num_columns));
  CHECK(num_columns == 1);
  EXPECT_OK(kvcs_result_column(result, "r", 1, 0, &replicas, &replica_index, values));
  CHECK(replicas == 2 && replica_index == 1);

  /* A result outlives its worker and block set. */
  kvcs_worker_destroy(worker);
  kvcs_blocks_destroy(blocks);
  EXPECT_OK(kvcs_result_column(result, "r", 0, 0, &replicas, &replica_index, values));
  kvcs_result_destroy(result);
  kvcs_result_destroy(NULL);
  CHECK(1); /* destroying NULL returned */
}

static void test_function_table_and_layouts(void);

/* kvcs_layer_from_layout: every refusal names its argument and leaves the
 * out-parameters as they were; a valid HND tensor over `cache` gives
 * good_segment()'s layer. */
static void test_layer_from_layout(void) {
  const int64_t shape[4] = {NUM_BLOCKS, NUM_HEADS, BLOCK_SIZE, CELL_BYTES / 2};
  const int64_t strides[4] = {NUM_HEADS * BLOCK_SIZE * CELL_BYTES, BLOCK_SIZE * CELL_BYTES, CELL_BYTES, 2};
  const kvcs_tensor hnd = {
      .address = (uint64_t)(uintptr_t)cache, .shape = shape, .strides = strides, .ndim = 4, .element_size = 2};
  kvcs_layer layer;
  kvcs_segment segments[2];
  memset(&layer, 0xAB, sizeof layer);
  memset(segments, 0xAB, sizeof segments);
  const kvcs_layer layer_before = layer;

  EXPECT(kvcs_layer_from_layout(NULL, &hnd, NULL, 1, &layer, segments), KVCS_ERR_INVALID_ARGUMENT, "layout is NULL");
  EXPECT(kvcs_layer_from_layout("HND", NULL, NULL, 1, &layer, segments), KVCS_ERR_INVALID_ARGUMENT, "cache is NULL");
  EXPECT(kvcs_layer_from_layout("HND", &hnd, NULL, 1, NULL, segments), KVCS_ERR_INVALID_ARGUMENT,
         "layer_out is NULL");
  EXPECT(kvcs_layer_from_layout("HND", &hnd, NULL, 1, &layer, NULL), KVCS_ERR_INVALID_ARGUMENT,
         "segments_out is NULL");
  EXPECT(kvcs_layer_from_layout("BTXD", &hnd, NULL, 1, &layer, segments), KVCS_ERR_INVALID_ARGUMENT,
         "layout \"BTXD\": name each dimension once");
  EXPECT(kvcs_layer_from_layout("BHHD", &hnd, NULL, 1, &layer, segments), KVCS_ERR_INVALID_ARGUMENT,
         "layout \"BHHD\"");
  EXPECT(kvcs_layer_from_layout("KBHTD", &hnd, NULL, 1, &layer, segments), KVCS_ERR_INVALID_ARGUMENT,
         "names 5 dimensions, cache has 4");
  EXPECT(kvcs_layer_from_layout("HND", &hnd, NULL, 0, &layer, segments), KVCS_ERR_INVALID_ARGUMENT,
         "kernel_blocks is 0");
  EXPECT(kvcs_layer_from_layout("HND", &hnd, NULL, 3, &layer, segments), KVCS_ERR_INVALID_ARGUMENT,
         "2 blocks (B) are not a multiple of kernel_blocks 3");
  /* V the cache itself: every V cell is a K cell. */
  EXPECT(kvcs_layer_from_layout("HND", &hnd, &hnd, 1, &layer, segments), KVCS_ERR_INVALID_ARGUMENT,
         "K and V must not overlap");
  CHECK(memcmp(&layer, &layer_before, sizeof layer) == 0);
  /* A stride of 0 over the heads (a broadcast view): tokens of two heads share bytes. */
  const int64_t broadcast[4] = {NUM_HEADS * BLOCK_SIZE * CELL_BYTES, 0, CELL_BYTES, 2};
  kvcs_tensor expanded = hnd;
  expanded.strides = broadcast;
  EXPECT(kvcs_layer_from_layout("HND", &expanded, NULL, 1, &layer, segments), KVCS_ERR_INVALID_ARGUMENT,
         "cache: distinct cells share bytes: H 0");
  CHECK(memcmp(&layer, &layer_before, sizeof layer) == 0);
  /* V in a tensor of its own, just past the cache (never read here). */
  kvcs_tensor v_apart = hnd;
  v_apart.address = hnd.address + (uint64_t)(NUM_BLOCKS * NUM_HEADS * BLOCK_SIZE * CELL_BYTES);
  EXPECT(kvcs_layer_from_layout("HND", &hnd, &v_apart, 1, &layer, segments), KVCS_OK, NULL);
  CHECK(layer.num_segments == 2); /* K and V in two tensors */
  layer = layer_before;
  memset(segments, 0xAB, sizeof segments);

  kvcs_tensor bad = hnd;
  bad.shape = NULL;
  EXPECT(kvcs_layer_from_layout("HND", &bad, NULL, 1, &layer, segments), KVCS_ERR_INVALID_ARGUMENT,
         "cache.shape is NULL");
  bad = hnd;
  bad.strides = NULL;
  EXPECT(kvcs_layer_from_layout("HND", &hnd, &bad, 1, &layer, segments), KVCS_ERR_INVALID_ARGUMENT,
         "v.strides is NULL");
  bad = hnd;
  bad.element_size = 0;
  EXPECT(kvcs_layer_from_layout("HND", &bad, NULL, 1, &layer, segments), KVCS_ERR_INVALID_ARGUMENT,
         "cache.element_size is 0");
  const int64_t negative[4] = {NUM_BLOCKS, -1, BLOCK_SIZE, CELL_BYTES / 2};
  bad = hnd;
  bad.shape = negative;
  EXPECT(kvcs_layer_from_layout("HND", &bad, NULL, 1, &layer, segments), KVCS_ERR_INVALID_ARGUMENT,
         "cache.shape[1] (H) is -1");
  const int64_t strided_d[4] = {strides[0], strides[1], strides[2], 4};
  bad = hnd;
  bad.strides = strided_d;
  EXPECT(kvcs_layer_from_layout("HND", &bad, NULL, 1, &layer, segments), KVCS_ERR_INVALID_ARGUMENT,
         "D dimension must be contiguous: its stride is 4 bytes, element_size is 2");
  const int64_t huge_d[4] = {NUM_BLOCKS, NUM_HEADS, BLOCK_SIZE, INT64_C(1) << 40};
  bad = hnd;
  bad.shape = huge_d;
  EXPECT(kvcs_layer_from_layout("HND", &bad, NULL, 1, &layer, segments), KVCS_ERR_INVALID_ARGUMENT,
         "bytes_per_token");
  const int64_t three_parts[5] = {3, NUM_BLOCKS, BLOCK_SIZE, NUM_HEADS, 2};
  const int64_t part_strides[5] = {CACHE_BYTES / 3, 64, 16, 8, 2};
  const kvcs_tensor kbthd = {.address = hnd.address, .shape = three_parts, .strides = part_strides, .ndim = 5,
                             .element_size = 2};
  EXPECT(kvcs_layer_from_layout("KBTHD", &kbthd, NULL, 1, &layer, segments), KVCS_ERR_INVALID_ARGUMENT,
         "the K dimension has size 3, not 2");
  EXPECT(kvcs_layer_from_layout("KBTHD", &kbthd, &kbthd, 1, &layer, segments), KVCS_ERR_INVALID_ARGUMENT,
         "has a K dimension and v is given too");
  const int64_t other_tokens[4] = {NUM_BLOCKS, NUM_HEADS, BLOCK_SIZE * 2, CELL_BYTES / 2};
  bad = hnd;
  bad.shape = other_tokens;
  EXPECT(kvcs_layer_from_layout("HND", &hnd, &bad, 1, &layer, segments), KVCS_ERR_INVALID_ARGUMENT,
         "v and cache differ in blocks, tokens or heads");
  CHECK(memcmp(&layer, &layer_before, sizeof layer) == 0);
  uint8_t untouched[sizeof segments];
  memset(untouched, 0xAB, sizeof untouched);
  CHECK(memcmp(segments, untouched, sizeof segments) == 0);

  /* The same layer as the hand-built one; the caller's fields are defaults. */
  EXPECT_OK(kvcs_layer_from_layout("hnd", &hnd, NULL, 1, &layer, segments));
  const kvcs_segment want = good_segment();
  CHECK(layer.num_segments == 1 && layer.segments == segments);
  CHECK(segments[0].address == want.address && segments[0].block_stride == want.block_stride &&
        segments[0].kernel_block_stride == NUM_HEADS * BLOCK_SIZE * CELL_BYTES &&
        segments[0].head_stride == want.head_stride && segments[0].token_stride == want.token_stride &&
        segments[0].bytes_per_token == want.bytes_per_token);
  CHECK(layer.num_heads == NUM_HEADS && layer.num_blocks == NUM_BLOCKS && layer.kernel_blocks == 1 &&
        layer.tokens_per_kernel_block == BLOCK_SIZE);
  CHECK(layer.group_id == 0 && layer.layer_number == 0 && layer.first_head == 0 && layer.replicas == 1 &&
        layer.replica_index == 0 && layer.identity == NULL && layer.identity_len == 0);
  kvcs_worker_options options = host_options();
  kvcs_worker *worker;
  EXPECT_OK(kvcs_worker_create(&options, &worker));
  EXPECT_OK(kvcs_worker_add_region(worker, (uint64_t)(uintptr_t)cache, CACHE_BYTES));
  EXPECT_OK(kvcs_worker_add_group(worker, 0, BLOCK_SIZE));
  EXPECT_OK(kvcs_worker_add_layer(worker, &layer));
  kvcs_worker_destroy(worker);
}

/* kvcs_report_repair_plan and kvcs_repair_plan: refusals name argument and
 * value; too small a buffer says how many entries are needed. */
static void test_repair_plan(void) {
  kvcs_blocks *blocks;
  EXPECT_OK(kvcs_blocks_create(&blocks));
  EXPECT_OK(kvcs_blocks_add_request(blocks, "r", 3 * BLOCK_SIZE));
  const uint32_t block_ids[3] = {7, 2, 9};
  EXPECT_OK(kvcs_blocks_add_group(blocks, "r", 0, 1, block_ids, 3)); /* positions 1..4 */
  const uint32_t groups[1] = {0};
  const uint32_t sizes[1] = {BLOCK_SIZE};
  /* Group 0, positions 2..4: tokens 8..15 differ (the blocks of a run that
   * ends with the request's tokens). */
  kvcs_mismatch mismatch = {.group_id = 0, .first_position = 2, .num_positions = 2, .first_token = 8,
                            .num_tokens = 7};
  kvcs_repair_block plan[4];
  memset(plan, 0xAB, sizeof plan);
  size_t len = 99;

  EXPECT(kvcs_repair_plan(NULL, 1, blocks, "r", groups, sizes, 1, plan, 4, &len), KVCS_ERR_INVALID_ARGUMENT,
         "mismatches is NULL with length 1");
  EXPECT(kvcs_repair_plan(&mismatch, 1, NULL, "r", groups, sizes, 1, plan, 4, &len), KVCS_ERR_INVALID_ARGUMENT,
         "consumer_blocks is NULL");
  EXPECT(kvcs_repair_plan(&mismatch, 1, blocks, NULL, groups, sizes, 1, plan, 4, &len), KVCS_ERR_INVALID_ARGUMENT,
         "req_id is NULL");
  EXPECT(kvcs_repair_plan(&mismatch, 1, blocks, "other", groups, sizes, 1, plan, 4, &len), KVCS_ERR_NOT_FOUND,
         "req_id \"other\" is not in consumer_blocks");
  EXPECT(kvcs_repair_plan(&mismatch, 1, blocks, "r", NULL, sizes, 1, plan, 4, &len), KVCS_ERR_INVALID_ARGUMENT,
         "group_ids is NULL with length 1");
  EXPECT(kvcs_repair_plan(&mismatch, 1, blocks, "r", groups, NULL, 1, plan, 4, &len), KVCS_ERR_INVALID_ARGUMENT,
         "block_sizes is NULL with length 1");
  EXPECT(kvcs_repair_plan(&mismatch, 1, blocks, "r", groups, sizes, 0, plan, 4, &len), KVCS_ERR_INVALID_ARGUMENT,
         "group 0 differs but block_sizes has no entry for it");
  const uint32_t zero[1] = {0};
  EXPECT(kvcs_repair_plan(&mismatch, 1, blocks, "r", groups, zero, 1, plan, 4, &len), KVCS_ERR_INVALID_ARGUMENT,
         "block_size of group 0 is 0 (block_sizes[0])");
  const uint32_t twice[2] = {0, 0};
  const uint32_t two_sizes[2] = {BLOCK_SIZE, BLOCK_SIZE};
  EXPECT(kvcs_repair_plan(&mismatch, 1, blocks, "r", twice, two_sizes, 2, plan, 4, &len), KVCS_ERR_INVALID_ARGUMENT,
         "group_ids[1] is 0, a group already given a block size");
  const uint32_t group_1[1] = {1};
  kvcs_mismatch other_group = mismatch;
  other_group.group_id = 1;
  EXPECT(kvcs_repair_plan(&other_group, 1, blocks, "r", group_1, sizes, 1, plan, 4, &len), KVCS_ERR_INVALID_ARGUMENT,
         "group 1 differs but consumer_blocks has no blocks of it in req_id \"r\"");
  kvcs_mismatch past = mismatch;
  past.num_positions = 3;
  past.num_tokens = 12;
  EXPECT(kvcs_repair_plan(&past, 1, blocks, "r", groups, sizes, 1, plan, 4, &len), KVCS_ERR_INVALID_ARGUMENT,
         "group 0 position 4 differs but consumer_blocks holds positions 1..4 of it");
  /* Positions that are not the blocks of their tokens under the block size
   * given: another block size than the mismatch's. */
  const uint32_t small[1] = {2};
  EXPECT(kvcs_repair_plan(&mismatch, 1, blocks, "r", groups, small, 1, plan, 4, &len), KVCS_ERR_INVALID_ARGUMENT,
         "positions 2..4 in blocks of 2 tokens (tokens 4..8) are not the blocks of the differing tokens 8..15: block "
         "size 2 is not the one the mismatch was made with");
  kvcs_mismatch mid_block = mismatch;
  mid_block.first_token = 9;
  mid_block.num_tokens = 6;
  EXPECT(kvcs_repair_plan(&mid_block, 1, blocks, "r", groups, sizes, 1, plan, 4, &len), KVCS_ERR_INVALID_ARGUMENT,
         "are not the blocks of the differing tokens 9..15");
  kvcs_mismatch short_run = mismatch;
  short_run.num_tokens = 4;
  EXPECT(kvcs_repair_plan(&short_run, 1, blocks, "r", groups, sizes, 1, plan, 4, &len), KVCS_ERR_INVALID_ARGUMENT,
         "are not the blocks of the differing tokens 8..12");
  kvcs_mismatch no_positions = mismatch;
  no_positions.num_positions = 0;
  EXPECT(kvcs_repair_plan(&no_positions, 1, blocks, "r", groups, sizes, 1, plan, 4, &len), KVCS_ERR_INVALID_ARGUMENT,
         "a differing run of 0 positions and 7 tokens (from position 2, token 8) names nothing to repair");
  kvcs_mismatch wrapping = mismatch;
  wrapping.num_tokens = UINT64_MAX;
  EXPECT(kvcs_repair_plan(&wrapping, 1, blocks, "r", groups, sizes, 1, plan, 4, &len), KVCS_ERR_INVALID_ARGUMENT,
         "first_token 8 + num_tokens 18446744073709551615 overflows");
  const kvcs_mismatch overlapping[2] = {mismatch, past};
  EXPECT(kvcs_repair_plan(overlapping, 2, blocks, "r", groups, sizes, 1, plan, 4, &len), KVCS_ERR_INVALID_ARGUMENT,
         "the differing positions 2..4 and 2..5 overlap");
  EXPECT(kvcs_repair_plan(&mismatch, 1, blocks, "r", groups, sizes, 1, plan, 4, NULL), KVCS_ERR_INVALID_ARGUMENT,
         "len is NULL");
  EXPECT(kvcs_repair_plan(&mismatch, 1, blocks, "r", groups, sizes, 1, NULL, 4, &len), KVCS_ERR_INVALID_ARGUMENT,
         "buf is NULL with cap 4");
  CHECK(len == 99);
  EXPECT(kvcs_repair_plan(&mismatch, 1, blocks, "r", groups, sizes, 1, plan, 1, &len), KVCS_ERR_BUFFER_TOO_SMALL,
         "cap 1 is below the 2 entries needed");
  CHECK(len == 2);
  uint8_t untouched[sizeof plan];
  memset(untouched, 0xAB, sizeof untouched);
  CHECK(memcmp(plan, untouched, sizeof plan) == 0);
  EXPECT_OK(kvcs_repair_plan(&mismatch, 1, blocks, "r", groups, sizes, 1, plan, 4, &len));
  CHECK(len == 2);
  CHECK(plan[0].group_id == 0 && plan[0].position == 2 && plan[0].block_id == 2 && plan[0].start_token == 8 &&
        plan[0].end_token == 12);
  CHECK(plan[1].group_id == 0 && plan[1].position == 3 && plan[1].block_id == 9 && plan[1].start_token == 12 &&
        plan[1].end_token == 15);
  EXPECT_OK(kvcs_repair_plan(NULL, 0, blocks, "r", NULL, NULL, 0, NULL, 0, &len));
  CHECK(len == 0);

  /* A report that compared nothing names nothing to repair. */
  kvcs_verifier *verifier;
  kvcs_report *report;
  EXPECT_OK(kvcs_verifier_create(1, &verifier));
  EXPECT_OK(kvcs_verifier_expect(verifier, blocks, KVCS_ROLE_CONSUMER));
  EXPECT_OK(kvcs_verifier_check_no_payload(verifier, "r", &report));
  len = 99;
  EXPECT(kvcs_report_repair_plan(NULL, blocks, "r", groups, sizes, 1, plan, 4, &len), KVCS_ERR_INVALID_ARGUMENT,
         "report is NULL");
  EXPECT(kvcs_report_repair_plan(report, NULL, "r", groups, sizes, 1, plan, 4, &len), KVCS_ERR_INVALID_ARGUMENT,
         "consumer_blocks is NULL");
  EXPECT(kvcs_report_repair_plan(report, blocks, "nope", groups, sizes, 1, plan, 4, &len), KVCS_ERR_NOT_FOUND,
         "req_id \"nope\"");
  EXPECT(kvcs_report_repair_plan(report, blocks, "r", groups, sizes, 1, plan, 4, &len), KVCS_ERR_INVALID_ARGUMENT,
         "report is unverified");
  CHECK(len == 99);
  kvcs_report_destroy(report);
  kvcs_verifier_destroy(verifier);
  kvcs_blocks_destroy(blocks);
}

/* kvcs_tier_index_*: every bad argument is refused naming it, a refused
 * store keeps nothing, and a stored block matches, then mismatches once
 * its bytes change. */
static void test_tier_index(void) {
  kvcs_tier_index *index = SENTINEL;
  EXPECT(kvcs_tier_index_create(0, &index), KVCS_ERR_INVALID_ARGUMENT, "capacity 0");
  EXPECT(kvcs_tier_index_create(UINT64_MAX, &index), KVCS_ERR_INVALID_ARGUMENT, "capacity 18446744073709551615");
  CHECK(index == SENTINEL);
  EXPECT(kvcs_tier_index_create(8, NULL), KVCS_ERR_INVALID_ARGUMENT, "out");
  EXPECT_OK(kvcs_tier_index_create(8, &index));
  kvcs_tier_index_destroy(NULL);

  kvcs_worker_options options = host_options();
  kvcs_worker *worker = NULL;
  EXPECT_OK(kvcs_worker_create(&options, &worker));
  EXPECT_OK(kvcs_worker_add_region(worker, (uint64_t)(uintptr_t)cache, CACHE_BYTES));
  EXPECT_OK(kvcs_worker_add_group(worker, 0, BLOCK_SIZE));
  kvcs_segment segment = good_segment();
  kvcs_layer layer = good_layer(&segment);
  EXPECT_OK(kvcs_worker_add_layer(worker, &layer));
  for (size_t i = 0; i < CACHE_BYTES / 8; i++) {
    cache[i] = 0x9E3779B97F4A7C15ull * (i + 1);
  }

  const uint32_t groups[2] = {0, 0}, bad_groups[2] = {0, 5};
  const uint64_t positions[2] = {0, 1};
  const uint32_t ids[2] = {0, 1}, bad_ids[2] = {0, NUM_BLOCKS};
  uint8_t hashes[2 * 32];
  for (size_t i = 0; i < sizeof hashes; i++) {
    hashes[i] = (uint8_t)(i * 7 + 1);
  }
  uint64_t entries = 99, dropped = 99, lost = 99, bytes = 99;
  EXPECT(kvcs_tier_index_store(NULL, worker, 2, groups, positions, ids, hashes, 32, NULL), KVCS_ERR_INVALID_ARGUMENT,
         "index");
  EXPECT(kvcs_tier_index_store(index, NULL, 2, groups, positions, ids, hashes, 32, NULL), KVCS_ERR_INVALID_ARGUMENT,
         "worker");
  EXPECT(kvcs_tier_index_store(index, worker, 2, NULL, positions, ids, hashes, 32, NULL), KVCS_ERR_INVALID_ARGUMENT,
         "group_ids is NULL");
  EXPECT(kvcs_tier_index_store(index, worker, 2, groups, NULL, ids, hashes, 32, NULL), KVCS_ERR_INVALID_ARGUMENT,
         "positions is NULL");
  EXPECT(kvcs_tier_index_store(index, worker, 2, groups, positions, NULL, hashes, 32, NULL), KVCS_ERR_INVALID_ARGUMENT,
         "block_ids is NULL");
  EXPECT(kvcs_tier_index_store(index, worker, 2, groups, positions, ids, NULL, 32, NULL), KVCS_ERR_INVALID_ARGUMENT,
         "hashes is NULL");
  EXPECT(kvcs_tier_index_store(index, worker, 2, groups, positions, ids, hashes, 7, NULL), KVCS_ERR_INVALID_ARGUMENT,
         "hash_bytes is 7");
  EXPECT(kvcs_tier_index_store(index, worker, 2, groups, positions, ids, hashes, 33, NULL), KVCS_ERR_INVALID_ARGUMENT,
         "hash_bytes is 33");
  EXPECT(kvcs_tier_index_store(index, worker, SIZE_MAX / 4, groups, positions, ids, hashes, 32, NULL),
         KVCS_ERR_INVALID_ARGUMENT, "too large");
  EXPECT(kvcs_tier_index_store(index, worker, 2, bad_groups, positions, ids, hashes, 32, NULL),
         KVCS_ERR_INVALID_ARGUMENT, "group_ids[1] 5");
  EXPECT(kvcs_tier_index_store(index, worker, 2, groups, positions, bad_ids, hashes, 32, NULL), KVCS_ERR_OUT_OF_BOUNDS,
         "2");
  EXPECT_OK(kvcs_tier_index_info(index, &entries, &dropped, &lost, &bytes));
  CHECK(entries == 0 && dropped == 0 && lost == 0); /* nothing kept by a refused store */
  EXPECT(kvcs_tier_index_info(NULL, &entries, NULL, NULL, NULL), KVCS_ERR_INVALID_ARGUMENT, "index");

  EXPECT_OK(kvcs_tier_index_store(index, worker, 2, groups, positions, ids, hashes, 32, NULL));
  EXPECT_OK(kvcs_tier_index_store(index, worker, 0, NULL, NULL, NULL, NULL, 0, NULL)); /* reads finished stores */
  EXPECT_OK(kvcs_tier_index_info(index, &entries, NULL, NULL, &bytes));
  CHECK(entries == 2 && bytes > 0 && bytes <= 8 * KVCS_TIER_INDEX_ENTRY_BYTES + 4096);

  uint64_t values[4] = {0}, position = 99;
  size_t len = 99;
  EXPECT(kvcs_tier_index_values(index, 0, hashes, 32, &position, values, 0, &len), KVCS_ERR_BUFFER_TOO_SMALL, "cap 0");
  CHECK(len == 1);
  EXPECT(kvcs_tier_index_values(index, 0, hashes, 32, &position, values, 4, NULL), KVCS_ERR_INVALID_ARGUMENT, "len");
  EXPECT(kvcs_tier_index_values(index, 0, NULL, 32, &position, values, 4, &len), KVCS_ERR_INVALID_ARGUMENT,
         "hash is NULL");
  EXPECT(kvcs_tier_index_values(index, 0, hashes, 4, &position, values, 4, &len), KVCS_ERR_INVALID_ARGUMENT,
         "hash_bytes is 4");
  EXPECT_OK(kvcs_tier_index_values(index, 0, hashes + 32, 32, &position, values, 4, &len));
  CHECK(len == 1 && position == 1);
  EXPECT_OK(kvcs_tier_index_values(index, 1, hashes, 32, &position, values, 4, &len));
  CHECK(len == 0); /* another group's hash */

  uint8_t outcomes[2] = {0, 0};
  const uint8_t hashed[2] = {1, 0}, bad_hashed[2] = {1, 2};
  EXPECT(kvcs_tier_index_check(index, worker, 2, groups, positions, ids, hashes, 32, NULL, NULL, NULL),
         KVCS_ERR_INVALID_ARGUMENT, "outcomes is NULL");
  EXPECT(kvcs_tier_index_check(index, worker, 2, groups, positions, ids, hashes, 32, bad_hashed, NULL, outcomes),
         KVCS_ERR_INVALID_ARGUMENT, "hashed[1] is 2");
  EXPECT(kvcs_tier_index_check(index, worker, 2, bad_groups, positions, ids, hashes, 32, NULL, NULL, outcomes),
         KVCS_ERR_INVALID_ARGUMENT, "group_ids[1] 5");
  CHECK(outcomes[0] == 0 && outcomes[1] == 0); /* not written on an error */
  EXPECT_OK(kvcs_tier_index_check(index, worker, 2, groups, positions, ids, hashes, 32, hashed, NULL, outcomes));
  CHECK(outcomes[0] == KVCS_TIER_MATCHED && outcomes[1] == KVCS_TIER_NO_BLOCK_HASH);
  /* Block 1 loaded at position 0 with block 0's hash: other bytes, a mismatch. */
  const uint32_t swapped[2] = {1, 0};
  EXPECT_OK(kvcs_tier_index_check(index, worker, 2, groups, positions, swapped, hashes, 32, NULL, NULL, outcomes));
  CHECK(outcomes[0] == KVCS_TIER_MISMATCHED && outcomes[1] == KVCS_TIER_MISMATCHED);
  /* A hash stored at position 1 loaded at position 0. */
  const uint64_t moved[2] = {1, 0};
  EXPECT_OK(kvcs_tier_index_check(index, worker, 2, groups, moved, ids, hashes, 32, NULL, NULL, outcomes));
  CHECK(outcomes[0] == KVCS_TIER_OTHER_POSITION && outcomes[1] == KVCS_TIER_OTHER_POSITION);

  kvcs_tier_index_destroy(index);
  kvcs_worker_destroy(worker);
  memset(cache, 0, sizeof cache); /* the later tests read an all-zero cache */
}

void test_errors(void) {
  test_versions_and_names();
  test_last_error_is_per_thread();
  test_worker_create();
  test_registration();
  test_blocks();
  test_blocks_add_arrays();
  test_tier_index();
  test_checksum_and_result();
  test_layer_from_layout();
  test_repair_plan();
  test_function_table_and_layouts();
}

/* One struct's layout as this compiler sees the header: the independent
 * reference for kvcs_struct_layout and kvcs_struct_field. */
struct field_ref {
  const char *name;
  size_t offset, size;
};
#define FIELD(type, field) {#field, offsetof(type, field), sizeof(((type *)0)->field)}

static void check_layout(const char *name, size_t size, const struct field_ref *fields, size_t count) {
  size_t their_size = 0, their_count = 0;
  EXPECT_OK(kvcs_struct_layout(name, &their_size, &their_count));
  CHECK(their_size == size);
  CHECK(their_count == count);
  for (size_t i = 0; i < count && i < their_count; i++) {
    const char *field_name = NULL;
    size_t offset = 0, field_size = 0;
    EXPECT_OK(kvcs_struct_field(name, i, &field_name, &offset, &field_size));
    int same = field_name != NULL && strcmp(field_name, fields[i].name) == 0 && offset == fields[i].offset &&
               field_size == fields[i].size;
    if (!same) fprintf(stderr, "  %s field %zu: library says %s at %zu (%zu bytes), this compiler %s at %zu (%zu)\n",
                       name, i, field_name ? field_name : "(null)", offset, field_size, fields[i].name,
                       fields[i].offset, fields[i].size);
    CHECK(same);
  }
}

static void test_function_table_and_layouts(void) {
  /* The table: another ABI version, or no out-parameter, is refused and
   * leaves *out alone. */
  const kvcs_api *api = SENTINEL;
  EXPECT(kvcs_api_get(KVCS_ABI_VERSION + 1, &api), KVCS_ERR_UNSUPPORTED, "abi_version 3");
  CHECK(api == SENTINEL);
  EXPECT(kvcs_api_get(0, &api), KVCS_ERR_UNSUPPORTED, "abi_version 0");
  EXPECT(kvcs_api_get(KVCS_ABI_VERSION, NULL), KVCS_ERR_INVALID_ARGUMENT, "out");
  EXPECT_OK(kvcs_api_get(KVCS_ABI_VERSION, &api));
  CHECK(api != SENTINEL && api != NULL);
  if (api == SENTINEL || api == NULL) return;
  CHECK(api->size == sizeof(kvcs_api));
  CHECK(api->abi_version == KVCS_ABI_VERSION);
  CHECK(KVCS_API_HAS(api, kvcs_abi_version) && KVCS_API_HAS(api, kvcs_worker_set_algorithm));
  /* Calls through the table are the library's calls. */
  CHECK(api->kvcs_abi_version() == kvcs_abi_version());
  CHECK(strcmp(api->kvcs_status_name(KVCS_ERR_NOT_FOUND), "KVCS_ERR_NOT_FOUND") == 0);
  kvcs_verifier *verifier = SENTINEL;
  CHECK(api->kvcs_verifier_create(0, &verifier) == KVCS_ERR_INVALID_ARGUMENT);
  CHECK(verifier == SENTINEL && strstr(api->kvcs_last_error(), "num_workers") != NULL);

  /* Layouts: unknown names, NULL names and indices past the end. */
  size_t size = 7, count = 7, offset = 7;
  const char *field_name = SENTINEL;
  EXPECT(kvcs_struct_layout("kvcs_nothing", &size, &count), KVCS_ERR_NOT_FOUND, "kvcs_nothing");
  EXPECT(kvcs_struct_layout(NULL, &size, &count), KVCS_ERR_INVALID_ARGUMENT, "struct_name");
  EXPECT(kvcs_struct_layout("kvcs_worker", &size, &count), KVCS_ERR_NOT_FOUND, "kvcs_worker");
  CHECK(size == 7 && count == 7);
  EXPECT(kvcs_struct_field("kvcs_layer", 13, &field_name, &offset, &size), KVCS_ERR_OUT_OF_BOUNDS, "index 13");
  EXPECT(kvcs_struct_field("kvcs_layer", SIZE_MAX, &field_name, &offset, &size), KVCS_ERR_OUT_OF_BOUNDS,
         "kvcs_layer, which has 13");
  EXPECT(kvcs_struct_field("layer", 0, &field_name, &offset, &size), KVCS_ERR_NOT_FOUND, "\"layer\"");
  EXPECT(kvcs_struct_field(NULL, 0, &field_name, &offset, &size), KVCS_ERR_INVALID_ARGUMENT, "struct_name");
  CHECK(field_name == SENTINEL && offset == 7 && size == 7);
  EXPECT_OK(kvcs_struct_layout("kvcs_segment", NULL, NULL));
  EXPECT_OK(kvcs_struct_field("kvcs_segment", 0, NULL, NULL, NULL));

  /* Each struct's layout is this compiler's. */
  static const struct field_ref options[] = {
      FIELD(kvcs_worker_options, tp_rank), FIELD(kvcs_worker_options, tp_size),
      FIELD(kvcs_worker_options, pp_rank), FIELD(kvcs_worker_options, device),
      FIELD(kvcs_worker_options, num_threads)};
  check_layout("kvcs_worker_options", sizeof(kvcs_worker_options), options, sizeof options / sizeof options[0]);
  static const struct field_ref segment[] = {
      FIELD(kvcs_segment, address), FIELD(kvcs_segment, block_stride), FIELD(kvcs_segment, kernel_block_stride),
      FIELD(kvcs_segment, head_stride), FIELD(kvcs_segment, token_stride), FIELD(kvcs_segment, bytes_per_token)};
  check_layout("kvcs_segment", sizeof(kvcs_segment), segment, sizeof segment / sizeof segment[0]);
  static const struct field_ref layer[] = {
      FIELD(kvcs_layer, group_id),       FIELD(kvcs_layer, layer_number),  FIELD(kvcs_layer, first_head),
      FIELD(kvcs_layer, num_heads),      FIELD(kvcs_layer, replicas),      FIELD(kvcs_layer, replica_index),
      FIELD(kvcs_layer, num_blocks),     FIELD(kvcs_layer, kernel_blocks), FIELD(kvcs_layer, tokens_per_kernel_block),
      FIELD(kvcs_layer, num_segments),   FIELD(kvcs_layer, segments),      FIELD(kvcs_layer, identity),
      FIELD(kvcs_layer, identity_len)};
  check_layout("kvcs_layer", sizeof(kvcs_layer), layer, sizeof layer / sizeof layer[0]);
  static const struct field_ref state[] = {
      FIELD(kvcs_state, group_id),   FIELD(kvcs_state, layer_number), FIELD(kvcs_state, split_known),
      FIELD(kvcs_state, num_blocks), FIELD(kvcs_state, num_tensors),  FIELD(kvcs_state, tensors),
      FIELD(kvcs_state, identity),   FIELD(kvcs_state, identity_len)};
  check_layout("kvcs_state", sizeof(kvcs_state), state, sizeof state / sizeof state[0]);
  static const struct field_ref mismatch[] = {
      FIELD(kvcs_mismatch, group_id),          FIELD(kvcs_mismatch, localised),  FIELD(kvcs_mismatch, first_position),
      FIELD(kvcs_mismatch, num_positions),     FIELD(kvcs_mismatch, first_token), FIELD(kvcs_mismatch, num_tokens),
      FIELD(kvcs_mismatch, num_failed_checks), FIELD(kvcs_mismatch, num_layers)};
  check_layout("kvcs_mismatch", sizeof(kvcs_mismatch), mismatch, sizeof mismatch / sizeof mismatch[0]);
  static const struct field_ref remote[] = {
      FIELD(kvcs_remote_engine, block_bytes), FIELD(kvcs_remote_engine, tp_size),
      FIELD(kvcs_remote_engine, block_size), FIELD(kvcs_remote_engine, kernel_blocks)};
  check_layout("kvcs_remote_engine", sizeof(kvcs_remote_engine), remote, sizeof remote / sizeof remote[0]);
  static const struct field_ref tensor[] = {FIELD(kvcs_tensor, address), FIELD(kvcs_tensor, shape),
                                            FIELD(kvcs_tensor, strides), FIELD(kvcs_tensor, ndim),
                                            FIELD(kvcs_tensor, element_size)};
  check_layout("kvcs_tensor", sizeof(kvcs_tensor), tensor, sizeof tensor / sizeof tensor[0]);
  static const struct field_ref repair[] = {FIELD(kvcs_repair_block, group_id), FIELD(kvcs_repair_block, block_id),
                                            FIELD(kvcs_repair_block, position), FIELD(kvcs_repair_block, start_token),
                                            FIELD(kvcs_repair_block, end_token)};
  check_layout("kvcs_repair_block", sizeof(kvcs_repair_block), repair, sizeof repair / sizeof repair[0]);
}
