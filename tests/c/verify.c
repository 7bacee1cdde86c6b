/*
 * Verification through the C API: worker records, the verifier's payload
 * and reports, base64, their ownership and buffer rules, and every error
 * path of those calls. What a verdict should be in each situation is the
 * Rust tests' business (tests/verify.rs, tests/verify_ffi.rs,
 * tests/it/wire_bytes.rs); here one end-to-end scenario runs real host
 * workers over a small random logical KV laid out by a producer (TP=2, HND,
 * 4-token blocks) and a consumer (TP=4 with each of the 2 KV heads on 2
 * ranks, cross-layer, K and V apart, 8-token blocks of two kernel blocks):
 * a match through base64, a flipped byte localised in detail mode, and no
 * payload at all.
 */
#include <inttypes.h>
#include <stdlib.h>

#include "check.h"

/* Never dereferenced: an out-parameter's value before a failing call,
 * which must be unchanged after it. */
static char sentinel_byte;
#define SENTINEL ((void *)&sentinel_byte)

/* The logical KV: 2 layers with model-wide numbers 3 and 8, 2 KV heads, a
 * cell of 3 K pieces then 2 V pieces, one request of 22 tokens. */
enum {
  LAYERS = 2,
  KV_HEADS = 2,
  K_PIECES = 3,
  V_PIECES = 2,
  PIECES = K_PIECES + V_PIECES,
  NUM_TOKENS = 22,
  MAX_TOKENS = 24,
  MAX_RANKS = 4,
  MAX_POSITIONS = 8,
  GROUP = 0,
};
static const uint32_t layer_numbers[LAYERS] = {3, 8};
static uint64_t logical[LAYERS][KV_HEADS][MAX_TOKENS][PIECES];

#define REQ_ID "req-a"

/* Layer identities, hashed into the group fingerprint (SPEC section 7). */
static const char *const identities[LAYERS] = {"abc", ""};

static uint64_t rng_state;

/* xorshift64*: random data from the test's seed. */
static uint64_t next_random(void) {
  rng_state ^= rng_state >> 12;
  rng_state ^= rng_state << 25;
  rng_state ^= rng_state >> 27;
  return rng_state * 0x2545F4914F6CDD1Dull;
}

static uint32_t random_below(uint32_t n) { return (uint32_t)(next_random() % n); }

/* ------------------------------------------------------------------------
 * Two sides laying the logical KV out in memory
 * --------------------------------------------------------------------- */

/* Where one segment of a rank's cache lives: its buffer, the offset and
 * strides in pieces, and which pieces of the cell it holds. */
typedef struct {
  int buffer;
  int64_t offset, layer, block, kernel_block, head, token;
  uint32_t first_piece, pieces;
} segment_place;

/* One engine: its TP size, block size, block table for the request, the
 * memory layout of each rank's cache and the buffers holding it. */
typedef struct {
  const char *name;
  uint32_t tp_size, block_size, kernel_blocks, num_blocks, num_positions;
  uint32_t num_segments;
  segment_place segments[2];
  uint32_t block_ids[MAX_POSITIONS];
  int64_t buffer_pieces[2];
  uint64_t *buffers[MAX_RANKS][2];
  kvcs_blocks *blocks; /* REQ_ID: NUM_TOKENS tokens, block_ids from position 0 */
} side;

/* SPEC section 4: with more ranks than KV heads each head is on
 * `tp / KV_HEADS` consecutive ranks. */
static uint32_t replicas_of(const side *s) { return s->tp_size > KV_HEADS ? s->tp_size / KV_HEADS : 1; }
static uint32_t heads_per_rank(const side *s) { return s->tp_size > KV_HEADS ? 1 : KV_HEADS / s->tp_size; }
static uint32_t first_head_of(const side *s, uint32_t rank) { return rank / replicas_of(s) * heads_per_rank(s); }

static int64_t piece_index(const side *s, const segment_place *seg, uint32_t layer, uint32_t block, uint32_t head,
                           uint32_t slot, uint32_t piece) {
  const uint32_t per_kernel_block = s->block_size / s->kernel_blocks;
  return seg->offset + layer * seg->layer + block * seg->block + (slot / per_kernel_block) * seg->kernel_block +
         head * seg->head + (slot % per_kernel_block) * seg->token + piece;
}

/* The piece `cell_piece` of (layer, local head, token) in `rank`'s memory. */
static uint64_t *piece_of(side *s, uint32_t rank, uint32_t layer, uint32_t head, uint32_t token,
                          uint32_t cell_piece) {
  const segment_place *seg = &s->segments[0];
  if (s->num_segments == 2 && cell_piece >= K_PIECES) {
    seg = &s->segments[1];
  }
  uint32_t position = token / s->block_size;
  int64_t at = piece_index(s, seg, layer, s->block_ids[position], head, token % s->block_size,
                           cell_piece - seg->first_piece);
  return &s->buffers[rank][seg->buffer][at];
}

/* Allocates each rank's buffers full of random junk (unused blocks, slots
 * past NUM_TOKENS and padding are never zero), writes the request's KV into
 * its blocks, and makes the side's block set. Block ids are random. */
static void place_side(side *s) {
  const uint32_t heads = heads_per_rank(s);
  for (uint32_t i = 0; i < s->num_segments; i++) {
    const segment_place *seg = &s->segments[i];
    int64_t last = piece_index(s, seg, LAYERS - 1, s->num_blocks - 1, heads - 1, s->block_size - 1, seg->pieces - 1);
    if (last + 1 > s->buffer_pieces[seg->buffer]) {
      s->buffer_pieces[seg->buffer] = last + 1;
    }
  }
  uint32_t ids[16];
  for (uint32_t i = 0; i < s->num_blocks; i++) {
    ids[i] = i;
  }
  for (uint32_t q = 0; q < s->num_positions; q++) { /* a partial Fisher-Yates shuffle */
    uint32_t pick = q + random_below(s->num_blocks - q);
    uint32_t id = ids[pick];
    ids[pick] = ids[q];
    ids[q] = id;
    s->block_ids[q] = id;
  }
  for (uint32_t rank = 0; rank < s->tp_size; rank++) {
    for (int b = 0; b < 2; b++) {
      if (s->buffer_pieces[b] == 0) {
        continue;
      }
      s->buffers[rank][b] = malloc((size_t)s->buffer_pieces[b] * sizeof(uint64_t));
      CHECK(s->buffers[rank][b] != NULL);
      for (int64_t i = 0; i < s->buffer_pieces[b]; i++) {
        s->buffers[rank][b][i] = next_random();
      }
    }
    for (uint32_t token = 0; token < NUM_TOKENS; token++)
      for (uint32_t layer = 0; layer < LAYERS; layer++)
        for (uint32_t head = 0; head < heads; head++)
          for (uint32_t piece = 0; piece < PIECES; piece++) {
            *piece_of(s, rank, layer, head, token, piece) =
                logical[layer][first_head_of(s, rank) + head][token][piece];
          }
  }
  EXPECT_OK(kvcs_blocks_create(&s->blocks));
  EXPECT_OK(kvcs_blocks_add_request(s->blocks, REQ_ID, NUM_TOKENS));
  EXPECT_OK(kvcs_blocks_add_group(s->blocks, REQ_ID, GROUP, 0, s->block_ids, s->num_positions));
}

static void free_side(side *s) {
  kvcs_blocks_destroy(s->blocks);
  for (uint32_t rank = 0; rank < s->tp_size; rank++) {
    free(s->buffers[rank][0]);
    free(s->buffers[rank][1]);
  }
}

/* The producer: TP=2 (one head per rank), HND [layer][block][head][4 tokens]
 * with the cell in one region, 10 blocks. */
static side producer_side(void) {
  side s = {.name = "producer", .tp_size = 2, .block_size = 4, .kernel_blocks = 1, .num_blocks = 10,
            .num_positions = 6, .num_segments = 1};
  const int64_t h = heads_per_rank(&s), b = s.block_size, p = PIECES;
  s.segments[0] = (segment_place){0, 0, s.num_blocks * h * b * p, h * b * p, 0, b * p, p, 0, PIECES};
  return s;
}

/* The consumer: TP=4, so each KV head is on 2 ranks (replica key (2, rank % 2));
 * 8-token blocks of two 4-token kernel blocks, cross-layer
 * [block][kernel block][layer][head] with 4 tokens of K then 4 of V. */
