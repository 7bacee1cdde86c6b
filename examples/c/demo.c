/*
 * kvcsum demo: one request's KV laid out by a "producer" and a "consumer"
 * that share nothing but the logical KV, checksummed on the host engine.
 *
 * Build and run: `make demo` (builds target/release/libkvcsum.so and this
 * file, then runs it). By hand, from the repository root:
 *   make lib   # cargo build --release --lib, plus the libkvcsum.so.2 link (its SONAME, the ABI version)
 *   gcc -std=c11 -Wall -Wextra -Wpedantic -Werror -Iinclude examples/c/demo.c \
 *       -Ltarget/release -lkvcsum -Wl,-rpath,$PWD/target/release -o demo && ./demo
 *
 * The model: 4 layers, 4 KV heads of size 64 in bf16 (128 bytes of K and
 * 128 of V per head and token), one request of 100 tokens.
 * - Producer: TP=2 (2 heads per rank), HND blocks of 16 tokens with K and V
 *   side by side in each block (FlashInfer's [blocks, 2, heads, 16, 64]).
 * - Consumer: TP=4 (1 head per rank), NHD blocks of 32 tokens with K and V
 *   in separate regions (FlashAttention's [2, blocks, 32, heads, 64]).
 * Each rank is one kvcs_worker; all of them live in this one process. The
 * demo sums each side's per-position checksums over its ranks, checks that
 * the consumer's 32-token positions equal the sums of the producer's
 * 16-token pairs, then flips one byte of the consumer's KV and shows which
 * position changed.
 *
 * Then verification (SPEC sections 9-10) on a GQA model with 2 KV heads, so
 * that the consumer's TP=4 holds each head on 2 ranks: every worker encodes
 * its record (kvcs_result_encode), the producer's kvcs_verifier sums them
 * into the vLLM payload, sent as base64 in kv_transfer_params, and the
 * consumer's verifier judges the load: an intact transfer (match), one
 * flipped bit in one replica (mismatch at its position; in detail mode also
 * its layer), one worker's record missing (unverified), a corrupted payload
 * (unverified, invalid checksums).
 *
 * Then an offload round trip (SPEC section 8): the producer's blocks go to a
 * host tier with their stored checksums (kvcs_worker_store) and come back
 * into other block ids; one byte goes bad while offloaded, and the load
 * check (kvcs_worker_check_stored) names its position.
 *
 * It exits 0 only when all of that holds (1 otherwise; 2 when a call fails).
 */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvcsum.h"

enum {
  LAYERS = 4,
  KV_HEADS = 4,
  HEAD_BYTES = 64 * 2, /* head size 64, bf16 */
  NUM_TOKENS = 100,
  MAX_TOKENS = 128, /* logical KV generated for this many tokens */
  MAX_RANKS = 4,
  MAX_POSITIONS = 8,
  VERIFY_KV_HEADS = 2, /* the verification part's GQA model */
};

/* The logical KV: what both sides hold, byte by byte. */
static uint8_t logical_kv[LAYERS][KV_HEADS][MAX_TOKENS][2][HEAD_BYTES];

/* Where the K (kv = 0) or V (kv = 1) bytes of one rank's cache live: in
 * which of its buffers, at what offset, with what byte strides. */
typedef struct {
  int buffer;
  size_t offset, layer_stride, block_stride, head_stride, token_stride;
} kv_place;

/* One side (producer or consumer): its parallelism, layout, workers,
 * block table and latest results. */
typedef struct {
  const char *name;
  uint32_t kv_heads; /* KV heads of the model (at most KV_HEADS) */
  uint32_t tp_size;
  uint32_t block_size;
  uint32_t num_blocks; /* allocated per layer; more than the request uses */
  uint32_t num_positions;
  uint32_t block_ids[MAX_POSITIONS];
  kv_place place[2];
  size_t buffer_bytes[2];
  uint8_t *buffers[MAX_RANKS][2];
  kvcs_worker *workers[MAX_RANKS];
  kvcs_blocks *blocks;
  kvcs_result *results[MAX_RANKS];
} side;

#define REQ_ID "req-0"
#define GROUP_ID 0u

/* Calls a kvcsum function; on failure prints why and exits 2. */
#define CALL(expr)                                                                                   \
  do {                                                                                               \
    kvcs_status status_ = (expr);                                                                    \
    if (status_ != KVCS_OK) {                                                                        \
      fprintf(stderr, "demo.c:%d: %s failed: %s: %s\n", __LINE__, #expr, kvcs_status_name(status_),  \
              kvcs_last_error());                                                                    \
      exit(2);                                                                                       \
    }                                                                                                \
  } while (0)

static uint64_t rng_state = 0x6b766373756d0002ull;

