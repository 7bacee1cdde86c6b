// The test of include/kvcsum.hpp (`make cpp-test`, part of `make test`):
// built with -std=c++17 -Wall -Wextra -Wpedantic -Werror under ASan and
// UBSan, it calls every method and free function of the wrapper at least
// once, each with a bad argument too where it takes one (the throw must
// carry the right status and a message naming the argument), and compares
// a worker's checksums of a FlashAttention-style layout (K and V in
// separate tensors, [num_blocks, block_size, heads, head_size]) with a
// deliberately naive reference of docs/SPEC.md sections 2, 3 and 12, the
// layout registered by hand and through a layout string.
//
// Data is random from a fresh seed, printed on failure; KVCS_TEST_SEED
// replays one. Exits 0 when everything holds, 1 otherwise.
#include "kvcsum.hpp"

#include <array>
#include <cinttypes>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <vector>

namespace {

int failures = 0;
uint64_t seed = 0;

void expect_at(bool ok, const char *what, int line) {
  if (!ok) {
    std::fprintf(stderr, "hpp_test.cpp:%d: FAIL %s (seed %" PRIu64 ")\n", line, what, seed);
    failures++;
  }
}
#define EXPECT(condition) expect_at((condition), #condition, __LINE__)

/// Runs `body`, which must throw kvcs::error with `status` and a message
/// containing `needle`.
void expect_throw_at(kvcs_status status, const char *needle, const std::function<void()> &body, int line) {
  try {
    body();
    std::fprintf(stderr, "hpp_test.cpp:%d: FAIL no exception, expected %s (seed %" PRIu64 ")\n", line,
                 kvcs_status_name(status), seed);
    failures++;
  } catch (const kvcs::error &error) {
    if (error.status() != status || std::strstr(error.what(), needle) == nullptr) {
      std::fprintf(stderr, "hpp_test.cpp:%d: FAIL expected %s naming \"%s\", got %s (seed %" PRIu64 ")\n", line,
                   kvcs_status_name(status), needle, error.what(), seed);
      failures++;
    }
  }
}
#define EXPECT_THROW(status, needle, ...) expect_throw_at((status), (needle), [&] { __VA_ARGS__; }, __LINE__)

std::mt19937_64 random_bits;

// --- The naive reference (docs/SPEC.md sections 2, 3 and 12) -----------------

uint64_t mix(uint64_t x) {
  uint64_t g = (x ^ (x >> 32)) * KVCS_MIX_MULTIPLIER;
  return g ^ (g >> 32);
}

/// One round of MIXED2: the low half times k as a 64-bit product, the high
/// half added to its high half, the halves swapped.
uint64_t mix2_round(uint64_t v, uint32_t k) {
  uint64_t sum = (v & 0xFFFFFFFF00000000ull) + (v & 0xFFFFFFFFull) * k;
  return (sum << 32) | (sum >> 32);
}

uint64_t mix2(uint64_t x) {
  uint64_t v = mix2_round(mix2_round(x, KVCS_MIX2_MULTIPLIER_1), KVCS_MIX2_MULTIPLIER_2);
  v ^= v >> 32;
  v = mix2_round(v, KVCS_MIX2_MULTIPLIER_3);
  return v ^ (v >> 32);
}

/// f of the algorithm.
uint64_t piece_value(kvcs::algorithm algorithm, uint64_t x) {
  switch (algorithm) {
    case kvcs::algorithm::mixed: return mix(x);
    case kvcs::algorithm::mixed2: return mix2(x);
    default: return x;
  }
}

constexpr uint32_t kLayers = 2;
constexpr uint32_t kLayerNumbers[kLayers] = {3, 5};
constexpr uint32_t kHeads = 2;
constexpr uint32_t kBlockSize = 4;
constexpr uint32_t kNumBlocks = 6;
constexpr uint32_t kHeadPieces = 2;  // 16 bytes of K (and of V) per head and token
constexpr uint32_t kPieces = 2 * kHeadPieces;

/// One layer's K and V tensors, FlashAttention's
/// [num_blocks, block_size, num_kv_heads, head_size], as 8-byte pieces.
struct flash_layer {
  std::vector<uint64_t> k, v;
  flash_layer() : k(kNumBlocks * kBlockSize * kHeads * kHeadPieces), v(k.size()) {
    for (uint64_t &piece : k) piece = random_bits();
    for (uint64_t &piece : v) piece = random_bits();
  }
  /// Piece `p` of the cell (K then V) of `head` at `slot` of `block`.
  uint64_t piece(uint32_t block, uint32_t slot, uint32_t head, uint32_t p) const {
    const std::vector<uint64_t> &tensor = p < kHeadPieces ? k : v;
    return tensor[((block * kBlockSize + slot) * kHeads + head) * kHeadPieces + p % kHeadPieces];
  }
};

/// c(g, q) of sections 2-3 by their loops, for the block at each position.
std::vector<uint64_t> naive_checksums(const std::vector<flash_layer> &layers, const std::vector<int32_t> &table,
                                      uint64_t num_tokens, kvcs::algorithm algorithm) {
  std::vector<uint64_t> out;
  for (uint64_t q = 0; q < table.size(); q++) {
    uint64_t total = 0;
    for (uint32_t l = 0; l < kLayers; l++) {
      for (uint32_t head = 0; head < kHeads; head++) {
        uint64_t slice = 0;
        for (uint32_t slot = 0; slot < kBlockSize; slot++) {
          uint64_t t = q * kBlockSize + slot;
          if (t >= num_tokens) break;
          for (uint32_t p = 0; p < kPieces; p++) {
            uint64_t x = layers[l].piece(static_cast<uint32_t>(table[q]), slot, head, p);
            uint64_t j = t * kPieces + p;
            slice += piece_value(algorithm, x) * (2 * j + 1);
          }
        }
        total += (2 * (uint64_t{kLayerNumbers[l]} * KVCS_MAX_KV_HEADS_PER_LAYER + head) + 1) * slice;
      }
    }
    out.push_back(total);
  }
  return out;
}

/// The segments of one flash_layer: K region, then V region.
std::array<kvcs_segment, 2> flash_segments(const flash_layer &layer) {
  std::array<kvcs_segment, 2> segments{};
  const std::vector<uint64_t> *tensors[2] = {&layer.k, &layer.v};
  for (int kv = 0; kv < 2; kv++) {
    segments[kv].address = kvcs::address_of(tensors[kv]->data());
    segments[kv].token_stride = kHeads * kHeadPieces * 8;
    segments[kv].block_stride = kBlockSize * segments[kv].token_stride;
    segments[kv].head_stride = kHeadPieces * 8;
    segments[kv].bytes_per_token = kHeadPieces * 8;
  }
  return segments;
}

/// A host worker (TP 1) over `layers`, group 0.
kvcs::worker flash_worker(const std::vector<flash_layer> &layers, kvcs::algorithm algorithm, bool detail,
                          bool via_layout = false) {
  kvcs::worker worker(kvcs_worker_options{0, 1, 0, KVCS_HOST, 1});
  worker.set_algorithm(algorithm);
  worker.set_detail(detail);
  worker.add_group(0, kBlockSize);
  for (uint32_t l = 0; l < kLayers; l++) {
    worker.add_region(layers[l].k.data(), layers[l].k.size() * 8);
    worker.add_region(kvcs::address_of(layers[l].v.data()), uint64_t{layers[l].v.size()} * 8);
    std::array<kvcs_segment, 2> segments = flash_segments(layers[l]);
    kvcs_layer layer{};
    layer.num_heads = kHeads;
    layer.replicas = 1;
    layer.num_blocks = kNumBlocks;
    layer.kernel_blocks = 1;
    layer.tokens_per_kernel_block = kBlockSize;
    layer.num_segments = 2;
    layer.segments = segments.data();
    // The same through the layout string: [num_blocks, block_size, heads, head_size] is "BTHD".
    const int64_t shape[4] = {kNumBlocks, kBlockSize, kHeads, kHeadPieces * 4};
    const int64_t strides[4] = {kBlockSize * kHeads * kHeadPieces * 8, kHeads * kHeadPieces * 8, kHeadPieces * 8, 2};
    kvcs::tensor k{kvcs::address_of(layers[l].k.data()), shape, strides, 2};
    kvcs::tensor v{kvcs::address_of(layers[l].v.data()), shape, strides, 2};
    kvcs::layout_layer described = kvcs::layer_from_layout("BTHD", k, &v);
    if (via_layout) {
      layer = described.layer();
    }
    layer.layer_number = kLayerNumbers[l];
    std::string identity = "model.layers." + std::to_string(kLayerNumbers[l]) + ".attn";
    layer.identity = kvcs::as_bytes(identity).data();
    layer.identity_len = identity.size();
    worker.add_layer(layer);
  }
  return worker;
}

// --- The sections ------------------------------------------------------------

void test_basics() {
  kvcs::check_abi();
  std::vector<kvcs::field_layout> fields = kvcs::struct_fields("kvcs_segment");
  EXPECT(fields.size() == 6 && fields[5].name == "bytes_per_token" &&
         fields[5].offset == offsetof(kvcs_segment, bytes_per_token) && fields[5].size == sizeof(uint32_t));
  EXPECT_THROW(KVCS_ERR_NOT_FOUND, "kvcs_nothing", kvcs::struct_fields("kvcs_nothing"));
  EXPECT(kvcs::version() == kvcs_version());
  EXPECT(kvcs::version() == std::to_string(KVCS_VERSION_MAJOR) + "." + std::to_string(KVCS_VERSION_MINOR) + "." +
                                std::to_string(KVCS_VERSION_PATCH));
  kvcs_worker_options init = KVCS_WORKER_OPTIONS_INIT;  // a host worker, in C++ too
  EXPECT(init.device == KVCS_HOST && init.tp_size == 1);
  kvcs::worker from_init(init);
  kvcs_layer layer_init = KVCS_LAYER_INIT;
  EXPECT(layer_init.replicas == 1 && layer_init.kernel_blocks == 1 && layer_init.num_segments == 1);
  EXPECT(kvcs::status_name(KVCS_ERR_NOT_FOUND) == "KVCS_ERR_NOT_FOUND");
  EXPECT(kvcs::to_string(kvcs::verdict::mismatch) == "KVCS_VERDICT_MISMATCH");
  EXPECT(kvcs::to_string(static_cast<kvcs::verdict>(77)) == "unknown kvcs_verdict");
  EXPECT(kvcs::to_string(kvcs::unverified_reason::workers_missing) == "KVCS_UNVERIFIED_WORKERS_MISSING");
  EXPECT(kvcs::to_string(kvcs::role::consumer) == "KVCS_ROLE_CONSUMER");
  EXPECT(kvcs::to_string(static_cast<kvcs::role>(9)) == "unknown kvcs_role");
  EXPECT(kvcs::to_string(kvcs::algorithm::weighted) == "KVCS_ALGORITHM_WEIGHTED");
  EXPECT(kvcs::to_string(kvcs::algorithm::mixed2) == "KVCS_ALGORITHM_MIXED2");
  EXPECT(kvcs::to_string(kvcs::stored_outcome::other_algorithm) == "KVCS_STORED_OTHER_ALGORITHM");
  EXPECT(kvcs::to_string(kvcs::policy::fail_open) == "KVCS_POLICY_FAIL_OPEN");
  EXPECT(kvcs::to_string(kvcs::direction::receiving) == "KVCS_DIRECTION_RECEIVING");

  // Views over each kind of storage see the same elements.
  const uint32_t c_array[3] = {7, 8, 9};
  std::array<uint32_t, 3> std_array = {7, 8, 9};
  std::vector<uint32_t> vector = {7, 8, 9};
  for (kvcs::view<uint32_t> ids : {kvcs::view<uint32_t>(c_array), kvcs::view<uint32_t>(std_array),
                                   kvcs::view<uint32_t>(vector), kvcs::view<uint32_t>(vector.data(), 3)}) {
    EXPECT(ids.size() == 3 && !ids.empty() && ids[0] == 7 && ids[2] == 9 && ids.end() - ids.begin() == 3);
  }
  EXPECT(kvcs::view<uint8_t>().empty() && kvcs::view<uint8_t>().data() == nullptr);
  EXPECT(kvcs::as_bytes("ab").size() == 2 && kvcs::as_bytes(c_array, sizeof c_array).size() == 12);

  // Every failure throws kvcs::error with the status; last_error keeps the
  // message of the call.
  EXPECT_THROW(KVCS_ERR_INVALID_ARGUMENT, "num_workers", kvcs::verifier(0));
  EXPECT(kvcs::last_error().find("num_workers") != std::string::npos);
  EXPECT_THROW(KVCS_ERR_INVALID_ARGUMENT, "tp_size", kvcs::worker(kvcs_worker_options{0, 0, 0, KVCS_HOST, 1}));

  // Owners move, release and destroy.
  kvcs::blocks first;
  kvcs_blocks *handle = first.get();
  kvcs::blocks second(std::move(first));
  EXPECT(!first && second && second.get() == handle);
  first = std::move(second);
  EXPECT(first.get() == handle && !second);
  kvcs_blocks_destroy(first.release());
  EXPECT(!first);
}

void test_base64() {
  std::vector<uint8_t> bytes(1 + random_bits() % 40);
  for (uint8_t &byte : bytes) byte = static_cast<uint8_t>(random_bits());
  std::string text = kvcs::base64_encode(bytes);
  EXPECT(text.size() == (bytes.size() + 2) / 3 * 4);
  EXPECT(kvcs::base64_decode(text) == bytes);
  EXPECT(kvcs::base64_encode(kvcs::as_bytes("kvcsum")) == "a3Zjc3Vt");
  EXPECT(kvcs::base64_encode({}).empty());
  EXPECT_THROW(KVCS_ERR_MALFORMED, "base64", kvcs::base64_decode("a3Z*"));
}

/// Block sets and checksums against the naive reference, both algorithms,
/// uint32 and int32 block tables.
void test_checksums() {
  std::vector<flash_layer> layers(kLayers);
  uint64_t num_tokens = 2 * kBlockSize + 1 + random_bits() % (kBlockSize - 1);  // the last block partial
  std::vector<int32_t> table = {4, 1, 3};

  kvcs::blocks blocks;
  blocks.add_request("r", num_tokens);
  blocks.add_group("r", 0, 0, kvcs::view<int32_t>(table));
  EXPECT_THROW(KVCS_ERR_INVALID_ARGUMENT, "req_id", blocks.add_request("", 1));
  // A std::string holding a NUL is refused, never cut there ("job\0A" and
  // "job\0B" would both be "job").
  const std::string nul_a("job\0A", 5), nul_b("job\0B", 5);
  EXPECT_THROW(KVCS_ERR_INVALID_ARGUMENT, "req_id holds a NUL at byte 3", blocks.add_request(nul_a, 1));
  EXPECT_THROW(KVCS_ERR_INVALID_ARGUMENT, "req_id holds a NUL", blocks.add_group(nul_b, 0, 0, {1u}));
  EXPECT_THROW(KVCS_ERR_INVALID_ARGUMENT, "req_id holds a NUL", kvcs::verifier(1).forget(nul_b));
  EXPECT_THROW(KVCS_ERR_INVALID_ARGUMENT, "r", blocks.add_request("r", 1));  // added before
  EXPECT_THROW(KVCS_ERR_NOT_FOUND, "nobody", blocks.add_group("nobody", 0, 0, {1u}));
  const int32_t negative[2] = {2, -3};
  EXPECT_THROW(KVCS_ERR_INVALID_ARGUMENT, "block_ids[1] is -3", blocks.add_group("r", 2, 0, negative));
  const int32_t extreme[1] = {INT32_MAX};
  blocks.add_request("big", 1);
  blocks.add_group("big", 0, 0, extreme);  // checked against the caches at checksum time only

  for (kvcs::algorithm algorithm : {kvcs::algorithm::weighted, kvcs::algorithm::mixed, kvcs::algorithm::mixed2}) {
    kvcs::worker worker = flash_worker(layers, algorithm, false, algorithm != kvcs::algorithm::weighted);
    kvcs::blocks scheduled;
    scheduled.add_request("r", num_tokens);
    std::vector<uint32_t> unsigned_table(table.begin(), table.end());
    scheduled.add_group("r", 0, 0, unsigned_table);
    kvcs::result result = worker.checksum(scheduled, kvcs::role::consumer);
    EXPECT(result.ready());
    result.wait();
    kvcs::group_shape shape = result.group("r", 0);
    EXPECT(shape.first_position == 0 && shape.num_positions == 3 && shape.num_columns == 1);
    EXPECT(result.num_positions("r", 0) == 3 && result.num_columns("r", 0) == 1);
    kvcs::column_values column = result.column_with_key("r", 0, 0);
    EXPECT(column.replicas == 1 && column.replica_index == 0);
    std::vector<uint64_t> expected = naive_checksums(layers, table, num_tokens, algorithm);
    EXPECT(column.values == expected);
    EXPECT(result.column("r", 0) == expected);
    EXPECT_THROW(KVCS_ERR_OUT_OF_BOUNDS, "column", result.column("r", 0, 1));
    EXPECT_THROW(KVCS_ERR_NOT_FOUND, "x", result.group("x", 0));
    EXPECT(!result.encode().empty());
    EXPECT_THROW(KVCS_ERR_INVALID_ARGUMENT, "algorithm", worker.set_algorithm(kvcs::algorithm::weighted));
    // The other algorithms give other values.
    for (kvcs::algorithm other : {kvcs::algorithm::weighted, kvcs::algorithm::mixed, kvcs::algorithm::mixed2}) {
      if (other != algorithm) EXPECT(naive_checksums(layers, table, num_tokens, other) != expected);
    }
    // A block id past the cache fails the call.
    EXPECT_THROW(KVCS_ERR_OUT_OF_BOUNDS, "2147483647", worker.checksum(blocks, kvcs::role::consumer));
  }
  // A bad algorithm value is refused, naming it.
  kvcs::worker fresh(kvcs_worker_options{0, 1, 0, KVCS_HOST, 1});
  EXPECT_THROW(KVCS_ERR_INVALID_ARGUMENT, "7", fresh.set_algorithm(static_cast<kvcs::algorithm>(7)));
}

/// A block set from arrays (add_arrays) checksums as the one built per
/// request; views of mismatched lengths are refused before the call.
void test_block_arrays() {
  std::vector<flash_layer> layers(kLayers);
  kvcs::worker worker = flash_worker(layers, kvcs::algorithm::mixed2, false);
  uint64_t num_tokens = 2 * kBlockSize + 1 + random_bits() % (kBlockSize - 1);
  std::vector<uint32_t> table = {4, 1, 3};
  kvcs::blocks one_by_one;
  one_by_one.add_request("r", num_tokens);
  one_by_one.add_group("r", 0, 0, table);
  one_by_one.add_request("s", kBlockSize);
  one_by_one.add_group("s", 0, 1, {2u});
  const size_t id_ends[2] = {1, 2};
  const uint64_t tokens[2] = {num_tokens, kBlockSize};
  const size_t group_ends[2] = {1, 2};
  const uint32_t group_ids[2] = {0, 0};
  const uint64_t firsts[2] = {0, 1};
  const size_t block_ends[2] = {3, 4};
  const uint32_t block_ids[4] = {4, 1, 3, 2};
  kvcs::block_arrays arrays{"rs", id_ends, tokens, group_ends, group_ids, firsts, block_ends, block_ids, {}, 0};
  kvcs::blocks bulk;
  bulk.add_arrays(arrays);
  kvcs::result a = worker.checksum(one_by_one, kvcs::role::consumer);
  kvcs::result b = worker.checksum(bulk, kvcs::role::consumer);
  a.wait();
  b.wait();
  EXPECT(a.column("r", 0) == b.column("r", 0) && a.column("s", 0) == b.column("s", 0));
  EXPECT(b.column("r", 0) == naive_checksums(layers, {4, 1, 3}, num_tokens, kvcs::algorithm::mixed2));
  kvcs::block_arrays short_tokens = arrays;
  short_tokens.num_tokens = kvcs::view<uint64_t>(tokens, 1);
  kvcs::blocks other;
  EXPECT_THROW(KVCS_ERR_INVALID_ARGUMENT, "num_tokens has 1", other.add_arrays(short_tokens));
  kvcs::block_arrays short_ids = arrays;
  short_ids.req_ids = "r";
  EXPECT_THROW(KVCS_ERR_INVALID_ARGUMENT, "req_ids has 1", other.add_arrays(short_ids));
  EXPECT_THROW(KVCS_ERR_INVALID_ARGUMENT, "already", bulk.add_arrays(arrays));
}

/// tier_index: a stored block's value is the naive checksum of its
/// position (the sum over the worker's columns, one column here), a check
/// matches it, another block at that position mismatches, and bad views
/// throw before any call.
void test_tier_index() {
  std::vector<flash_layer> layers(kLayers);
  kvcs::worker worker = flash_worker(layers, kvcs::algorithm::mixed2, false);
  kvcs::tier_index index(16);
  const uint32_t group_ids[2] = {0, 0};
  const uint64_t positions[2] = {0, 1};
  const uint32_t block_ids[2] = {4, 1};
  std::vector<uint8_t> hashes(64);
  for (size_t i = 0; i < hashes.size(); i++) {
    hashes[i] = static_cast<uint8_t>(random_bits());
  }
  kvcs::tier_blocks blocks{group_ids, positions, block_ids, hashes, 32, {}};
  index.store(worker, blocks);
  EXPECT(index.info().entries == 2);
  uint64_t position = 9;
  std::vector<uint64_t> kept = index.values(0, kvcs::view<uint8_t>(hashes.data() + 32, 32), &position);
  std::vector<uint64_t> naive = naive_checksums(layers, {4, 1}, 2 * kBlockSize, kvcs::algorithm::mixed2);
  EXPECT(kept.size() == 1 && kept[0] == naive[1] && position == 1);
  std::vector<kvcs::tier_outcome> got = index.check_loaded(worker, blocks);
  EXPECT(got.size() == 2 && got[0] == kvcs::tier_outcome::matched && got[1] == kvcs::tier_outcome::matched);
  const uint32_t swapped[2] = {1, 4};
  const uint8_t hashed[2] = {1, 0};
  kvcs::tier_blocks loaded{group_ids, positions, swapped, hashes, 32, hashed};
  got = index.check_loaded(worker, loaded);
  EXPECT(got[0] == kvcs::tier_outcome::mismatched && got[1] == kvcs::tier_outcome::no_block_hash);
  kvcs::tier_blocks short_positions{group_ids, kvcs::view<uint64_t>(positions, 1), block_ids, hashes, 32, {}};
  EXPECT_THROW(KVCS_ERR_INVALID_ARGUMENT, "positions has 1", index.store(worker, short_positions));
  kvcs::tier_blocks short_hash{group_ids, positions, block_ids, kvcs::view<uint8_t>(hashes.data(), 14), 7, {}};
  EXPECT_THROW(KVCS_ERR_INVALID_ARGUMENT, "hash_bytes is 7", index.store(worker, short_hash));
  EXPECT_THROW(KVCS_ERR_INVALID_ARGUMENT, "capacity 0", kvcs::tier_index(0));
}

/// The registration calls and their errors: regions, layers, state layers,
/// aliases, skipped groups.
void test_registration() {
  std::vector<flash_layer> layers(kLayers);
  kvcs::worker worker = flash_worker(layers, kvcs::algorithm::mixed2, false);
  EXPECT_THROW(KVCS_ERR_INVALID_ARGUMENT, "address", worker.add_region(uint64_t{0}, 64));
  EXPECT_THROW(KVCS_ERR_INVALID_ARGUMENT, "block_size", worker.add_group(1, 0));
  kvcs_layer outside{};
  std::vector<uint64_t> unregistered(64);
  kvcs_segment segment{kvcs::address_of(unregistered.data()), 64, 0, 32, 8, 8};
  outside.layer_number = 9;
  outside.num_heads = 1;
  outside.replicas = 1;
  outside.num_blocks = 4;
  outside.kernel_blocks = 1;
  outside.tokens_per_kernel_block = kBlockSize;
  outside.num_segments = 1;
  outside.segments = &segment;
  EXPECT_THROW(KVCS_ERR_OUT_OF_BOUNDS, "region", worker.add_layer(outside));

  // The layout string gives the hand-built segments of flash_segments.
  const int64_t shape[4] = {kNumBlocks, kBlockSize, kHeads, kHeadPieces * 4};
  const int64_t strides[4] = {kBlockSize * kHeads * kHeadPieces * 8, kHeads * kHeadPieces * 8, kHeadPieces * 8, 2};
  kvcs::tensor k{kvcs::address_of(layers[0].k.data()), shape, strides, 2};
  kvcs::tensor v{kvcs::address_of(layers[0].v.data()), shape, strides, 2};
  kvcs::layout_layer described = kvcs::layer_from_layout("BTHD", k, &v);
  std::array<kvcs_segment, 2> by_hand = flash_segments(layers[0]);
  kvcs_layer layer = described.layer();
  EXPECT(layer.num_heads == kHeads && layer.num_blocks == kNumBlocks && layer.kernel_blocks == 1 &&
         layer.tokens_per_kernel_block == kBlockSize && layer.num_segments == 2 && layer.replicas == 1 &&
         layer.segments == described.segments().data());
  for (size_t i = 0; i < 2 && described.segments().size() == 2; i++) {
    const kvcs_segment &got = described.segments()[i];
    EXPECT(got.address == by_hand[i].address && got.block_stride == by_hand[i].block_stride &&
           got.head_stride == by_hand[i].head_stride && got.token_stride == by_hand[i].token_stride &&
           got.bytes_per_token == by_hand[i].bytes_per_token);
  }
  kvcs::layout_layer copy = described;  // the copy's layer points at its own segments
  EXPECT(copy.layer().segments == copy.segments().data() && copy.layer().segments != layer.segments);
  EXPECT_THROW(KVCS_ERR_INVALID_ARGUMENT, "layout", kvcs::layer_from_layout("BTQD", k, &v));
  EXPECT_THROW(KVCS_ERR_INVALID_ARGUMENT, "layout holds a NUL at byte 4",
               kvcs::layer_from_layout(std::string("BTHD\0D", 6), k, &v));
  EXPECT_THROW(KVCS_ERR_INVALID_ARGUMENT, "v is given too", kvcs::layer_from_layout("KBTHD", k, &v));
  kvcs::tensor ragged{k.address, shape, kvcs::view<int64_t>(strides, 3), 2};
  EXPECT_THROW(KVCS_ERR_INVALID_ARGUMENT, "cache.strides 3", kvcs::layer_from_layout("BTHD", ragged));

  // An alias of layer 3: it adds no checksum but changes the fingerprint.
  EXPECT_THROW(KVCS_ERR_NOT_FOUND, "4", worker.add_alias(0, 7, 4, kvcs::as_bytes("model.layers.7.attn")));
  EXPECT_THROW(KVCS_ERR_INVALID_ARGUMENT, "itself", worker.add_alias(0, 3, 3, {}));
  worker.add_alias(0, 7, 3, kvcs::as_bytes("model.layers.7.attn"));

  // A state group (Mamba): rank 1 of 2 holds rows 2 and 3 of 4.
  constexpr uint32_t kSlots = 3, kRows = 2, kElements = 8;
  std::vector<uint16_t> state_cache(kSlots * kRows * kElements);
  for (uint16_t &element : state_cache) element = static_cast<uint16_t>(random_bits());
  kvcs::worker state_worker(kvcs_worker_options{1, 2, 0, KVCS_HOST, 1});
  state_worker.add_region(state_cache.data(), state_cache.size() * 2);
  state_worker.add_group(4, 16);
  kvcs_state_tensor tensor{kvcs::address_of(state_cache.data()), kRows * kElements * 2, kElements * 2, 2, kRows, 4,
                           kElements * 2, 2};
  std::string identity = "model.layers.9.mixer";
  kvcs_state state{4, 9, 1, kSlots, 1, &tensor, kvcs::as_bytes(identity).data(), identity.size()};
  kvcs_state bad = state;
  bad.split_known = 2;
  EXPECT_THROW(KVCS_ERR_INVALID_ARGUMENT, "split_known", state_worker.add_state(bad));
  state_worker.add_state(state);
  state_worker.skip_group(5, "an encoder cache kvcsum cannot read");
  EXPECT_THROW(KVCS_ERR_INVALID_ARGUMENT, "reason", state_worker.skip_group(6, ""));

  kvcs::blocks blocks;
  blocks.add_request("s", 40);
  blocks.add_group("s", 4, 0, {2u});
  blocks.add_group("s", 5, 0, {0u, 1u});
  kvcs::result before = state_worker.checksum(blocks, kvcs::role::producer);
  EXPECT_THROW(KVCS_ERR_NOT_FOUND, "encoder cache", before.group("s", 5));
  std::vector<uint64_t> state_value = before.column("s", 4);
  EXPECT(state_value.size() == 1);
  state_cache[2 * kRows * kElements + 3] ^= 0x0100;  // slot 2, row 0
  EXPECT(state_worker.checksum(blocks, kvcs::role::producer).column("s", 4) != state_value);
}

/// Offload: stored checksums, tags, load checks and their verdict.
void test_stored() {
  constexpr size_t kHashBytes = 32;
  std::vector<flash_layer> layers(kLayers);
  kvcs::worker worker = flash_worker(layers, kvcs::algorithm::mixed2, false);
  std::vector<uint64_t> stored(kNumBlocks * KVCS_BLOCK_CHECKSUM_BYTES / 8);
  EXPECT_THROW(KVCS_ERR_OUT_OF_BOUNDS, "region", worker.add_stored(0, stored.data(), kNumBlocks));
  worker.add_region(stored.data(), stored.size() * 8);
  EXPECT_THROW(KVCS_ERR_NOT_FOUND, "group_id 3", worker.add_stored(3, stored.data(), kNumBlocks));
  EXPECT_THROW(KVCS_ERR_INVALID_ARGUMENT, "address", worker.add_stored(0, uint64_t{0}, kNumBlocks));
  worker.add_stored(0, kvcs::address_of(stored.data()), kNumBlocks);

  const std::vector<int32_t> table = {2, 0, 5};
  uint64_t num_tokens = 3 * kBlockSize - 1;
  kvcs::blocks blocks;
  blocks.add_request("o", num_tokens);
  blocks.add_group("o", 0, 0, table);
  std::vector<uint8_t> hashes(table.size() * kHashBytes);
  for (uint8_t &byte : hashes) byte = static_cast<uint8_t>(random_bits());
  EXPECT_THROW(KVCS_ERR_INVALID_ARGUMENT, "block hashes", worker.store(blocks));
  EXPECT_THROW(KVCS_ERR_INVALID_ARGUMENT, "not a multiple of hash_bytes 32",
               blocks.set_hashes("o", 0, kvcs::view<uint8_t>(hashes.data(), hashes.size() - 1), kHashBytes));
  EXPECT_THROW(KVCS_ERR_INVALID_ARGUMENT, "hash_bytes", blocks.set_hashes("o", 0, hashes, 0));
  EXPECT_THROW(KVCS_ERR_INVALID_ARGUMENT, "hash_bytes", blocks.set_hashes("o", 0, {hashes.data(), 12}, 4));
  blocks.set_hashes("o", 0, hashes, kHashBytes);

  std::vector<uint64_t> tags = worker.block_tags(0, hashes, kHashBytes);
  EXPECT(tags.size() == 3);
  EXPECT_THROW(KVCS_ERR_NOT_FOUND, "group_id 9", worker.block_tags(9, hashes, kHashBytes));
  kvcs::result store = worker.store(blocks);
  std::vector<uint64_t> values = store.column("o", 0);
  EXPECT(values == naive_checksums(layers, table, num_tokens, kvcs::algorithm::mixed2));
  for (size_t q = 0; q < table.size(); q++) {
    EXPECT((stored[table[q] * 2] ^ tags[q]) == values[q]);
  }
  EXPECT_THROW(KVCS_ERR_NOT_FOUND, "load check", store.stored("o", 0));
  EXPECT(worker.block_tags(0, {}, kHashBytes).empty());  // no hashes, no tags

  // Entries kept by the connector: the store's words, judged as a load check.
  kvcs::result consumer = worker.checksum(blocks, kvcs::role::consumer);
  std::vector<uint64_t> entries = consumer.entries("o", 0);
  EXPECT(entries.size() == 2 * table.size());
  for (size_t q = 0; q < table.size(); q++) {
    EXPECT(entries[2 * q] == stored[table[q] * 2] && entries[2 * q + 1] == stored[table[q] * 2 + 1]);
  }
  EXPECT(consumer.check_entries("o", 0, entries) ==
         (std::vector<kvcs::stored_outcome>(table.size(), kvcs::stored_outcome::matched)));
  std::vector<uint64_t> damaged = entries;
  damaged[2 * 2 + 1] ^= uint64_t{1} << (random_bits() % 64);  // the last position's stamp
  EXPECT(consumer.check_entries("o", 0, damaged) ==
         (std::vector<kvcs::stored_outcome>{kvcs::stored_outcome::matched, kvcs::stored_outcome::matched,
                                            kvcs::stored_outcome::failed}));
  EXPECT_THROW(KVCS_ERR_INVALID_ARGUMENT, "2 each",
               consumer.check_entries("o", 0, kvcs::view<uint64_t>(entries.data(), 3)));
  EXPECT_THROW(KVCS_ERR_INVALID_ARGUMENT, "KVCS_ROLE_PRODUCER",
               worker.checksum(blocks, kvcs::role::producer).entries("o", 0));
  EXPECT_THROW(KVCS_ERR_NOT_FOUND, "group_id 4", consumer.entries("o", 4));
  EXPECT(kvcs::to_string(kvcs::stored_outcome::other_tokens) == "KVCS_STORED_OTHER_TOKENS");
  EXPECT(kvcs::to_string(kvcs::stored_outcome::other_format) == "KVCS_STORED_OTHER_FORMAT");

  // A group with no blocks: a load check of nothing, no outcomes.
  kvcs::blocks empty;
  empty.add_request("e", 0);
  empty.add_group("e", 0, 0, kvcs::view<uint32_t>());
  empty.set_hashes("e", 0, {}, kHashBytes);
  EXPECT(worker.check_stored(empty).stored("e", 0).empty());

  // One flipped bit at a valid token of position 1 while offloaded.
  layers[1].v[(table[1] * kBlockSize + 2) * kHeads * kHeadPieces + 1] ^= uint64_t{1} << (random_bits() % 64);
  kvcs::result loaded = worker.check_stored(blocks);
  std::vector<kvcs::stored_outcome> outcomes = loaded.stored("o", 0);
  EXPECT(outcomes == (std::vector<kvcs::stored_outcome>{kvcs::stored_outcome::matched,
                                                        kvcs::stored_outcome::failed,
                                                        kvcs::stored_outcome::matched}));

  kvcs::verifier verifier(1);
  verifier.expect(blocks, kvcs::role::consumer);
  verifier.add_record(loaded.encode());
  kvcs::report report = verifier.check_stored("o");
  EXPECT(report.verdict() == kvcs::verdict::mismatch && !report.passed());
  EXPECT(report.num_mismatches() == 1 && report.mismatch(0).first_position == 1);
  EXPECT_THROW(KVCS_ERR_NOT_FOUND, "\"x\"", verifier.check_stored("x"));
}

/// One transfer verified: a producer verifier's payload, a consumer
/// verifier's reports (match, mismatch with detail, unverified) and their
/// accessors, the setters.
void test_verification() {
  std::vector<flash_layer> layers(kLayers);
  const std::vector<int32_t> table = {5, 0, 2};
  uint64_t num_tokens = 2 * kBlockSize + 2;
  kvcs::blocks blocks;
  blocks.add_request("v", num_tokens);
  blocks.add_group("v", 0, 0, table);

  kvcs::worker producer_worker = flash_worker(layers, kvcs::algorithm::mixed2, true);
  kvcs::verifier producer(1);
  producer.set_extension(true);
  producer.expect(blocks, kvcs::role::producer);
  EXPECT_THROW(KVCS_ERR_NOT_READY, "0 of 1 workers", producer.payload("v"));
  EXPECT_THROW(KVCS_ERR_MALFORMED, "record", producer.add_record(kvcs::as_bytes("not a record")));
  producer.add_record(producer_worker.checksum(blocks, kvcs::role::producer).encode());
  std::vector<uint8_t> payload = producer.payload("v");
  EXPECT(!payload.empty());
  EXPECT_THROW(KVCS_ERR_NOT_FOUND, "w", producer.payload("w"));

  // The consumer loads the same KV into its own copy.
  for (int corrupt = 0; corrupt < 2; corrupt++) {
    std::vector<flash_layer> loaded = layers;
    uint32_t bad_layer = static_cast<uint32_t>(random_bits() % kLayers);
    uint32_t bad_head = static_cast<uint32_t>(random_bits() % kHeads);  // any head: one worker holds both
    if (corrupt) {
      // Position 2 (block 2) holds 2 valid tokens: slot 1, one head, K.
      loaded[bad_layer].k[((2 * kBlockSize + 1) * kHeads + bad_head) * kHeadPieces] ^= 1 + random_bits() % 255;
    }
    kvcs::worker consumer_worker = flash_worker(loaded, kvcs::algorithm::mixed2, true);
    kvcs::verifier consumer(1);
    consumer.set_policy(kvcs::policy::fail_closed);
    consumer.set_require_coverage(true);
    consumer.set_producer_tp_size(1);
    consumer.set_producer_block_size(0, kBlockSize);
    EXPECT_THROW(KVCS_ERR_INVALID_ARGUMENT, "tp_size", consumer.set_producer_tp_size(0));
    EXPECT_THROW(KVCS_ERR_INVALID_ARGUMENT, "block_size", consumer.set_producer_block_size(0, 0));
    EXPECT_THROW(KVCS_ERR_INVALID_ARGUMENT, "policy", consumer.set_policy(static_cast<kvcs::policy>(5)));
    consumer.expect(blocks, kvcs::role::consumer);
    consumer.add_record(consumer_worker.checksum(blocks, kvcs::role::consumer).encode());

    kvcs::report report = consumer.check("v", payload);
    EXPECT(report.compared_positions() == 3 && report.uncompared_positions() == 0);
    EXPECT(report.message().find(corrupt ? "MISMATCH" : "MATCH") != std::string::npos ||
           report.message().find(corrupt ? "mismatch" : "match") != std::string::npos);
    if (!corrupt) {
      EXPECT(report.verdict() == kvcs::verdict::match && report.passed());
      EXPECT(report.reason() == kvcs::unverified_reason::none && report.num_unverified() == 0);
      EXPECT(report.num_mismatches() == 0 && report.mismatches().empty() && report.findings().empty());
      EXPECT_THROW(KVCS_ERR_OUT_OF_BOUNDS, "index 0", report.mismatch(0));
      const uint32_t group_ids[1] = {0};
      const uint32_t block_sizes[1] = {kBlockSize};
      EXPECT(report.repair_plan(blocks, "v", group_ids, block_sizes).empty());
      continue;
    }
    EXPECT(report.verdict() == kvcs::verdict::mismatch && !report.passed());
    std::vector<kvcs::mismatch_detail> mismatches = report.mismatches();
    EXPECT(mismatches.size() == 1);
    if (mismatches.size() != 1) continue;
    const kvcs_mismatch &entry = mismatches[0].entry;
    EXPECT(entry.group_id == 0 && entry.first_position == 2 && entry.num_positions == 1 && entry.localised == 1);
    EXPECT(entry.first_token == 2 * kBlockSize && entry.num_tokens == 2);
    EXPECT(mismatches[0].failed_checks == std::vector<uint32_t>{0});
    EXPECT(report.failed_check(0, 0) == 0);
    EXPECT_THROW(KVCS_ERR_OUT_OF_BOUNDS, "index 1", report.failed_check(0, 1));
    EXPECT(mismatches[0].layers.size() == 1);
    if (!mismatches[0].layers.empty()) {
      kvcs_layer_difference layer = report.layer_difference(0, 0);
      // Partials are per layer and worker: the range is the worker's heads.
      EXPECT(layer.layer_number == kLayerNumbers[bad_layer] && layer.first_head == 0 && layer.num_heads == kHeads &&
             layer.check == 0);
    }
    EXPECT_THROW(KVCS_ERR_OUT_OF_BOUNDS, "mismatch 3", report.layer_difference(3, 0));

    // The repair plan: position 2's block, its tokens; the same from the entries.
    const uint32_t group_ids[1] = {0};
    const uint32_t block_sizes[1] = {kBlockSize};
    std::vector<kvcs_repair_block> plan = report.repair_plan(blocks, "v", group_ids, block_sizes);
    EXPECT(plan.size() == 1);
    if (plan.size() == 1) {
      EXPECT(plan[0].group_id == 0 && plan[0].position == 2 && plan[0].block_id == static_cast<uint32_t>(table[2]));
      EXPECT(plan[0].start_token == 2 * kBlockSize && plan[0].end_token == num_tokens);
    }
    std::vector<kvcs_mismatch> entries = {entry};
    std::vector<kvcs_repair_block> from_entries = kvcs::repair_plan(entries, blocks, "v", group_ids, block_sizes);
    EXPECT(from_entries.size() == plan.size() && !plan.empty() && from_entries[0].block_id == plan[0].block_id &&
           from_entries[0].end_token == plan[0].end_token);
    EXPECT_THROW(KVCS_ERR_INVALID_ARGUMENT, "block_sizes 0",
                 report.repair_plan(blocks, "v", group_ids, kvcs::view<uint32_t>()));
    EXPECT_THROW(KVCS_ERR_INVALID_ARGUMENT, "block_sizes 0",
                 kvcs::repair_plan(entries, blocks, "v", group_ids, kvcs::view<uint32_t>()));
    EXPECT_THROW(KVCS_ERR_NOT_FOUND, "w", report.repair_plan(blocks, "w", group_ids, block_sizes));
    EXPECT_THROW(KVCS_ERR_NOT_FOUND, "w", kvcs::repair_plan(entries, blocks, "w", group_ids, block_sizes));
    // Only the report's request and block size: another request's id (with
    // blocks of its own) and another block size throw, naming both.
    kvcs::blocks both;
    both.add_request("v", num_tokens);
    both.add_group("v", 0, 0, table);
    both.add_request("u", num_tokens);
    both.add_group("u", 0, 0, std::vector<int32_t>{1, 3, 4});
    EXPECT_THROW(KVCS_ERR_INVALID_ARGUMENT, "report judged req_id \"v\", but the plan was asked for req_id \"u\"",
                 report.repair_plan(both, "u", group_ids, block_sizes));
    const uint32_t other_sizes[1] = {kBlockSize + 1};
    EXPECT_THROW(KVCS_ERR_INVALID_ARGUMENT, "the report counted its positions in blocks of",
                 report.repair_plan(blocks, "v", group_ids, other_sizes));
    EXPECT_THROW(KVCS_ERR_INVALID_ARGUMENT, "is not the one the mismatch was made with",
                 kvcs::repair_plan(entries, blocks, "v", group_ids, other_sizes));

    // The same load through base64, then with no payload, fail-open.
    EXPECT(consumer.check_base64("v", kvcs::base64_encode(payload)).verdict() == kvcs::verdict::mismatch);
    consumer.set_policy(kvcs::policy::fail_open);
    kvcs::report none = consumer.check_no_payload("v");
    EXPECT(none.verdict() == kvcs::verdict::unverified && none.passed());
    EXPECT(none.reason() == kvcs::unverified_reason::no_checksums);
    std::vector<kvcs::finding> findings = none.findings();
    EXPECT(findings.size() == 1 && findings[0].group_id == KVCS_WHOLE_LOAD && !findings[0].message.empty());
    EXPECT(none.unverified(0).reason == kvcs::unverified_reason::no_checksums);
    EXPECT_THROW(KVCS_ERR_OUT_OF_BOUNDS, "index 1", none.unverified(1));
    const uint32_t one_group[1] = {0};
    const uint32_t one_size[1] = {kBlockSize};
    EXPECT_THROW(KVCS_ERR_INVALID_ARGUMENT, "report is unverified", none.repair_plan(blocks, "v", one_group, one_size));
    EXPECT(consumer.check("v", kvcs::as_bytes("junk", 4)).reason() == kvcs::unverified_reason::invalid_checksums);
    consumer.forget("v");
    EXPECT_THROW(KVCS_ERR_NOT_FOUND, "v", consumer.check("v", payload));
    EXPECT_THROW(KVCS_ERR_NOT_FOUND, "v", consumer.forget("v"));
  }
}

/// A payload read back through kvcs::payload, and layer decodings: a
/// consumer whose declared K scale differs is unverified, never a match.
void test_payload_and_decodings() {
  std::vector<flash_layer> layers(kLayers);
  kvcs::blocks blocks;
  blocks.add_request("d", 2 * kBlockSize + 3);
  blocks.add_group("d", 0, 0, std::vector<int32_t>{1, 4, 0});
  kvcs::worker producer_worker = flash_worker(layers, kvcs::algorithm::mixed, true);
  producer_worker.set_layer_decoding(0, kLayerNumbers[0], "fp8_e4m3", 16, 0.0125, 0.5);
  EXPECT_THROW(KVCS_ERR_NOT_FOUND, "layer_number 999", producer_worker.set_layer_decoding(0, 999, "fp8_e4m3"));
  EXPECT_THROW(KVCS_ERR_INVALID_ARGUMENT, "dtype", producer_worker.set_layer_decoding(0, kLayerNumbers[0], "Fp8"));
  EXPECT_THROW(KVCS_ERR_INVALID_ARGUMENT, "k_scale", producer_worker.set_layer_decoding(0, kLayerNumbers[0], "", 0, -1.0));
  kvcs::result produced = producer_worker.checksum(blocks, kvcs::role::producer);
  kvcs::verifier producer(1);
  producer.expect(blocks, kvcs::role::producer);
  producer.add_record(produced.encode());
  std::vector<uint8_t> bytes = producer.payload("d");

  kvcs::payload payload(bytes);
  kvcs_payload_summary info = payload.info();
  EXPECT(info.extension_version == KVCS_EXTENSION_VERSION && info.num_groups == 1 && info.producer_tp_size == 1);
  EXPECT(info.algorithm == KVCS_ALGORITHM_MIXED && info.num_tokens == 2 * kBlockSize + 3);
  kvcs_group_checksums group = payload.group(0);
  EXPECT(group.block_size == kBlockSize && group.num_values == 3 && group.num_layers == kLayers);
  EXPECT(group.num_decodings == 1 && group.has_marks == 1);
  EXPECT(payload.values(0) == produced.column("d", 0));
  std::vector<uint64_t> summed(3, 0);
  for (size_t l = 0; l < kLayers; l++) {
    EXPECT(payload.layer(0, l).layer_number == kLayerNumbers[l]);
    std::vector<uint64_t> values = payload.layer_values(0, l);
    for (size_t q = 0; q < summed.size() && q < values.size(); q++) summed[q] += values[q];
  }
  EXPECT(summed == payload.values(0));
  // The short last value: position 2 over one token fewer, as a call over
  // that many tokens computes it.
  {
    kvcs::blocks fewer;
    fewer.add_request("d", 2 * kBlockSize + 2);
    fewer.add_group("d", 0, 0, std::vector<int32_t>{1, 4, 0});
    std::vector<uint64_t> over_fewer = producer_worker.checksum(fewer, kvcs::role::consumer).column("d", 0);
    std::vector<uint64_t> short_last = payload.short_last(0);
    EXPECT(short_last.size() == 1 && short_last[0] == over_fewer[2] && short_last[0] != payload.values(0)[2]);
    EXPECT_THROW(KVCS_ERR_OUT_OF_BOUNDS, "group_index 1", payload.short_last(1));
  }
  kvcs::layer_decoding decoding = payload.decoding(0, 0);
  EXPECT(decoding.layer_number == kLayerNumbers[0] && decoding.dtype == "fp8_e4m3" && decoding.head_size == 16);
  EXPECT(decoding.k_scale_bits == kvcs::detail::scale_bits(0.0125) &&
         decoding.v_scale_bits == kvcs::detail::scale_bits(0.5));
  EXPECT_THROW(KVCS_ERR_OUT_OF_BOUNDS, "group_index 1", payload.group(1));
  EXPECT_THROW(KVCS_ERR_OUT_OF_BOUNDS, "index 1", payload.decoding(0, 1));
  EXPECT_THROW(KVCS_ERR_MALFORMED, "payload", kvcs::payload(kvcs::as_bytes("junk")));

  for (double k_scale : {0.025, 0.0125}) {
    kvcs::worker consumer_worker = flash_worker(layers, kvcs::algorithm::mixed, false);
    consumer_worker.set_layer_decoding(0, kLayerNumbers[0], "fp8_e4m3", 16, k_scale, 0.5);
    kvcs::verifier consumer(1);
    consumer.expect(blocks, kvcs::role::consumer);
    consumer.add_record(consumer_worker.checksum(blocks, kvcs::role::consumer).encode());
    kvcs::report report = consumer.check("d", bytes);
    if (k_scale == 0.0125) {
      EXPECT(report.verdict() == kvcs::verdict::match);
    } else {
      EXPECT(report.verdict() == kvcs::verdict::unverified &&
             report.reason() == kvcs::unverified_reason::decoding_differs);
      EXPECT(report.message().find("k_scale differs") != std::string::npos);
    }
  }
}

void test_topology() {
  EXPECT(kvcs::tp_ratio(2, 4) == -2 && kvcs::tp_ratio(4, 2) == 2);
  EXPECT_THROW(KVCS_ERR_INVALID_ARGUMENT, "3", kvcs::tp_ratio(2, 3));
  EXPECT(kvcs::remote_ranks(1, 2, 4) == (std::vector<uint32_t>{2, 3}));
  EXPECT_THROW(KVCS_ERR_OUT_OF_BOUNDS, "local_rank", kvcs::remote_ranks(2, 2, 4));
  EXPECT(kvcs::handshake_targets(3, 4, 2) == std::vector<uint32_t>{1});
  EXPECT(kvcs::block_size_ratio(32, 16) == 2);
  EXPECT_THROW(KVCS_ERR_INVALID_ARGUMENT, "remote_block_size 32", kvcs::block_size_ratio(16, 32));
  EXPECT(kvcs::remote_kv_replicated(8, 4) && !kvcs::remote_kv_replicated(4, 8));
  EXPECT(kvcs::local_kv_replicated(2, 8, true) && !kvcs::local_kv_replicated(2, 8, false));
  kvcs::head_range heads = kvcs::rank_heads(1, 4, 8, false);
  EXPECT(heads.first_head == 2 && heads.num_heads == 2);
  EXPECT_THROW(KVCS_ERR_INVALID_ARGUMENT, "tp 3", kvcs::rank_heads(0, 3, 8, false));
  std::vector<kvcs_head_source> sources = kvcs::head_sources(0, 2, 4, 8, false);
  EXPECT(sources.size() == 2 && sources[0].remote_rank == 0 && sources[1].remote_rank == 1 &&
         sources[1].first_head == 2 && sources[1].local_offset == 2 && sources[1].remote_offset == 0);

  kvcs::topology topology("decode", kvcs_local_engine{1, 2, 8, 0, 32});
  EXPECT_THROW(KVCS_ERR_INVALID_ARGUMENT, "tp is 0", kvcs::topology("d", kvcs_local_engine{0, 0, 8, 0, 32}));
  kvcs_remote_engine prefill{4096, 4, 16, 1};
  EXPECT(topology.add_remote("prefill", prefill));
  EXPECT(!topology.add_remote("prefill", kvcs_remote_engine{4096, 1, 16, 1}));
  EXPECT_THROW(KVCS_ERR_INVALID_ARGUMENT, "decode", topology.add_remote("decode", prefill));
  kvcs_remote_engine told = topology.remote("prefill");
  EXPECT(told.block_bytes == 4096 && told.tp_size == 4 && told.block_size == 16 && told.kernel_blocks == 1);
  EXPECT(topology.tp_ratio("prefill") == -2 && topology.block_size_ratio("prefill") == 2);
  EXPECT(!topology.remote_kv_replicated("prefill"));
  EXPECT(topology.remote_ranks("prefill") == (std::vector<uint32_t>{2, 3}));
  std::vector<kvcs_head_source> remote_sources = topology.head_sources("prefill");
  EXPECT(remote_sources.size() == 2 && remote_sources[1].remote_rank == 3 && remote_sources[1].first_head == 6);
  EXPECT_THROW(KVCS_ERR_NOT_FOUND, "nobody", topology.remote("nobody"));
  EXPECT_THROW(KVCS_ERR_NOT_FOUND, "nobody", topology.tp_ratio("nobody"));
  EXPECT_THROW(KVCS_ERR_NOT_FOUND, "nobody", topology.block_size_ratio("nobody"));
  EXPECT_THROW(KVCS_ERR_NOT_FOUND, "nobody", topology.remote_kv_replicated("nobody"));
  EXPECT_THROW(KVCS_ERR_NOT_FOUND, "nobody", topology.remote_ranks("nobody"));
  EXPECT_THROW(KVCS_ERR_NOT_FOUND, "nobody", topology.head_sources("nobody"));
}

void test_completion() {
  kvcs::completion completion(2);
  EXPECT_THROW(KVCS_ERR_INVALID_ARGUMENT, "expected_workers", kvcs::completion(0));
  std::vector<std::string> first = {"a", "b"};
  EXPECT(completion.report(0, kvcs::direction::sending, first) == (std::vector<bool>{false, false}));
  EXPECT(completion.reported(kvcs::direction::sending, "a") == 1);
  EXPECT(completion.reported(kvcs::direction::receiving, "a") == 0);
  EXPECT_THROW(KVCS_ERR_INVALID_ARGUMENT, "a", completion.report(0, kvcs::direction::sending, {"a"}));
  EXPECT(completion.report(1, kvcs::direction::sending, {"b"}) == std::vector<bool>{true});
  EXPECT(completion.report(1, kvcs::direction::sending, kvcs::view<std::string>()).empty());
  completion.set_expected(1);
  EXPECT_THROW(KVCS_ERR_INVALID_ARGUMENT, "expected_workers", completion.set_expected(0));
  EXPECT(completion.report(0, kvcs::direction::receiving, {"c"}) == std::vector<bool>{true});

  const int32_t vllm_ids[3] = {9, 2, 9};
  completion.add_invalid_blocks(vllm_ids);
  completion.add_invalid_blocks(std::vector<uint32_t>{4});
  const int32_t negative[1] = {-1};
  EXPECT_THROW(KVCS_ERR_INVALID_ARGUMENT, "block_ids[0] is -1", completion.add_invalid_blocks(negative));
  EXPECT(completion.invalid_blocks() == (std::vector<uint32_t>{2, 4, 9}));
  completion.clear_invalid_blocks();
  EXPECT(completion.invalid_blocks().empty());
}

}  // namespace

int main() {
  const char *replay = std::getenv("KVCS_TEST_SEED");
  seed = replay != nullptr ? std::strtoull(replay, nullptr, 0) : std::random_device{}() * 0x100000001ull;
  random_bits.seed(seed);
  try {
    test_basics();
    test_base64();
    test_checksums();
    test_block_arrays();
    test_tier_index();
    test_registration();
    test_stored();
    test_verification();
    test_payload_and_decodings();
    test_topology();
    test_completion();
  } catch (const kvcs::error &error) {
    std::fprintf(stderr, "hpp_test.cpp: FAIL unexpected %s (seed %" PRIu64 ")\n", error.what(), seed);
    return 1;
  }
  if (failures != 0) {
    std::fprintf(stderr, "hpp_test.cpp: %d failures (seed %" PRIu64 "; KVCS_TEST_SEED=%" PRIu64 " replays it)\n",
                 failures, seed, seed);
    return 1;
  }
  std::printf("hpp_test.cpp: OK (seed %" PRIu64 ")\n", seed);
  return 0;
}
