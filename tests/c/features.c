/*
 * The calls of SPEC sections 6-8 and of coverage reporting through the C
 * ABI: aliases, state layers (one checked against a naive reference written
 * here), stored checksums (store, load check, tags, the verifier's judgement
 * of an offload load from load-check records) and the verifier's uncompared
 * positions; every call's error paths, with out-parameters unchanged on
 * failure.
 */
#include <stdlib.h>

#include "check.h"

/* An HND cache of 4 blocks x 2 heads x 4 tokens x 16 bytes, layer 0 of group 0. */
enum { F_BLOCK_SIZE = 4, F_BLOCKS = 4, F_HEADS = 2, F_CELL = 16 };
static uint64_t kv_cache[F_BLOCKS * F_HEADS * F_BLOCK_SIZE * F_CELL / 8];

/* A state tensor: 3 blocks x 2 rows x 6 two-byte elements (12 bytes, rows 16 apart). */
enum { S_BLOCKS = 3, S_ROWS = 2, S_ELEMENTS = 6, S_ROW_STRIDE = 16 };
static uint16_t state_cache[S_BLOCKS * S_ROWS * S_ROW_STRIDE / 2];

/* Never dereferenced: a result out-parameter's value before failing calls. */
static char result_sentinel;
#define SENTINEL_RESULT ((kvcs_result *)(void *)&result_sentinel)

static uint64_t feature_rng = 0x51a7e5eedull;

static uint64_t next_feature_random(void) {
  feature_rng ^= feature_rng << 13;
  feature_rng ^= feature_rng >> 7;
  feature_rng ^= feature_rng << 17;
  return feature_rng;
}

static kvcs_worker *attention_worker_of(kvcs_segment *segment, uint32_t pp_rank, uint32_t algorithm) {
  static const uint8_t identity[] = "('model.layers.0.self_attn.attn', 'FullAttentionSpec', 'bfloat16')";
  kvcs_worker_options options = {
      .tp_rank = 0, .tp_size = 1, .pp_rank = pp_rank, .device = KVCS_HOST, .num_threads = 1};
  kvcs_worker *worker = NULL;
  EXPECT_OK(kvcs_worker_create(&options, &worker));
  EXPECT_OK(kvcs_worker_set_algorithm(worker, algorithm));
  EXPECT_OK(kvcs_worker_add_region(worker, (uint64_t)(uintptr_t)kv_cache, sizeof kv_cache));
  EXPECT_OK(kvcs_worker_add_group(worker, 0, F_BLOCK_SIZE));
  *segment = (kvcs_segment){.address = (uint64_t)(uintptr_t)kv_cache,
                            .block_stride = F_HEADS * F_BLOCK_SIZE * F_CELL,
                            .kernel_block_stride = 0,
                            .head_stride = F_BLOCK_SIZE * F_CELL,
                            .token_stride = F_CELL,
                            .bytes_per_token = F_CELL};
  kvcs_layer layer = {.group_id = 0, .layer_number = 0, .first_head = 0, .num_heads = F_HEADS, .replicas = 1,
                      .replica_index = 0, .num_blocks = F_BLOCKS, .kernel_blocks = 1,
                      .tokens_per_kernel_block = F_BLOCK_SIZE, .num_segments = 1, .segments = segment,
                      .identity = identity, .identity_len = sizeof identity - 1};
  EXPECT_OK(kvcs_worker_add_layer(worker, &layer));
  return worker;
}

/* The default algorithm's worker, TP rank 0 of 1, PP stage 0. */
static kvcs_worker *attention_worker(kvcs_segment *segment) {
  return attention_worker_of(segment, 0, KVCS_ALGORITHM_MIXED2);
}

static void test_aliases(void) {
  kvcs_segment segment;
  kvcs_worker *worker = attention_worker(&segment);
  static const uint8_t identity[] = "('model.layers.1.self_attn.attn', 'FullAttentionSpec', 'bfloat16')";
  EXPECT(kvcs_worker_add_alias(NULL, 0, 1, 0, identity, sizeof identity - 1), KVCS_ERR_INVALID_ARGUMENT, "worker");
  EXPECT(kvcs_worker_add_alias(worker, 7, 1, 0, identity, sizeof identity - 1), KVCS_ERR_NOT_FOUND, "group_id 7");
  EXPECT(kvcs_worker_add_alias(worker, 0, 1, 3, identity, sizeof identity - 1), KVCS_ERR_NOT_FOUND,
         "target_layer_number 3");
  EXPECT(kvcs_worker_add_alias(worker, 0, 0, 0, identity, 0), KVCS_ERR_INVALID_ARGUMENT, "names itself");
  EXPECT(kvcs_worker_add_alias(worker, 0, 1, 0, NULL, 4), KVCS_ERR_INVALID_ARGUMENT, "identity");
  EXPECT_OK(kvcs_worker_add_alias(worker, 0, 1, 0, identity, sizeof identity - 1));
  EXPECT(kvcs_worker_add_alias(worker, 0, 1, 0, identity, sizeof identity - 1), KVCS_ERR_INVALID_ARGUMENT,
         "layer_number 1 is already registered");
  kvcs_worker_destroy(worker);
}

/* One round of MIXED2's f (SPEC section 12): the low half times k as a
 * 64-bit product, the high half added to its high half, halves swapped. */