static uint64_t next_random(void) {
  rng_state ^= rng_state >> 12;
  rng_state ^= rng_state << 25;
  rng_state ^= rng_state >> 27;
  return rng_state * 0x2545F4914F6CDD1Dull;
}

static void fill_logical_kv(void) {
  uint8_t *bytes = &logical_kv[0][0][0][0][0];
  for (size_t i = 0; i < sizeof logical_kv; i++) {
    bytes[i] = (uint8_t)(next_random() >> 56);
  }
}

/* Heads per rank; with more ranks than heads, each rank holds one head and
 * `replicas` consecutive ranks hold the same one (SPEC section 4). */
static uint32_t heads_per_rank(const side *s) { return s->tp_size <= s->kv_heads ? s->kv_heads / s->tp_size : 1; }

static uint32_t replicas(const side *s) { return s->tp_size > s->kv_heads ? s->tp_size / s->kv_heads : 1; }

static uint32_t first_head(const side *s, uint32_t rank) { return rank / replicas(s) * heads_per_rank(s); }

/* The producer: TP=2, HND [blocks, 2, heads, 16 tokens, head] per layer,
 * every layer in one buffer per rank; the request's 7 blocks scattered. */
static side producer_side(uint32_t kv_heads) {
  side s = {.name = "producer", .kv_heads = kv_heads, .tp_size = 2, .block_size = 16, .num_blocks = 16,
            .num_positions = 7,
            .block_ids = {9, 3, 14, 0, 7, 12, 5}};
  size_t heads = heads_per_rank(&s);
  size_t head_stride = s.block_size * HEAD_BYTES;
  size_t block_stride = 2 * heads * head_stride;
  size_t layer_stride = s.num_blocks * block_stride;
  s.place[0] = (kv_place){0, 0, layer_stride, block_stride, head_stride, HEAD_BYTES};
  s.place[1] = (kv_place){0, heads * head_stride, layer_stride, block_stride, head_stride, HEAD_BYTES};
  s.buffer_bytes[0] = LAYERS * layer_stride;
  return s;
}

/* The consumer: TP=4, NHD [blocks, 32 tokens, heads, head] per layer, K of
 * every layer in one buffer per rank and V in another. */
static side consumer_side(uint32_t kv_heads) {
  side s = {.name = "consumer", .kv_heads = kv_heads, .tp_size = 4, .block_size = 32, .num_blocks = 8,
            .num_positions = 4,
            .block_ids = {6, 1, 4, 2}};
  size_t heads = heads_per_rank(&s);
  size_t token_stride = heads * HEAD_BYTES;
  size_t block_stride = s.block_size * token_stride;
  size_t layer_stride = s.num_blocks * block_stride;
  s.place[0] = (kv_place){0, 0, layer_stride, block_stride, HEAD_BYTES, token_stride};
  s.place[1] = (kv_place){1, 0, layer_stride, block_stride, HEAD_BYTES, token_stride};
  s.buffer_bytes[0] = LAYERS * layer_stride;
  s.buffer_bytes[1] = LAYERS * layer_stride;
  return s;
}

/* The K (kv = 0) or V (kv = 1) bytes of (layer, local head, block, slot) on `rank`. */
static uint8_t *cell_part(const side *s, uint32_t rank, int kv, uint32_t layer, uint32_t head, uint32_t block,
                          uint32_t slot) {
  const kv_place *p = &s->place[kv];
  return s->buffers[rank][p->buffer] + p->offset + layer * p->layer_stride + block * p->block_stride +
         head * p->head_stride + slot * p->token_stride;
}

/* Allocates each rank's buffers (random bytes: unused blocks and slots hold
 * junk, as a real cache does) and writes the request's KV into its blocks.
 * Slots past NUM_TOKENS in the last block get junk too: decode tokens. */
static void write_kv(side *s) {
  for (uint32_t rank = 0; rank < s->tp_size; rank++) {
    for (int b = 0; b < 2; b++) {
      if (s->buffer_bytes[b] == 0) {
        continue;
      }
      s->buffers[rank][b] = aligned_alloc(64, s->buffer_bytes[b]);
      if (s->buffers[rank][b] == NULL) {
        fprintf(stderr, "out of memory\n");
        exit(2);
      }
      for (size_t i = 0; i < s->buffer_bytes[b]; i++) {
        s->buffers[rank][b][i] = (uint8_t)next_random();
      }
    }
    for (uint32_t q = 0; q < s->num_positions; q++)
      for (uint32_t slot = 0; slot < s->block_size; slot++) {
        uint32_t token = q * s->block_size + slot;
        if (token >= NUM_TOKENS) {
          continue;
        }
        for (uint32_t layer = 0; layer < LAYERS; layer++)
          for (uint32_t head = 0; head < heads_per_rank(s); head++)
            for (int kv = 0; kv < 2; kv++) {
              uint32_t global_head = first_head(s, rank) + head;
              memcpy(cell_part(s, rank, kv, layer, head, s->block_ids[q], slot),
                     logical_kv[layer][global_head][token][kv], HEAD_BYTES);
            }
      }
  }
}

