/*
 * Checksums of a small random cache, in several memory layouts, against a
 * naive reference of SPEC sections 2-3 and 12 that loops over logical
 * indices (layer, head, token, piece) of the logical KV and never looks at
 * memory, under both algorithms.
 */
#include <inttypes.h>
#include <stdlib.h>

#include "check.h"

/* The logical KV: 3 layers with model-wide numbers 0, 5, 17; 3 global
 * heads; 6 blocks of 8 tokens; a cell of k_pieces K pieces then v_pieces V
 * pieces. The tests run with 2 + 3 pieces and with 8 + 16 (whole cache
 * lines per head and token, which the host engine handles apart). */
enum { LAYERS = 3, HEADS = 3, BLOCKS = 6, BLOCK = 8, MAX_PIECES = 24 };
static const uint32_t layer_numbers[LAYERS] = {0, 5, 17};
static uint64_t logical[LAYERS][HEADS][BLOCKS][BLOCK][MAX_PIECES];
static int64_t k_pieces, v_pieces, pieces_per_token;

static uint64_t rng_state;

/* xorshift64*: random data from the test's seed. */
static uint64_t next_random(void) {
  rng_state ^= rng_state >> 12;
  rng_state ^= rng_state << 25;
  rng_state ^= rng_state >> 27;
  return rng_state * 0x2545F4914F6CDD1Dull;
}

/* The algorithm of the workers and the reference. */
static uint32_t algorithm = KVCS_ALGORITHM_MIXED2;

/* One round of MIXED2's f: the low half times k (64-bit), the high half
 * added to the product's high half, the halves swapped. */
static uint64_t mix2_round(uint64_t v, uint32_t k) {
  uint64_t product = (v & 0xFFFFFFFFull) * k;
  uint64_t sum = (v & 0xFFFFFFFF00000000ull) + product;
  return (sum << 32) | (sum >> 32);
}

/* f of SPEC section 12, written here again: the identity for WEIGHTED. */
static uint64_t piece_value(uint64_t x) {
  if (algorithm == KVCS_ALGORITHM_WEIGHTED) {
    return x;
  }
  if (algorithm == KVCS_ALGORITHM_MIXED2) {
    uint64_t v = mix2_round(x, KVCS_MIX2_MULTIPLIER_1);
    v = mix2_round(v, KVCS_MIX2_MULTIPLIER_2);
    v ^= v >> 32;
    v = mix2_round(v, KVCS_MIX2_MULTIPLIER_3);
    return v ^ (v >> 32);
  }
  uint64_t g = (x ^ (x >> 32)) * 0x9E3779B97F4A7C15ull;
  return g ^ (g >> 32);
}

/* SPEC sections 2-3, naively: the checksum of the block at `position` of a
 * request of `num_tokens` tokens, stored in block `block_id`, over global
 * heads `first_head .. first_head + num_heads`. */
static uint64_t reference_checksum(uint32_t block_id, uint64_t position, uint64_t num_tokens, uint32_t first_head,
                                   uint32_t num_heads) {
  uint64_t valid = 0;
  if (num_tokens > position * BLOCK) {
    valid = num_tokens - position * BLOCK;
  }
  if (valid > BLOCK) {
    valid = BLOCK;
  }
  uint64_t block_sum = 0;
  for (uint32_t layer = 0; layer < LAYERS; layer++) {
    for (uint32_t head = first_head; head < first_head + num_heads; head++) {
      uint64_t slice = 0;
      for (uint64_t slot = 0; slot < valid; slot++) {
        uint64_t token = position * BLOCK + slot; /* from the request's start */
        for (uint64_t piece = 0; piece < (uint64_t)pieces_per_token; piece++) {
          uint64_t j = token * pieces_per_token + piece;
          slice += piece_value(logical[layer][head][block_id][slot][piece]) * (2 * j + 1);
        }
      }
      uint64_t m = 2 * ((uint64_t)layer_numbers[layer] * KVCS_MAX_KV_HEADS_PER_LAYER + head) + 1;
      block_sum += m * slice;
    }
  }
  return block_sum;
}

/* Where one segment's pieces live: offsets in pieces within one buffer. */
typedef struct {
  int buffer;
  int64_t offset, layer, block, kernel_block, head, token;
} segment_place;

/* A memory layout of the KV a worker holds (strides in pieces). */
typedef struct {
  const char *name;
  uint32_t kernel_blocks;
  uint32_t num_segments; /* 1: the whole cell; 2: K then V */
  segment_place segments[2];
} layout_desc;

/* The layouts, strides for a worker holding H heads; TK = tokens per
 * kernel block where a block has two. */