static uint64_t mix2_round(uint64_t v, uint32_t k) {
  uint64_t sum = (v & 0xFFFFFFFF00000000ull) + (v & 0xFFFFFFFFull) * k;
  return (sum << 32) | (sum >> 32);
}

/* `sum_j f(x_j) * (2j + 1)` over a row of two-byte elements, each
 * zero-extended and mixed (SPEC section 12: the default, MIXED2). */
static uint64_t naive_row(const uint16_t *row) {
  uint64_t sum = 0;
  for (uint64_t j = 0; j < S_ELEMENTS; j++) {
    uint64_t v = mix2_round(mix2_round(row[j], KVCS_MIX2_MULTIPLIER_1), KVCS_MIX2_MULTIPLIER_2);
    v ^= v >> 32;
    v = mix2_round(v, KVCS_MIX2_MULTIPLIER_3);
    sum += (v ^ (v >> 32)) * (2 * j + 1);
  }
  return sum;
}

static void test_state_layers(void) {
  for (size_t i = 0; i < sizeof state_cache / sizeof state_cache[0]; i++) {
    state_cache[i] = (uint16_t)next_feature_random();
  }
  kvcs_worker_options options = {.tp_rank = 1, .tp_size = 2, .pp_rank = 0, .device = KVCS_HOST, .num_threads = 1};
  kvcs_worker *worker = NULL;
  EXPECT_OK(kvcs_worker_create(&options, &worker));
  EXPECT_OK(kvcs_worker_add_region(worker, (uint64_t)(uintptr_t)state_cache, sizeof state_cache));
  EXPECT_OK(kvcs_worker_add_group(worker, 4, 16));
  /* Rank 1 of 2 holds rows 2 and 3 of 4. */
  kvcs_state_tensor tensor = {.address = (uint64_t)(uintptr_t)state_cache,
                              .block_stride = S_ROWS * S_ROW_STRIDE,
                              .row_stride = S_ROW_STRIDE,
                              .first_row = 2,
                              .num_rows = S_ROWS,
                              .total_rows = 4,
                              .bytes_per_row = S_ELEMENTS * 2,
                              .element_size = 2};
  static const uint8_t identity[] = "('model.layers.9.mixer', 'MambaSpec', 'float32')";
  kvcs_state state = {.group_id = 4, .layer_number = 9, .split_known = 1, .num_blocks = S_BLOCKS,
                      .num_tensors = 1, .tensors = &tensor, .identity = identity,
                      .identity_len = sizeof identity - 1};
  EXPECT(kvcs_worker_add_state(worker, NULL), KVCS_ERR_INVALID_ARGUMENT, "state");
  EXPECT(kvcs_worker_add_state(NULL, &state), KVCS_ERR_INVALID_ARGUMENT, "worker");
  kvcs_state bad = state;
  bad.split_known = 2;
  EXPECT(kvcs_worker_add_state(worker, &bad), KVCS_ERR_INVALID_ARGUMENT, "state.split_known 2");
  bad = state;
  bad.num_tensors = 0;
  EXPECT(kvcs_worker_add_state(worker, &bad), KVCS_ERR_INVALID_ARGUMENT, "num_tensors is 0");
  bad = state;
  bad.group_id = 5;
  EXPECT(kvcs_worker_add_state(worker, &bad), KVCS_ERR_NOT_FOUND, "group_id 5");
  kvcs_state_tensor bad_tensor = tensor;
  bad_tensor.element_size = 3;
  bad.group_id = 4;
  bad.tensors = &bad_tensor;
  EXPECT(kvcs_worker_add_state(worker, &bad), KVCS_ERR_INVALID_ARGUMENT, "element_size is 3");
  bad_tensor = tensor;
  bad_tensor.block_stride = 4096;
  EXPECT(kvcs_worker_add_state(worker, &bad), KVCS_ERR_OUT_OF_BOUNDS, "tensors[0]");
  EXPECT_OK(kvcs_worker_add_state(worker, &state));

  /* The request's state sits in block 1, at position 0 whatever num_tokens says. */
  kvcs_blocks *blocks = NULL;
  EXPECT_OK(kvcs_blocks_create(&blocks));
  EXPECT_OK(kvcs_blocks_add_request(blocks, "s", 0));
  const uint32_t block_id = 1;
  EXPECT_OK(kvcs_blocks_add_group(blocks, "s", 4, 0, &block_id, 1));
  kvcs_result *result = NULL;
  EXPECT_OK(kvcs_worker_checksum(worker, blocks, KVCS_ROLE_PRODUCER, NULL, &result));
  uint64_t value = 0;
  EXPECT_OK(kvcs_result_column(result, "s", 4, 0, NULL, NULL, &value));
  uint64_t expected = 0;
  for (uint64_t row = 0; row < S_ROWS; row++) {
    const uint16_t *elements = state_cache + (block_id * S_ROWS * S_ROW_STRIDE + row * S_ROW_STRIDE) / 2;
    uint64_t weight = 2 * (9 * 65536ull + 2 + row) + 1; /* global rows 2 and 3 */
    expected += weight * naive_row(elements);
  }
  CHECK(value == expected);
  kvcs_result_destroy(result);
  kvcs_blocks_destroy(blocks);
  kvcs_worker_destroy(worker);
}