/* One host worker per rank: its buffers, group 0, one kvcs_layer per layer
 * (global heads rank*h .. rank*h + h - 1, K segment then V segment). */
static void register_workers(side *s) {
  for (uint32_t rank = 0; rank < s->tp_size; rank++) {
    kvcs_worker_options options = {
        .tp_rank = rank, .tp_size = s->tp_size, .pp_rank = 0, .device = KVCS_HOST, .num_threads = 1};
    CALL(kvcs_worker_create(&options, &s->workers[rank]));
    kvcs_worker *worker = s->workers[rank];
    for (int b = 0; b < 2; b++) {
      if (s->buffers[rank][b] != NULL) {
        CALL(kvcs_worker_add_region(worker, (uint64_t)(uintptr_t)s->buffers[rank][b], s->buffer_bytes[b]));
      }
    }
    CALL(kvcs_worker_add_group(worker, GROUP_ID, s->block_size));
    for (uint32_t layer = 0; layer < LAYERS; layer++) {
      kvcs_segment segments[2];
      for (int kv = 0; kv < 2; kv++) {
        const kv_place *p = &s->place[kv];
        segments[kv] = (kvcs_segment){
            .address = (uint64_t)(uintptr_t)cell_part(s, rank, kv, layer, 0, 0, 0),
            .block_stride = (int64_t)p->block_stride,
            .kernel_block_stride = 0,
            .head_stride = (int64_t)p->head_stride,
            .token_stride = (int64_t)p->token_stride,
            .bytes_per_token = HEAD_BYTES,
        };
      }
      char identity[64];
      int identity_len = snprintf(identity, sizeof identity, "('model.layers.%u.self_attn.attn', 'bfloat16')", layer);
      kvcs_layer desc = {
          .group_id = GROUP_ID,
          .layer_number = layer,
          .first_head = first_head(s, rank),
          .num_heads = heads_per_rank(s),
          .replicas = replicas(s),
          .replica_index = rank % replicas(s),
          .num_blocks = s->num_blocks,
          .kernel_blocks = 1,
          .tokens_per_kernel_block = s->block_size,
          .num_segments = 2,
          .segments = segments,
          .identity = (const uint8_t *)identity,
          .identity_len = (size_t)identity_len,
      };
      CALL(kvcs_worker_add_layer(worker, &desc));
    }
  }
}

/* The side's block set: one request, its block ids from position 0. */
static void make_blocks(side *s) {
  CALL(kvcs_blocks_create(&s->blocks));
  CALL(kvcs_blocks_add_request(s->blocks, REQ_ID, NUM_TOKENS));
  CALL(kvcs_blocks_add_group(s->blocks, REQ_ID, GROUP_ID, 0, s->block_ids, s->num_positions));
}

/* Every rank's partial checksums in `role`, kept in s->results. */
static void checksum_side(side *s, kvcs_role role) {
  for (uint32_t rank = 0; rank < s->tp_size; rank++) {
    kvcs_result_destroy(s->results[rank]);
    s->results[rank] = NULL;
    CALL(kvcs_worker_checksum(s->workers[rank], s->blocks, role, NULL, &s->results[rank]));
    CALL(kvcs_result_wait(s->results[rank]));
  }
}

/* Per position, the sum over ranks of their (single, unreplicated) column. */
static void sum_over_ranks(const side *s, uint64_t sums[MAX_POSITIONS]) {
  memset(sums, 0, MAX_POSITIONS * sizeof sums[0]);
  for (uint32_t rank = 0; rank < s->tp_size; rank++) {
    uint64_t first_position = 0;
    size_t num_positions = 0, num_columns = 0;
    CALL(kvcs_result_group(s->results[rank], REQ_ID, GROUP_ID, &first_position, &num_positions, &num_columns));
    uint64_t values[MAX_POSITIONS];
    uint32_t replicas = 0, replica_index = 0;
    if (num_columns != 1 || num_positions != s->num_positions || first_position != 0) {
      fprintf(stderr, "%s rank %u: unexpected result shape\n", s->name, rank);
      exit(1);
    }
    CALL(kvcs_result_column(s->results[rank], REQ_ID, GROUP_ID, 0, &replicas, &replica_index, values));
    for (size_t q = 0; q < num_positions; q++) {
      sums[q] += values[q];
    }
  }
}