enum { H = 2, TK = 4, NUM_LAYOUTS = 6 };
static layout_desc layouts[NUM_LAYOUTS];

static void make_layouts(void) {
  const int64_t k = k_pieces, v = v_pieces, p = pieces_per_token, pad_row = k + 1 + v + 1;
  const layout_desc made[NUM_LAYOUTS] = {
      {"HND, cell in one region", 1, 1, {{0, 0, BLOCKS * H * BLOCK * p, H * BLOCK * p, 0, BLOCK * p, p}}},
      {"HND, K and V side by side per block",
       1,
       2,
       {{0, 0, BLOCKS * H * BLOCK * p, H * BLOCK * p, 0, BLOCK * k, k},
        {0, H * BLOCK * k, BLOCKS * H * BLOCK * p, H * BLOCK * p, 0, BLOCK * v, v}}},
      {"NHD, K and V in separate regions",
       1,
       2,
       {{0, 0, BLOCKS * BLOCK * H * k, BLOCK * H * k, 0, k, H * k},
        {1, 0, BLOCKS * BLOCK * H * v, BLOCK * H * v, 0, v, H * v}}},
      {"cross-layer [blocks, 2 kernel blocks, layers, heads, 4 tokens]",
       2,
       1,
       {{0, 0, H * TK * p, 2 * LAYERS * H * TK * p, LAYERS * H * TK * p, TK * p, p}}},
      {"NHD kernel blocks, K and V interleaved per kernel block",
       2,
       2,
       {{0, 0, BLOCKS * BLOCK * H * p, BLOCK * H * p, TK * H * p, k, H * k},
        {0, TK * H * k, BLOCKS * BLOCK * H * p, BLOCK * H * p, TK * H * p, v, H * v}}},
      {"blocks and heads reversed, padded tokens",
       1,
       2,
       {{0, 0, BLOCKS * H * BLOCK * pad_row, -(H * BLOCK * pad_row), 0, -(BLOCK * pad_row), pad_row},
        {0, k + 1, BLOCKS * H * BLOCK * pad_row, -(H * BLOCK * pad_row), 0, -(BLOCK * pad_row), pad_row}}},
  };
  memcpy(layouts, made, sizeof made);
}

/* One worker's cache: up to two buffers and where piece 0 of each is. */
typedef struct {
  const layout_desc *layout;
  uint32_t first_head, num_heads;
  uint64_t *buffers[2];
  int64_t lengths[2];  /* pieces */
  int64_t shift[2];    /* the offset of the lowest piece, made 0 */
} placed_cache;

static int64_t piece_offset(const segment_place *s, uint32_t layer, uint32_t block, uint32_t head, uint32_t slot,
                            uint32_t piece, uint32_t per_kernel_block) {
  return s->offset + layer * s->layer + block * s->block + (slot / per_kernel_block) * s->kernel_block +
         head * s->head + (slot % per_kernel_block) * s->token + piece;
}

static uint32_t segment_pieces(const layout_desc *layout, uint32_t segment) {
  return (uint32_t)(layout->num_segments == 1 ? pieces_per_token : (segment == 0 ? k_pieces : v_pieces));
}

/* Lays global heads `first_head .. first_head + num_heads` (at most H) of
 * the logical KV out in memory per `layout`, over random bytes (so padding
 * and unused slots are never zero). */
static placed_cache place(const layout_desc *layout, uint32_t first_head, uint32_t num_heads) {
  placed_cache cache = {.layout = layout, .first_head = first_head, .num_heads = num_heads};
  const uint32_t per_kernel_block = BLOCK / layout->kernel_blocks;
  int64_t low[2] = {INT64_MAX, INT64_MAX}, high[2] = {INT64_MIN, INT64_MIN};
  for (int pass = 0; pass < 2; pass++) {
    for (uint32_t s = 0; s < layout->num_segments; s++) {
      const segment_place *seg = &layout->segments[s];
      uint32_t first_piece = (s == 0) ? 0 : (uint32_t)k_pieces;
      for (uint32_t layer = 0; layer < LAYERS; layer++)
        for (uint32_t block = 0; block < BLOCKS; block++)
          for (uint32_t head = 0; head < H; head++)
            for (uint32_t slot = 0; slot < BLOCK; slot++)
              for (uint32_t piece = 0; piece < segment_pieces(layout, s); piece++) {
                int64_t at = piece_offset(seg, layer, block, head, slot, piece, per_kernel_block);
                int b = seg->buffer;
                if (pass == 0) {
                  low[b] = at < low[b] ? at : low[b];
                  high[b] = at > high[b] ? at : high[b];
                } else if (head < num_heads) {
                  cache.buffers[b][at - cache.shift[b]] =
                      logical[layer][first_head + head][block][slot][first_piece + piece];
                }
              }
    }
    if (pass == 0) {
      for (int b = 0; b < 2; b++) {
        if (low[b] > high[b]) {
          continue;
        }
        cache.shift[b] = low[b];
        cache.lengths[b] = high[b] - low[b] + 1;
        cache.buffers[b] = malloc((size_t)cache.lengths[b] * sizeof(uint64_t));
        CHECK(cache.buffers[b] != NULL);
        for (int64_t i = 0; i < cache.lengths[b]; i++) {
          cache.buffers[b][i] = next_random();
        }
      }
    }
  }
  return cache;
}

