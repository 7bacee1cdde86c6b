/*
 * Who owns what across the C ABI (include/kvcsum.h): handles are freed by
 * their destroy call only and are independent of the handles they were made
 * from; everything a call takes by pointer is copied before it returns, so
 * the caller may overwrite or free it at once; strings handed out stay valid
 * as long as documented; output buffers are written whole or not at all.
 * Under ASan a use after free or a leak on either side fails the run.
 */
#include <stdlib.h>

#include "check.h"

/* One host worker's cache: 3 blocks x 1 head x 4 tokens x 16 bytes, HND. */
enum { BLOCK_SIZE = 4, NUM_BLOCKS = 3, CELL_BYTES = 16, CACHE_WORDS = NUM_BLOCKS * BLOCK_SIZE * CELL_BYTES / 8 };
static uint64_t cache[CACHE_WORDS];

/* A worker over `cache`, registered from structs and strings that are
 * overwritten as soon as each call returns. */
static kvcs_worker *make_worker(void) {
  kvcs_worker_options options = {.tp_rank = 0, .tp_size = 1, .pp_rank = 0, .device = KVCS_HOST, .num_threads = 1};
  kvcs_worker *worker = NULL;
  EXPECT_OK(kvcs_worker_create(&options, &worker));
  memset(&options, 0xff, sizeof options);
  EXPECT_OK(kvcs_worker_add_region(worker, (uint64_t)(uintptr_t)cache, sizeof cache));
  EXPECT_OK(kvcs_worker_add_group(worker, 0, BLOCK_SIZE));
  kvcs_segment segment = {.address = (uint64_t)(uintptr_t)cache,
                          .block_stride = BLOCK_SIZE * CELL_BYTES,
                          .kernel_block_stride = 0,
                          .head_stride = BLOCK_SIZE * CELL_BYTES,
                          .token_stride = CELL_BYTES,
                          .bytes_per_token = CELL_BYTES};
  uint8_t identity[] = "model.layers.0.self_attn.attn";
  kvcs_layer layer = {.group_id = 0, .layer_number = 0, .first_head = 0, .num_heads = 1, .replicas = 1,
                      .replica_index = 0, .num_blocks = NUM_BLOCKS, .kernel_blocks = 1,
                      .tokens_per_kernel_block = BLOCK_SIZE, .num_segments = 1, .segments = &segment,
                      .identity = identity, .identity_len = sizeof identity - 1};
  EXPECT_OK(kvcs_worker_add_layer(worker, &layer));
  memset(&segment, 0xff, sizeof segment);
  memset(&layer, 0xff, sizeof layer);
  memset(identity, 'x', sizeof identity);
  return worker;
}

/* A block set of request "req" (7 tokens, blocks 2 and 0 at positions
 * 0 and 1, the second partial), built from a request id and block ids
 * overwritten at once. */
static kvcs_blocks *make_blocks(void) {
  char req_id[] = "req";
  uint32_t block_ids[] = {2, 0};
  kvcs_blocks *blocks = NULL;
  EXPECT_OK(kvcs_blocks_create(&blocks));
  EXPECT_OK(kvcs_blocks_add_request(blocks, req_id, 7));
  EXPECT_OK(kvcs_blocks_add_group(blocks, req_id, 0, 0, block_ids, 2));
  memset(req_id, 'z', sizeof req_id - 1);
  block_ids[0] = block_ids[1] = 0xdead;
  return blocks;
}

/* A result's values, read through a request id in a buffer that is
 * overwritten afterwards. */
static void column_of(const kvcs_result *result, uint64_t values[2]) {
  char req_id[] = "req";
  uint32_t replicas = 0, replica_index = 99;
  EXPECT_OK(kvcs_result_column(result, req_id, 0, 0, &replicas, &replica_index, values));
  CHECK(replicas == 1 && replica_index == 0);
}

/* The worker's record of `result` (malloc'd). */
static uint8_t *record_of(const kvcs_result *result, size_t *len) {
  size_t needed = 0;
  EXPECT(kvcs_result_encode(result, NULL, 0, &needed), KVCS_ERR_BUFFER_TOO_SMALL, "bytes needed");
  uint8_t *bytes = malloc(needed);
  CHECK(bytes != NULL);
  EXPECT_OK(kvcs_result_encode(result, bytes, needed, len));
  CHECK(*len == needed);
  return bytes;
}

/* Results are independent of their worker and block set; registration and
 * block sets copied what they were given. */
static void test_results_own_their_values(void) {
  for (size_t i = 0; i < CACHE_WORDS; i++) {
    cache[i] = 0x9e3779b97f4a7c15ull * (i + 1);
  }
  kvcs_worker *worker = make_worker();
  kvcs_blocks *blocks = make_blocks();
  kvcs_result *first = NULL, *second = NULL;
  EXPECT_OK(kvcs_worker_checksum(worker, blocks, KVCS_ROLE_PRODUCER, NULL, &first));
  EXPECT_OK(kvcs_worker_checksum(worker, blocks, KVCS_ROLE_PRODUCER, NULL, &second));
  uint64_t before[2] = {0, 0}, after[2] = {1, 1};
  column_of(first, before);
  CHECK(before[0] != 0 && before[1] != 0 && before[0] != before[1]);
  kvcs_worker_destroy(worker);
  kvcs_blocks_destroy(blocks);
  /* Freed in either order, each result still reads and encodes. */
  column_of(second, after);
  CHECK(after[0] == before[0] && after[1] == before[1]);
  kvcs_result_destroy(first);
  size_t len = 0;
  uint8_t *record = record_of(second, &len);
  CHECK(len > 0);
  kvcs_result_destroy(second);
  free(record);
}