static side consumer_side(void) {
  side s = {.name = "consumer", .tp_size = 4, .block_size = 8, .kernel_blocks = 2, .num_blocks = 5,
            .num_positions = 3, .num_segments = 2};
  const int64_t h = heads_per_rank(&s), t = s.block_size / s.kernel_blocks, k = K_PIECES, p = PIECES;
  const int64_t kernel_block = LAYERS * h * t * p;
  s.segments[0] = (segment_place){0, 0, h * t * p, 2 * kernel_block, kernel_block, t * p, k, 0, K_PIECES};
  s.segments[1] = (segment_place){0, t * k, h * t * p, 2 * kernel_block, kernel_block, t * p, V_PIECES, K_PIECES,
                                  V_PIECES};
  return s;
}

/* A host worker for `rank` of side `s`: its buffers, group 0, one
 * kvcs_layer per layer with identity `names[layer]`. */
/* The algorithm of the workers make_worker creates; 0 leaves the default
 * (KVCS_ALGORITHM_MIXED2). */
static uint32_t worker_algorithm;

static kvcs_worker *make_worker(const side *s, uint32_t rank, uint32_t detail, const char *const names[LAYERS]) {
  kvcs_worker_options options = {
      .tp_rank = rank, .tp_size = s->tp_size, .pp_rank = 0, .device = KVCS_HOST, .num_threads = 1};
  kvcs_worker *worker = NULL;
  EXPECT_OK(kvcs_worker_create(&options, &worker));
  for (int b = 0; b < 2; b++) {
    if (s->buffers[rank][b] != NULL) {
      EXPECT_OK(kvcs_worker_add_region(worker, (uint64_t)(uintptr_t)s->buffers[rank][b],
                                       (uint64_t)s->buffer_pieces[b] * 8));
    }
  }
  EXPECT_OK(kvcs_worker_add_group(worker, GROUP, s->block_size));
  for (uint32_t layer = 0; layer < LAYERS; layer++) {
    kvcs_segment segments[2];
    for (uint32_t i = 0; i < s->num_segments; i++) {
      const segment_place *seg = &s->segments[i];
      segments[i] = (kvcs_segment){
          .address = (uint64_t)(uintptr_t)(s->buffers[rank][seg->buffer] + seg->offset + layer * seg->layer),
          .block_stride = 8 * seg->block,
          .kernel_block_stride = 8 * seg->kernel_block,
          .head_stride = 8 * seg->head,
          .token_stride = 8 * seg->token,
          .bytes_per_token = 8 * seg->pieces,
      };
    }
    kvcs_layer desc = {
        .group_id = GROUP,
        .layer_number = layer_numbers[layer],
        .first_head = first_head_of(s, rank),
        .num_heads = heads_per_rank(s),
        .replicas = replicas_of(s),
        .replica_index = rank % replicas_of(s),
        .num_blocks = s->num_blocks,
        .kernel_blocks = s->kernel_blocks,
        .tokens_per_kernel_block = s->block_size / s->kernel_blocks,
        .num_segments = s->num_segments,
        .segments = segments,
        .identity = (const uint8_t *)names[layer],
        .identity_len = strlen(names[layer]),
    };
    EXPECT_OK(kvcs_worker_add_layer(worker, &desc));
  }
  if (detail) {
    EXPECT_OK(kvcs_worker_set_detail(worker, 1));
  }
  if (worker_algorithm != 0) {
    EXPECT_OK(kvcs_worker_set_algorithm(worker, worker_algorithm));
  }
  return worker;
}

/* ------------------------------------------------------------------------
 * Records, payloads, reports
 * --------------------------------------------------------------------- */

/* One worker's record of `result` (malloc'd, length in *len), through a
 * size query, a buffer one byte short, then the real call. */
static uint8_t *encode_record(const kvcs_result *result, size_t *len) {
  size_t needed = SIZE_MAX;
  EXPECT(kvcs_result_encode(result, NULL, 0, &needed), KVCS_ERR_BUFFER_TOO_SMALL, "bytes needed");
  CHECK(needed > 16 && needed != SIZE_MAX);
  uint8_t *record = malloc(needed);
  CHECK(record != NULL);
  memset(record, 0xa5, needed);
  size_t short_len = 0;
  EXPECT(kvcs_result_encode(result, record, needed - 1, &short_len), KVCS_ERR_BUFFER_TOO_SMALL, "cap");
  CHECK(short_len == needed && record[0] == 0xa5 && record[needed - 2] == 0xa5);
  EXPECT_OK(kvcs_result_encode(result, record, needed, len));
  CHECK(*len == needed);
  return record;
}

/* Every rank's record of side `s` checksumming `blocks` in `role`. */
typedef struct {
  uint32_t count;
  uint8_t *bytes[MAX_RANKS];
  size_t lens[MAX_RANKS];
} records;

static records side_records(const side *s, const kvcs_blocks *blocks, kvcs_role role, uint32_t detail,
                            const char *const names[LAYERS]) {
  records r = {.count = s->tp_size};
  for (uint32_t rank = 0; rank < s->tp_size; rank++) {
    kvcs_worker *worker = make_worker(s, rank, detail, names);
    kvcs_result *result = NULL;
    EXPECT_OK(kvcs_worker_checksum(worker, blocks, role, NULL, &result));
    r.bytes[rank] = encode_record(result, &r.lens[rank]);
    kvcs_result_destroy(result);
    kvcs_worker_destroy(worker);
  }
  return r;
}

static records plain_records(const side *s, kvcs_role role) {
  return side_records(s, s->blocks, role, 0, identities);
}

static void free_records(records *r) {
  for (uint32_t rank = 0; rank < r->count; rank++) {
    free(r->bytes[rank]);
  }
}

/* Adds every record but `missing_rank`'s (-1: none). */
static void add_records(kvcs_verifier *verifier, const records *r, int missing_rank) {
  for (uint32_t rank = 0; rank < r->count; rank++) {
    if ((int)rank != missing_rank) {
      EXPECT_OK(kvcs_verifier_add_record(verifier, r->bytes[rank], r->lens[rank]));
    }
  }
}

/* A verifier of side `s` expecting its request in `role`. */
static kvcs_verifier *make_verifier(const side *s, kvcs_role role) {
  kvcs_verifier *verifier = NULL;
  EXPECT_OK(kvcs_verifier_create(s->tp_size, &verifier));
  EXPECT_OK(kvcs_verifier_expect(verifier, s->blocks, role));
  return verifier;
}

/* The payload of REQ_ID (malloc'd), through a size query, a buffer one byte
 * short, then the real call. */
static uint8_t *payload_of(kvcs_verifier *verifier, size_t *len) {
  size_t needed = SIZE_MAX;
  EXPECT(kvcs_verifier_payload(verifier, REQ_ID, NULL, 0, &needed), KVCS_ERR_BUFFER_TOO_SMALL, "bytes needed");
  CHECK(needed > 8 && needed != SIZE_MAX);
  uint8_t *payload = malloc(needed);
  CHECK(payload != NULL);
  memset(payload, 0x5a, needed);
  size_t short_len = 0;
  EXPECT(kvcs_verifier_payload(verifier, REQ_ID, payload, needed - 1, &short_len), KVCS_ERR_BUFFER_TOO_SMALL,
         "cap");
  CHECK(short_len == needed && payload[0] == 0x5a);
  EXPECT_OK(kvcs_verifier_payload(verifier, REQ_ID, payload, needed, len));
  CHECK(*len == needed);
  return payload;
}

/* The producer's payload: its workers' records through a producer verifier. */
static uint8_t *produce(const side *producer, uint32_t detail, uint32_t extension, size_t *len) {
  records r = side_records(producer, producer->blocks, KVCS_ROLE_PRODUCER, detail, identities);
  kvcs_verifier *verifier = make_verifier(producer, KVCS_ROLE_PRODUCER);
  EXPECT_OK(kvcs_verifier_set_extension(verifier, extension));
  add_records(verifier, &r, -1);
  uint8_t *payload = payload_of(verifier, len);
  kvcs_verifier_destroy(verifier);
  free_records(&r);
  return payload;
}