static void free_cache(placed_cache *cache) {
  free(cache->buffers[0]);
  free(cache->buffers[1]);
}

/* A host worker over `cache`: group 0 (block size 8), one kvcs_layer per layer. */
static kvcs_worker *make_worker(const placed_cache *cache, uint32_t num_threads) {
  kvcs_worker_options options = {
      .tp_rank = 0, .tp_size = 1, .pp_rank = 0, .device = KVCS_HOST, .num_threads = num_threads};
  kvcs_worker *worker = NULL;
  EXPECT_OK(kvcs_worker_create(&options, &worker));
  EXPECT_OK(kvcs_worker_set_algorithm(worker, algorithm));
  for (int b = 0; b < 2; b++) {
    if (cache->buffers[b] != NULL) {
      EXPECT_OK(kvcs_worker_add_region(worker, (uint64_t)(uintptr_t)cache->buffers[b],
                                       (uint64_t)cache->lengths[b] * 8));
    }
  }
  EXPECT_OK(kvcs_worker_add_group(worker, 0, BLOCK));
  const layout_desc *layout = cache->layout;
  for (uint32_t layer = 0; layer < LAYERS; layer++) {
    kvcs_segment segments[2];
    for (uint32_t s = 0; s < layout->num_segments; s++) {
      const segment_place *seg = &layout->segments[s];
      segments[s] = (kvcs_segment){
          .address = (uint64_t)(uintptr_t)cache->buffers[seg->buffer] +
                     8 * (uint64_t)(seg->offset + layer * seg->layer - cache->shift[seg->buffer]),
          .block_stride = 8 * seg->block,
          .kernel_block_stride = 8 * seg->kernel_block,
          .head_stride = 8 * seg->head,
          .token_stride = 8 * seg->token,
          .bytes_per_token = 8 * segment_pieces(layout, s),
      };
    }
    char identity[32];
    int identity_len = snprintf(identity, sizeof identity, "layer.%u", layer_numbers[layer]);
    kvcs_layer desc = {
        .group_id = 0,
        .layer_number = layer_numbers[layer],
        .first_head = cache->first_head,
        .num_heads = cache->num_heads,
        .replicas = 1,
        .replica_index = 0,
        .num_blocks = BLOCKS,
        .kernel_blocks = layout->kernel_blocks,
        .tokens_per_kernel_block = BLOCK / layout->kernel_blocks,
        .num_segments = layout->num_segments,
        .segments = segments,
        .identity = (const uint8_t *)identity,
        .identity_len = (size_t)identity_len,
    };
    EXPECT_OK(kvcs_worker_add_layer(worker, &desc));
  }
  return worker;
}

/* The requests: positions from 0 and from 2, a last block partly or not
 * at all filled, a block used twice. */
typedef struct {
  const char *req_id;
  uint64_t num_tokens;
  uint64_t first_position;
  size_t n;
  uint32_t block_ids[4];
} request_desc;
static const request_desc requests[] = {
    {"full-then-partial", 21, 0, 3, {4, 1, 3}},
    {"from-position-2", 21, 2, 1, {0}},
    {"one-token-then-empty", 9, 0, 3, {5, 2, 0}},
    {"same-block-twice", 100, 1, 2, {2, 2}},
};
enum { NUM_REQUESTS = sizeof requests / sizeof requests[0] };

static kvcs_blocks *make_blocks(void) {
  kvcs_blocks *blocks = NULL;
  EXPECT_OK(kvcs_blocks_create(&blocks));
  for (size_t r = 0; r < NUM_REQUESTS; r++) {
    EXPECT_OK(kvcs_blocks_add_request(blocks, requests[r].req_id, requests[r].num_tokens));
    EXPECT_OK(kvcs_blocks_add_group(blocks, requests[r].req_id, 0, requests[r].first_position,
                                    requests[r].block_ids, requests[r].n));
  }
  return blocks;
}

/* Whether every value of `result` (of a worker holding `num_heads` heads
 * from `first_head`) equals the reference; prints each that does not. */