/* A verifier copies the block set it expects, the records it is given and
 * the payload it checks; its reports and their strings outlive it. */
static void test_verifier_copies_its_inputs(void) {
  kvcs_worker *worker = make_worker();
  kvcs_blocks *blocks = make_blocks();
  kvcs_result *result = NULL;
  EXPECT_OK(kvcs_worker_checksum(worker, blocks, KVCS_ROLE_PRODUCER, NULL, &result));
  size_t record_len = 0;
  uint8_t *record = record_of(result, &record_len);
  kvcs_result_destroy(result);
  kvcs_worker_destroy(worker);

  kvcs_verifier *producer = NULL;
  EXPECT_OK(kvcs_verifier_create(1, &producer));
  EXPECT_OK(kvcs_verifier_expect(producer, blocks, KVCS_ROLE_PRODUCER));
  kvcs_blocks_destroy(blocks);
  EXPECT_OK(kvcs_verifier_add_record(producer, record, record_len));
  uint8_t payload[512];
  size_t payload_len = 0;
  EXPECT_OK(kvcs_verifier_payload(producer, "req", payload, sizeof payload, &payload_len));
  kvcs_verifier_destroy(producer);

  kvcs_verifier *consumer = NULL;
  EXPECT_OK(kvcs_verifier_create(1, &consumer));
  blocks = make_blocks();
  EXPECT_OK(kvcs_verifier_expect(consumer, blocks, KVCS_ROLE_CONSUMER));
  kvcs_blocks_destroy(blocks);
  /* The consumer's record is the same bytes but for the role; re-encode
   * from a consumer-role result, then scribble over the buffer. */
  worker = make_worker();
  blocks = make_blocks();
  EXPECT_OK(kvcs_worker_checksum(worker, blocks, KVCS_ROLE_CONSUMER, NULL, &result));
  free(record);
  record = record_of(result, &record_len);
  kvcs_result_destroy(result);
  kvcs_blocks_destroy(blocks);
  kvcs_worker_destroy(worker);
  EXPECT_OK(kvcs_verifier_add_record(consumer, record, record_len));
  memset(record, 0, record_len);
  free(record);

  uint8_t *copy = malloc(payload_len);
  CHECK(copy != NULL);
  memcpy(copy, payload, payload_len);
  kvcs_report *report = NULL;
  EXPECT_OK(kvcs_verifier_check(consumer, "req", copy, payload_len, &report));
  memset(copy, 0, payload_len);
  free(copy);
  kvcs_verifier_destroy(consumer);

  /* The report, its message and its finding strings outlive the verifier;
   * the message pointer is the same on every call. */
  uint32_t verdict = 99, passed = 99;
  const char *message = NULL, *again = NULL;
  EXPECT_OK(kvcs_report_verdict(report, &verdict));
  EXPECT_OK(kvcs_report_passed(report, &passed));
  EXPECT_OK(kvcs_report_message(report, &message));
  EXPECT_OK(kvcs_report_message(report, &again));
  CHECK(verdict == KVCS_VERDICT_MATCH && passed == 1);
  CHECK(message != NULL && message == again && strstr(message, "req") != NULL);
  kvcs_report_destroy(report);
}

/* Output buffers: a size query writes only the length; a buffer one byte
 * short is left untouched; an exact one is filled. */
static void test_output_buffers(void) {
  const uint8_t bytes[5] = {1, 2, 3, 4, 5};
  char text[16];
  size_t len = 0;
  EXPECT(kvcs_base64_encode(bytes, sizeof bytes, NULL, 0, &len), KVCS_ERR_BUFFER_TOO_SMALL, "bytes needed");
  CHECK(len == 9); /* "AQIDBAU=" and its NUL */
  memset(text, '#', sizeof text);
  size_t short_len = 0;
  EXPECT(kvcs_base64_encode(bytes, sizeof bytes, text, len - 1, &short_len), KVCS_ERR_BUFFER_TOO_SMALL, "cap 8");
  CHECK(short_len == len);
  int untouched = 1;
  for (size_t i = 0; i < sizeof text; i++) {
    untouched &= text[i] == '#';
  }
  CHECK(untouched);
  EXPECT_OK(kvcs_base64_encode(bytes, sizeof bytes, text, len, &short_len));
  CHECK(short_len == len && strcmp(text, "AQIDBAU=") == 0 && text[len] == '#');
}

/* The last error belongs to the thread and stays until the next failure:
 * successful calls leave it, and its pointer, as they were. */
static void test_last_error_lifetime(void) {
  EXPECT(kvcs_blocks_create(NULL), KVCS_ERR_INVALID_ARGUMENT, "out is NULL");
  const char *message = kvcs_last_error();
  char copy[64];
  snprintf(copy, sizeof copy, "%s", message);
  kvcs_blocks *blocks = make_blocks();
  kvcs_blocks_destroy(blocks);
  CHECK(kvcs_last_error() == message && strcmp(message, copy) == 0);
  /* Static strings never change. */
  const char *name = kvcs_status_name(KVCS_ERR_NOT_FOUND);
  CHECK(name == kvcs_status_name(KVCS_ERR_NOT_FOUND) && strcmp(name, "KVCS_ERR_NOT_FOUND") == 0);
}

/* Every destroy call takes NULL. */
static void test_destroy_null(void) {
  kvcs_worker_destroy(NULL);
  kvcs_blocks_destroy(NULL);
  kvcs_result_destroy(NULL);
  kvcs_verifier_destroy(NULL);
  kvcs_report_destroy(NULL);
  CHECK(1); /* all returned */
}

void test_ownership(void) {
  test_results_own_their_values();
  test_verifier_copies_its_inputs();
  test_output_buffers();
  test_last_error_lifetime();
  test_destroy_null();
}