/* The payload as base64 text (malloc'd, NUL-terminated). */
static char *base64_of(const uint8_t *bytes, size_t len) {
  size_t needed = 0;
  EXPECT(kvcs_base64_encode(bytes, len, NULL, 0, &needed), KVCS_ERR_BUFFER_TOO_SMALL, "bytes needed");
  CHECK(needed == (len + 2) / 3 * 4 + 1);
  char *text = malloc(needed);
  CHECK(text != NULL);
  size_t text_len = 0;
  EXPECT_OK(kvcs_base64_encode(bytes, len, text, needed, &text_len));
  CHECK(text_len == needed && strlen(text) == needed - 1);
  return text;
}

/* Records that a report has this verdict, first reason and passed flag;
 * prints the report's message when the verdict or reason differs. */
static void expect_report(const kvcs_report *report, uint32_t verdict, uint32_t reason, uint32_t passed,
                          const char *file, int line) {
  uint32_t got_verdict = 99, got_reason = 99, got_passed = 99;
  const char *message = NULL;
  check_status(kvcs_report_verdict(report, &got_verdict), KVCS_OK, NULL, file, line, "kvcs_report_verdict");
  check_status(kvcs_report_reason(report, &got_reason), KVCS_OK, NULL, file, line, "kvcs_report_reason");
  check_status(kvcs_report_passed(report, &got_passed), KVCS_OK, NULL, file, line, "kvcs_report_passed");
  check_status(kvcs_report_message(report, &message), KVCS_OK, NULL, file, line, "kvcs_report_message");
  int ok = got_verdict == verdict && got_reason == reason;
  check_record(ok, file, line, "the report's verdict and reason");
  check_record(got_passed == passed, file, line, "the report's passed flag");
  check_record(message != NULL && strstr(message, REQ_ID) != NULL, file, line, "the message names the request");
  if (!ok) {
    fprintf(stderr, "  expected %s (%s), got %s (%s): %s\n", kvcs_verdict_name(verdict),
            kvcs_unverified_reason_name(reason), kvcs_verdict_name(got_verdict),
            kvcs_unverified_reason_name(got_reason), message ? message : "(no message)");
  }
}
#define EXPECT_REPORT(report, verdict, reason, passed) \
  expect_report(report, verdict, reason, passed, __FILE__, __LINE__)

/* Whether the report's message contains `needle`. */
static int message_has(const kvcs_report *report, const char *needle) {
  const char *message = NULL;
  if (kvcs_report_message(report, &message) != KVCS_OK || message == NULL) {
    return 0;
  }
  if (strstr(message, needle) == NULL) {
    fprintf(stderr, "  message \"%s\" lacks \"%s\"\n", message, needle);
    return 0;
  }
  return 1;
}

/* Whether the report's only finding is `reason` about `group_id`, with a
 * message containing `needle`. */
static int only_finding(const kvcs_report *report, uint32_t reason, uint32_t group_id, const char *needle) {
  size_t count = 0;
  uint32_t got_reason = 99, got_group = 99;
  const char *message = NULL;
  if (kvcs_report_num_unverified(report, &count) != KVCS_OK || count != 1 ||
      kvcs_report_unverified(report, 0, &got_reason, &got_group, &message) != KVCS_OK) {
    fprintf(stderr, "  %zu findings\n", count);
    return 0;
  }
  int ok = got_reason == reason && got_group == group_id && message != NULL && strstr(message, needle) != NULL;
  if (!ok) {
    fprintf(stderr, "  finding %s (group %" PRIu32 "): \"%s\"; expected %s (group %" PRIu32 ") with \"%s\"\n",
            kvcs_unverified_reason_name(got_reason), got_group, message ? message : "",
            kvcs_unverified_reason_name(reason), group_id, needle);
  }
  return ok;
}

static uint64_t compared_positions(const kvcs_report *report) {
  uint64_t positions = UINT64_MAX;
  EXPECT_OK(kvcs_report_compared_positions(report, &positions));
  return positions;
}

static size_t num_mismatches(const kvcs_report *report) {
  size_t count = SIZE_MAX;
  EXPECT_OK(kvcs_report_num_mismatches(report, &count));
  return count;
}

/* Judges `payload` against every record but `missing_rank`'s in a fresh
 * consumer verifier of `s`; `producer_block_size` 0 leaves it unset. */
static kvcs_report *judge(const side *s, const records *r, int missing_rank, uint32_t producer_block_size,
                          const uint8_t *payload, size_t len) {
  kvcs_verifier *verifier = make_verifier(s, KVCS_ROLE_CONSUMER);
  if (producer_block_size != 0) {
    EXPECT_OK(kvcs_verifier_set_producer_block_size(verifier, GROUP, producer_block_size));
  }
  add_records(verifier, r, missing_rank);
  kvcs_report *report = NULL;
  EXPECT_OK(kvcs_verifier_check(verifier, REQ_ID, payload, len, &report));
  CHECK(report != NULL);
  kvcs_verifier_destroy(verifier);
  return report;
}

/* ------------------------------------------------------------------------
 * The tests
 * --------------------------------------------------------------------- */

static void test_names(void) {
  static const char *const verdicts[] = {"KVCS_VERDICT_MATCH", "KVCS_VERDICT_MISMATCH", "KVCS_VERDICT_UNVERIFIED"};
  for (uint32_t v = 0; v < 3; v++) {
    CHECK(strcmp(kvcs_verdict_name(v), verdicts[v]) == 0);
  }
  CHECK(KVCS_VERDICT_MATCH == 0 && KVCS_VERDICT_MISMATCH == 1 && KVCS_VERDICT_UNVERIFIED == 2);
  CHECK(strcmp(kvcs_verdict_name(3), "unknown kvcs_verdict") == 0);
  CHECK(strcmp(kvcs_verdict_name(UINT32_MAX), "unknown kvcs_verdict") == 0);
  static const char *const reasons[] = {
      "KVCS_UNVERIFIED_NONE",           "KVCS_UNVERIFIED_NO_CHECKSUMS",        "KVCS_UNVERIFIED_INVALID_CHECKSUMS",
      "KVCS_UNVERIFIED_WORKERS_MISSING", "KVCS_UNVERIFIED_OTHER_BLOCKS",       "KVCS_UNVERIFIED_ONE_SIDED_GROUP",
      "KVCS_UNVERIFIED_FINGERPRINT_DIFFERS", "KVCS_UNVERIFIED_NO_COMMON_POSITION", "KVCS_UNVERIFIED_REPLICA_MISSING",
      "KVCS_UNVERIFIED_STATE_TP_DIFFERS", "KVCS_UNVERIFIED_ROLE_DIFFERS",  "KVCS_UNVERIFIED_UNCOMPARED_POSITIONS",
      "KVCS_UNVERIFIED_NOT_LOAD_CHECK", "KVCS_UNVERIFIED_ALGORITHM_DIFFERS",
  };
  for (uint32_t r = 0; r < sizeof reasons / sizeof reasons[0]; r++) {
    CHECK(strcmp(kvcs_unverified_reason_name(r), reasons[r]) == 0);
  }
  CHECK(KVCS_UNVERIFIED_WORKERS_MISSING == 3 && KVCS_UNVERIFIED_STATE_TP_DIFFERS == 9);
  CHECK(KVCS_UNVERIFIED_UNCOMPARED_POSITIONS == 11 && KVCS_UNVERIFIED_NOT_LOAD_CHECK == 12);
  CHECK(KVCS_UNVERIFIED_ALGORITHM_DIFFERS == 13);
  CHECK(strcmp(kvcs_unverified_reason_name(16), "KVCS_UNVERIFIED_COVERAGE_DIFFERS") == 0);
  CHECK(strcmp(kvcs_unverified_reason_name(17), "KVCS_UNVERIFIED_DECODING_DIFFERS") == 0);
  CHECK(strcmp(kvcs_unverified_reason_name(18), "KVCS_UNVERIFIED_GEOMETRY_DIFFERS") == 0);
  CHECK(KVCS_UNVERIFIED_GEOMETRY_DIFFERS == 18);
  CHECK(strcmp(kvcs_unverified_reason_name(19), "unknown kvcs_unverified_reason") == 0);
  CHECK(strcmp(kvcs_unverified_reason_name(UINT32_MAX), "unknown kvcs_unverified_reason") == 0);
}

