/*
 * Verification through the C API (SPEC sections 4, 7, 9, 10): worker
 * records, the verifier's payload and reports, base64, and every error path
 * of those calls.
 *
 * The positive flows run real host workers over one small random logical KV
 * laid out by a producer (TP=2, HND, 4-token blocks) and two consumers
 * (TP=2, NHD with K and V in separate buffers, 4-token blocks; TP=4 with
 * each of the 2 KV heads on 2 ranks, cross-layer, 8-token blocks of two
 * kernel blocks). The producer's payload is checked against a naive
 * reference of SPEC sections 2-3 and 7 before any consumer judges a load.
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

/* Layer identities: the messages of two published SHA-256 test vectors
 * ("abc" and ""), so the group fingerprint of SPEC section 7 can be checked
 * here without a SHA-256 of our own. */
static const char *const identities[LAYERS] = {"abc", ""};
/* LE_u64 of the first 8 bytes of SHA-256("abc") = ba7816bf 8f01cfea ... and
 * of SHA-256("") = e3b0c442 98fc1c14 ... */
static const uint64_t identity_fingerprints[LAYERS] = {0xeacf018fbf1678baull, 0x141cfc9842c4b0e3ull};
/* Other identities, for a consumer whose layers are not the producer's. */
static const char *const other_identities[LAYERS] = {"abd", "x"};

static uint64_t rng_state;

/* xorshift64*: random data from the test's seed. */
static uint64_t next_random(void) {
  rng_state ^= rng_state >> 12;
  rng_state ^= rng_state << 25;
  rng_state ^= rng_state >> 27;
  return rng_state * 0x2545F4914F6CDD1Dull;
}

static uint32_t random_below(uint32_t n) { return (uint32_t)(next_random() % n); }

/* SPEC sections 2-3, naively: the checksum of all heads and layers of the
 * block at `position` (block size `block_size`) of the logical KV. */
static uint64_t reference_block(uint64_t position, uint32_t block_size) {
  uint64_t block_sum = 0;
  for (uint32_t layer = 0; layer < LAYERS; layer++) {
    for (uint32_t head = 0; head < KV_HEADS; head++) {
      uint64_t slice = 0;
      for (uint64_t token = position * block_size; token < (position + 1) * block_size && token < NUM_TOKENS;
           token++) {
        for (uint64_t piece = 0; piece < PIECES; piece++) {
          uint64_t j = token * PIECES + piece;
          slice += logical[layer][head][token][piece] * (2 * j + 1);
        }
      }
      block_sum += (2 * ((uint64_t)layer_numbers[layer] * KVCS_MAX_KV_HEADS_PER_LAYER + head) + 1) * slice;
    }
  }
  return block_sum;
}

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

/* Consumer A: TP=2, NHD [layer][block][4 tokens][head], K in one buffer and
 * V in another, 8 blocks. */
static side consumer_a_side(void) {
  side s = {.name = "consumer A", .tp_size = 2, .block_size = 4, .kernel_blocks = 1, .num_blocks = 8,
            .num_positions = 6, .num_segments = 2};
  const int64_t h = heads_per_rank(&s), b = s.block_size, k = K_PIECES, v = V_PIECES, n = s.num_blocks;
  s.segments[0] = (segment_place){0, 0, n * b * h * k, b * h * k, 0, k, h * k, 0, K_PIECES};
  s.segments[1] = (segment_place){1, 0, n * b * h * v, b * h * v, 0, v, h * v, K_PIECES, V_PIECES};
  return s;
}

/* Consumer B: TP=4, so each KV head is on 2 ranks (replica key (2, rank % 2));
 * 8-token blocks of two 4-token kernel blocks, cross-layer
 * [block][kernel block][layer][head] with 4 tokens of K then 4 of V. */
