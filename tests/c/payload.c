/*
 * Payloads read through the C API (kvcs_payload_*) and layer decodings
 * (kvcs_worker_set_layer_decoding): a producer's payload decoded again,
 * its values against a naive reference of SPEC sections 2, 3 and 12 (the
 * MIXED2 function, the default, written here again), its extension's layer partials and
 * decodings as declared; a consumer whose declared K scale differs is
 * KVCS_UNVERIFIED_DECODING_DIFFERS, never a match; and every error path of
 * those calls.
 */
#include <inttypes.h>
#include <math.h>
#include <stdlib.h>

#include "check.h"

enum {
  P_LAYERS = 2,
  P_HEADS = 2,
  P_PIECES = 8, /* 64-byte cells */
  P_BLOCK = 4,
  P_BLOCKS = 4,
  P_TOKENS = 10,
  P_POSITIONS = 3,
};
static const uint32_t p_layer_numbers[P_LAYERS] = {3, 8};
static const uint32_t p_table[P_POSITIONS] = {2, 0, 3};
#define P_REQ "req-payload"

/* One cache per layer, NHD: [block][token][head][piece]. */
static uint64_t p_cache[P_LAYERS][P_BLOCKS][P_BLOCK][P_HEADS][P_PIECES];

static uint64_t p_rng;

static uint64_t p_random(void) {
  p_rng ^= p_rng >> 12;
  p_rng ^= p_rng << 25;
  p_rng ^= p_rng >> 27;
  return p_rng * 0x2545F4914F6CDD1Dull;
}

/* One round of MIXED2's f (SPEC section 12): the low half times k
 * (64-bit), the high half added to the product's high half, the halves
 * swapped. */
static uint64_t naive_mix2_round(uint64_t v, uint32_t k) {
  uint64_t sum = (v & 0xFFFFFFFF00000000ull) + (v & 0xFFFFFFFFull) * k;
  return (sum << 32) | (sum >> 32);
}

/* f of the default algorithm, MIXED2 (SPEC section 12), from its
 * definition: three rounds, a fold after the second and the third. */
static uint64_t naive_mix(uint64_t x) {
  uint64_t v = naive_mix2_round(x, KVCS_MIX2_MULTIPLIER_1);
  v = naive_mix2_round(v, KVCS_MIX2_MULTIPLIER_2);
  v ^= v >> 32;
  v = naive_mix2_round(v, KVCS_MIX2_MULTIPLIER_3);
  return v ^ (v >> 32);
}

/* The checksum of position q over `layers` (a bit mask of layer indices)
 * and the request's first `tokens` tokens, as SPEC section 3's reference
 * loops write it. */
static uint64_t naive_position_over(uint32_t q, unsigned layers, uint64_t tokens) {
  uint64_t total = 0;
  for (uint32_t l = 0; l < P_LAYERS; l++) {
    if (!(layers & (1u << l))) {
      continue;
    }
    for (uint32_t h = 0; h < P_HEADS; h++) {
      uint64_t s = 0;
      for (uint32_t i = 0; i < P_BLOCK; i++) {
        uint64_t t = (uint64_t)q * P_BLOCK + i;
        if (t >= tokens) {
          break;
        }
        for (uint32_t p = 0; p < P_PIECES; p++) {
          uint64_t j = t * P_PIECES + p;
          s += naive_mix(p_cache[l][p_table[q]][i][h][p]) * (2 * j + 1);
        }
      }
      total += (2 * ((uint64_t)p_layer_numbers[l] * 65536 + h) + 1) * s;
    }
  }
  return total;
}

/* The checksum of position q over `layers` and all P_TOKENS tokens. */
static uint64_t naive_position(uint32_t q, unsigned layers) { return naive_position_over(q, layers, P_TOKENS); }

static uint64_t bits_of(double value) {
  uint64_t bits;
  memcpy(&bits, &value, sizeof bits);
  return bits;
}