/* RFC 4648 test vectors, random round trips and malformed text. */
static void test_base64(void) {
  static const char *const vectors[][2] = {
      {"", ""},         {"f", "Zg=="},         {"fo", "Zm8="},         {"foo", "Zm9v"},
      {"foob", "Zm9vYg=="}, {"fooba", "Zm9vYmE="}, {"foobar", "Zm9vYmFy"},
  };
  for (size_t i = 0; i < sizeof vectors / sizeof vectors[0]; i++) {
    const uint8_t *bytes = (const uint8_t *)vectors[i][0];
    const size_t len = strlen(vectors[i][0]), text_len = strlen(vectors[i][1]);
    char text[16];
    size_t needed = 0;
    EXPECT(kvcs_base64_encode(bytes, len, NULL, 0, &needed), KVCS_ERR_BUFFER_TOO_SMALL, "bytes needed");
    CHECK(needed == text_len + 1); /* the NUL counts */
    EXPECT_OK(kvcs_base64_encode(bytes, len, text, sizeof text, &needed));
    CHECK(needed == text_len + 1 && strcmp(text, vectors[i][1]) == 0);
    uint8_t decoded[16];
    size_t decoded_len = SIZE_MAX;
    if (len == 0) {
      EXPECT_OK(kvcs_base64_decode(vectors[i][1], 0, NULL, 0, &decoded_len)); /* (NULL, 0) holds 0 bytes */
      CHECK(decoded_len == 0);
    } else {
      EXPECT(kvcs_base64_decode(vectors[i][1], text_len, NULL, 0, &decoded_len), KVCS_ERR_BUFFER_TOO_SMALL,
             "bytes needed");
      CHECK(decoded_len == len);
    }
    EXPECT_OK(kvcs_base64_decode(vectors[i][1], text_len, decoded, sizeof decoded, &decoded_len));
    CHECK(decoded_len == len && memcmp(decoded, bytes, len) == 0);
  }
  /* The standard alphabet ('+' and '/'), not the URL-safe one. */
  const uint8_t high[] = {0xfb, 0xff, 0xbf};
  char text[8];
  size_t text_len = 0;
  EXPECT_OK(kvcs_base64_encode(high, sizeof high, text, sizeof text, &text_len));
  CHECK(strcmp(text, "+/+/") == 0);
  /* (NULL, 0) is the empty input. */
  EXPECT_OK(kvcs_base64_encode(NULL, 0, text, sizeof text, &text_len));
  CHECK(text_len == 1 && text[0] == '\0');

  for (size_t len = 0; len <= 40; len++) {
    uint8_t bytes[40], decoded[40];
    for (size_t i = 0; i < len; i++) {
      bytes[i] = (uint8_t)(next_random() >> 56);
    }
    char round[64];
    EXPECT_OK(kvcs_base64_encode(bytes, len, round, sizeof round, &text_len));
    CHECK(text_len == (len + 2) / 3 * 4 + 1 && strspn(round, "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"
                                                               "0123456789+/=") == text_len - 1);
    size_t decoded_len = 0;
    EXPECT_OK(kvcs_base64_decode(round, text_len - 1, decoded, sizeof decoded, &decoded_len));
    CHECK(decoded_len == len && memcmp(decoded, bytes, len) == 0);
  }

  /* Errors: NULL arrays and out-pointers, short buffers (left untouched). */
  const uint8_t three[] = {1, 2, 3};
  size_t len = 77;
  EXPECT(kvcs_base64_encode(NULL, 3, text, sizeof text, &len), KVCS_ERR_INVALID_ARGUMENT,
         "bytes is NULL with length 3");
  EXPECT(kvcs_base64_encode(three, 3, text, sizeof text, NULL), KVCS_ERR_INVALID_ARGUMENT, "text_len is NULL");
  EXPECT(kvcs_base64_encode(three, 3, NULL, 8, &len), KVCS_ERR_INVALID_ARGUMENT, "buf is NULL with cap 8");
  CHECK(len == 77);
  memset(text, '#', sizeof text);
  EXPECT(kvcs_base64_encode(three, 3, text, 4, &len), KVCS_ERR_BUFFER_TOO_SMALL, "cap 4 is below the 5 bytes");
  CHECK(len == 5 && text[0] == '#' && text[3] == '#');
  uint8_t out[8] = {0};
  len = 77;
  EXPECT(kvcs_base64_decode(NULL, 4, out, sizeof out, &len), KVCS_ERR_INVALID_ARGUMENT, "text is NULL with length 4");
  EXPECT(kvcs_base64_decode("Zm9v", 4, out, sizeof out, NULL), KVCS_ERR_INVALID_ARGUMENT, "len is NULL");
  EXPECT(kvcs_base64_decode("Zm9v", 4, NULL, 4, &len), KVCS_ERR_INVALID_ARGUMENT, "buf is NULL with cap 4");
  CHECK(len == 77);
  EXPECT(kvcs_base64_decode("Zm9v", 4, out, 2, &len), KVCS_ERR_BUFFER_TOO_SMALL, "cap 2 is below the 3 bytes");
  CHECK(len == 3 && out[0] == 0);
  /* Not standard padded base64: missing or extra padding, a cut, whitespace,
   * the URL-safe alphabet, characters outside any alphabet. */
  static const char *const malformed[] = {"Zg", "Zg=", "Zm9", "Zm9v====", "Zm9v\n", "Zm 9v", "-_-_", "Zm9v!A==", "="};
  for (size_t i = 0; i < sizeof malformed / sizeof malformed[0]; i++) {
    len = 77;
    EXPECT(kvcs_base64_decode(malformed[i], strlen(malformed[i]), out, sizeof out, &len), KVCS_ERR_MALFORMED,
           "base64");
    CHECK(len == 77);
  }
  /* text_len, not a NUL, ends the text: 3 of "Zm9v" is a cut. */
  EXPECT(kvcs_base64_decode("Zm9v", 3, out, sizeof out, &len), KVCS_ERR_MALFORMED, "base64");
}

/* kvcs_result_encode and kvcs_worker_set_detail errors; malformed records
 * to kvcs_verifier_add_record, after which the verifier is unchanged. */