static side consumer_b_side(void) {
  side s = {.name = "consumer B", .tp_size = 4, .block_size = 8, .kernel_blocks = 2, .num_blocks = 5,
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
 * A naive msgpack reader and writer for the plain payload
 * --------------------------------------------------------------------- */

/* The plain payload [version, num_tokens, [[group_id, fingerprint,
 * first_position, values]]] of one group. */
typedef struct {
  uint64_t version, num_tokens, group_id, fingerprint, first_position;
  size_t num_values;
  uint64_t values[MAX_POSITIONS];
} plain_payload;

typedef struct {
  const uint8_t *bytes;
  size_t len, pos;
  int ok;
} msgpack_reader;

static uint64_t read_big_endian(msgpack_reader *r, size_t n) {
  uint64_t value = 0;
  if (r->len - r->pos < n) {
    r->ok = 0;
    return 0;
  }
  for (size_t i = 0; i < n; i++) {
    value = value << 8 | r->bytes[r->pos++];
  }
  return value;
}

static uint8_t read_marker(msgpack_reader *r) {
  if (r->pos >= r->len) {
    r->ok = 0;
    return 0xc1;
  }
  return r->bytes[r->pos++];
}

static uint64_t read_uint(msgpack_reader *r) {
  uint8_t marker = read_marker(r);
  if (marker <= 0x7f) {
    return marker;
  }
  if (marker >= 0xcc && marker <= 0xcf) {
    return read_big_endian(r, (size_t)1 << (marker - 0xcc));
  }
  r->ok = 0;
  return 0;
}

static uint64_t read_array(msgpack_reader *r) {
  uint8_t marker = read_marker(r);
  if (marker >= 0x90 && marker <= 0x9f) {
    return marker & 0x0f;
  }
  if (marker == 0xdc || marker == 0xdd) {
    return read_big_endian(r, marker == 0xdc ? 2 : 4);
  }
  r->ok = 0;
  return 0;
}

/* Parses exactly a one-group plain payload; 0 if `bytes` are anything else. */
static int parse_plain_payload(const uint8_t *bytes, size_t len, plain_payload *out) {
  msgpack_reader r = {bytes, len, 0, 1};
  memset(out, 0, sizeof *out);
  if (read_array(&r) != 3) {
    return 0;
  }
  out->version = read_uint(&r);
  out->num_tokens = read_uint(&r);
  if (read_array(&r) != 1 || read_array(&r) != 4) {
    return 0;
  }
  out->group_id = read_uint(&r);
  out->fingerprint = read_uint(&r);
  out->first_position = read_uint(&r);
  uint8_t marker = read_marker(&r);
  if (marker < 0xc4 || marker > 0xc6) {
    return 0;
  }
  uint64_t bin_len = read_big_endian(&r, (size_t)1 << (marker - 0xc4));
  if (!r.ok || bin_len % 8 != 0 || bin_len / 8 > MAX_POSITIONS || r.len - r.pos != bin_len) {
    return 0;
  }
  out->num_values = (size_t)(bin_len / 8);
  for (size_t i = 0; i < out->num_values; i++) {
    for (int b = 7; b >= 0; b--) { /* little-endian */
      out->values[i] = out->values[i] << 8 | bytes[r.pos + 8 * i + (size_t)b];
    }
  }
  return r.ok;
}

typedef struct {
  uint8_t bytes[256];
  size_t len;
  int wide; /* 1: every header and integer in its widest form */
} msgpack_writer;

static void put(msgpack_writer *w, uint8_t byte) {
  if (w->len < sizeof w->bytes) {
    w->bytes[w->len++] = byte;
  }
}

static void put_big_endian(msgpack_writer *w, uint64_t value, size_t n) {
  for (size_t i = n; i-- > 0;) {
    put(w, (uint8_t)(value >> (8 * i)));
  }
}

static void write_uint(msgpack_writer *w, uint64_t value) {
  if (w->wide) {
    put(w, 0xcf);
    put_big_endian(w, value, 8);
  } else if (value <= 0x7f) {
    put(w, (uint8_t)value);
  } else if (value <= 0xff) {
    put(w, 0xcc);
    put_big_endian(w, value, 1);
  } else if (value <= 0xffff) {
    put(w, 0xcd);
    put_big_endian(w, value, 2);
  } else if (value <= 0xffffffffu) {
    put(w, 0xce);
    put_big_endian(w, value, 4);
  } else {
    put(w, 0xcf);
    put_big_endian(w, value, 8);
  }
}

static void write_array(msgpack_writer *w, size_t len) {
  if (w->wide) {
    put(w, 0xdd);
    put_big_endian(w, len, 4);
  } else {
    put(w, (uint8_t)(0x90 | len)); /* at most 15 here */
  }
}

/* SPEC section 9's bytes of `p`, shortest (vLLM's own) or widest form. */
static msgpack_writer write_plain_payload(const plain_payload *p, int wide) {
  msgpack_writer w = {.wide = wide};
  write_array(&w, 3);
  write_uint(&w, p->version);
  write_uint(&w, p->num_tokens);
  write_array(&w, 1);
  write_array(&w, 4);
  write_uint(&w, p->group_id);
  write_uint(&w, p->fingerprint);
  write_uint(&w, p->first_position);
  if (wide) {
    put(&w, 0xc6);
    put_big_endian(&w, 8 * p->num_values, 4);
  } else {
    put(&w, 0xc4);
    put(&w, (uint8_t)(8 * p->num_values));
  }
  for (size_t i = 0; i < p->num_values; i++) {
    for (size_t b = 0; b < 8; b++) {
      put(&w, (uint8_t)(p->values[i] >> (8 * b)));
    }
  }
  return w;
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
      "KVCS_UNVERIFIED_STATE_TP_DIFFERS", "KVCS_UNVERIFIED_ROLE_DIFFERS", "KVCS_UNVERIFIED_UNCOMPARED_POSITIONS",
  };
  for (uint32_t r = 0; r < sizeof reasons / sizeof reasons[0]; r++) {
    CHECK(strcmp(kvcs_unverified_reason_name(r), reasons[r]) == 0);
  }
  CHECK(KVCS_UNVERIFIED_WORKERS_MISSING == 3 && KVCS_UNVERIFIED_STATE_TP_DIFFERS == 9);
  CHECK(strcmp(kvcs_unverified_reason_name(12), "unknown kvcs_unverified_reason") == 0);
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

  /* The record is ["kvcsum.record", 1, ...]: a fixarray of 7, a 13-byte
   * fixstr, then the version at byte 15. */
  CHECK(record[0] == 0x97 && record[1] == 0xad && memcmp(record + 2, "kvcsum.record", 13) == 0 &&
        record[15] == 0x01);

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
  changed[15] = 0x02;
  EXPECT(kvcs_verifier_add_record(verifier, changed, record_len), KVCS_ERR_MALFORMED, "version 2 is not supported");
  changed[15] = 0x01;
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
  /* A record of another TP size than the records held (the producer's 2). */
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

/* The producer's payload against SPEC sections 2-3 (values), 7 (the
 * fingerprint) and 9 (the bytes: shortest msgpack integers). */
static void test_payload_bytes(const uint8_t *payload, size_t len, const side *producer) {
  plain_payload parsed;
  CHECK(parse_plain_payload(payload, len, &parsed));
  CHECK(parsed.version == 1 && parsed.num_tokens == NUM_TOKENS && parsed.group_id == GROUP &&
        parsed.first_position == 0 && parsed.num_values == producer->num_positions);
  int values_equal = 1;
  for (size_t q = 0; q < parsed.num_values; q++) {
    uint64_t want = reference_block(q, producer->block_size);
    if (parsed.values[q] != want) {
      fprintf(stderr, "  payload position %zu: %#" PRIx64 ", reference %#" PRIx64 "\n", q, parsed.values[q], want);
      values_equal = 0;
    }
  }
  CHECK(values_equal);
  CHECK(parsed.fingerprint == identity_fingerprints[0] + identity_fingerprints[1]);
  msgpack_writer shortest = write_plain_payload(&parsed, 0);
  CHECK(shortest.len == len && memcmp(shortest.bytes, payload, len) == 0);
}

/* Payload bytes that are not a payload make the load unverified (invalid
 * checksums), never an error; valid msgpack of the payload's shape in other
 * integer widths is accepted. `verifier` has every record of `consumer`. */
static void test_malformed_payloads(kvcs_verifier *verifier, const uint8_t *payload, size_t len) {
  kvcs_report *report = NULL;
  int prefixes_unverified = 1;
  for (size_t cut = 0; cut < len; cut++) {
    EXPECT_OK(kvcs_verifier_check(verifier, REQ_ID, cut ? payload : NULL, cut, &report));
    uint32_t verdict = 99;
    EXPECT_OK(kvcs_report_verdict(report, &verdict));
    if (verdict != KVCS_VERDICT_UNVERIFIED ||
        !only_finding(report, KVCS_UNVERIFIED_INVALID_CHECKSUMS, KVCS_WHOLE_LOAD, "truncated")) {
      fprintf(stderr, "  payload prefix of %zu bytes\n", cut);
      prefixes_unverified = 0;
    }
    kvcs_report_destroy(report);
  }
  CHECK(prefixes_unverified);

  plain_payload parsed;
  CHECK(parse_plain_payload(payload, len, &parsed));
  struct {
    const char *what;
    msgpack_writer bytes;
    uint32_t verdict;
    const char *needle;
  } cases[] = {
      {"widest integers and headers", write_plain_payload(&parsed, 1), KVCS_VERDICT_MATCH, NULL},
      {"trailing byte", write_plain_payload(&parsed, 0), KVCS_VERDICT_UNVERIFIED, "1 trailing bytes"},
      {"version 2", write_plain_payload(&parsed, 0), KVCS_VERDICT_UNVERIFIED, "version 2 is not supported"},
      {"bin of 8n-1 bytes", write_plain_payload(&parsed, 1), KVCS_VERDICT_UNVERIFIED, "values"},
      {"a string for the version", write_plain_payload(&parsed, 0), KVCS_VERDICT_UNVERIFIED, "version"},
      {"2^32-1 groups declared", {{0x93, 0x01, NUM_TOKENS, 0xdd, 0xff, 0xff, 0xff, 0xff}, 8, 0},
       KVCS_VERDICT_UNVERIFIED, "payload"},
      {"a map", {{0x81, 0x01, 0x02}, 3, 0}, KVCS_VERDICT_UNVERIFIED, "payload"},
      {"random bytes", {{0}, 48, 0}, KVCS_VERDICT_UNVERIFIED, "payload"},
  };
  put(&cases[1].bytes, 0xc0);
  cases[2].bytes.bytes[1] = 0x02;
  cases[3].bytes.len--; /* the bin is last: its length field is 4 bytes before the values */
  size_t at = cases[3].bytes.len - 8 * parsed.num_values + 1 - 4;
  CHECK(cases[3].bytes.bytes[at - 1] == 0xc6);
  cases[3].bytes.bytes[at + 3] = (uint8_t)(8 * parsed.num_values - 1);
  memmove(cases[4].bytes.bytes + 2, cases[4].bytes.bytes + 1, cases[4].bytes.len - 1);
  cases[4].bytes.bytes[1] = 0xa1; /* "1": a one-character string */
  cases[4].bytes.bytes[2] = '1';
  cases[4].bytes.len++;
  for (size_t i = 0; i < cases[7].bytes.len; i++) {
    cases[7].bytes.bytes[i] = (uint8_t)next_random();
  }
  cases[7].bytes.bytes[0] = 0x93; /* an array of 3 to get past the first byte */
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    EXPECT_OK(kvcs_verifier_check(verifier, REQ_ID, cases[i].bytes.bytes, cases[i].bytes.len, &report));
    uint32_t verdict = 99;
    EXPECT_OK(kvcs_report_verdict(report, &verdict));
    int ok = verdict == cases[i].verdict;
    if (cases[i].needle != NULL) {
      ok = ok && only_finding(report, KVCS_UNVERIFIED_INVALID_CHECKSUMS, KVCS_WHOLE_LOAD, cases[i].needle);
    }
    check_record(ok, __FILE__, __LINE__, cases[i].what);
    kvcs_report_destroy(report);
  }

  /* A valid payload without the group: the group is one-sided. */
  const uint8_t no_groups[] = {0x93, 0x01, NUM_TOKENS, 0x90};
  EXPECT_OK(kvcs_verifier_check(verifier, REQ_ID, no_groups, sizeof no_groups, &report));
  EXPECT_REPORT(report, KVCS_VERDICT_UNVERIFIED, KVCS_UNVERIFIED_ONE_SIDED_GROUP, 0);
  CHECK(only_finding(report, KVCS_UNVERIFIED_ONE_SIDED_GROUP, GROUP, "did not send"));
  kvcs_report_destroy(report);

  /* Base64 that is not standard padded base64. */
  static const char *const bad_text[] = {"", "kw", "k w==", "!!!!", "kwEW-A=="};
  for (size_t i = 0; i < sizeof bad_text / sizeof bad_text[0]; i++) {
    EXPECT_OK(kvcs_verifier_check_base64(verifier, REQ_ID, bad_text[i], &report));
    EXPECT_REPORT(report, KVCS_VERDICT_UNVERIFIED, KVCS_UNVERIFIED_INVALID_CHECKSUMS, 0);
    CHECK(only_finding(report, KVCS_UNVERIFIED_INVALID_CHECKSUMS, KVCS_WHOLE_LOAD, i == 0 ? "payload" : "base64"));
    kvcs_report_destroy(report);
  }
}

/* Consumer A (TP=2, same block size as the producer): match, the producer's
 * value of one position changed in transit, a write past num_tokens, a
 * flipped byte, other identities, other tokens. */
static void test_consumer_a(side *consumer, const side *producer, const uint8_t *payload, size_t len) {
  records r = plain_records(consumer, KVCS_ROLE_CONSUMER);
  kvcs_verifier *verifier = make_verifier(consumer, KVCS_ROLE_CONSUMER);
  add_records(verifier, &r, -1);
  kvcs_report *report = NULL;
  EXPECT_OK(kvcs_verifier_check(verifier, REQ_ID, payload, len, &report));
  EXPECT_REPORT(report, KVCS_VERDICT_MATCH, KVCS_UNVERIFIED_NONE, 1);
  CHECK(compared_positions(report) == consumer->num_positions && num_mismatches(report) == 0);
  CHECK(message_has(report, "match (6 block positions compared)"));
  size_t findings = SIZE_MAX;
  EXPECT_OK(kvcs_report_num_unverified(report, &findings));
  CHECK(findings == 0);
  test_report_errors(report);
  kvcs_report_destroy(report);

  test_malformed_payloads(verifier, payload, len);

  /* The producer's value of one position changed on the way: a mismatch
   * there (the payload's values are its last bytes). */
  uint32_t position = random_below(producer->num_positions);
  uint8_t *changed = malloc(len);
  CHECK(changed != NULL);
  memcpy(changed, payload, len);
  changed[len - 8 * (producer->num_positions - position) + random_below(8)] ^= 0x10;
  EXPECT_OK(kvcs_verifier_check(verifier, REQ_ID, changed, len, &report));
  EXPECT_REPORT(report, KVCS_VERDICT_MISMATCH, KVCS_UNVERIFIED_NONE, 0);
  kvcs_mismatch mismatch = {0};
  CHECK(num_mismatches(report) == 1);
  EXPECT_OK(kvcs_report_mismatch(report, 0, &mismatch));
  CHECK(mismatch.first_position == position && mismatch.num_positions == 1);
  kvcs_report_destroy(report);
  free(changed);

  /* SPEC property 5 through the verifier: a write to token 23, past
   * num_tokens 22 in the last block, changes nothing. */
  uint8_t *past = (uint8_t *)&consumer->buffers[1][0][piece_index(
      consumer, &consumer->segments[0], 1, consumer->block_ids[NUM_TOKENS / 4], 0, 3, 1)];
  *past ^= 0xff;
  records after = plain_records(consumer, KVCS_ROLE_CONSUMER);
  add_records(verifier, &after, -1); /* newer records replace older ones */
  EXPECT_OK(kvcs_verifier_check(verifier, REQ_ID, payload, len, &report));
  EXPECT_REPORT(report, KVCS_VERDICT_MATCH, KVCS_UNVERIFIED_NONE, 1);
  kvcs_report_destroy(report);
  free_records(&after);
  *past ^= 0xff;

  /* One flipped byte: a mismatch at its position, in check 0 (no replicas). */
  const int failed_before = checks_failed;
  uint32_t rank = random_below(consumer->tp_size), layer = 0;
  uint8_t *flipped = NULL;
  uint32_t token = flip_random_byte(consumer, rank, &layer, &flipped);
  after = plain_records(consumer, KVCS_ROLE_CONSUMER);
  add_records(verifier, &after, -1);
  EXPECT_OK(kvcs_verifier_set_policy(verifier, KVCS_POLICY_FAIL_OPEN)); /* a mismatch fails whatever the policy */
  EXPECT_OK(kvcs_verifier_check(verifier, REQ_ID, payload, len, &report));
  EXPECT_REPORT(report, KVCS_VERDICT_MISMATCH, KVCS_UNVERIFIED_NONE, 0);
  CHECK(compared_positions(report) == consumer->num_positions && num_mismatches(report) == 1);
  EXPECT_OK(kvcs_report_mismatch(report, 0, &mismatch));
  uint32_t q = token / consumer->block_size;
  uint64_t valid = NUM_TOKENS - q * consumer->block_size < consumer->block_size ? NUM_TOKENS - q * consumer->block_size
                                                                                : consumer->block_size;
  CHECK(mismatch.group_id == GROUP && mismatch.first_position == q && mismatch.num_positions == 1 &&
        mismatch.first_token == q * consumer->block_size && mismatch.num_tokens == valid &&
        mismatch.num_failed_checks == 1 && mismatch.localised == 0 && mismatch.num_layers == 0);
  uint32_t check = 99;
  EXPECT_OK(kvcs_report_failed_check(report, 0, 0, &check));
  CHECK(check == 0);
  char needle[32];
  snprintf(needle, sizeof needle, "group 0 position %" PRIu32, q);
  CHECK(message_has(report, needle));
  test_report_errors(report);
  kvcs_report_destroy(report);
  *flipped ^= 0xff;
  free_records(&after);
  kvcs_verifier_destroy(verifier);
  if (checks_failed != failed_before) {
    fprintf(stderr, "  (consumer A: flipped rank %" PRIu32 ", layer %" PRIu32 ", token %" PRIu32 ")\n", rank, layer,
            token);
  }

  /* Other layer identities: the fingerprint differs, nothing is compared. */
  records other = side_records(consumer, consumer->blocks, KVCS_ROLE_CONSUMER, 0, other_identities);
  report = judge(consumer, &other, -1, 0, payload, len);
  EXPECT_REPORT(report, KVCS_VERDICT_UNVERIFIED, KVCS_UNVERIFIED_FINGERPRINT_DIFFERS, 0);
  CHECK(only_finding(report, KVCS_UNVERIFIED_FINGERPRINT_DIFFERS, GROUP, "fingerprint"));
  CHECK(compared_positions(report) == 0);
  kvcs_report_destroy(report);
  free_records(&other);

  /* Workers that checksummed 21 tokens where 22 were scheduled. */
  kvcs_blocks *fewer = NULL;
  EXPECT_OK(kvcs_blocks_create(&fewer));
  EXPECT_OK(kvcs_blocks_add_request(fewer, REQ_ID, NUM_TOKENS - 1));
  EXPECT_OK(kvcs_blocks_add_group(fewer, REQ_ID, GROUP, 0, consumer->block_ids, consumer->num_positions));
  other = side_records(consumer, fewer, KVCS_ROLE_CONSUMER, 0, identities);
  report = judge(consumer, &other, -1, 0, payload, len);
  EXPECT_REPORT(report, KVCS_VERDICT_UNVERIFIED, KVCS_UNVERIFIED_OTHER_BLOCKS, 0);
  CHECK(only_finding(report, KVCS_UNVERIFIED_OTHER_BLOCKS, KVCS_WHOLE_LOAD,
                     "checksummed 21 tokens, 22 were scheduled"));
  kvcs_report_destroy(report);
  free_records(&other);
  kvcs_blocks_destroy(fewer);

  /* The same on the producer side: no payload can be made. */
  EXPECT_OK(kvcs_blocks_create(&fewer));
  EXPECT_OK(kvcs_blocks_add_request(fewer, REQ_ID, NUM_TOKENS - 1));
  EXPECT_OK(kvcs_blocks_add_group(fewer, REQ_ID, GROUP, 0, producer->block_ids, producer->num_positions));
  other = side_records(producer, fewer, KVCS_ROLE_PRODUCER, 0, identities);
  verifier = make_verifier(producer, KVCS_ROLE_PRODUCER);
  add_records(verifier, &other, -1);
  size_t payload_len = 77;
  EXPECT(kvcs_verifier_payload(verifier, REQ_ID, NULL, 0, &payload_len), KVCS_ERR_INVALID_ARGUMENT,
         "checksummed 21 tokens, 22 were scheduled");
  CHECK(payload_len == 77);
  kvcs_verifier_destroy(verifier);
  free_records(&other);
  kvcs_blocks_destroy(fewer);
  free_records(&r);
}

/* Consumer B (TP=4, each head on 2 ranks, 8-token blocks against the
 * producer's 4): match, a flipped byte in each replica, detail mode, a
 * missing record, policies, no payload, a corrupted payload, a missing
 * replica, no common position. */
static void test_consumer_b(side *consumer, const side *producer, const uint8_t *payload, size_t len,
                            const char *text) {
  const uint32_t runs = (NUM_TOKENS + 7) / 8; /* lcm(4, 8) = 8 tokens per compared run */
  records r = plain_records(consumer, KVCS_ROLE_CONSUMER);
  kvcs_report *report = judge(consumer, &r, -1, producer->block_size, payload, len);
  EXPECT_REPORT(report, KVCS_VERDICT_MATCH, KVCS_UNVERIFIED_NONE, 1);
  CHECK(compared_positions(report) == runs);
  kvcs_report_destroy(report);

  kvcs_verifier *verifier = make_verifier(consumer, KVCS_ROLE_CONSUMER);
  EXPECT_OK(kvcs_verifier_set_producer_block_size(verifier, GROUP, producer->block_size));
  EXPECT_OK(kvcs_verifier_set_producer_tp_size(verifier, producer->tp_size));
  add_records(verifier, &r, -1);
  EXPECT_OK(kvcs_verifier_check_base64(verifier, REQ_ID, text, &report));
  EXPECT_REPORT(report, KVCS_VERDICT_MATCH, KVCS_UNVERIFIED_NONE, 1);
  CHECK(compared_positions(report) == runs);
  kvcs_report_destroy(report);

  /* No payload: unverified (the producer sent none), failed when closed,
   * passed when open. */
  EXPECT_OK(kvcs_verifier_check_no_payload(verifier, REQ_ID, &report));
  EXPECT_REPORT(report, KVCS_VERDICT_UNVERIFIED, KVCS_UNVERIFIED_NO_CHECKSUMS, 0);
  CHECK(only_finding(report, KVCS_UNVERIFIED_NO_CHECKSUMS, KVCS_WHOLE_LOAD, "no payload"));
  CHECK(message_has(report, "fail-closed"));
  kvcs_report_destroy(report);
  EXPECT_OK(kvcs_verifier_set_policy(verifier, KVCS_POLICY_FAIL_OPEN));
  EXPECT_OK(kvcs_verifier_check_no_payload(verifier, REQ_ID, &report));
  EXPECT_REPORT(report, KVCS_VERDICT_UNVERIFIED, KVCS_UNVERIFIED_NO_CHECKSUMS, 1);
  CHECK(message_has(report, "fail-open"));
  kvcs_report_destroy(report);
  /* A corrupted base64 payload, under fail-open then fail-closed. */
  char *corrupted = malloc(strlen(text) + 1);
  CHECK(corrupted != NULL);
  strcpy(corrupted, text);
  corrupted[random_below((uint32_t)strlen(text) - 4)] = '!';
  EXPECT_OK(kvcs_verifier_check_base64(verifier, REQ_ID, corrupted, &report));
  EXPECT_REPORT(report, KVCS_VERDICT_UNVERIFIED, KVCS_UNVERIFIED_INVALID_CHECKSUMS, 1);
  kvcs_report_destroy(report);
  EXPECT_OK(kvcs_verifier_set_policy(verifier, KVCS_POLICY_FAIL_CLOSED));
  EXPECT_OK(kvcs_verifier_check_base64(verifier, REQ_ID, corrupted, &report));
  EXPECT_REPORT(report, KVCS_VERDICT_UNVERIFIED, KVCS_UNVERIFIED_INVALID_CHECKSUMS, 0);
  CHECK(only_finding(report, KVCS_UNVERIFIED_INVALID_CHECKSUMS, KVCS_WHOLE_LOAD, "base64"));
  test_report_errors(report);
  kvcs_report_destroy(report);
  free(corrupted);
  kvcs_verifier_destroy(verifier);

  /* One record missing: unverified with the worker named, under either
   * policy; the same without a payload. */
  uint32_t missing = random_below(consumer->tp_size);
  char needle[64];
  snprintf(needle, sizeof needle, "3 of 4 workers reported; missing (pp_rank 0, tp_rank %" PRIu32 ")", missing);
  verifier = make_verifier(consumer, KVCS_ROLE_CONSUMER);
  EXPECT_OK(kvcs_verifier_set_producer_block_size(verifier, GROUP, producer->block_size));
  add_records(verifier, &r, (int)missing);
  EXPECT_OK(kvcs_verifier_check(verifier, REQ_ID, payload, len, &report));
  EXPECT_REPORT(report, KVCS_VERDICT_UNVERIFIED, KVCS_UNVERIFIED_WORKERS_MISSING, 0);
  CHECK(only_finding(report, KVCS_UNVERIFIED_WORKERS_MISSING, KVCS_WHOLE_LOAD, needle));
  CHECK(compared_positions(report) == 0 && num_mismatches(report) == 0);
  kvcs_report_destroy(report);
  EXPECT_OK(kvcs_verifier_check_no_payload(verifier, REQ_ID, &report));
  EXPECT_REPORT(report, KVCS_VERDICT_UNVERIFIED, KVCS_UNVERIFIED_WORKERS_MISSING, 0);
  kvcs_report_destroy(report);
  EXPECT_OK(kvcs_verifier_set_policy(verifier, KVCS_POLICY_FAIL_OPEN));
  EXPECT_OK(kvcs_verifier_check(verifier, REQ_ID, payload, len, &report));
  EXPECT_REPORT(report, KVCS_VERDICT_UNVERIFIED, KVCS_UNVERIFIED_WORKERS_MISSING, 1);
  kvcs_report_destroy(report);
  /* The last record arrives: a match, which passes under either policy. */
  EXPECT_OK(kvcs_verifier_add_record(verifier, r.bytes[missing], r.lens[missing]));
  EXPECT_OK(kvcs_verifier_check(verifier, REQ_ID, payload, len, &report));
  EXPECT_REPORT(report, KVCS_VERDICT_MATCH, KVCS_UNVERIFIED_NONE, 1);
  kvcs_report_destroy(report);
  kvcs_verifier_destroy(verifier);

  /* A flipped byte in each replica of a head: a mismatch at its position in
   * the replica's check only (check k compares copy k % 2). */
  for (uint32_t replica = 0; replica < 2; replica++) {
    const int failed_before = checks_failed;
    uint32_t rank = 2 * random_below(KV_HEADS) + replica, layer = 0;
    uint8_t *flipped = NULL;
    uint32_t token = flip_random_byte(consumer, rank, &layer, &flipped);
    records after = plain_records(consumer, KVCS_ROLE_CONSUMER);
    report = judge(consumer, &after, -1, producer->block_size, payload, len);
    EXPECT_REPORT(report, KVCS_VERDICT_MISMATCH, KVCS_UNVERIFIED_NONE, 0);
    CHECK(compared_positions(report) == runs && num_mismatches(report) == 1);
    kvcs_mismatch mismatch = {0};
    EXPECT_OK(kvcs_report_mismatch(report, 0, &mismatch));
    uint32_t q = token / 8;
    CHECK(mismatch.group_id == GROUP && mismatch.first_position == q && mismatch.num_positions == 1 &&
          mismatch.first_token == 8 * q && mismatch.num_tokens == (NUM_TOKENS - 8 * q < 8 ? NUM_TOKENS - 8 * q : 8) &&
          mismatch.num_failed_checks == 1 && mismatch.localised == 0 && mismatch.num_layers == 0);
    uint32_t check = 99;
    EXPECT_OK(kvcs_report_failed_check(report, 0, 0, &check));
    CHECK(check == replica);
    kvcs_report_destroy(report);
    free_records(&after);

    /* Detail mode on both sides, with the payload extension (which also
     * carries the producer's block size): the report names the layer and
     * head of the flipped byte. */
    if (replica == 1) {
      size_t detailed_len = 0;
      uint8_t *detailed = produce(producer, 1, 1, &detailed_len);
      CHECK(detailed[0] == 0x94); /* the plain payload's 3 elements and the extension */
      after = side_records(consumer, consumer->blocks, KVCS_ROLE_CONSUMER, 1, identities);
      report = judge(consumer, &after, -1, 0, detailed, detailed_len);
      EXPECT_REPORT(report, KVCS_VERDICT_MISMATCH, KVCS_UNVERIFIED_NONE, 0);
      CHECK(compared_positions(report) == runs && num_mismatches(report) == 1);
      EXPECT_OK(kvcs_report_mismatch(report, 0, &mismatch));
      CHECK(mismatch.first_position == q && mismatch.localised == 1 && mismatch.num_layers == 1);
      kvcs_layer_difference difference = {0};
      EXPECT_OK(kvcs_report_layer_difference(report, 0, 0, &difference));
      CHECK(difference.layer_number == layer_numbers[layer] && difference.first_head == first_head_of(consumer, rank) &&
            difference.num_heads == 1 && difference.check == 1);
      snprintf(needle, sizeof needle, "layer %" PRIu32 " heads %" PRIu32 "..%" PRIu32, layer_numbers[layer],
               first_head_of(consumer, rank), first_head_of(consumer, rank) + 1);
      CHECK(message_has(report, needle));
      test_report_errors(report);
      kvcs_report_destroy(report);
      /* The plain payload has no layers: the same mismatch, not localised. */
      report = judge(consumer, &after, -1, producer->block_size, payload, len);
      EXPECT_REPORT(report, KVCS_VERDICT_MISMATCH, KVCS_UNVERIFIED_NONE, 0);
      EXPECT_OK(kvcs_report_mismatch(report, 0, &mismatch));
      CHECK(mismatch.first_position == q && mismatch.localised == 0 && mismatch.num_layers == 0);
      kvcs_report_destroy(report);
      free_records(&after);
      /* With the KV intact again, the detailed payload matches. */
      *flipped ^= 0xff;
      after = side_records(consumer, consumer->blocks, KVCS_ROLE_CONSUMER, 1, identities);
      report = judge(consumer, &after, -1, 0, detailed, detailed_len);
      EXPECT_REPORT(report, KVCS_VERDICT_MATCH, KVCS_UNVERIFIED_NONE, 1);
      CHECK(compared_positions(report) == runs);
      kvcs_report_destroy(report);
      free_records(&after);
      free(detailed);
    } else {
      *flipped ^= 0xff;
    }
    if (checks_failed != failed_before) {
      fprintf(stderr, "  (consumer B: flipped rank %" PRIu32 ", layer %" PRIu32 ", token %" PRIu32 ")\n", rank,
              layer, token);
    }
  }

  /* Records computed in the producer role: a configuration error. */
  records producer_role = plain_records(consumer, KVCS_ROLE_PRODUCER);
  report = judge(consumer, &producer_role, -1, producer->block_size, payload, len);
  EXPECT_REPORT(report, KVCS_VERDICT_UNVERIFIED, KVCS_UNVERIFIED_ROLE_DIFFERS, 0);
  CHECK(only_finding(report, KVCS_UNVERIFIED_ROLE_DIFFERS, KVCS_WHOLE_LOAD, "as a producer"));
  kvcs_report_destroy(report);
  free_records(&producer_role);

  /* A request whose only block (position 3, tokens 24..31) holds none of
   * the 22 tokens: no position in common with the payload. */
  kvcs_blocks *tail = NULL;
  const uint32_t tail_block = consumer->block_ids[0];
  EXPECT_OK(kvcs_blocks_create(&tail));
  EXPECT_OK(kvcs_blocks_add_request(tail, REQ_ID, NUM_TOKENS));
  EXPECT_OK(kvcs_blocks_add_group(tail, REQ_ID, GROUP, 3, &tail_block, 1));
  records tail_records = side_records(consumer, tail, KVCS_ROLE_CONSUMER, 0, identities);
  verifier = NULL;
  EXPECT_OK(kvcs_verifier_create(consumer->tp_size, &verifier));
  EXPECT_OK(kvcs_verifier_expect(verifier, tail, KVCS_ROLE_CONSUMER));
  EXPECT_OK(kvcs_verifier_set_producer_block_size(verifier, GROUP, producer->block_size));
  add_records(verifier, &tail_records, -1);
  EXPECT_OK(kvcs_verifier_check(verifier, REQ_ID, payload, len, &report));
  EXPECT_REPORT(report, KVCS_VERDICT_UNVERIFIED, KVCS_UNVERIFIED_NO_COMMON_POSITION, 0);
  CHECK(only_finding(report, KVCS_UNVERIFIED_NO_COMMON_POSITION, GROUP, "share no position"));
  CHECK(compared_positions(report) == 0);
  kvcs_report_destroy(report);
  kvcs_verifier_destroy(verifier);
  free_records(&tail_records);
  kvcs_blocks_destroy(tail);
  free_records(&r);
}

void test_verify(uint64_t seed) {
  rng_state = (seed ^ 0x7665726966790000ull) | 1;
  uint64_t *all = &logical[0][0][0][0];
  for (size_t i = 0; i < sizeof logical / sizeof logical[0][0][0][0]; i++) {
    all[i] = next_random();
  }
  side producer = producer_side(), consumer_a = consumer_a_side(), consumer_b = consumer_b_side();
  place_side(&producer);
  place_side(&consumer_a);
  place_side(&consumer_b);

  test_names();
  test_base64();
  test_record_errors(&producer);
  test_verifier_errors(&producer, &consumer_b);

  size_t len = 0;
  uint8_t *payload = produce(&producer, 0, 0, &len);
  test_payload_bytes(payload, len, &producer);
  char *text = base64_of(payload, len);
  uint8_t decoded[256];
  size_t decoded_len = 0;
  EXPECT_OK(kvcs_base64_decode(text, strlen(text), decoded, sizeof decoded, &decoded_len));
  CHECK(decoded_len == len && memcmp(decoded, payload, len) == 0);
  /* Detail mode without the extension gives the plain payload, byte for byte. */
  size_t detail_len = 0;
  uint8_t *detail_plain = produce(&producer, 1, 0, &detail_len);
  CHECK(detail_len == len && memcmp(detail_plain, payload, len) == 0);
  free(detail_plain);

  test_consumer_a(&consumer_a, &producer, payload, len);
  test_consumer_b(&consumer_b, &producer, payload, len, text);

  kvcs_report_destroy(NULL);
  CHECK(1); /* destroying NULL returned */
  free(text);
  free(payload);
  free_side(&producer);
  free_side(&consumer_a);
  free_side(&consumer_b);
}