static int result_matches(const kvcs_result *result, uint32_t first_head, uint32_t num_heads, const char *what) {
  int all_equal = 1;
  for (size_t r = 0; r < NUM_REQUESTS; r++) {
    const request_desc *req = &requests[r];
    uint64_t first_position = 0;
    size_t num_positions = 0, num_columns = 0;
    EXPECT_OK(kvcs_result_group(result, req->req_id, 0, &first_position, &num_positions, &num_columns));
    CHECK(first_position == req->first_position && num_positions == req->n && num_columns == 1);
    uint64_t values[4] = {0};
    uint32_t replicas = 0, replica_index = 9;
    EXPECT_OK(kvcs_result_column(result, req->req_id, 0, 0, &replicas, &replica_index, values));
    CHECK(replicas == 1 && replica_index == 0);
    for (size_t i = 0; i < req->n; i++) {
      uint64_t position = req->first_position + i;
      uint64_t want = reference_checksum(req->block_ids[i], position, req->num_tokens, first_head, num_heads);
      if (values[i] != want) {
        all_equal = 0;
        fprintf(stderr, "%s: req %s position %" PRIu64 ": got %#" PRIx64 ", reference %#" PRIx64 "\n", what,
                req->req_id, position, values[i], want);
      }
    }
  }
  return all_equal;
}

/* One layout: thread counts 1 and 2 and both roles agree with the reference. */
static void test_layout(const layout_desc *layout) {
  placed_cache cache = place(layout, 1, H);
  kvcs_blocks *blocks = make_blocks();
  for (uint32_t threads = 1; threads <= 2; threads++) {
    kvcs_worker *worker = make_worker(&cache, threads);
    for (uint32_t role = KVCS_ROLE_PRODUCER; role <= KVCS_ROLE_CONSUMER; role++) {
      kvcs_result *result = NULL;
      EXPECT_OK(kvcs_worker_checksum(worker, blocks, role, NULL, &result));
      check_record(result_matches(result, 1, H, layout->name), __FILE__, __LINE__, layout->name);
      kvcs_result_destroy(result);
    }
    kvcs_worker_destroy(worker);
  }
  kvcs_blocks_destroy(blocks);
  free_cache(&cache);
}

/* The value at position 2 of request 0 (block 3, 5 valid tokens of 8). */
static uint64_t partial_block_value(kvcs_worker *worker, const kvcs_blocks *blocks) {
  kvcs_result *result = NULL;
  uint64_t values[4] = {0};
  EXPECT_OK(kvcs_worker_checksum(worker, blocks, KVCS_ROLE_PRODUCER, NULL, &result));
  EXPECT_OK(kvcs_result_column(result, requests[0].req_id, 0, 0, NULL, NULL, values));
  kvcs_result_destroy(result);
  return values[2];
}

/* SPEC property 5: a write past num_tokens changes nothing; a write to a
 * valid slot changes the value. Layout 0: cell in one region. */
static void test_past_num_tokens(void) {
  placed_cache cache = place(&layouts[0], 1, H);
  kvcs_blocks *blocks = make_blocks();
  kvcs_worker *worker = make_worker(&cache, 1);
  const segment_place *seg = &layouts[0].segments[0];
  uint64_t before = partial_block_value(worker, blocks);
  /* Block 3 holds position 2 of request 0: slots 5..7 are past num_tokens 21. */
  int64_t past = piece_offset(seg, 1, 3, 0, 6, 2, BLOCK) - cache.shift[0];
  cache.buffers[0][past] ^= 0x100;
  CHECK(partial_block_value(worker, blocks) == before);
  int64_t valid = piece_offset(seg, 1, 3, 0, 4, 2, BLOCK) - cache.shift[0];
  cache.buffers[0][valid] ^= 0x100;
  CHECK(partial_block_value(worker, blocks) != before);
  kvcs_worker_destroy(worker);
  kvcs_blocks_destroy(blocks);
  free_cache(&cache);
}

/* SPEC property 1: head shards on two workers (in different layouts) add
 * up to the checksum of all heads. */