/* A result's record bytes (free them). */
static uint8_t *record_bytes(const kvcs_result *result, size_t *len) {
  size_t needed = 0;
  EXPECT(kvcs_result_encode(result, NULL, 0, &needed), KVCS_ERR_BUFFER_TOO_SMALL, "bytes needed");
  uint8_t *bytes = malloc(needed);
  CHECK(bytes != NULL);
  EXPECT_OK(kvcs_result_encode(result, bytes, needed, len));
  return bytes;
}

/* A one-worker verifier expecting `blocks` as a consumer, holding `result`'s record. */
static kvcs_verifier *verifier_with(const kvcs_blocks *blocks, const kvcs_result *result) {
  kvcs_verifier *verifier = NULL;
  EXPECT_OK(kvcs_verifier_create(1, &verifier));
  EXPECT_OK(kvcs_verifier_expect(verifier, blocks, KVCS_ROLE_CONSUMER));
  size_t len = 0;
  uint8_t *bytes = record_bytes(result, &len);
  EXPECT_OK(kvcs_verifier_add_record(verifier, bytes, len));
  free(bytes);
  return verifier;
}

/* The verifier's judgement of the offload load "o" from load-check records:
 * the failed position named (position 1: tokens 4..8), and each error path. */
static void check_offload_reports(const kvcs_blocks *blocks, const kvcs_result *load_check,
                                  const kvcs_result *plain) {
  kvcs_verifier *verifier = verifier_with(blocks, load_check);
  kvcs_report *report = (kvcs_report *)(void *)&result_sentinel;
  EXPECT(kvcs_verifier_check_stored(NULL, "o", &report), KVCS_ERR_INVALID_ARGUMENT, "verifier");
  EXPECT(kvcs_verifier_check_stored(verifier, NULL, &report), KVCS_ERR_INVALID_ARGUMENT, "req_id");
  EXPECT(kvcs_verifier_check_stored(verifier, "o", NULL), KVCS_ERR_INVALID_ARGUMENT, "out");
  EXPECT(kvcs_verifier_check_stored(verifier, "x", &report), KVCS_ERR_NOT_FOUND, "req_id \"x\"");
  CHECK(report == (kvcs_report *)(void *)&result_sentinel);
  EXPECT_OK(kvcs_verifier_check_stored(verifier, "o", &report));
  uint32_t verdict = 9, passed = 9;
  EXPECT_OK(kvcs_report_verdict(report, &verdict));
  EXPECT_OK(kvcs_report_passed(report, &passed));
  CHECK(verdict == KVCS_VERDICT_MISMATCH && passed == 0);
  size_t count = 0;
  EXPECT_OK(kvcs_report_num_mismatches(report, &count));
  CHECK(count == 1);
  kvcs_mismatch mismatch;
  EXPECT_OK(kvcs_report_mismatch(report, 0, &mismatch));
  CHECK(mismatch.group_id == 0 && mismatch.first_position == 1 && mismatch.num_positions == 1 &&
        mismatch.first_token == 4 && mismatch.num_tokens == 4 && mismatch.num_failed_checks == 0);
  uint64_t compared = 0;
  EXPECT_OK(kvcs_report_compared_positions(report, &compared));
  CHECK(compared == 3); /* the failed position was compared too */
  const char *message = NULL;
  EXPECT_OK(kvcs_report_message(report, &message));
  CHECK(strstr(message, "position 1 (tokens 4..8, stored checksum failed on worker (pp_rank 0, tp_rank 0))") != NULL);
  kvcs_report_destroy(report);
  /* Expected as a producer: loads are checked for consumers. */
  kvcs_blocks *copy = NULL;
  EXPECT_OK(kvcs_blocks_create(&copy));
  EXPECT_OK(kvcs_blocks_add_request(copy, "p", 10));
  EXPECT_OK(kvcs_verifier_expect(verifier, copy, KVCS_ROLE_PRODUCER));
  report = NULL;
  EXPECT(kvcs_verifier_check_stored(verifier, "p", &report), KVCS_ERR_INVALID_ARGUMENT, "producer");
  CHECK(report == NULL);
  kvcs_blocks_destroy(copy);
  kvcs_verifier_destroy(verifier);

  /* A plain checksum call's record is no load check. */
  verifier = verifier_with(blocks, plain);
  EXPECT_OK(kvcs_verifier_check_stored(verifier, "o", &report));
  uint32_t reason = 0;
  EXPECT_OK(kvcs_report_verdict(report, &verdict));
  EXPECT_OK(kvcs_report_reason(report, &reason));
  CHECK(verdict == KVCS_VERDICT_UNVERIFIED && reason == KVCS_UNVERIFIED_NOT_LOAD_CHECK);
  kvcs_report_destroy(report);
  kvcs_verifier_destroy(verifier);
}