static void test_record_errors(const side *producer) {
  kvcs_worker *worker = make_worker(producer, 0, 0, identities);
  EXPECT(kvcs_worker_set_detail(NULL, 1), KVCS_ERR_INVALID_ARGUMENT, "worker is NULL");
  EXPECT(kvcs_worker_set_detail(worker, 2), KVCS_ERR_INVALID_ARGUMENT, "on 2 is neither 0 nor 1");
  EXPECT(kvcs_worker_set_detail(worker, UINT32_MAX), KVCS_ERR_INVALID_ARGUMENT, "on 4294967295");
  EXPECT_OK(kvcs_worker_set_detail(worker, 1));
  EXPECT_OK(kvcs_worker_set_detail(worker, 0));
  kvcs_result *result = NULL;
  EXPECT_OK(kvcs_worker_checksum(worker, producer->blocks, KVCS_ROLE_PRODUCER, NULL, &result));
  uint8_t buf[8];
  size_t len = 77;
  EXPECT(kvcs_result_encode(NULL, buf, sizeof buf, &len), KVCS_ERR_INVALID_ARGUMENT, "result is NULL");
  EXPECT(kvcs_result_encode(result, buf, sizeof buf, NULL), KVCS_ERR_INVALID_ARGUMENT, "len is NULL");
  EXPECT(kvcs_result_encode(result, NULL, 8, &len), KVCS_ERR_INVALID_ARGUMENT, "buf is NULL with cap 8");
  CHECK(len == 77);
  size_t record_len = 0;
  uint8_t *record = encode_record(result, &record_len);
  kvcs_result_destroy(result);
  kvcs_worker_destroy(worker);

  /* The record is ["kvcsum.record", 7, ...]: a fixarray of 8, a 13-byte
   * fixstr, then the version at byte 15. */
  CHECK(record[0] == 0x98 && record[1] == 0xad && memcmp(record + 2, "kvcsum.record", 13) == 0 &&
        record[15] == KVCS_RECORD_VERSION && KVCS_RECORD_VERSION == 0x07);

  kvcs_verifier *verifier = make_verifier(producer, KVCS_ROLE_PRODUCER);
  EXPECT(kvcs_verifier_add_record(NULL, record, record_len), KVCS_ERR_INVALID_ARGUMENT, "verifier is NULL");
  EXPECT(kvcs_verifier_add_record(verifier, NULL, 5), KVCS_ERR_INVALID_ARGUMENT, "record is NULL with length 5");
  EXPECT(kvcs_verifier_add_record(verifier, NULL, 0), KVCS_ERR_MALFORMED, "truncated");
  /* Every proper prefix is truncated. */
  int prefixes_rejected = 1;
  for (size_t cut = 1; cut < record_len; cut++) {
    if (kvcs_verifier_add_record(verifier, record, cut) != KVCS_ERR_MALFORMED ||
        strstr(kvcs_last_error(), "truncated") == NULL) {
      fprintf(stderr, "  record prefix of %zu bytes: %s\n", cut, kvcs_last_error());
      prefixes_rejected = 0;
    }
  }
  CHECK(prefixes_rejected);
  uint8_t *changed = malloc(record_len + 1);
  CHECK(changed != NULL);
  memcpy(changed, record, record_len);
  changed[record_len] = 0x00;
  EXPECT(kvcs_verifier_add_record(verifier, changed, record_len + 1), KVCS_ERR_MALFORMED, "1 trailing bytes");
  changed[15] = 0x08;
  EXPECT(kvcs_verifier_add_record(verifier, changed, record_len), KVCS_ERR_MALFORMED, "version 8 is not supported");
  changed[15] = 0x03;
  EXPECT(kvcs_verifier_add_record(verifier, changed, record_len), KVCS_ERR_MALFORMED, "version 3 is not supported");
  changed[15] = 0x01;
  EXPECT(kvcs_verifier_add_record(verifier, changed, record_len), KVCS_ERR_MALFORMED, "version 1 is not supported");
  changed[15] = 0x02;
  EXPECT(kvcs_verifier_add_record(verifier, changed, record_len), KVCS_ERR_MALFORMED, "version 2 is not supported");
  changed[15] = KVCS_RECORD_VERSION;
  changed[2] = 'K';
  EXPECT(kvcs_verifier_add_record(verifier, changed, record_len), KVCS_ERR_MALFORMED, "not a kvcsum record");
  for (size_t i = 0; i < record_len; i++) {
    changed[i] = (uint8_t)next_random();
  }
  EXPECT(kvcs_verifier_add_record(verifier, changed, record_len), KVCS_ERR_MALFORMED, "record");
  free(changed);

  /* A rank that does not fit: a TP=2 record for 3 workers. */
  kvcs_verifier *three = NULL;
  EXPECT_OK(kvcs_verifier_create(3, &three));
  EXPECT(kvcs_verifier_add_record(three, record, record_len), KVCS_ERR_INVALID_ARGUMENT,
         "tp_size 2 does not fit num_workers 3");
  kvcs_verifier_destroy(three);

  /* Nothing of the failed calls was kept: one record of two is still one. */
  EXPECT_OK(kvcs_verifier_add_record(verifier, record, record_len));
  EXPECT_OK(kvcs_verifier_add_record(verifier, record, record_len)); /* the same worker again replaces it */
  size_t payload_len = 77;
  EXPECT(kvcs_verifier_payload(verifier, REQ_ID, NULL, 0, &payload_len), KVCS_ERR_NOT_READY,
         "1 of 2 workers reported; missing (pp_rank 0, tp_rank 1)");
  CHECK(payload_len == 77);
  kvcs_verifier_destroy(verifier);
  free(record);
}

/* Every verifier call's NULL, enum and lookup errors. */
static void test_verifier_errors(const side *producer, const side *consumer) {
  kvcs_verifier *verifier = SENTINEL;
  EXPECT(kvcs_verifier_create(2, NULL), KVCS_ERR_INVALID_ARGUMENT, "out is NULL");
  EXPECT(kvcs_verifier_create(0, &verifier), KVCS_ERR_INVALID_ARGUMENT, "num_workers is 0");
  CHECK(verifier == SENTINEL);
  EXPECT_OK(kvcs_verifier_create(2, &verifier));
  CHECK(verifier != SENTINEL && verifier != NULL);

  EXPECT(kvcs_verifier_set_policy(NULL, KVCS_POLICY_FAIL_OPEN), KVCS_ERR_INVALID_ARGUMENT, "verifier is NULL");
  EXPECT(kvcs_verifier_set_policy(verifier, 2), KVCS_ERR_INVALID_ARGUMENT, "policy 2");
  EXPECT(kvcs_verifier_set_policy(verifier, UINT32_MAX), KVCS_ERR_INVALID_ARGUMENT, "policy 4294967295");
  EXPECT_OK(kvcs_verifier_set_policy(verifier, KVCS_POLICY_FAIL_OPEN));
  EXPECT_OK(kvcs_verifier_set_policy(verifier, KVCS_POLICY_FAIL_CLOSED));
  EXPECT(kvcs_verifier_set_extension(NULL, 1), KVCS_ERR_INVALID_ARGUMENT, "verifier is NULL");
  EXPECT(kvcs_verifier_set_extension(verifier, 2), KVCS_ERR_INVALID_ARGUMENT, "on 2 is neither 0 nor 1");
  EXPECT(kvcs_verifier_set_producer_tp_size(NULL, 2), KVCS_ERR_INVALID_ARGUMENT, "verifier is NULL");
  EXPECT(kvcs_verifier_set_producer_tp_size(verifier, 0), KVCS_ERR_INVALID_ARGUMENT, "tp_size is 0");
  EXPECT_OK(kvcs_verifier_set_producer_tp_size(verifier, 2));
  EXPECT(kvcs_verifier_set_producer_block_size(NULL, GROUP, 4), KVCS_ERR_INVALID_ARGUMENT, "verifier is NULL");
  EXPECT(kvcs_verifier_set_producer_block_size(verifier, 7, 0), KVCS_ERR_INVALID_ARGUMENT,
         "block_size is 0 (group_id 7)");
  EXPECT(kvcs_verifier_expect(NULL, producer->blocks, KVCS_ROLE_PRODUCER), KVCS_ERR_INVALID_ARGUMENT,
         "verifier is NULL");
  EXPECT(kvcs_verifier_expect(verifier, NULL, KVCS_ROLE_PRODUCER), KVCS_ERR_INVALID_ARGUMENT, "scheduled is NULL");
  EXPECT(kvcs_verifier_expect(verifier, producer->blocks, 2), KVCS_ERR_INVALID_ARGUMENT, "role 2");

  /* Not expected yet: every request lookup fails. */
  kvcs_report *report = SENTINEL;
  size_t len = 77;
  EXPECT(kvcs_verifier_payload(verifier, REQ_ID, NULL, 0, &len), KVCS_ERR_NOT_FOUND, "req_id \"req-a\"");
  EXPECT(kvcs_verifier_forget(verifier, REQ_ID), KVCS_ERR_NOT_FOUND, "req_id \"req-a\" is not expected");
  EXPECT(kvcs_verifier_check(verifier, "nope", (const uint8_t *)"x", 1, &report), KVCS_ERR_NOT_FOUND,
         "req_id \"nope\"");
  EXPECT(kvcs_verifier_check_base64(verifier, "nope", "eA==", &report), KVCS_ERR_NOT_FOUND, "req_id \"nope\"");
  EXPECT(kvcs_verifier_check_no_payload(verifier, "nope", &report), KVCS_ERR_NOT_FOUND, "req_id \"nope\"");
  CHECK(report == SENTINEL && len == 77);

  /* A record of a request not expected is ignored, not kept for later. */
  records r = plain_records(producer, KVCS_ROLE_PRODUCER);
  add_records(verifier, &r, -1);
  EXPECT_OK(kvcs_verifier_expect(verifier, producer->blocks, KVCS_ROLE_PRODUCER));
  EXPECT(kvcs_verifier_payload(verifier, REQ_ID, NULL, 0, &len), KVCS_ERR_NOT_READY, "0 of 2 workers reported");

  EXPECT(kvcs_verifier_payload(NULL, REQ_ID, NULL, 0, &len), KVCS_ERR_INVALID_ARGUMENT, "verifier is NULL");
  EXPECT(kvcs_verifier_payload(verifier, NULL, NULL, 0, &len), KVCS_ERR_INVALID_ARGUMENT, "req_id is NULL");
  EXPECT(kvcs_verifier_payload(verifier, "\xff", NULL, 0, &len), KVCS_ERR_INVALID_ARGUMENT, "req_id is not UTF-8");
  EXPECT(kvcs_verifier_payload(verifier, REQ_ID, NULL, 0, NULL), KVCS_ERR_INVALID_ARGUMENT, "len is NULL");
  add_records(verifier, &r, -1);
  uint8_t small[4] = {0};
  EXPECT(kvcs_verifier_payload(verifier, REQ_ID, NULL, 4, &len), KVCS_ERR_INVALID_ARGUMENT, "buf is NULL with cap 4");
  CHECK(len == 77);
  EXPECT(kvcs_verifier_payload(verifier, REQ_ID, small, sizeof small, &len), KVCS_ERR_BUFFER_TOO_SMALL,
         "cap 4 is below");
  CHECK(len > sizeof small && small[0] == 0);
  /* A producer's request is not checked, and a consumer's has no payload. */
  EXPECT(kvcs_verifier_check(verifier, REQ_ID, small, sizeof small, &report), KVCS_ERR_INVALID_ARGUMENT,
         "expected as a producer");
  EXPECT(kvcs_verifier_check_no_payload(verifier, REQ_ID, &report), KVCS_ERR_INVALID_ARGUMENT,
         "expected as a producer");
  CHECK(report == SENTINEL);

  /* Expecting a request again starts it over; forgetting drops it. */
  EXPECT_OK(kvcs_verifier_expect(verifier, producer->blocks, KVCS_ROLE_PRODUCER));
  EXPECT(kvcs_verifier_payload(verifier, REQ_ID, NULL, 0, &len), KVCS_ERR_NOT_READY, "0 of 2 workers reported");
  EXPECT(kvcs_verifier_forget(NULL, REQ_ID), KVCS_ERR_INVALID_ARGUMENT, "verifier is NULL");
  EXPECT(kvcs_verifier_forget(verifier, NULL), KVCS_ERR_INVALID_ARGUMENT, "req_id is NULL");
  EXPECT_OK(kvcs_verifier_forget(verifier, REQ_ID));
  EXPECT(kvcs_verifier_forget(verifier, REQ_ID), KVCS_ERR_NOT_FOUND, "req_id \"req-a\" is not expected");
  EXPECT(kvcs_verifier_payload(verifier, REQ_ID, NULL, 0, &len), KVCS_ERR_NOT_FOUND, "req_id \"req-a\"");

  /* The consumer's side of the calls. */
  EXPECT_OK(kvcs_verifier_expect(verifier, consumer->blocks, KVCS_ROLE_CONSUMER));
  EXPECT(kvcs_verifier_payload(verifier, REQ_ID, NULL, 0, &len), KVCS_ERR_INVALID_ARGUMENT, "expected as a consumer");
  const uint8_t byte = 0x90;
  EXPECT(kvcs_verifier_check(NULL, REQ_ID, &byte, 1, &report), KVCS_ERR_INVALID_ARGUMENT, "verifier is NULL");
  EXPECT(kvcs_verifier_check(verifier, NULL, &byte, 1, &report), KVCS_ERR_INVALID_ARGUMENT, "req_id is NULL");
  EXPECT(kvcs_verifier_check(verifier, REQ_ID, NULL, 5, &report), KVCS_ERR_INVALID_ARGUMENT,
         "payload is NULL with length 5");
  EXPECT(kvcs_verifier_check(verifier, REQ_ID, &byte, 1, NULL), KVCS_ERR_INVALID_ARGUMENT, "out is NULL");
  EXPECT(kvcs_verifier_check_base64(NULL, REQ_ID, "kA==", &report), KVCS_ERR_INVALID_ARGUMENT, "verifier is NULL");
  EXPECT(kvcs_verifier_check_base64(verifier, NULL, "kA==", &report), KVCS_ERR_INVALID_ARGUMENT, "req_id is NULL");
  EXPECT(kvcs_verifier_check_base64(verifier, REQ_ID, NULL, &report), KVCS_ERR_INVALID_ARGUMENT,
         "payload_base64 is NULL");
  EXPECT(kvcs_verifier_check_base64(verifier, REQ_ID, "kA==", NULL), KVCS_ERR_INVALID_ARGUMENT, "out is NULL");
  EXPECT(kvcs_verifier_check_no_payload(NULL, REQ_ID, &report), KVCS_ERR_INVALID_ARGUMENT, "verifier is NULL");
  EXPECT(kvcs_verifier_check_no_payload(verifier, NULL, &report), KVCS_ERR_INVALID_ARGUMENT, "req_id is NULL");
  EXPECT(kvcs_verifier_check_no_payload(verifier, REQ_ID, NULL), KVCS_ERR_INVALID_ARGUMENT, "out is NULL");
  CHECK(report == SENTINEL);
  /* A record of another TP size than earlier records' (the producer's 2). */
  records b = plain_records(consumer, KVCS_ROLE_CONSUMER);
  kvcs_verifier *four = NULL;
  EXPECT_OK(kvcs_verifier_create(4, &four));
  EXPECT_OK(kvcs_verifier_expect(four, producer->blocks, KVCS_ROLE_PRODUCER));
  EXPECT_OK(kvcs_verifier_add_record(four, r.bytes[0], r.lens[0]));
  EXPECT(kvcs_verifier_add_record(four, b.bytes[0], b.lens[0]), KVCS_ERR_INVALID_ARGUMENT,
         "tp_size 4 differs from tp_size 2");
  kvcs_verifier_destroy(four);
  free_records(&b);
  free_records(&r);

  kvcs_verifier_destroy(verifier);
  kvcs_verifier_destroy(NULL);
  CHECK(1); /* destroying NULL returned */
}