/* Prints both sides per consumer position and returns how many differ:
 * the consumer's position q covers the producer's positions 2q and 2q+1. */
static int compare_sides(const side *producer, const uint64_t producer_sums[MAX_POSITIONS], const side *consumer,
                         const uint64_t consumer_sums[MAX_POSITIONS]) {
  uint32_t ratio = consumer->block_size / producer->block_size;
  int differing = 0;
  char producer_title[64], consumer_title[64];
  snprintf(producer_title, sizeof producer_title, "producer %u-token blocks, sum of %u ranks", producer->block_size,
           producer->tp_size);
  snprintf(consumer_title, sizeof consumer_title, "consumer, sum of %u ranks", consumer->tp_size);
  printf("  %3s  %-8s %-46s   %-18s   %s\n", "pos", "tokens", producer_title, "pair sum", consumer_title);
  for (uint32_t q = 0; q < consumer->num_positions; q++) {
    uint64_t pair_sum = 0;
    char pair[80] = "";
    size_t used = 0;
    for (uint32_t k = 0; k < ratio; k++) {
      uint32_t p = q * ratio + k;
      if (p < producer->num_positions) {
        pair_sum += producer_sums[p];
        used += (size_t)snprintf(pair + used, sizeof pair - used, "%s[%u] %#018" PRIx64, k ? " + " : "", p,
                                 producer_sums[p]);
      }
    }
    uint32_t first = q * consumer->block_size;
    uint32_t end = first + consumer->block_size < NUM_TOKENS ? first + consumer->block_size : NUM_TOKENS;
    int equal = pair_sum == consumer_sums[q];
    differing += !equal;
    printf("  %3u  %3u..%-3u %-46s = %#018" PRIx64 "   %#018" PRIx64 "  %s\n", q, first, end, pair, pair_sum,
           consumer_sums[q], equal ? "equal" : "DIFFERENT");
  }
  return differing;
}

/* Flips every bit of one byte of the consumer's V: layer 1, global head 2
 * (consumer rank 2), token 45 (position 1, slot 13), byte 17. Returns the
 * position that holds it. */
static uint32_t flip_consumer_byte(side *consumer) {
  const uint32_t layer = 1, head = 2, token = 45, byte = 17;
  uint32_t rank = head / heads_per_rank(consumer);
  uint32_t position = token / consumer->block_size;
  uint32_t slot = token % consumer->block_size;
  uint8_t *cell = cell_part(consumer, rank, 1, layer, head % heads_per_rank(consumer), consumer->block_ids[position],
                            slot);
  cell[byte] ^= 0xFF;
  printf("\nflipped V byte %u of layer %u, head %u, token %u (consumer rank %u, block %u, slot %u)\n", byte, layer,
         head, token, rank, consumer->block_ids[position], slot);
  return position;
}

static void free_side(side *s) {
  kvcs_blocks_destroy(s->blocks);
  for (uint32_t rank = 0; rank < s->tp_size; rank++) {
    kvcs_result_destroy(s->results[rank]);
    kvcs_worker_destroy(s->workers[rank]);
    free(s->buffers[rank][0]);
    free(s->buffers[rank][1]);
  }
}

/* ---------------------------------------------------------------------------
 * Verification: the two sides' schedulers exchange the workers' records and
 * the producer's payload, and the consumer judges each load (SPEC 9, 10).
 * The model has 2 KV heads here, so the consumer's TP=4 holds every head on
 * 2 ranks (replica key (2, rank % 2)): each copy is checked separately.
 * ------------------------------------------------------------------------- */

/* Each rank's record (kvcs_result_encode) of the side's request in `role`;
 * records[rank] is malloc'd, lens[rank] its length. */
static void encode_records(side *s, kvcs_role role, uint8_t *records[MAX_RANKS], size_t lens[MAX_RANKS]) {
  checksum_side(s, role);
  for (uint32_t rank = 0; rank < s->tp_size; rank++) {
    /* (NULL, 0) asks for the size: KVCS_ERR_BUFFER_TOO_SMALL with lens[rank] set. */
    if (kvcs_result_encode(s->results[rank], NULL, 0, &lens[rank]) != KVCS_ERR_BUFFER_TOO_SMALL) {
      fprintf(stderr, "%s rank %u: no record size: %s\n", s->name, rank, kvcs_last_error());
      exit(2);
    }
    records[rank] = malloc(lens[rank]);
    if (records[rank] == NULL) {
      fprintf(stderr, "out of memory\n");
      exit(2);
    }
    CALL(kvcs_result_encode(s->results[rank], records[rank], lens[rank], &lens[rank]));
  }
}