static void test_shards_add_up(void) {
  placed_cache low = place(&layouts[2], 0, 2);  /* heads 0, 1 */
  placed_cache high = place(&layouts[3], 2, 1); /* head 2 */
  kvcs_blocks *blocks = make_blocks();
  kvcs_worker *workers[2] = {make_worker(&low, 1), make_worker(&high, 2)};
  kvcs_result *results[2] = {NULL, NULL};
  for (int w = 0; w < 2; w++) {
    EXPECT_OK(kvcs_worker_checksum(workers[w], blocks, KVCS_ROLE_PRODUCER, NULL, &results[w]));
  }
  for (size_t r = 0; r < NUM_REQUESTS; r++) {
    const request_desc *req = &requests[r];
    uint64_t a[4] = {0}, b[4] = {0};
    EXPECT_OK(kvcs_result_column(results[0], req->req_id, 0, 0, NULL, NULL, a));
    EXPECT_OK(kvcs_result_column(results[1], req->req_id, 0, 0, NULL, NULL, b));
    for (size_t i = 0; i < req->n; i++) {
      uint64_t all = reference_checksum(req->block_ids[i], req->first_position + i, req->num_tokens, 0, HEADS);
      CHECK(a[i] + b[i] == all);
    }
  }
  for (int w = 0; w < 2; w++) {
    kvcs_result_destroy(results[w]);
    kvcs_worker_destroy(workers[w]);
  }
  kvcs_blocks_destroy(blocks);
  free_cache(&low);
  free_cache(&high);
}

/* DCP token placement (docs/SPEC.md#16-token-placement): D = 1, 2 and 4
 * ranks, interleave I = 1 and 2, local blocks of 4 slots (scheduler blocks
 * of 4 * D tokens), one layer of one head, 2 pieces per cell. Each rank's
 * cache is filled through vLLM's forward map (offset o on rank (o / I) % D,
 * slot (o / (D*I))*I + o % I); the reference numbers each token by its
 * place in the request, and the ranks' values add up to one worker's
 * holding every token. Also the call's error paths (at D = 2). */
enum { MAX_DCP = 4, LOCAL = 4, MAX_DCP_BLOCK = LOCAL * MAX_DCP, DCP_BLOCKS = 2, DCP_PIECES = 2 };

static uint64_t dcp_reference(const uint64_t units[][DCP_PIECES], uint32_t dcp, uint64_t position,
                              uint64_t num_tokens, uint32_t interleave, int rank) {
  const uint64_t block = (uint64_t)LOCAL * dcp;
  uint64_t slice = 0;
  for (uint64_t o = 0; o < block; o++) {
    if (rank >= 0 && (o / interleave) % dcp != (uint64_t)rank) {
      continue;
    }
    uint64_t token = position * block + o;
    if (token >= num_tokens) {
      continue;
    }
    for (uint64_t piece = 0; piece < DCP_PIECES; piece++) {
      slice += piece_value(units[token][piece]) * (2 * (token * DCP_PIECES + piece) + 1);
    }
  }
  return 1 * slice; /* m of layer 0, head 0 */
}

/* The placement call's error paths, on a worker of group 0 with no layer
 * yet (D = 2, local blocks of 4 slots); leaves `placement` valid for
 * `rank`. */
static void check_placement_errors(kvcs_worker *worker, kvcs_group_placement *placement, uint32_t rank,
                                   uint32_t interleave) {
  EXPECT(kvcs_worker_set_group_placement(NULL, 0, placement), KVCS_ERR_INVALID_ARGUMENT, "worker is NULL");
  EXPECT(kvcs_worker_set_group_placement(worker, 0, NULL), KVCS_ERR_INVALID_ARGUMENT, "placement is NULL");
  EXPECT(kvcs_worker_set_group_placement(worker, 9, placement), KVCS_ERR_NOT_FOUND, "group_id 9");
  placement->dcp_size = 2;
  placement->dcp_rank = 2;
  EXPECT(kvcs_worker_set_group_placement(worker, 0, placement), KVCS_ERR_INVALID_ARGUMENT,
         "dcp_rank 2 is not below placement.dcp_size 2");
  placement->dcp_rank = rank;
  placement->dcp_size = 0;
  EXPECT(kvcs_worker_set_group_placement(worker, 0, placement), KVCS_ERR_INVALID_ARGUMENT, "dcp_size is 0");
  placement->dcp_size = 3;
  EXPECT(kvcs_worker_set_group_placement(worker, 0, placement), KVCS_ERR_INVALID_ARGUMENT,
         "not a multiple of placement.dcp_size 3");
  placement->dcp_size = 2;
  placement->interleave = 3;
  EXPECT(kvcs_worker_set_group_placement(worker, 0, placement), KVCS_ERR_INVALID_ARGUMENT,
         "interleave 3 does not divide the local block of 4 slots");
  placement->interleave = 0;
  EXPECT(kvcs_worker_set_group_placement(worker, 0, placement), KVCS_ERR_INVALID_ARGUMENT, "interleave is 0");
  placement->interleave = interleave;
  placement->tokens_per_slot = 3;
  EXPECT(kvcs_worker_set_group_placement(worker, 0, placement), KVCS_ERR_INVALID_ARGUMENT,
         "not a multiple of placement.tokens_per_slot 3");
  placement->tokens_per_slot = 0;
  EXPECT(kvcs_worker_set_group_placement(worker, 0, placement), KVCS_ERR_INVALID_ARGUMENT,
         "tokens_per_slot is 0");
  placement->tokens_per_slot = 1;
}