/* Every report accessor's NULL and index errors, out-parameters untouched. */
static void test_report_errors(const kvcs_report *report) {
  uint32_t value = 77;
  uint64_t positions = 77;
  size_t count = 77;
  const char *message = SENTINEL;
  kvcs_mismatch mismatch = {.group_id = 77};
  kvcs_layer_difference layer = {.layer_number = 77};
  EXPECT(kvcs_report_verdict(NULL, &value), KVCS_ERR_INVALID_ARGUMENT, "report is NULL");
  EXPECT(kvcs_report_verdict(report, NULL), KVCS_ERR_INVALID_ARGUMENT, "verdict is NULL");
  EXPECT(kvcs_report_passed(NULL, &value), KVCS_ERR_INVALID_ARGUMENT, "report is NULL");
  EXPECT(kvcs_report_passed(report, NULL), KVCS_ERR_INVALID_ARGUMENT, "passed is NULL");
  EXPECT(kvcs_report_reason(NULL, &value), KVCS_ERR_INVALID_ARGUMENT, "report is NULL");
  EXPECT(kvcs_report_reason(report, NULL), KVCS_ERR_INVALID_ARGUMENT, "reason is NULL");
  EXPECT(kvcs_report_message(NULL, &message), KVCS_ERR_INVALID_ARGUMENT, "report is NULL");
  EXPECT(kvcs_report_message(report, NULL), KVCS_ERR_INVALID_ARGUMENT, "message is NULL");
  EXPECT(kvcs_report_compared_positions(NULL, &positions), KVCS_ERR_INVALID_ARGUMENT, "report is NULL");
  EXPECT(kvcs_report_compared_positions(report, NULL), KVCS_ERR_INVALID_ARGUMENT, "positions is NULL");
  EXPECT(kvcs_report_num_uncompared(NULL, &count), KVCS_ERR_INVALID_ARGUMENT, "report is NULL");
  EXPECT(kvcs_report_num_uncompared(report, NULL), KVCS_ERR_INVALID_ARGUMENT, "count is NULL");
  EXPECT(kvcs_report_uncompared(NULL, 0, &value, &positions, &positions), KVCS_ERR_INVALID_ARGUMENT,
         "report is NULL");
  EXPECT(kvcs_report_num_mismatches(NULL, &count), KVCS_ERR_INVALID_ARGUMENT, "report is NULL");
  EXPECT(kvcs_report_num_mismatches(report, NULL), KVCS_ERR_INVALID_ARGUMENT, "count is NULL");
  EXPECT(kvcs_report_num_unverified(NULL, &count), KVCS_ERR_INVALID_ARGUMENT, "report is NULL");
  EXPECT(kvcs_report_num_unverified(report, NULL), KVCS_ERR_INVALID_ARGUMENT, "count is NULL");
  EXPECT(kvcs_report_mismatch(NULL, 0, &mismatch), KVCS_ERR_INVALID_ARGUMENT, "report is NULL");
  EXPECT(kvcs_report_mismatch(report, 0, NULL), KVCS_ERR_INVALID_ARGUMENT, "out is NULL");
  EXPECT(kvcs_report_failed_check(NULL, 0, 0, &value), KVCS_ERR_INVALID_ARGUMENT, "report is NULL");
  EXPECT(kvcs_report_failed_check(report, 0, 0, NULL), KVCS_ERR_INVALID_ARGUMENT, "check is NULL");
  EXPECT(kvcs_report_layer_difference(NULL, 0, 0, &layer), KVCS_ERR_INVALID_ARGUMENT, "report is NULL");
  EXPECT(kvcs_report_layer_difference(report, 0, 0, NULL), KVCS_ERR_INVALID_ARGUMENT, "out is NULL");
  EXPECT(kvcs_report_unverified(NULL, 0, &value, &value, &message), KVCS_ERR_INVALID_ARGUMENT, "report is NULL");

  /* Indexes at the counts. */
  size_t mismatches = num_mismatches(report), findings = SIZE_MAX;
  EXPECT_OK(kvcs_report_num_unverified(report, &findings));
  char needle[64];
  snprintf(needle, sizeof needle, "index %zu is not below %zu", mismatches, mismatches);
  EXPECT(kvcs_report_mismatch(report, mismatches, &mismatch), KVCS_ERR_OUT_OF_BOUNDS, needle);
  EXPECT(kvcs_report_mismatch(report, SIZE_MAX, &mismatch), KVCS_ERR_OUT_OF_BOUNDS, "index");
  snprintf(needle, sizeof needle, "mismatch %zu is not below %zu", mismatches, mismatches);
  EXPECT(kvcs_report_failed_check(report, mismatches, 0, &value), KVCS_ERR_OUT_OF_BOUNDS, needle);
  EXPECT(kvcs_report_layer_difference(report, mismatches, 0, &layer), KVCS_ERR_OUT_OF_BOUNDS, needle);
  if (mismatches > 0) {
    kvcs_mismatch first;
    EXPECT_OK(kvcs_report_mismatch(report, 0, &first));
    snprintf(needle, sizeof needle, "index %zu is not below %zu", first.num_failed_checks, first.num_failed_checks);
    EXPECT(kvcs_report_failed_check(report, 0, first.num_failed_checks, &value), KVCS_ERR_OUT_OF_BOUNDS, needle);
    snprintf(needle, sizeof needle, "index %zu is not below %zu", first.num_layers, first.num_layers);
    EXPECT(kvcs_report_layer_difference(report, 0, first.num_layers, &layer), KVCS_ERR_OUT_OF_BOUNDS, needle);
  }
  size_t ranges = SIZE_MAX;
  EXPECT_OK(kvcs_report_num_uncompared(report, &ranges));
  snprintf(needle, sizeof needle, "index %zu is not below %zu", ranges, ranges);
  EXPECT(kvcs_report_uncompared(report, ranges, &value, &positions, &positions), KVCS_ERR_OUT_OF_BOUNDS, needle);
  EXPECT(kvcs_report_uncompared(report, SIZE_MAX, NULL, NULL, NULL), KVCS_ERR_OUT_OF_BOUNDS, "index");
  snprintf(needle, sizeof needle, "index %zu is not below %zu", findings, findings);
  EXPECT(kvcs_report_unverified(report, findings, &value, &value, &message), KVCS_ERR_OUT_OF_BOUNDS, needle);
  CHECK(value == 77 && positions == 77 && count == 77 && message == SENTINEL && mismatch.group_id == 77 &&
        layer.layer_number == 77);
}