static kvcs_worker *p_worker(uint32_t detail) {
  kvcs_worker_options options = {.tp_rank = 0, .tp_size = 1, .pp_rank = 0, .device = KVCS_HOST, .num_threads = 1};
  kvcs_worker *worker = NULL;
  EXPECT_OK(kvcs_worker_create(&options, &worker));
  EXPECT_OK(kvcs_worker_add_region(worker, (uint64_t)(uintptr_t)p_cache, sizeof p_cache));
  EXPECT_OK(kvcs_worker_add_group(worker, 0, P_BLOCK));
  for (uint32_t l = 0; l < P_LAYERS; l++) {
    kvcs_segment segment = {
        .address = (uint64_t)(uintptr_t)p_cache[l],
        .block_stride = (int64_t)sizeof p_cache[l][0],
        .kernel_block_stride = (int64_t)sizeof p_cache[l][0],
        .head_stride = (int64_t)sizeof p_cache[l][0][0][0],
        .token_stride = (int64_t)sizeof p_cache[l][0][0],
        .bytes_per_token = (uint32_t)sizeof p_cache[l][0][0][0],
    };
    kvcs_layer layer = {
        .group_id = 0,
        .layer_number = p_layer_numbers[l],
        .first_head = 0,
        .num_heads = P_HEADS,
        .replicas = 1,
        .replica_index = 0,
        .num_blocks = P_BLOCKS,
        .kernel_blocks = 1,
        .tokens_per_kernel_block = P_BLOCK,
        .num_segments = 1,
        .segments = &segment,
        .identity = (const uint8_t *)"layer",
        .identity_len = 5,
    };
    EXPECT_OK(kvcs_worker_add_layer(worker, &layer));
  }
  EXPECT_OK(kvcs_worker_set_detail(worker, detail));
  return worker;
}

static kvcs_blocks *p_blocks(void) {
  kvcs_blocks *blocks = NULL;
  EXPECT_OK(kvcs_blocks_create(&blocks));
  EXPECT_OK(kvcs_blocks_add_request(blocks, P_REQ, P_TOKENS));
  EXPECT_OK(kvcs_blocks_add_group(blocks, P_REQ, 0, 0, p_table, P_POSITIONS));
  return blocks;
}

/* The worker's record of the request, in `role` (malloc'd). */
static uint8_t *p_record(kvcs_worker *worker, const kvcs_blocks *blocks, uint32_t role, size_t *len) {
  kvcs_result *result = NULL;
  EXPECT_OK(kvcs_worker_checksum(worker, blocks, role, NULL, &result));
  size_t needed = 0;
  EXPECT(kvcs_result_encode(result, NULL, 0, &needed), KVCS_ERR_BUFFER_TOO_SMALL, "bytes needed");
  uint8_t *record = malloc(needed);
  CHECK(record != NULL);
  EXPECT_OK(kvcs_result_encode(result, record, needed, len));
  kvcs_result_destroy(result);
  return record;
}

/* The producer's payload (malloc'd): one worker's record, extension on or off. */
static uint8_t *p_payload(kvcs_worker *worker, const kvcs_blocks *blocks, uint32_t extension, size_t *len) {
  size_t record_len = 0;
  uint8_t *record = p_record(worker, blocks, KVCS_ROLE_PRODUCER, &record_len);
  kvcs_verifier *verifier = NULL;
  EXPECT_OK(kvcs_verifier_create(1, &verifier));
  EXPECT_OK(kvcs_verifier_set_extension(verifier, extension));
  EXPECT_OK(kvcs_verifier_expect(verifier, blocks, KVCS_ROLE_PRODUCER));
  EXPECT_OK(kvcs_verifier_add_record(verifier, record, record_len));
  size_t needed = 0;
  EXPECT(kvcs_verifier_payload(verifier, P_REQ, NULL, 0, &needed), KVCS_ERR_BUFFER_TOO_SMALL, "bytes needed");
  uint8_t *payload = malloc(needed);
  CHECK(payload != NULL);
  EXPECT_OK(kvcs_verifier_payload(verifier, P_REQ, payload, needed, len));
  kvcs_verifier_destroy(verifier);
  free(record);
  return payload;
}

/* The consumer's report on `payload` (its reason and whether the message
 * has `needle`), from a worker in the consumer role. */
static uint32_t p_judge(kvcs_worker *worker, const kvcs_blocks *blocks, const uint8_t *payload, size_t len,
                        uint32_t *reason, const char *needle) {
  size_t record_len = 0;
  uint8_t *record = p_record(worker, blocks, KVCS_ROLE_CONSUMER, &record_len);
  kvcs_verifier *verifier = NULL;
  EXPECT_OK(kvcs_verifier_create(1, &verifier));
  EXPECT_OK(kvcs_verifier_expect(verifier, blocks, KVCS_ROLE_CONSUMER));
  EXPECT_OK(kvcs_verifier_add_record(verifier, record, record_len));
  kvcs_report *report = NULL;
  EXPECT_OK(kvcs_verifier_check(verifier, P_REQ, payload, len, &report));
  uint32_t verdict = 99;
  EXPECT_OK(kvcs_report_verdict(report, &verdict));
  EXPECT_OK(kvcs_report_reason(report, reason));
  if (needle != NULL) {
    const char *message = NULL;
    EXPECT_OK(kvcs_report_message(report, &message));
    CHECK(message != NULL && strstr(message, needle) != NULL);
    if (message == NULL || strstr(message, needle) == NULL) {
      fprintf(stderr, "  the message %s should contain %s\n", message ? message : "(null)", needle);
    }
  }
  kvcs_report_destroy(report);
  kvcs_verifier_destroy(verifier);
  free(record);
  return verdict;
}