/* The producer's scheduler: takes every worker's record and returns the
 * payload as the base64 text that goes into kv_transfer_params under
 * "kv_checksums" (malloc'd). `extension` = 1 adds the kvcsum extension
 * (block size, TP size, algorithm, per-layer partials in detail mode), which
 * vLLM's own decoder does not read; 0 gives the plain, vLLM-compatible
 * payload for KVCS_ALGORITHM_WEIGHTED workers only: the workers here use the
 * default, KVCS_ALGORITHM_MIXED2, whose payload always carries the extension
 * (a plain payload means weighted). */
static char *produce_payload(side *producer, uint32_t extension) {
  kvcs_verifier *verifier = NULL;
  CALL(kvcs_verifier_create(producer->tp_size, &verifier));
  CALL(kvcs_verifier_set_extension(verifier, extension));
  CALL(kvcs_verifier_expect(verifier, producer->blocks, KVCS_ROLE_PRODUCER));
  uint8_t *records[MAX_RANKS];
  size_t lens[MAX_RANKS];
  encode_records(producer, KVCS_ROLE_PRODUCER, records, lens);
  for (uint32_t rank = 0; rank < producer->tp_size; rank++) {
    CALL(kvcs_verifier_add_record(verifier, records[rank], lens[rank]));
    free(records[rank]);
  }
  size_t payload_len = 0, text_len = 0;
  if (kvcs_verifier_payload(verifier, REQ_ID, NULL, 0, &payload_len) != KVCS_ERR_BUFFER_TOO_SMALL) {
    fprintf(stderr, "no payload size: %s\n", kvcs_last_error());
    exit(2);
  }
  uint8_t *payload = malloc(payload_len);
  char *text = NULL;
  if (payload != NULL) {
    CALL(kvcs_verifier_payload(verifier, REQ_ID, payload, payload_len, &payload_len));
    (void)kvcs_base64_encode(payload, payload_len, NULL, 0, &text_len); /* size, NUL included */
    text = malloc(text_len);
  }
  if (text == NULL) {
    fprintf(stderr, "out of memory\n");
    exit(2);
  }
  CALL(kvcs_base64_encode(payload, payload_len, text, text_len, &text_len));
  free(payload);
  kvcs_verifier_destroy(verifier);
  return text;
}

/* Prints a report: the verdict, whether the load passes, and what differs
 * (groups, positions, replica checks, layers) or why it was not verified. */
static void print_report(const kvcs_report *report) {
  uint32_t verdict = 0, passed = 0;
  size_t num_mismatches = 0, num_unverified = 0;
  CALL(kvcs_report_verdict(report, &verdict));
  CALL(kvcs_report_passed(report, &passed));
  CALL(kvcs_report_num_mismatches(report, &num_mismatches));
  CALL(kvcs_report_num_unverified(report, &num_unverified));
  printf("  -> %s, the load %s\n", kvcs_verdict_name(verdict), passed ? "passes" : "fails");
  for (size_t i = 0; i < num_mismatches; i++) {
    kvcs_mismatch mismatch;
    uint32_t check = 0;
    CALL(kvcs_report_mismatch(report, i, &mismatch));
    CALL(kvcs_report_failed_check(report, i, 0, &check));
    printf("     group %u, position %" PRIu64 " (tokens %" PRIu64 "..%" PRIu64 "): replica check %u differs\n",
           mismatch.group_id, mismatch.first_position, mismatch.first_token,
           mismatch.first_token + mismatch.num_tokens, check);
    for (size_t j = 0; j < mismatch.num_layers; j++) {
      kvcs_layer_difference layer;
      CALL(kvcs_report_layer_difference(report, i, j, &layer));
      if (layer.num_heads == 1) {
        printf("     layer %u, head %u differs (replica check %u)\n", layer.layer_number, layer.first_head,
               layer.check);
      } else {
        printf("     layer %u, heads %u..%u differ (replica check %u)\n", layer.layer_number, layer.first_head,
               layer.first_head + layer.num_heads - 1, layer.check);
      }
    }
  }
  for (size_t i = 0; i < num_unverified; i++) {
    uint32_t reason = 0;
    const char *message = NULL;
    CALL(kvcs_report_unverified(report, i, &reason, NULL, &message));
    printf("     %s: %s\n", kvcs_unverified_reason_name(reason), message);
  }
}

/* The consumer's scheduler: the records of every rank except `missing_rank`
 * (-1: none), then the verdict on the load against the payload text. A plain
 * payload does not say the producer's block size, so the consumer's
 * scheduler is told it (from the transfer handshake, say). Prints the
 * report; returns whether the verdict is `expected` with `expected_reason`. */