static void test_stored_checksums(void) {
  enum { HASH_BYTES = 32 };
  for (size_t i = 0; i < sizeof kv_cache / 8; i++) {
    kv_cache[i] = next_feature_random();
  }
  kvcs_segment segment;
  kvcs_worker *worker = attention_worker(&segment);
  uint64_t stored[F_BLOCKS][2] = {{0}}; /* value, stamp per block id */
  EXPECT(kvcs_worker_add_stored(NULL, 0, (uint64_t)(uintptr_t)stored, F_BLOCKS), KVCS_ERR_INVALID_ARGUMENT,
         "worker");
  EXPECT(kvcs_worker_add_stored(worker, 3, (uint64_t)(uintptr_t)stored, F_BLOCKS), KVCS_ERR_NOT_FOUND, "group_id 3");
  EXPECT(kvcs_worker_add_stored(worker, 0, (uint64_t)(uintptr_t)stored + 4, F_BLOCKS), KVCS_ERR_UNSUPPORTED,
         "multiple of 8");
  EXPECT(kvcs_worker_add_stored(worker, 0, (uint64_t)(uintptr_t)stored, 0), KVCS_ERR_INVALID_ARGUMENT,
         "num_blocks is 0");

  kvcs_blocks *blocks = NULL;
  EXPECT_OK(kvcs_blocks_create(&blocks));
  EXPECT_OK(kvcs_blocks_add_request(blocks, "o", 10)); /* positions 0..2, the last one partial */
  const uint32_t block_ids[3] = {2, 0, 3};
  EXPECT_OK(kvcs_blocks_add_group(blocks, "o", 0, 0, block_ids, 3));
  uint8_t hashes[3 * HASH_BYTES];
  for (size_t i = 0; i < sizeof hashes; i++) {
    hashes[i] = (uint8_t)next_feature_random();
  }
  kvcs_result *result = SENTINEL_RESULT;
  /* No buffer yet; then no hashes yet. */
  EXPECT(kvcs_worker_store(worker, blocks, NULL, &result), KVCS_ERR_NOT_FOUND, "kvcs_worker_add_stored");
  CHECK(result == SENTINEL_RESULT);
  EXPECT(kvcs_worker_add_stored(worker, 0, 0, F_BLOCKS), KVCS_ERR_INVALID_ARGUMENT, "address is 0");
  EXPECT(kvcs_worker_add_stored(worker, 0, (uint64_t)(uintptr_t)stored, F_BLOCKS), KVCS_ERR_OUT_OF_BOUNDS,
         "no registered region");
  EXPECT_OK(kvcs_worker_add_region(worker, (uint64_t)(uintptr_t)stored, sizeof stored));
  EXPECT_OK(kvcs_worker_add_stored(worker, 0, (uint64_t)(uintptr_t)stored, F_BLOCKS));
  EXPECT(kvcs_worker_store(worker, blocks, NULL, &result), KVCS_ERR_INVALID_ARGUMENT, "block hashes");
  EXPECT(kvcs_worker_check_stored(worker, blocks, NULL, &result), KVCS_ERR_INVALID_ARGUMENT, "block hashes");
  EXPECT(kvcs_worker_store(worker, blocks, NULL, NULL), KVCS_ERR_INVALID_ARGUMENT, "out");
  EXPECT(kvcs_worker_check_stored(NULL, blocks, NULL, &result), KVCS_ERR_INVALID_ARGUMENT, "worker");
  CHECK(result == SENTINEL_RESULT);

  EXPECT(kvcs_blocks_set_hashes(blocks, "o", 0, hashes, 4, 3), KVCS_ERR_INVALID_ARGUMENT, "hash_bytes is 4");
  EXPECT(kvcs_blocks_set_hashes(blocks, "o", 0, hashes, HASH_BYTES, 2), KVCS_ERR_INVALID_ARGUMENT, "not 3 hashes");
  EXPECT(kvcs_blocks_set_hashes(blocks, "x", 0, hashes, HASH_BYTES, 3), KVCS_ERR_NOT_FOUND, "req_id");
  EXPECT(kvcs_blocks_set_hashes(blocks, "o", 1, hashes, HASH_BYTES, 3), KVCS_ERR_NOT_FOUND, "group_id 1");
  EXPECT(kvcs_blocks_set_hashes(blocks, "o", 0, NULL, HASH_BYTES, 3), KVCS_ERR_INVALID_ARGUMENT, "hashes");
  EXPECT_OK(kvcs_blocks_set_hashes(blocks, "o", 0, hashes, HASH_BYTES, 3));

  uint64_t tags[3] = {7, 7, 7};
  EXPECT(kvcs_block_tags(worker, 0, hashes, 7, 3, tags), KVCS_ERR_INVALID_ARGUMENT, "hash_bytes is 7");
  EXPECT(kvcs_block_tags(worker, 9, hashes, HASH_BYTES, 3, tags), KVCS_ERR_NOT_FOUND, "group_id 9");
  EXPECT(kvcs_block_tags(worker, 0, hashes, HASH_BYTES, 3, NULL), KVCS_ERR_INVALID_ARGUMENT, "tags");
  CHECK(tags[0] == 7 && tags[1] == 7 && tags[2] == 7);
  EXPECT_OK(kvcs_block_tags(worker, 0, hashes, HASH_BYTES, 3, tags));

  /* Store: each block's value untagged is its plain checksum. */
  EXPECT_OK(kvcs_worker_store(worker, blocks, NULL, &result));
  uint64_t values[3];
  EXPECT_OK(kvcs_result_column(result, "o", 0, 0, NULL, NULL, values));
  for (int q = 0; q < 3; q++) {
    CHECK((stored[block_ids[q]][0] ^ tags[q]) == values[q]);
  }
  uint8_t outcomes[3] = {9, 9, 9};
  EXPECT(kvcs_result_stored(result, "o", 0, outcomes), KVCS_ERR_NOT_FOUND, "not a load check");
  CHECK(outcomes[0] == 9);
  kvcs_result_destroy(result);

  /* Load check: intact, then one byte of position 1 (block 0) flipped. */
  EXPECT_OK(kvcs_worker_check_stored(worker, blocks, NULL, &result));
  EXPECT(kvcs_result_stored(NULL, "o", 0, outcomes), KVCS_ERR_INVALID_ARGUMENT, "result");
  EXPECT(kvcs_result_stored(result, "o", 0, NULL), KVCS_ERR_INVALID_ARGUMENT, "outcomes");
  EXPECT(kvcs_result_stored(result, "o", 5, outcomes), KVCS_ERR_NOT_FOUND, "group_id 5");
  EXPECT_OK(kvcs_result_stored(result, "o", 0, outcomes));
  CHECK(outcomes[0] == KVCS_STORED_MATCHED && outcomes[1] == KVCS_STORED_MATCHED &&
        outcomes[2] == KVCS_STORED_MATCHED);
  kvcs_result_destroy(result);
  ((uint8_t *)kv_cache)[0 * F_HEADS * F_BLOCK_SIZE * F_CELL + 5] ^= 0x40;
  EXPECT_OK(kvcs_worker_check_stored(worker, blocks, NULL, &result));
  EXPECT_OK(kvcs_result_stored(result, "o", 0, outcomes));
  CHECK(outcomes[0] == KVCS_STORED_MATCHED && outcomes[1] == KVCS_STORED_FAILED &&
        outcomes[2] == KVCS_STORED_MATCHED);
  /* The capacity-taking form: the buffer convention. */
  uint8_t buf_outcomes[4] = {9, 9, 9, 9};
  size_t len = 77;
  EXPECT(kvcs_result_stored_buf(NULL, "o", 0, buf_outcomes, 4, &len), KVCS_ERR_INVALID_ARGUMENT, "result");
  EXPECT(kvcs_result_stored_buf(result, "o", 0, buf_outcomes, 4, NULL), KVCS_ERR_INVALID_ARGUMENT, "len is NULL");
  EXPECT(kvcs_result_stored_buf(result, "o", 5, buf_outcomes, 4, &len), KVCS_ERR_NOT_FOUND, "group_id 5");
  EXPECT(kvcs_result_stored_buf(result, "o", 0, NULL, 4, &len), KVCS_ERR_INVALID_ARGUMENT,
         "outcomes is NULL with cap 4");
  CHECK(len == 77);
  EXPECT(kvcs_result_stored_buf(result, "o", 0, buf_outcomes, 2, &len), KVCS_ERR_BUFFER_TOO_SMALL,
         "cap 2 is below the 3 outcomes needed");
  CHECK(len == 3 && buf_outcomes[0] == 9 && buf_outcomes[1] == 9);
  EXPECT_OK(kvcs_result_stored_buf(result, "o", 0, buf_outcomes, 4, &len));
  CHECK(len == 3 && memcmp(buf_outcomes, outcomes, 3) == 0 && buf_outcomes[3] == 9);
  kvcs_result *plain = NULL;
  EXPECT_OK(kvcs_worker_checksum(worker, blocks, KVCS_ROLE_CONSUMER, NULL, &plain));
  check_offload_reports(blocks, result, plain);
  kvcs_result_destroy(plain);
  kvcs_result_destroy(result);

  /* Another algorithm (docs/SPEC.md sections 8 and 12). The intact blocks,
   * stored under MIXED2, load-checked by a WEIGHTED worker and by a MIXED
   * one (kvcsum 0.2's default): the stamp stored with each value names its
   * algorithm, so every position is "other algorithm", never a failure,
   * and the verifier says unverified. */
  ((uint8_t *)kv_cache)[0 * F_HEADS * F_BLOCK_SIZE * F_CELL + 5] ^= 0x40;
  kvcs_segment other_segment;
  kvcs_worker *weighted = attention_worker_of(&other_segment, 1, KVCS_ALGORITHM_WEIGHTED);
  EXPECT_OK(kvcs_worker_add_region(weighted, (uint64_t)(uintptr_t)stored, sizeof stored));
  EXPECT_OK(kvcs_worker_add_stored(weighted, 0, (uint64_t)(uintptr_t)stored, F_BLOCKS));
  kvcs_result *mixed_check = NULL, *weighted_check = NULL;
  EXPECT_OK(kvcs_worker_check_stored(worker, blocks, NULL, &mixed_check));
  EXPECT_OK(kvcs_worker_check_stored(weighted, blocks, NULL, &weighted_check));
  EXPECT_OK(kvcs_result_stored(mixed_check, "o", 0, outcomes));
  CHECK(outcomes[0] == KVCS_STORED_MATCHED && outcomes[1] == KVCS_STORED_MATCHED &&
        outcomes[2] == KVCS_STORED_MATCHED);
  EXPECT_OK(kvcs_result_stored(weighted_check, "o", 0, outcomes));
  CHECK(outcomes[0] == KVCS_STORED_OTHER_ALGORITHM && outcomes[1] == KVCS_STORED_OTHER_ALGORITHM &&
        outcomes[2] == KVCS_STORED_OTHER_ALGORITHM);
  kvcs_segment mixed_segment;
  kvcs_worker *mixed = attention_worker_of(&mixed_segment, 1, KVCS_ALGORITHM_MIXED);
  EXPECT_OK(kvcs_worker_add_region(mixed, (uint64_t)(uintptr_t)stored, sizeof stored));
  EXPECT_OK(kvcs_worker_add_stored(mixed, 0, (uint64_t)(uintptr_t)stored, F_BLOCKS));
  kvcs_result *old_mixed_check = NULL;
  EXPECT_OK(kvcs_worker_check_stored(mixed, blocks, NULL, &old_mixed_check));
  EXPECT_OK(kvcs_result_stored(old_mixed_check, "o", 0, outcomes));
  CHECK(outcomes[0] == KVCS_STORED_OTHER_ALGORITHM && outcomes[1] == KVCS_STORED_OTHER_ALGORITHM &&
        outcomes[2] == KVCS_STORED_OTHER_ALGORITHM);
  for (int other = 0; other < 2; other++) {
    kvcs_verifier *pair = NULL;
    EXPECT_OK(kvcs_verifier_create(2, &pair)); /* TP 1 x 2 PP stages */
    EXPECT_OK(kvcs_verifier_expect(pair, blocks, KVCS_ROLE_CONSUMER));
    const kvcs_result *pair_checks[2] = {mixed_check, other ? old_mixed_check : weighted_check};
    for (int i = 0; i < 2; i++) {
      size_t len = 0;
      uint8_t *bytes = record_bytes(pair_checks[i], &len);
      EXPECT_OK(kvcs_verifier_add_record(pair, bytes, len));
      free(bytes);
    }
    kvcs_report *pair_report = NULL;
    EXPECT_OK(kvcs_verifier_check_stored(pair, "o", &pair_report));
    uint32_t pair_verdict = 9, pair_reason = 9;
    EXPECT_OK(kvcs_report_verdict(pair_report, &pair_verdict));
    EXPECT_OK(kvcs_report_reason(pair_report, &pair_reason));
    CHECK(pair_verdict == KVCS_VERDICT_UNVERIFIED && pair_reason == KVCS_UNVERIFIED_ALGORITHM_DIFFERS);
    kvcs_report_destroy(pair_report);
    kvcs_verifier_destroy(pair);
  }
  kvcs_result_destroy(old_mixed_check);
  kvcs_worker_destroy(mixed);
  kvcs_verifier *verifier = NULL;
  EXPECT_OK(kvcs_verifier_create(2, &verifier)); /* TP 1 x 2 PP stages */
  EXPECT_OK(kvcs_verifier_expect(verifier, blocks, KVCS_ROLE_CONSUMER));
  const kvcs_result *checks[2] = {mixed_check, weighted_check};
  for (int i = 0; i < 2; i++) {
    size_t len = 0;
    uint8_t *bytes = record_bytes(checks[i], &len);
    EXPECT_OK(kvcs_verifier_add_record(verifier, bytes, len));
    free(bytes);
  }
  kvcs_report *report = NULL;
  EXPECT_OK(kvcs_verifier_check_stored(verifier, "o", &report));
  uint32_t verdict = 9, reason = 9;
  EXPECT_OK(kvcs_report_verdict(report, &verdict));
  EXPECT_OK(kvcs_report_reason(report, &reason));
  CHECK(verdict == KVCS_VERDICT_UNVERIFIED && reason == KVCS_UNVERIFIED_ALGORITHM_DIFFERS);
  kvcs_report_destroy(report);
  kvcs_verifier_destroy(verifier);
  kvcs_result_destroy(mixed_check);
  kvcs_result_destroy(weighted_check);

  /* Connectors that keep the entries themselves: kvcs_result_entries gives
   * what the store wrote (value and stamp), kvcs_result_check_entries judges
   * them as a load check does. */
  kvcs_result *consumer = NULL, *producer = NULL;
  EXPECT_OK(kvcs_worker_checksum(worker, blocks, KVCS_ROLE_CONSUMER, NULL, &consumer));
  EXPECT_OK(kvcs_worker_checksum(worker, blocks, KVCS_ROLE_PRODUCER, NULL, &producer));
  uint64_t entries[6] = {7, 7, 7, 7, 7, 7};
  EXPECT(kvcs_result_entries(NULL, "o", 0, entries), KVCS_ERR_INVALID_ARGUMENT, "result");
  EXPECT(kvcs_result_entries(consumer, NULL, 0, entries), KVCS_ERR_INVALID_ARGUMENT, "req_id");
  EXPECT(kvcs_result_entries(consumer, "o", 0, NULL), KVCS_ERR_INVALID_ARGUMENT, "entries is NULL for 3");
  EXPECT(kvcs_result_entries(consumer, "o", 5, entries), KVCS_ERR_NOT_FOUND, "group_id 5");
  EXPECT(kvcs_result_entries(consumer, "x", 0, entries), KVCS_ERR_NOT_FOUND, "req_id \"x\"");
  EXPECT(kvcs_result_entries(producer, "o", 0, entries), KVCS_ERR_INVALID_ARGUMENT, "KVCS_ROLE_PRODUCER");
  CHECK(entries[0] == 7 && entries[5] == 7);
  kvcs_blocks *unhashed = NULL;
  EXPECT_OK(kvcs_blocks_create(&unhashed));
  EXPECT_OK(kvcs_blocks_add_request(unhashed, "o", 10));
  EXPECT_OK(kvcs_blocks_add_group(unhashed, "o", 0, 0, block_ids, 3));
  kvcs_result *unhashed_result = NULL;
  EXPECT_OK(kvcs_worker_checksum(worker, unhashed, KVCS_ROLE_CONSUMER, NULL, &unhashed_result));
  EXPECT(kvcs_result_entries(unhashed_result, "o", 0, entries), KVCS_ERR_INVALID_ARGUMENT, "no block hashes");
  EXPECT_OK(kvcs_result_entries(consumer, "o", 0, entries));
  for (int q = 0; q < 3; q++) {
    CHECK(entries[2 * q] == stored[block_ids[q]][0] && entries[2 * q + 1] == stored[block_ids[q]][1]);
  }
  uint8_t kept[3] = {9, 9, 9};
  EXPECT(kvcs_result_check_entries(NULL, "o", 0, entries, kept), KVCS_ERR_INVALID_ARGUMENT, "result");
  EXPECT(kvcs_result_check_entries(consumer, "o", 0, NULL, kept), KVCS_ERR_INVALID_ARGUMENT, "entries is NULL");
  EXPECT(kvcs_result_check_entries(consumer, "o", 0, entries, NULL), KVCS_ERR_INVALID_ARGUMENT, "outcomes");
  EXPECT(kvcs_result_check_entries(consumer, "o", 5, entries, kept), KVCS_ERR_NOT_FOUND, "group_id 5");
  EXPECT(kvcs_result_check_entries(producer, "o", 0, entries, kept), KVCS_ERR_INVALID_ARGUMENT,
         "KVCS_ROLE_PRODUCER");
  CHECK(kept[0] == 9);
  EXPECT_OK(kvcs_result_check_entries(consumer, "o", 0, entries, kept));
  CHECK(kept[0] == KVCS_STORED_MATCHED && kept[1] == KVCS_STORED_MATCHED && kept[2] == KVCS_STORED_MATCHED);
  /* The capacity-taking forms: the buffer convention, both lengths. */
  uint64_t buf_entries[7] = {7, 7, 7, 7, 7, 7, 7};
  len = 77;
  EXPECT(kvcs_result_entries_buf(NULL, "o", 0, buf_entries, 7, &len), KVCS_ERR_INVALID_ARGUMENT, "result");
  EXPECT(kvcs_result_entries_buf(consumer, "o", 0, buf_entries, 7, NULL), KVCS_ERR_INVALID_ARGUMENT, "len is NULL");
  EXPECT(kvcs_result_entries_buf(consumer, "o", 5, buf_entries, 7, &len), KVCS_ERR_NOT_FOUND, "group_id 5");
  EXPECT(kvcs_result_entries_buf(producer, "o", 0, buf_entries, 7, &len), KVCS_ERR_INVALID_ARGUMENT,
         "KVCS_ROLE_PRODUCER");
  EXPECT(kvcs_result_entries_buf(consumer, "o", 0, NULL, 7, &len), KVCS_ERR_INVALID_ARGUMENT,
         "entries is NULL with cap 7");
  CHECK(len == 77);
  EXPECT(kvcs_result_entries_buf(consumer, "o", 0, buf_entries, 5, &len), KVCS_ERR_BUFFER_TOO_SMALL,
         "cap 5 is below the 6 words needed");
  CHECK(len == 6 && buf_entries[0] == 7 && buf_entries[4] == 7);
  EXPECT_OK(kvcs_result_entries_buf(consumer, "o", 0, buf_entries, 7, &len));
  CHECK(len == 6 && memcmp(buf_entries, entries, sizeof entries) == 0 && buf_entries[6] == 7);
  uint8_t buf_kept[4] = {9, 9, 9, 9};
  len = 77;
  EXPECT(kvcs_result_check_entries_buf(NULL, "o", 0, entries, 6, buf_kept, 4, &len), KVCS_ERR_INVALID_ARGUMENT,
         "result");
  EXPECT(kvcs_result_check_entries_buf(consumer, "o", 0, entries, 6, buf_kept, 4, NULL),
         KVCS_ERR_INVALID_ARGUMENT, "len is NULL");
  EXPECT(kvcs_result_check_entries_buf(consumer, "o", 0, entries, 5, buf_kept, 4, &len),
         KVCS_ERR_INVALID_ARGUMENT, "num_words 5 is not 2 x the 3 positions of group_id 0");
  EXPECT(kvcs_result_check_entries_buf(consumer, "o", 0, entries, 8, buf_kept, 4, &len),
         KVCS_ERR_INVALID_ARGUMENT, "num_words 8");
  EXPECT(kvcs_result_check_entries_buf(consumer, "o", 0, NULL, 6, buf_kept, 4, &len), KVCS_ERR_INVALID_ARGUMENT,
         "entries is NULL");
  EXPECT(kvcs_result_check_entries_buf(consumer, "o", 0, entries, 6, NULL, 4, &len), KVCS_ERR_INVALID_ARGUMENT,
         "outcomes is NULL with cap 4");
  EXPECT(kvcs_result_check_entries_buf(consumer, "o", 5, entries, 6, buf_kept, 4, &len), KVCS_ERR_NOT_FOUND,
         "group_id 5");
  EXPECT(kvcs_result_check_entries_buf(producer, "o", 0, entries, 6, buf_kept, 4, &len),
         KVCS_ERR_INVALID_ARGUMENT, "KVCS_ROLE_PRODUCER");
  CHECK(len == 77 && buf_kept[0] == 9);
  EXPECT(kvcs_result_check_entries_buf(consumer, "o", 0, entries, 6, buf_kept, 2, &len), KVCS_ERR_BUFFER_TOO_SMALL,
         "cap 2 is below the 3 outcomes needed");
  CHECK(len == 3 && buf_kept[0] == 9 && buf_kept[1] == 9);
  EXPECT_OK(kvcs_result_check_entries_buf(consumer, "o", 0, entries, 6, buf_kept, 4, &len));
  CHECK(len == 3 && memcmp(buf_kept, kept, 3) == 0 && buf_kept[3] == 9);
  /* A damaged stamp fails; it does not read as another configuration. */
  entries[2 * 1 + 1] ^= 1u << 9;
  EXPECT_OK(kvcs_result_check_entries(consumer, "o", 0, entries, kept));
  CHECK(kept[0] == KVCS_STORED_MATCHED && kept[1] == KVCS_STORED_FAILED && kept[2] == KVCS_STORED_MATCHED);
  EXPECT_OK(kvcs_result_check_entries_buf(consumer, "o", 0, entries, 6, buf_kept, 3, &len));
  CHECK(len == 3 && memcmp(buf_kept, kept, 3) == 0);
  entries[2 * 1 + 1] ^= 1u << 9;
  /* The partial last block (2 of 4 tokens) load-checked holding 4: other tokens. */
  kvcs_blocks *longer = NULL;
  EXPECT_OK(kvcs_blocks_create(&longer));
  EXPECT_OK(kvcs_blocks_add_request(longer, "o", 12));
  EXPECT_OK(kvcs_blocks_add_group(longer, "o", 0, 0, block_ids, 3));
  EXPECT_OK(kvcs_blocks_set_hashes(longer, "o", 0, hashes, HASH_BYTES, 3));
  kvcs_result *longer_result = NULL;
  EXPECT_OK(kvcs_worker_checksum(worker, longer, KVCS_ROLE_CONSUMER, NULL, &longer_result));
  EXPECT_OK(kvcs_result_check_entries(longer_result, "o", 0, entries, kept));
  CHECK(kept[0] == KVCS_STORED_MATCHED && kept[1] == KVCS_STORED_MATCHED && kept[2] == KVCS_STORED_OTHER_TOKENS);
  kvcs_result_destroy(longer_result);
  kvcs_blocks_destroy(longer);
  kvcs_result_destroy(unhashed_result);
  kvcs_blocks_destroy(unhashed);
  kvcs_result_destroy(consumer);
  kvcs_result_destroy(producer);

  kvcs_worker_destroy(weighted);
  kvcs_blocks_destroy(blocks);
  kvcs_worker_destroy(worker);
}