static void test_decoding_declarations(kvcs_worker *worker) {
  const uint64_t k = bits_of(0.0125), v = bits_of(0.5);
  EXPECT(kvcs_worker_set_layer_decoding(NULL, 0, 3, "fp8_e4m3", 16, k, v), KVCS_ERR_INVALID_ARGUMENT, "worker");
  EXPECT(kvcs_worker_set_layer_decoding(worker, 9, 3, "fp8_e4m3", 16, k, v), KVCS_ERR_NOT_FOUND, "group_id 9");
  EXPECT(kvcs_worker_set_layer_decoding(worker, 0, 5, "fp8_e4m3", 16, k, v), KVCS_ERR_NOT_FOUND,
         "layer_number 5 is not a registered layer of group_id 0");
  EXPECT(kvcs_worker_set_layer_decoding(worker, 0, 3, "FP8", 16, k, v), KVCS_ERR_INVALID_ARGUMENT,
         "dtype \"FP8\" is not an element type name");
  EXPECT(kvcs_worker_set_layer_decoding(worker, 0, 3, "torch.float8_e4m3fn", 16, k, v), KVCS_ERR_INVALID_ARGUMENT,
         "dtype");
  EXPECT(kvcs_worker_set_layer_decoding(worker, 0, 3, "", 16, k, v), KVCS_ERR_INVALID_ARGUMENT, "dtype is empty");
  EXPECT(kvcs_worker_set_layer_decoding(worker, 0, 3, "fp8_e4m3", 16, bits_of(NAN), v),
         KVCS_ERR_INVALID_ARGUMENT, "k_scale NaN");
  EXPECT(kvcs_worker_set_layer_decoding(worker, 0, 3, "fp8_e4m3", 16, k, bits_of(-0.5)), KVCS_ERR_INVALID_ARGUMENT,
         "v_scale -0.5");
  EXPECT(kvcs_worker_set_layer_decoding(worker, 0, 3, "fp8_e4m3", 16, bits_of(INFINITY), v),
         KVCS_ERR_INVALID_ARGUMENT, "k_scale inf");
  EXPECT(kvcs_worker_set_layer_decoding(worker, 0, 3, NULL, 0, 0, 0), KVCS_ERR_INVALID_ARGUMENT, "declares nothing");
  /* What is declared: layer 3 fp8 with its scales, layer 8 its element type. */
  EXPECT_OK(kvcs_worker_set_layer_decoding(worker, 0, 3, "fp8_e4m3", 16, k, v));
  EXPECT_OK(kvcs_worker_set_layer_decoding(worker, 0, 8, "bfloat16", 0, 0, 0));
}