static int judge(const char *title, side *consumer, const char *payload_base64, int missing_rank,
                 uint32_t producer_block_size, uint32_t expected, uint32_t expected_reason) {
  kvcs_verifier *verifier = NULL;
  CALL(kvcs_verifier_create(consumer->tp_size, &verifier));
  CALL(kvcs_verifier_set_producer_block_size(verifier, GROUP_ID, producer_block_size));
  CALL(kvcs_verifier_expect(verifier, consumer->blocks, KVCS_ROLE_CONSUMER));
  uint8_t *records[MAX_RANKS];
  size_t lens[MAX_RANKS];
  encode_records(consumer, KVCS_ROLE_CONSUMER, records, lens);
  for (uint32_t rank = 0; rank < consumer->tp_size; rank++) {
    if ((int)rank != missing_rank) {
      CALL(kvcs_verifier_add_record(verifier, records[rank], lens[rank]));
    }
    free(records[rank]);
  }
  kvcs_report *report = NULL;
  CALL(kvcs_verifier_check_base64(verifier, REQ_ID, payload_base64, &report));
  printf("%s\n", title);
  print_report(report);
  uint32_t verdict = 0, reason = 0;
  CALL(kvcs_report_verdict(report, &verdict));
  CALL(kvcs_report_reason(report, &reason));
  kvcs_report_destroy(report);
  kvcs_verifier_destroy(verifier);
  int ok = verdict == expected && reason == expected_reason;
  if (!ok) {
    printf("  expected %s (%s): FAILED\n", kvcs_verdict_name(expected), kvcs_unverified_reason_name(expected_reason));
  }
  return ok;
}

/* Flips bit 0 of K byte 5 of layer 2, global head 0, token 40 on consumer
 * rank 1, which holds head 0 as replica 1 of 2 (rank 0 holds the other copy). */
static void flip_replica_bit(side *consumer) {
  const uint32_t rank = 1, layer = 2, token = 40, byte = 5;
  uint32_t position = token / consumer->block_size;
  cell_part(consumer, rank, 0, layer, 0, consumer->block_ids[position], token % consumer->block_size)[byte] ^= 1;
}

/* Producer TP=2 and consumer TP=4 with GQA replicas exchange records and the
 * base64 payload; the consumer's verdicts for an intact transfer, a flipped
 * bit in one replica (plain and detail mode), a missing record and a
 * corrupted payload. Returns 1 when every verdict is the expected one. */
static int verification_demo(void) {
  printf("\n== verification: %u layers, %u KV heads; producer TP=2 (16-token blocks), consumer TP=4 (32-token\n"
         "   blocks), each head on 2 consumer ranks; records -> verifier -> kv_transfer_params -> verdict\n",
         LAYERS, VERIFY_KV_HEADS);
  side producer = producer_side(VERIFY_KV_HEADS);
  side consumer = consumer_side(VERIFY_KV_HEADS);
  side *sides[2] = {&producer, &consumer};
  for (int i = 0; i < 2; i++) {
    write_kv(sides[i]);
    register_workers(sides[i]);
    make_blocks(sides[i]);
  }
  int ok = 1;
  char *plain = produce_payload(&producer, 0);
  printf("kv_transfer_params[\"kv_checksums\"] = \"%.40s...\" (%zu characters; MIXED2 values, so with the kvcsum\n"
         "   extension that names the algorithm)\n",
         plain, strlen(plain));
  ok &= judge("intact transfer:", &consumer, plain, -1, producer.block_size, KVCS_VERDICT_MATCH,
              KVCS_UNVERIFIED_NONE);

  flip_replica_bit(&consumer);
  ok &= judge("one flipped bit in consumer rank 1 (replica 1 of head 0), layer 2, token 40:", &consumer, plain, -1,
              producer.block_size, KVCS_VERDICT_MISMATCH, KVCS_UNVERIFIED_NONE);
  for (int i = 0; i < 2; i++) {
    for (uint32_t rank = 0; rank < sides[i]->tp_size; rank++) {
      CALL(kvcs_worker_set_detail(sides[i]->workers[rank], 1));
    }
  }
  char *detailed = produce_payload(&producer, 1);
  ok &= judge("the same in detail mode (per-layer partials in the payload extension):", &consumer, detailed, -1,
              producer.block_size, KVCS_VERDICT_MISMATCH, KVCS_UNVERIFIED_NONE);
  flip_replica_bit(&consumer); /* flipped back: the KV is intact again */

  ok &= judge("consumer rank 3's record missing:", &consumer, plain, 3, producer.block_size,
              KVCS_VERDICT_UNVERIFIED, KVCS_UNVERIFIED_WORKERS_MISSING);
  plain[10] = '!'; /* the payload text corrupted on the way */
  ok &= judge("corrupted payload (one base64 character changed):", &consumer, plain, -1, producer.block_size,
              KVCS_VERDICT_UNVERIFIED, KVCS_UNVERIFIED_INVALID_CHECKSUMS);

  free(plain);
  free(detailed);
  for (int i = 0; i < 2; i++) {
    free_side(sides[i]);
  }
  return ok;
}