static void test_coverage_calls(void) {
  kvcs_verifier *verifier = NULL;
  EXPECT_OK(kvcs_verifier_create(1, &verifier));
  EXPECT(kvcs_verifier_set_require_coverage(NULL, 1), KVCS_ERR_INVALID_ARGUMENT, "verifier");
  EXPECT(kvcs_verifier_set_require_coverage(verifier, 2), KVCS_ERR_INVALID_ARGUMENT, "on");
  EXPECT_OK(kvcs_verifier_set_require_coverage(verifier, 1));
  kvcs_blocks *blocks = NULL;
  EXPECT_OK(kvcs_blocks_create(&blocks));
  EXPECT_OK(kvcs_blocks_add_request(blocks, "c", 16));
  EXPECT_OK(kvcs_verifier_expect(verifier, blocks, KVCS_ROLE_CONSUMER));
  kvcs_report *report = NULL;
  EXPECT_OK(kvcs_verifier_check_no_payload(verifier, "c", &report));
  uint64_t uncompared = 77;
  EXPECT(kvcs_report_uncompared_positions(NULL, &uncompared), KVCS_ERR_INVALID_ARGUMENT, "report");
  EXPECT(kvcs_report_uncompared_positions(report, NULL), KVCS_ERR_INVALID_ARGUMENT, "positions");
  CHECK(report != NULL);
  CHECK(uncompared == 77);
  EXPECT_OK(kvcs_report_uncompared_positions(report, &uncompared));
  CHECK(uncompared == 0);
  /* No payload: unverified as a whole, so no range either. */
  size_t ranges = 77;
  uint32_t group = 77;
  uint64_t first = 77, count = 77;
  EXPECT(kvcs_report_num_uncompared(report, NULL), KVCS_ERR_INVALID_ARGUMENT, "count");
  EXPECT_OK(kvcs_report_num_uncompared(report, &ranges));
  CHECK(ranges == 0);
  EXPECT(kvcs_report_uncompared(report, 0, &group, &first, &count), KVCS_ERR_OUT_OF_BOUNDS, "index 0 is not below 0");
  CHECK(group == 77 && first == 77 && count == 77);
  kvcs_report_destroy(report);
  kvcs_blocks_destroy(blocks);
  kvcs_verifier_destroy(verifier);
}

void test_features(void) {
  test_aliases();
  test_state_layers();
  test_stored_checksums();
  test_coverage_calls();
}