void test_payload(uint64_t seed) {
  p_rng = seed ^ 0x7061796c6f6164ull;
  for (size_t i = 0; i < sizeof p_cache / sizeof(uint64_t); i++) {
    ((uint64_t *)p_cache)[i] = p_random();
  }
  CHECK(strcmp(kvcs_unverified_reason_name(17), "KVCS_UNVERIFIED_DECODING_DIFFERS") == 0);
  kvcs_blocks *blocks = p_blocks();
  kvcs_worker *producer = p_worker(1);
  test_decoding_declarations(producer);
  size_t len = 0;
  uint8_t *bytes = p_payload(producer, blocks, 1, &len);

  /* Decoded again through the library. */
  kvcs_payload *payload = (kvcs_payload *)&len; /* must stay as it is */
  EXPECT(kvcs_payload_decode(NULL, 4, &payload), KVCS_ERR_INVALID_ARGUMENT, "bytes is NULL");
  EXPECT(kvcs_payload_decode(bytes, len, NULL), KVCS_ERR_INVALID_ARGUMENT, "out");
  EXPECT(kvcs_payload_decode(bytes, len - 1, &payload), KVCS_ERR_MALFORMED, "truncated");
  EXPECT(kvcs_payload_decode((const uint8_t *)"\x93\x02\x00\x90", 4, &payload), KVCS_ERR_MALFORMED,
         "version 2 is not supported");
  EXPECT(kvcs_payload_decode((const uint8_t *)"\x93\x01\x00\x90\xc0", 5, &payload), KVCS_ERR_MALFORMED,
         "1 trailing bytes");
  CHECK(payload == (kvcs_payload *)&len);
  EXPECT_OK(kvcs_payload_decode(bytes, len, &payload));

  kvcs_payload_summary info = {0};
  EXPECT(kvcs_payload_info(NULL, &info), KVCS_ERR_INVALID_ARGUMENT, "payload");
  EXPECT(kvcs_payload_info(payload, NULL), KVCS_ERR_INVALID_ARGUMENT, "out");
  EXPECT_OK(kvcs_payload_info(payload, &info));
  CHECK(info.version == KVCS_PAYLOAD_VERSION && info.extension_version == KVCS_EXTENSION_VERSION);
  CHECK(info.num_tokens == P_TOKENS && info.num_groups == 1 && info.producer_tp_size == 1);
  CHECK(info.algorithm == KVCS_ALGORITHM_MIXED2);

  kvcs_group_checksums group = {0};
  EXPECT(kvcs_payload_group(payload, 1, &group), KVCS_ERR_OUT_OF_BOUNDS, "group_index 1");
  EXPECT(kvcs_payload_group(payload, 0, NULL), KVCS_ERR_INVALID_ARGUMENT, "out");
  EXPECT_OK(kvcs_payload_group(payload, 0, &group));
  CHECK(group.group_id == 0 && group.block_size == P_BLOCK && group.first_position == 0);
  CHECK(group.num_values == P_POSITIONS && group.has_coverage == 1 && group.has_marks == 1 && group.marks == 0);
  CHECK(group.num_layers == P_LAYERS && group.num_decodings == 2);

  uint64_t values[P_POSITIONS + 1];
  size_t count = 0;
  EXPECT(kvcs_payload_values(payload, 0, NULL, 0, &count), KVCS_ERR_BUFFER_TOO_SMALL, "cap 0");
  CHECK(count == P_POSITIONS);
  EXPECT(kvcs_payload_values(payload, 0, values, P_POSITIONS, NULL), KVCS_ERR_INVALID_ARGUMENT, "len");
  EXPECT(kvcs_payload_values(payload, 3, values, P_POSITIONS, &count), KVCS_ERR_OUT_OF_BOUNDS, "group_index 3");
  EXPECT_OK(kvcs_payload_values(payload, 0, values, P_POSITIONS + 1, &count));
  CHECK(count == P_POSITIONS);
  for (uint32_t q = 0; q < P_POSITIONS; q++) {
    CHECK(values[q] == naive_position(q, 3));
  }
  /* The short last value: the last position (tokens 8 and 9) over one
   * token fewer, which a load of P_TOKENS - 1 tokens is compared with. */
  uint64_t short_last[2] = {0, 0};
  EXPECT(kvcs_payload_short_last(NULL, 0, short_last, 2, &count), KVCS_ERR_INVALID_ARGUMENT, "payload");
  EXPECT(kvcs_payload_short_last(payload, 0, short_last, 2, NULL), KVCS_ERR_INVALID_ARGUMENT, "len");
  EXPECT(kvcs_payload_short_last(payload, 1, short_last, 2, &count), KVCS_ERR_OUT_OF_BOUNDS, "group_index 1");
  EXPECT(kvcs_payload_short_last(payload, 0, NULL, 0, &count), KVCS_ERR_BUFFER_TOO_SMALL, "cap 0");
  CHECK(count == 1);
  EXPECT_OK(kvcs_payload_short_last(payload, 0, short_last, 2, &count));
  CHECK(count == 1 && short_last[0] == naive_position_over(P_POSITIONS - 1, 3, P_TOKENS - 1));
  CHECK(short_last[0] != values[P_POSITIONS - 1]);
  for (size_t l = 0; l < P_LAYERS; l++) {
    kvcs_layer_checksums layer = {0};
    EXPECT_OK(kvcs_payload_layer(payload, 0, l, &layer));
    CHECK(layer.layer_number == p_layer_numbers[l] && layer.first_head == 0 && layer.num_heads == P_HEADS);
    CHECK(layer.num_values == P_POSITIONS);
    EXPECT_OK(kvcs_payload_layer_values(payload, 0, l, values, P_POSITIONS, &count));
    for (uint32_t q = 0; q < P_POSITIONS; q++) {
      CHECK(values[q] == naive_position(q, 1u << l));
    }
  }
  kvcs_layer_checksums layer = {0};
  EXPECT(kvcs_payload_layer(payload, 0, P_LAYERS, &layer), KVCS_ERR_OUT_OF_BOUNDS, "layer_index 2");
  EXPECT(kvcs_payload_layer(payload, 0, 0, NULL), KVCS_ERR_INVALID_ARGUMENT, "out");
  EXPECT(kvcs_payload_layer_values(payload, 0, 7, values, P_POSITIONS, &count), KVCS_ERR_OUT_OF_BOUNDS,
         "layer_index 7");
  EXPECT(kvcs_payload_layer_values(payload, 0, 0, values, 1, &count), KVCS_ERR_BUFFER_TOO_SMALL, "cap 1");

  kvcs_layer_decoding decoding = {0};
  EXPECT_OK(kvcs_payload_decoding(payload, 0, 0, &decoding));
  CHECK(decoding.layer_number == 3 && decoding.dtype != NULL && strcmp(decoding.dtype, "fp8_e4m3") == 0);
  CHECK(decoding.head_size == 16 && decoding.k_scale_bits == bits_of(0.0125) && decoding.v_scale_bits == bits_of(0.5));
  EXPECT_OK(kvcs_payload_decoding(payload, 0, 1, &decoding));
  CHECK(decoding.layer_number == 8 && decoding.dtype != NULL && strcmp(decoding.dtype, "bfloat16") == 0);
  CHECK(decoding.head_size == 0 && decoding.k_scale_bits == 0 && decoding.v_scale_bits == 0);
  EXPECT(kvcs_payload_decoding(payload, 0, 2, &decoding), KVCS_ERR_OUT_OF_BOUNDS, "index 2");
  EXPECT(kvcs_payload_decoding(payload, 1, 0, &decoding), KVCS_ERR_OUT_OF_BOUNDS, "group_index 1");
  EXPECT(kvcs_payload_decoding(payload, 0, 0, NULL), KVCS_ERR_INVALID_ARGUMENT, "out");
  kvcs_payload_destroy(payload);
  kvcs_payload_destroy(NULL);

  /* A consumer that reads layer 3 with another K scale: the same bytes,
   * other KV, so never a match; with the producer's scales, or declaring
   * nothing, a match. */
  kvcs_worker *consumer = p_worker(0);
  uint32_t reason = 0;
  EXPECT_OK(kvcs_worker_set_layer_decoding(consumer, 0, 3, "fp8_e4m3", 16, bits_of(0.025), bits_of(0.5)));
  CHECK(p_judge(consumer, blocks, bytes, len, &reason, "layer 3: k_scale differs") == KVCS_VERDICT_UNVERIFIED);
  CHECK(reason == KVCS_UNVERIFIED_DECODING_DIFFERS);
  EXPECT_OK(kvcs_worker_set_layer_decoding(consumer, 0, 3, "fp8_e4m3", 16, bits_of(0.0125), bits_of(0.5)));
  CHECK(p_judge(consumer, blocks, bytes, len, &reason, NULL) == KVCS_VERDICT_MATCH);
  kvcs_worker_destroy(consumer);
  consumer = p_worker(0);
  CHECK(p_judge(consumer, blocks, bytes, len, &reason, NULL) == KVCS_VERDICT_MATCH);
  kvcs_worker_destroy(consumer);
  free(bytes);

  /* A plain payload (WEIGHTED, no extension): nothing but the groups. */
  kvcs_worker_destroy(producer);
  producer = p_worker(0);
  EXPECT_OK(kvcs_worker_set_algorithm(producer, KVCS_ALGORITHM_WEIGHTED));
  bytes = p_payload(producer, blocks, 0, &len);
  EXPECT_OK(kvcs_payload_decode(bytes, len, &payload));
  EXPECT_OK(kvcs_payload_info(payload, &info));
  CHECK(info.extension_version == 0 && info.producer_tp_size == 0 && info.algorithm == KVCS_ALGORITHM_WEIGHTED);
  EXPECT_OK(kvcs_payload_group(payload, 0, &group));
  CHECK(group.block_size == 0 && group.has_coverage == 0 && group.has_marks == 0 && group.num_layers == 0);
  CHECK(group.num_decodings == 0 && group.num_values == P_POSITIONS);
  EXPECT(kvcs_payload_decoding(payload, 0, 0, &decoding), KVCS_ERR_OUT_OF_BOUNDS, "index 0");
  EXPECT(kvcs_payload_layer(payload, 0, 0, &layer), KVCS_ERR_OUT_OF_BOUNDS, "layer_index 0");
  kvcs_payload_destroy(payload);
  free(bytes);
  kvcs_worker_destroy(producer);
  kvcs_blocks_destroy(blocks);
}