/* Flips every bit of one random byte of the valid KV of `rank` on side `s`
 * (random layer, local head, token, piece); returns the token, the layer in
 * *layer and the byte in *flipped, so that the caller can flip it back. */
static uint32_t flip_random_byte(side *s, uint32_t rank, uint32_t *layer, uint8_t **flipped) {
  *layer = random_below(LAYERS);
  uint32_t head = random_below(heads_per_rank(s));
  uint32_t token = random_below(NUM_TOKENS);
  uint32_t piece = random_below(PIECES);
  *flipped = (uint8_t *)piece_of(s, rank, *layer, head, token, piece) + random_below(8);
  **flipped ^= 0xff;
  return token;
}

/* The end-to-end scenario: the producer's payload, sent as base64, against
 * the consumer's records (TP=4, each head on 2 ranks, 8-token blocks against
 * the producer's 4): a match; a flipped byte in one replica, a mismatch at
 * its position in that replica's check, named down to the layer and head in
 * detail mode; no payload at all, unverified. Each report is read after
 * its verifier is gone (reports are independent of it). */
static void test_end_to_end(side *consumer, const side *producer, const char *text) {
  const uint32_t runs = (NUM_TOKENS + 7) / 8; /* lcm(4, 8) = 8 tokens per compared run */
  records r = plain_records(consumer, KVCS_ROLE_CONSUMER);
  kvcs_verifier *verifier = make_verifier(consumer, KVCS_ROLE_CONSUMER);
  EXPECT_OK(kvcs_verifier_set_producer_block_size(verifier, GROUP, producer->block_size));
  EXPECT_OK(kvcs_verifier_set_producer_tp_size(verifier, producer->tp_size));
  add_records(verifier, &r, -1);
  kvcs_report *report = NULL;
  EXPECT_OK(kvcs_verifier_check_base64(verifier, REQ_ID, text, &report));
  EXPECT_REPORT(report, KVCS_VERDICT_MATCH, KVCS_UNVERIFIED_NONE, 1);
  CHECK(compared_positions(report) == runs && num_mismatches(report) == 0);
  size_t findings = SIZE_MAX;
  EXPECT_OK(kvcs_report_num_unverified(report, &findings));
  CHECK(findings == 0);
  test_report_errors(report);
  kvcs_report_destroy(report);

  /* No payload: unverified (the producer sent none), failed when closed. */
  EXPECT_OK(kvcs_verifier_check_no_payload(verifier, REQ_ID, &report));
  EXPECT_REPORT(report, KVCS_VERDICT_UNVERIFIED, KVCS_UNVERIFIED_NO_CHECKSUMS, 0);
  CHECK(only_finding(report, KVCS_UNVERIFIED_NO_CHECKSUMS, KVCS_WHOLE_LOAD, "no payload"));
  test_report_errors(report);
  kvcs_verifier_destroy(verifier);
  CHECK(message_has(report, "fail-closed")); /* read after the verifier is gone */
  kvcs_report_destroy(report);

  /* A flipped byte in replica 1 of a head, both sides in detail mode with
   * the payload extension: a mismatch at its position, in check 1 only,
   * named down to the layer and head. */
  const int failed_before = checks_failed;
  uint32_t rank = 2 * random_below(KV_HEADS) + 1, layer = 0;
  uint8_t *flipped = NULL;
  uint32_t token = flip_random_byte(consumer, rank, &layer, &flipped);
  size_t detailed_len = 0;
  uint8_t *detailed = produce(producer, 1, 1, &detailed_len);
  records after = side_records(consumer, consumer->blocks, KVCS_ROLE_CONSUMER, 1, identities);
  report = judge(consumer, &after, -1, 0, detailed, detailed_len);
  EXPECT_REPORT(report, KVCS_VERDICT_MISMATCH, KVCS_UNVERIFIED_NONE, 0);
  CHECK(compared_positions(report) == runs && num_mismatches(report) == 1);
  kvcs_mismatch mismatch = {0};
  EXPECT_OK(kvcs_report_mismatch(report, 0, &mismatch));
  uint32_t q = token / 8;
  CHECK(mismatch.group_id == GROUP && mismatch.first_position == q && mismatch.num_positions == 1 &&
        mismatch.first_token == 8 * q && mismatch.num_tokens == (NUM_TOKENS - 8 * q < 8 ? NUM_TOKENS - 8 * q : 8) &&
        mismatch.num_failed_checks == 1 && mismatch.localised == 1 && mismatch.num_layers == 1);
  uint32_t check = 99;
  EXPECT_OK(kvcs_report_failed_check(report, 0, 0, &check));
  CHECK(check == 1);
  kvcs_layer_difference difference = {0};
  EXPECT_OK(kvcs_report_layer_difference(report, 0, 0, &difference));
  CHECK(difference.layer_number == layer_numbers[layer] && difference.first_head == first_head_of(consumer, rank) &&
        difference.num_heads == 1 && difference.check == 1);
  char needle[64];
  snprintf(needle, sizeof needle, "layer %" PRIu32 " heads %" PRIu32 "..%" PRIu32, layer_numbers[layer],
           first_head_of(consumer, rank), first_head_of(consumer, rank) + 1);
  CHECK(message_has(report, needle));
  test_report_errors(report);
  kvcs_report_destroy(report);
  free_records(&after);
  free(detailed);
  *flipped ^= 0xff;
  if (checks_failed != failed_before) {
    fprintf(stderr, "  (flipped rank %" PRIu32 ", layer %" PRIu32 ", token %" PRIu32 ")\n", rank, layer, token);
  }
  free_records(&r);
}