/* ---------------------------------------------------------------------------
 * Offload round trip with stored checksums (SPEC section 8)
 * ------------------------------------------------------------------------- */

/* The producer's blocks go to an offload tier (host memory) with their stored
 * checksums and come back into other block ids; one byte is corrupted while
 * offloaded, and the load check names its position. Returns whether it did. */
static int offload_demo(side *s) {
  enum { HASH_BYTES = 32, CORRUPT_POSITION = 3 };
  printf("\n== offload: the producer's %u blocks to a host tier with their stored checksums and back\n",
         s->num_positions);
  const kv_place *p = &s->place[0]; /* HND: a block's K and V lie in one stretch per layer */
  size_t block_bytes = p->block_stride;
  uint8_t hashes[MAX_POSITIONS * HASH_BYTES];
  for (size_t i = 0; i < sizeof hashes; i++) {
    hashes[i] = (uint8_t)next_random(); /* stand-ins for vLLM's block hashes */
  }
  CALL(kvcs_blocks_set_hashes(s->blocks, REQ_ID, GROUP_ID, hashes, HASH_BYTES, s->num_positions));
  uint64_t *stored[MAX_RANKS];
  uint8_t *tier[MAX_RANKS];
  uint64_t tier_stored[MAX_RANKS][MAX_POSITIONS][KVCS_BLOCK_CHECKSUM_BYTES / 8];
  uint32_t loaded_ids[MAX_POSITIONS];
  for (uint32_t q = 0; q < s->num_positions; q++) {
    loaded_ids[q] = (s->block_ids[q] + 1) % s->num_blocks; /* other ids: 10, 4, 15, 1, 8, 13, 6 */
  }
  kvcs_blocks *loaded;
  CALL(kvcs_blocks_create(&loaded));
  CALL(kvcs_blocks_add_request(loaded, REQ_ID, NUM_TOKENS));
  CALL(kvcs_blocks_add_group(loaded, REQ_ID, GROUP_ID, 0, loaded_ids, s->num_positions));
  CALL(kvcs_blocks_set_hashes(loaded, REQ_ID, GROUP_ID, hashes, HASH_BYTES, s->num_positions));
  int ok = 1;
  uint32_t failed_total[MAX_POSITIONS] = {0};
  for (uint32_t rank = 0; rank < s->tp_size; rank++) {
    stored[rank] = calloc(s->num_blocks, KVCS_BLOCK_CHECKSUM_BYTES); /* value, stamp per block id */
    tier[rank] = malloc((size_t)s->num_positions * LAYERS * block_bytes);
    if (stored[rank] == NULL || tier[rank] == NULL) {
      fprintf(stderr, "out of memory\n");
      exit(2);
    }
    /* A host worker writes its stored values in memory it was given as a region. */
    CALL(kvcs_worker_add_region(s->workers[rank], (uint64_t)(uintptr_t)stored[rank],
                                (uint64_t)s->num_blocks * KVCS_BLOCK_CHECKSUM_BYTES));
    CALL(kvcs_worker_add_stored(s->workers[rank], GROUP_ID, (uint64_t)(uintptr_t)stored[rank], s->num_blocks));
    kvcs_result *result;
    CALL(kvcs_worker_store(s->workers[rank], s->blocks, NULL, &result));
    kvcs_result_destroy(result);
    /* Offload: each block's bytes of every layer, and its 16 stored bytes. */
    for (uint32_t q = 0; q < s->num_positions; q++) {
      for (uint32_t layer = 0; layer < LAYERS; layer++) {
        memcpy(tier[rank] + ((size_t)q * LAYERS + layer) * block_bytes,
               s->buffers[rank][0] + layer * p->layer_stride + s->block_ids[q] * p->block_stride, block_bytes);
      }
      memcpy(tier_stored[rank][q], stored[rank] + 2 * (size_t)s->block_ids[q], KVCS_BLOCK_CHECKSUM_BYTES);
    }
  }
  /* One byte of position 3 goes bad in the tier (rank 1, layer 2, K of its first head, token 2 of the block). */
  tier[1][((size_t)CORRUPT_POSITION * LAYERS + 2) * block_bytes + 2 * HEAD_BYTES + 17] ^= 0x08;
  printf("flipped a byte of position %d on producer rank 1 while offloaded\n", CORRUPT_POSITION);
  for (uint32_t rank = 0; rank < s->tp_size; rank++) {
    /* Load back into other block ids, the stored values with them. */
    for (uint32_t q = 0; q < s->num_positions; q++) {
      for (uint32_t layer = 0; layer < LAYERS; layer++) {
        memcpy(s->buffers[rank][0] + layer * p->layer_stride + loaded_ids[q] * p->block_stride,
               tier[rank] + ((size_t)q * LAYERS + layer) * block_bytes, block_bytes);
      }
      memcpy(stored[rank] + 2 * (size_t)loaded_ids[q], tier_stored[rank][q], KVCS_BLOCK_CHECKSUM_BYTES);
    }
    kvcs_result *result;
    uint8_t outcomes[MAX_POSITIONS];
    CALL(kvcs_worker_check_stored(s->workers[rank], loaded, NULL, &result));
    CALL(kvcs_result_stored(result, REQ_ID, GROUP_ID, outcomes));
    kvcs_result_destroy(result);
    printf("rank %u load check:", rank);
    for (uint32_t q = 0; q < s->num_positions; q++) {
      printf(" %s", outcomes[q] == KVCS_STORED_MATCHED ? "ok" : outcomes[q] == KVCS_STORED_FAILED ? "FAILED" : "-");
      failed_total[q] += outcomes[q] == KVCS_STORED_FAILED;
    }
    printf("\n");
  }
  for (uint32_t q = 0; q < s->num_positions; q++) {
    int failed = failed_total[q] > 0;
    if (failed) {
      printf("position %u failed its load check (tokens %u..%u): re-fetch or recompute it\n", q, q * s->block_size,
             (q + 1) * s->block_size);
    }
    if (failed != (q == CORRUPT_POSITION)) {
      printf("position %u: %s: FAILED\n", q, failed ? "failed unexpectedly" : "not caught");
      ok = 0;
    }
  }
  for (uint32_t rank = 0; rank < s->tp_size; rank++) {
    free(stored[rank]);
    free(tier[rank]);
  }
  kvcs_blocks_destroy(loaded);
  return ok;
}