static void test_dcp_placement(void) {
  const uint32_t block_ids[DCP_BLOCKS] = {1, 0};
  static uint64_t units[DCP_BLOCKS * MAX_DCP_BLOCK][DCP_PIECES];
  for (size_t u = 0; u < DCP_BLOCKS * MAX_DCP_BLOCK; u++) {
    for (size_t p = 0; p < DCP_PIECES; p++) {
      units[u][p] = next_random();
    }
  }
  const uint32_t dcp_sizes[] = {1, 2, 4};
  for (size_t d = 0; d < sizeof dcp_sizes / sizeof dcp_sizes[0]; d++) {
    const uint32_t dcp = dcp_sizes[d];
    const uint32_t dcp_block = LOCAL * dcp;
    /* The second block partly filled: 3 of its tokens have KV. */
    const uint64_t num_tokens = dcp_block + 3;
    kvcs_blocks *blocks = NULL;
    EXPECT_OK(kvcs_blocks_create(&blocks));
    EXPECT_OK(kvcs_blocks_add_request(blocks, "dcp", num_tokens));
    EXPECT_OK(kvcs_blocks_add_group(blocks, "dcp", 0, 0, block_ids, DCP_BLOCKS));
    for (uint32_t interleave = 1; interleave <= 2; interleave++) {
      uint64_t sum[DCP_BLOCKS] = {0, 0};
      for (uint32_t rank = 0; rank < dcp; rank++) {
        static uint64_t cache[DCP_BLOCKS][LOCAL][DCP_PIECES];
        for (size_t i = 0; i < sizeof cache / sizeof cache[0][0][0]; i++) {
          (&cache[0][0][0])[i] = next_random(); /* junk where no token is */
        }
        for (uint64_t q = 0; q < DCP_BLOCKS; q++) {
          for (uint64_t o = 0; o < dcp_block; o++) {
            if ((o / interleave) % dcp == rank) {
              uint64_t slot = (o / (dcp * interleave)) * interleave + o % interleave;
              memcpy(cache[block_ids[q]][slot], units[q * dcp_block + o], sizeof units[0]);
            }
          }
        }
        kvcs_worker_options options = KVCS_WORKER_OPTIONS_INIT;
        options.tp_rank = rank;
        options.tp_size = dcp;
        kvcs_worker *worker = NULL;
        EXPECT_OK(kvcs_worker_create(&options, &worker));
        EXPECT_OK(kvcs_worker_set_algorithm(worker, algorithm));
        EXPECT_OK(kvcs_worker_add_region(worker, (uint64_t)(uintptr_t)cache, sizeof cache));
        EXPECT_OK(kvcs_worker_add_group(worker, 0, dcp_block));
        kvcs_group_placement placement = KVCS_GROUP_PLACEMENT_INIT;
        CHECK(placement.dcp_size == 1 && placement.dcp_rank == 0 && placement.interleave == 1 &&
              placement.tokens_per_slot == 1);
        if (dcp == 2) {
          check_placement_errors(worker, &placement, rank, interleave);
        }
        placement.dcp_size = dcp;
        placement.dcp_rank = rank;
        placement.interleave = interleave;
        EXPECT_OK(kvcs_worker_set_group_placement(worker, 0, &placement));
        kvcs_segment segment = {
            .address = (uint64_t)(uintptr_t)cache,
            .block_stride = 8 * LOCAL * DCP_PIECES,
            .kernel_block_stride = 0,
            .head_stride = 0,
            .token_stride = 8 * DCP_PIECES,
            .bytes_per_token = 8 * DCP_PIECES,
        };
        kvcs_layer layer = KVCS_LAYER_INIT;
        layer.num_heads = 1;
        layer.num_blocks = DCP_BLOCKS;
        if (dcp > 1) {
          layer.tokens_per_kernel_block = dcp_block; /* the scheduler's block: not the local one */
          layer.segments = &segment;
          EXPECT(kvcs_worker_add_layer(worker, &layer), KVCS_ERR_INVALID_ARGUMENT, "the 4 local slots per block");
        }
        layer.tokens_per_kernel_block = LOCAL;
        layer.segments = &segment;
        EXPECT_OK(kvcs_worker_add_layer(worker, &layer));
        if (dcp == 2) {
          EXPECT(kvcs_worker_set_group_placement(worker, 0, &placement), KVCS_ERR_INVALID_ARGUMENT,
                 "set its placement before registering them");
        }
        kvcs_result *result = NULL;
        EXPECT_OK(kvcs_worker_checksum(worker, blocks, KVCS_ROLE_CONSUMER, NULL, &result));
        EXPECT_OK(kvcs_result_wait(result));
        uint64_t values[DCP_BLOCKS] = {0, 0};
        EXPECT_OK(kvcs_result_column(result, "dcp", 0, 0, NULL, NULL, values));
        for (uint64_t q = 0; q < DCP_BLOCKS; q++) {
          CHECK(values[q] == dcp_reference((const uint64_t(*)[DCP_PIECES])units, dcp, q, num_tokens, interleave,
                                           (int)rank));
          sum[q] += values[q];
        }
        kvcs_result_destroy(result);
        kvcs_worker_destroy(worker);
      }
      for (uint64_t q = 0; q < DCP_BLOCKS; q++) {
        CHECK(sum[q] == dcp_reference((const uint64_t(*)[DCP_PIECES])units, dcp, q, num_tokens, interleave, -1));
      }
    }
    kvcs_blocks_destroy(blocks);
  }
}