/* Algorithms (docs/SPEC.md sections 9 and 12): a producer of MIXED2 (or
 * MIXED) workers sends the extension even with it off, and the consumer's
 * verdict is UNVERIFIED (KVCS_UNVERIFIED_ALGORITHM_DIFFERS), never a
 * mismatch, whenever the payload's algorithm or one of its workers'
 * differs: MIXED (kvcsum 0.2's default) and MIXED2 (0.3's) included. */
static void test_algorithms(const side *producer, const side *consumer) {
  /* kvcs_worker_set_algorithm's errors. */
  kvcs_worker *worker = make_worker(producer, 0, 0, identities);
  EXPECT(kvcs_worker_set_algorithm(NULL, KVCS_ALGORITHM_MIXED), KVCS_ERR_INVALID_ARGUMENT, "worker is NULL");
  EXPECT(kvcs_worker_set_algorithm(worker, 0), KVCS_ERR_INVALID_ARGUMENT, "algorithm 0 is not");
  EXPECT(kvcs_worker_set_algorithm(worker, 4), KVCS_ERR_INVALID_ARGUMENT, "algorithm 4");
  EXPECT_OK(kvcs_worker_set_algorithm(worker, KVCS_ALGORITHM_WEIGHTED));
  EXPECT_OK(kvcs_worker_set_algorithm(worker, KVCS_ALGORITHM_MIXED2));
  EXPECT_OK(kvcs_worker_set_algorithm(worker, KVCS_ALGORITHM_MIXED));
  kvcs_result *result = NULL;
  EXPECT_OK(kvcs_worker_checksum(worker, producer->blocks, KVCS_ROLE_PRODUCER, NULL, &result));
  EXPECT(kvcs_worker_set_algorithm(worker, KVCS_ALGORITHM_WEIGHTED), KVCS_ERR_INVALID_ARGUMENT,
         "already computed checksums with MIXED");
  kvcs_result_destroy(result);
  kvcs_worker_destroy(worker);

  /* Payloads: MIXED2 (the default) and MIXED carry the extension, a
   * fixarray of 4; WEIGHTED without extension is vLLM's plain fixarray of 3. */
  size_t mixed_len = 0, weighted_len = 0, old_mixed_len = 0;
  worker_algorithm = 0;
  uint8_t *mixed = produce(producer, 0, 0, &mixed_len);
  worker_algorithm = KVCS_ALGORITHM_WEIGHTED;
  uint8_t *weighted = produce(producer, 0, 0, &weighted_len);
  worker_algorithm = KVCS_ALGORITHM_MIXED;
  uint8_t *old_mixed = produce(producer, 0, 0, &old_mixed_len);
  CHECK(mixed[0] == 0x94 && weighted[0] == 0x93 && old_mixed[0] == 0x94);
  /* The extension's last element, the algorithm, is the payload's last byte. */
  CHECK(mixed[mixed_len - 1] == KVCS_ALGORITHM_MIXED2 && old_mixed[old_mixed_len - 1] == KVCS_ALGORITHM_MIXED);

  /* Consumers of each algorithm: the same algorithm matches, the others
   * are unverified. */
  const uint32_t algorithms[3] = {KVCS_ALGORITHM_WEIGHTED, KVCS_ALGORITHM_MIXED, KVCS_ALGORITHM_MIXED2};
  uint8_t *payloads[3] = {weighted, old_mixed, mixed};
  const size_t payload_lens[3] = {weighted_len, old_mixed_len, mixed_len};
  const char *producer_says[3] = {"are WEIGHTED (a plain payload)", "are MIXED,", "are MIXED2"};
  for (int a = 0; a < 3; a++) {
    worker_algorithm = algorithms[a];
    records r = plain_records(consumer, KVCS_ROLE_CONSUMER);
    kvcs_report *same = judge(consumer, &r, -1, producer->block_size, payloads[a], payload_lens[a]);
    EXPECT_REPORT(same, KVCS_VERDICT_MATCH, KVCS_UNVERIFIED_NONE, 1);
    kvcs_report_destroy(same);
    for (int b = 0; b < 3; b++) {
      if (b == a) {
        continue;
      }
      kvcs_report *other = judge(consumer, &r, -1, producer->block_size, payloads[b], payload_lens[b]);
      EXPECT_REPORT(other, KVCS_VERDICT_UNVERIFIED, KVCS_UNVERIFIED_ALGORITHM_DIFFERS, 0);
      CHECK(num_mismatches(other) == 0);
      CHECK(only_finding(other, KVCS_UNVERIFIED_ALGORITHM_DIFFERS, KVCS_WHOLE_LOAD, producer_says[b]));
      kvcs_report_destroy(other);
    }
    free_records(&r);
  }
  free(old_mixed);

  /* One consumer worker of another algorithm (MIXED among MIXED2 ones):
   * unverified, whatever the payload. */
  worker_algorithm = KVCS_ALGORITHM_MIXED2;
  records r = plain_records(consumer, KVCS_ROLE_CONSUMER);
  worker_algorithm = KVCS_ALGORITHM_MIXED;
  records odd = plain_records(consumer, KVCS_ROLE_CONSUMER);
  free(r.bytes[1]);
  r.bytes[1] = odd.bytes[1];
  r.lens[1] = odd.lens[1];
  odd.bytes[1] = NULL;
  kvcs_report *report = judge(consumer, &r, -1, producer->block_size, mixed, mixed_len);
  EXPECT_REPORT(report, KVCS_VERDICT_UNVERIFIED, KVCS_UNVERIFIED_ALGORITHM_DIFFERS, 0);
  CHECK(message_has(report, "with algorithm"));
  kvcs_report_destroy(report);
  free_records(&odd);
  free_records(&r);

  /* Producer workers of different algorithms (MIXED2 and MIXED) make no payload. */
  worker_algorithm = KVCS_ALGORITHM_MIXED2;
  records p = plain_records(producer, KVCS_ROLE_PRODUCER);
  worker_algorithm = KVCS_ALGORITHM_MIXED;
  records p_odd = plain_records(producer, KVCS_ROLE_PRODUCER);
  kvcs_verifier *verifier = make_verifier(producer, KVCS_ROLE_PRODUCER);
  EXPECT_OK(kvcs_verifier_add_record(verifier, p.bytes[0], p.lens[0]));
  EXPECT_OK(kvcs_verifier_add_record(verifier, p_odd.bytes[1], p_odd.lens[1]));
  uint8_t buf[512];
  size_t len = 0;
  EXPECT(kvcs_verifier_payload(verifier, REQ_ID, buf, sizeof buf, &len), KVCS_ERR_INVALID_ARGUMENT,
         "the checksum algorithms differ");
  kvcs_verifier_destroy(verifier);
  free_records(&p);
  free_records(&p_odd);
  worker_algorithm = 0;
  free(mixed);
  free(weighted);
}

void test_verify(uint64_t seed) {
  rng_state = (seed ^ 0x7665726966790000ull) | 1;
  uint64_t *all = &logical[0][0][0][0];
  for (size_t i = 0; i < sizeof logical / sizeof logical[0][0][0][0]; i++) {
    all[i] = next_random();
  }
  side producer = producer_side(), consumer = consumer_side();
  place_side(&producer);
  place_side(&consumer);

  test_names();
  test_base64();
  test_record_errors(&producer);
  test_verifier_errors(&producer, &consumer);
  test_algorithms(&producer, &consumer);

  size_t len = 0;
  uint8_t *payload = produce(&producer, 0, 0, &len);
  char *text = base64_of(payload, len);
  uint8_t decoded[256];
  size_t decoded_len = 0;
  EXPECT_OK(kvcs_base64_decode(text, strlen(text), decoded, sizeof decoded, &decoded_len));
  CHECK(decoded_len == len && memcmp(decoded, payload, len) == 0);
  test_end_to_end(&consumer, &producer, text);

  free(text);
  free(payload);
  free_side(&producer);
  free_side(&consumer);
}