int main(void) {
  if (kvcs_abi_version() != KVCS_ABI_VERSION) {
    fprintf(stderr, "libkvcsum ABI %u, header ABI %u\n", kvcs_abi_version(), (unsigned)KVCS_ABI_VERSION);
    return 2;
  }
  printf("kvcsum %s demo: %u layers, %u KV heads of size 64 (bf16), one request of %u tokens\n", kvcs_version(),
         LAYERS, KV_HEADS, NUM_TOKENS);
  printf("producer: TP=2, HND, 16-token blocks (K and V side by side per block)\n");
  printf("consumer: TP=4, NHD, 32-token blocks (K and V in separate regions)\n\n");

  fill_logical_kv();
  side producer = producer_side(KV_HEADS);
  side consumer = consumer_side(KV_HEADS);
  side *sides[2] = {&producer, &consumer};
  for (int i = 0; i < 2; i++) {
    write_kv(sides[i]);
    register_workers(sides[i]);
    make_blocks(sides[i]);
  }

  uint64_t producer_sums[MAX_POSITIONS], consumer_sums[MAX_POSITIONS];
  checksum_side(&producer, KVCS_ROLE_PRODUCER);
  checksum_side(&consumer, KVCS_ROLE_CONSUMER);
  sum_over_ranks(&producer, producer_sums);
  sum_over_ranks(&consumer, consumer_sums);
  int differing = compare_sides(&producer, producer_sums, &consumer, consumer_sums);
  int ok = differing == 0;
  if (ok) {
    printf("all %u positions equal\n", consumer.num_positions);
  } else {
    printf("%d positions differ: FAILED\n", differing);
  }

  uint32_t flipped = flip_consumer_byte(&consumer);
  checksum_side(&consumer, KVCS_ROLE_CONSUMER);
  uint64_t corrupted_sums[MAX_POSITIONS];
  sum_over_ranks(&consumer, corrupted_sums);
  compare_sides(&producer, producer_sums, &consumer, corrupted_sums);
  for (uint32_t q = 0; q < consumer.num_positions; q++) {
    int changed = corrupted_sums[q] != consumer_sums[q];
    if (changed) {
      printf("position %u changed (tokens %u..%u)\n", q, q * consumer.block_size, (q + 1) * consumer.block_size);
    }
    if (changed != (q == flipped)) {
      printf("position %u %s: FAILED\n", q, changed ? "changed unexpectedly" : "did not change");
      ok = 0;
    }
  }

  ok &= offload_demo(&producer);
  for (int i = 0; i < 2; i++) {
    free_side(sides[i]);
  }
  ok &= verification_demo();
  printf(ok ? "demo: OK\n" : "demo: FAILED\n");
  return ok ? 0 : 1;
}