/* Several caches of one layer number (SPEC section 1: their heads one
 * cache after the other, in the layer's cache order): layer 5 holds an
 * MLA-like cache of one 16-byte cell a token (head 0, 8-byte pieces) and
 * an indexer-like cache of 8 key bytes then a 4-byte scale a token, kept
 * as each block's keys then their scales (head 1, 12-byte cells of
 * 4-byte pieces, two segments). 8-token blocks, 2 blocks, 13 tokens. The
 * reference walks logical (head, token, piece) indices. */
enum { TWO_BLOCK = 8, TWO_BLOCKS = 2, TWO_LAYER = 5, MLA_PIECES = 2, KEY_BYTES = 8, SCALE_BYTES = 4 };

static void test_two_caches_of_one_layer(void) {
  const uint32_t block_ids[TWO_BLOCKS] = {1, 0};
  const uint64_t num_tokens = TWO_BLOCK + 5;
  static uint64_t mla[TWO_BLOCKS][TWO_BLOCK][MLA_PIECES];
  /* A page a block: every token's key, then every token's scale. */
  static uint8_t indexer[TWO_BLOCKS][TWO_BLOCK * (KEY_BYTES + SCALE_BYTES)];
  for (size_t i = 0; i < sizeof mla / sizeof mla[0][0][0]; i++) {
    (&mla[0][0][0])[i] = next_random();
  }
  for (size_t i = 0; i < sizeof indexer; i++) {
    (&indexer[0][0])[i] = (uint8_t)next_random();
  }
  uint64_t want[TWO_BLOCKS] = {0, 0};
  for (uint64_t q = 0; q < TWO_BLOCKS; q++) {
    uint64_t mla_slice = 0, indexer_slice = 0;
    for (uint64_t i = 0; i < TWO_BLOCK; i++) {
      uint64_t t = q * TWO_BLOCK + i;
      if (t >= num_tokens) {
        break;
      }
      for (uint64_t p = 0; p < MLA_PIECES; p++) {
        mla_slice += piece_value(mla[block_ids[q]][i][p]) * (2 * (t * MLA_PIECES + p) + 1);
      }
      /* The 12-byte cell: the token's key bytes, then its scale bytes. */
      uint8_t cell[KEY_BYTES + SCALE_BYTES];
      memcpy(cell, &indexer[block_ids[q]][i * KEY_BYTES], KEY_BYTES);
      memcpy(cell + KEY_BYTES, &indexer[block_ids[q]][TWO_BLOCK * KEY_BYTES + i * SCALE_BYTES], SCALE_BYTES);
      const uint64_t pieces = (KEY_BYTES + SCALE_BYTES) / 4;
      for (uint64_t p = 0; p < pieces; p++) {
        uint64_t x = (uint64_t)cell[4 * p] | (uint64_t)cell[4 * p + 1] << 8 | (uint64_t)cell[4 * p + 2] << 16 |
                     (uint64_t)cell[4 * p + 3] << 24;
        indexer_slice += piece_value(x) * (2 * (t * pieces + p) + 1);
      }
    }
    const uint64_t m0 = 2 * ((uint64_t)TWO_LAYER * 65536 + 0) + 1;
    const uint64_t m1 = 2 * ((uint64_t)TWO_LAYER * 65536 + 1) + 1;
    want[q] = m0 * mla_slice + m1 * indexer_slice;
  }
  kvcs_blocks *blocks = NULL;
  EXPECT_OK(kvcs_blocks_create(&blocks));
  EXPECT_OK(kvcs_blocks_add_request(blocks, "two", num_tokens));
  EXPECT_OK(kvcs_blocks_add_group(blocks, "two", 0, 0, block_ids, TWO_BLOCKS));
  kvcs_worker_options options = KVCS_WORKER_OPTIONS_INIT;
  kvcs_worker *worker = NULL;
  EXPECT_OK(kvcs_worker_create(&options, &worker));
  EXPECT_OK(kvcs_worker_set_algorithm(worker, algorithm));
  EXPECT_OK(kvcs_worker_add_region(worker, (uint64_t)(uintptr_t)mla, sizeof mla));
  EXPECT_OK(kvcs_worker_add_region(worker, (uint64_t)(uintptr_t)indexer, sizeof indexer));
  EXPECT_OK(kvcs_worker_add_group(worker, 0, TWO_BLOCK));
  kvcs_segment mla_segment = {
      .address = (uint64_t)(uintptr_t)mla,
      .block_stride = sizeof mla[0],
      .kernel_block_stride = 0,
      .head_stride = 0,
      .token_stride = sizeof mla[0][0],
      .bytes_per_token = sizeof mla[0][0],
  };
  kvcs_layer layer = KVCS_LAYER_INIT;
  layer.layer_number = TWO_LAYER;
  layer.first_head = 0;
  layer.num_heads = 1;
  layer.num_blocks = TWO_BLOCKS;
  layer.tokens_per_kernel_block = TWO_BLOCK;
  layer.segments = &mla_segment;
  EXPECT_OK(kvcs_worker_add_layer(worker, &layer));
  kvcs_segment indexer_segments[2] = {
      {.address = (uint64_t)(uintptr_t)indexer,
       .block_stride = sizeof indexer[0],
       .kernel_block_stride = 0,
       .head_stride = 0,
       .token_stride = KEY_BYTES,
       .bytes_per_token = KEY_BYTES},
      {.address = (uint64_t)(uintptr_t)indexer + TWO_BLOCK * KEY_BYTES,
       .block_stride = sizeof indexer[0],
       .kernel_block_stride = 0,
       .head_stride = 0,
       .token_stride = SCALE_BYTES,
       .bytes_per_token = SCALE_BYTES},
  };
  layer.first_head = 1;
  layer.num_segments = 2;
  layer.segments = indexer_segments;
  /* Head 0 of layer 5 is the first cache's: a second cache claiming it is refused. */
  layer.first_head = 0;
  CHECK(kvcs_worker_add_layer(worker, &layer) != KVCS_OK);
  layer.first_head = 1;
  EXPECT_OK(kvcs_worker_add_layer(worker, &layer));
  kvcs_result *result = NULL;
  EXPECT_OK(kvcs_worker_checksum(worker, blocks, KVCS_ROLE_PRODUCER, NULL, &result));
  uint64_t values[TWO_BLOCKS] = {0, 0};
  EXPECT_OK(kvcs_result_column(result, "two", 0, 0, NULL, NULL, values));
  for (uint64_t q = 0; q < TWO_BLOCKS; q++) {
    CHECK(values[q] == want[q]);
  }
  kvcs_result_destroy(result);
  /* A scale byte changed changes the value of its block only. */
  indexer[block_ids[1]][TWO_BLOCK * KEY_BYTES + 2 * SCALE_BYTES + 1] ^= 0x10;
  EXPECT_OK(kvcs_worker_checksum(worker, blocks, KVCS_ROLE_PRODUCER, NULL, &result));
  uint64_t changed[TWO_BLOCKS] = {0, 0};
  EXPECT_OK(kvcs_result_column(result, "two", 0, 0, NULL, NULL, changed));
  CHECK(changed[0] == want[0] && changed[1] != want[1]);
  kvcs_result_destroy(result);
  kvcs_worker_destroy(worker);
  kvcs_blocks_destroy(blocks);
}

void test_checksums(uint64_t seed) {
  rng_state = seed | 1;
  uint64_t *all = &logical[0][0][0][0][0];
  for (size_t i = 0; i < sizeof logical / sizeof logical[0][0][0][0][0]; i++) {
    all[i] = next_random();
  }
  const int64_t cells[2][2] = {{2, 3}, {8, 16}};
  for (int c = 0; c < 2; c++) {
    k_pieces = cells[c][0];
    v_pieces = cells[c][1];
    pieces_per_token = k_pieces + v_pieces;
    make_layouts();
    for (algorithm = KVCS_ALGORITHM_WEIGHTED; algorithm <= KVCS_ALGORITHM_MIXED2; algorithm++) {
      for (size_t l = 0; l < NUM_LAYOUTS; l++) {
        test_layout(&layouts[l]);
      }
      test_past_num_tokens();
      test_shards_add_up();
      test_dcp_placement();
      test_two_caches_of_one_layer();
    }
  }
}
