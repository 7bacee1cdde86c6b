/*
 * kvcsum from C++: one request's KV moved from a TP 2 producer to a TP 4
 * consumer, verified, one block corrupted, the repair plan printed and
 * carried out.
 *
 * Build and run: `make cpp-example` (builds target/release/libkvcsum.so and
 * this file under ASan/UBSan, then runs it). By hand, from the repository
 * root:
 *   make lib   # cargo build --release --lib, plus the libkvcsum.so.0 link
 *   g++ -std=c++17 -Wall -Wextra -Wpedantic -Werror -Iinclude examples/cpp/flash_transfer.cpp \
 *       -Ltarget/release -lkvcsum -Wl,-rpath,$PWD/target/release -o flash_transfer && ./flash_transfer
 *
 * The model: 2 layers, 8 KV heads of size 64 in bf16. Every rank of both
 * engines keeps FlashAttention's layout, one K and one V tensor per layer,
 * each [num_blocks, block_size, num_kv_heads, head_dim] ("BTHD"), in host
 * memory here (a GPU engine passes device addresses and a CUDA stream, and
 * nothing else changes). The producer runs TP 2 (4 heads per rank), the
 * consumer TP 4 (2 heads per rank); each has its own block table, int32 as
 * vLLM's. Each rank is one kvcs::worker; each engine's scheduler has one
 * kvcs::verifier. All of them live in this one process.
 *
 *   1. Each producer rank checksums the request's blocks and encodes its
 *      record; the producer's verifier sums the records into the payload,
 *      which travels with the KV (kv_transfer_params in vLLM).
 *   2. The KV arrives in the consumer's blocks; each consumer rank
 *      checksums them; the consumer's verifier judges the load: MATCH.
 *   3. One bit of one block goes bad on one consumer rank: MISMATCH, and
 *      the repair plan names the consumer block (and tokens) to load again.
 *   4. That block is loaded again; the load is judged again: MATCH.
 *
 * Exits 0 when all of that holds, 1 when something does not, 2 when a call
 * throws.
 */
#include <kvcsum.hpp>

#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

namespace {

constexpr uint32_t kLayers = 2;
constexpr uint32_t kKvHeads = 8;
constexpr uint32_t kHeadDim = 64;  // bf16 elements
constexpr uint32_t kBlockSize = 16;
constexpr uint64_t kNumTokens = 70;  // 5 blocks, the last one partial
constexpr uint32_t kGroup = 0;
const char *const kRequest = "req-0";

/// The logical KV, the same on both engines: element `d` of the K (kv = 0)
/// or V (kv = 1) row of (layer, global head, token), as bf16 bits.
uint16_t logical_kv(uint32_t layer, uint32_t head, uint64_t token, uint32_t kv, uint32_t d) {
  uint64_t x = ((((uint64_t{layer} * kKvHeads + head) * 4096 + token) * 2 + kv) * kHeadDim + d) + 0x9e3779b97f4a7c15u;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9u;  // splitmix64's finaliser
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebu;
  return static_cast<uint16_t>(x ^ (x >> 31));
}

/// One rank of an engine: its K and V tensors per layer and its worker.
struct rank {
  uint32_t first_head = 0;
  uint32_t num_heads = 0;
  std::vector<std::vector<uint16_t>> k, v;  // [layer][num_blocks * block_size * heads * head_dim]
  kvcs::worker worker;

  rank(uint32_t tp_rank, uint32_t tp_size, uint32_t num_blocks)
      : first_head(tp_rank * (kKvHeads / tp_size)),
        num_heads(kKvHeads / tp_size),
        worker(kvcs_worker_options{tp_rank, tp_size, 0, KVCS_HOST, 1}) {
    size_t elements = size_t{num_blocks} * kBlockSize * num_heads * kHeadDim;
    uint16_t junk = static_cast<uint16_t>(tp_rank * 77 + 1);  // what an engine's free blocks hold
    for (uint32_t layer = 0; layer < kLayers; layer++) {
      k.emplace_back(elements, junk);
      v.emplace_back(elements, static_cast<uint16_t>(junk + 1));
    }
    // Register the caches: the layout string says which dimension is which;
    // the strides (in bytes) say where things are.
    worker.add_group(kGroup, kBlockSize);
    const std::vector<int64_t> shape = {num_blocks, kBlockSize, num_heads, kHeadDim};
    const std::vector<int64_t> strides = {int64_t{kBlockSize} * num_heads * kHeadDim * 2,
                                          int64_t{num_heads} * kHeadDim * 2, kHeadDim * 2, 2};
    for (uint32_t layer = 0; layer < kLayers; layer++) {
      worker.add_region(k[layer].data(), elements * 2);
      worker.add_region(v[layer].data(), elements * 2);
      kvcs::tensor k_tensor{kvcs::address_of(k[layer].data()), shape, strides, 2};
      kvcs::tensor v_tensor{kvcs::address_of(v[layer].data()), shape, strides, 2};
      kvcs::layout_layer cache = kvcs::layer_from_layout("BTHD", k_tensor, &v_tensor);
      kvcs_layer description = cache.layer();
      description.group_id = kGroup;
      description.layer_number = layer;  // model-wide
      description.first_head = first_head;  // global number of this rank's first head
      std::string identity = "model.layers." + std::to_string(layer) + ".self_attn.attn";
      description.identity = kvcs::as_bytes(identity).data();
      description.identity_len = identity.size();
      worker.add_layer(description);
    }
  }

  /// Where element `d` of (layer, local head, slot of block) lives.
  uint16_t &element(uint32_t kv, uint32_t layer, uint32_t block, uint32_t slot, uint32_t head, uint32_t d) {
    std::vector<uint16_t> &tensor = kv == 0 ? k[layer] : v[layer];
    return tensor[((size_t{block} * kBlockSize + slot) * num_heads + head) * kHeadDim + d];
  }

  /// Writes the logical KV of the request's position `position` into block `block_id`.
  void load_block(uint64_t position, uint32_t block_id) {
    for (uint32_t slot = 0; slot < kBlockSize; slot++) {
      uint64_t token = position * kBlockSize + slot;
      for (uint32_t layer = 0; layer < kLayers; layer++)
        for (uint32_t head = 0; head < num_heads; head++)
          for (uint32_t kv = 0; kv < 2; kv++)
            for (uint32_t d = 0; d < kHeadDim; d++) {
              element(kv, layer, block_id, slot, head, d) =
                  token < kNumTokens ? logical_kv(layer, first_head + head, token, kv, d) : uint16_t{0x7fc0};
            }
    }
  }
};

/// An engine: its ranks, its block table for the request and its scheduler's verifier.
struct engine {
  std::vector<rank> ranks;
  std::vector<int32_t> block_table;  // vLLM's: int32, one block id per position
  kvcs::blocks blocks;
  kvcs::verifier verifier;

  engine(uint32_t tp_size, uint32_t num_blocks, std::vector<int32_t> table, kvcs::role role)
      : block_table(std::move(table)), verifier(tp_size) {
    ranks.reserve(tp_size);
    for (uint32_t r = 0; r < tp_size; r++) {
      ranks.emplace_back(r, tp_size, num_blocks);
    }
    blocks.add_request(kRequest, kNumTokens);
    blocks.add_group(kRequest, kGroup, 0, block_table);  // int32 ids: a negative one throws
    verifier.expect(blocks, role);
  }

  /// Every rank checksums the request's blocks and its record goes to the
  /// verifier (in a real engine: over the engine's own channel to the
  /// scheduler, as bytes).
  void report_checksums(kvcs::role role) {
    for (rank &r : ranks) {
      kvcs::result result = r.worker.checksum(blocks, role);
      std::vector<uint8_t> record = result.encode();
      verifier.add_record(record);
    }
  }
};

int failures = 0;

void expect(bool ok, const char *what) {
  if (!ok) {
    std::fprintf(stderr, "flash_transfer: FAIL %s\n", what);
    failures++;
  }
}

void print_report(const char *when, const kvcs::report &report) {
  std::printf("%s: %s, passed=%d\n  %s\n", when, kvcs::to_string(report.verdict()).c_str(),
              report.passed() ? 1 : 0, report.message().c_str());
}

int run() {
  kvcs::check_abi();
  engine producer(2, 16, {9, 3, 14, 0, 7}, kvcs::role::producer);
  engine consumer(4, 12, {6, 1, 4, 2, 11}, kvcs::role::consumer);

  // 1. The producer computed the KV; its scheduler builds the payload.
  for (rank &r : producer.ranks)
    for (size_t q = 0; q < producer.block_table.size(); q++) r.load_block(q, producer.block_table[q]);
  producer.report_checksums(kvcs::role::producer);
  std::vector<uint8_t> payload = producer.verifier.payload(kRequest);
  std::printf("producer (TP 2): payload of %zu bytes, sent as %zu characters of base64\n", payload.size(),
              kvcs::base64_encode(payload).size());

  // 2. The transfer: each consumer block gets the same tokens' KV.
  for (rank &r : consumer.ranks)
    for (size_t q = 0; q < consumer.block_table.size(); q++) r.load_block(q, consumer.block_table[q]);
  consumer.report_checksums(kvcs::role::consumer);
  kvcs::report intact = consumer.verifier.check(kRequest, payload);
  print_report("consumer (TP 4), intact load", intact);
  expect(intact.verdict() == kvcs::verdict::match && intact.passed(), "the intact load matches");

  // 3. One bit goes bad: rank 3, layer 1, V of position 2's block, a valid token.
  const uint64_t bad_position = 2;
  const uint32_t bad_block = static_cast<uint32_t>(consumer.block_table[bad_position]);
  consumer.ranks[3].element(1, 1, bad_block, 5, 1, 17) ^= 0x0040;
  consumer.report_checksums(kvcs::role::consumer);  // newer records replace the older ones
  kvcs::report corrupted = consumer.verifier.check(kRequest, payload);
  print_report("consumer, one bit flipped", corrupted);
  expect(corrupted.verdict() == kvcs::verdict::mismatch && !corrupted.passed(), "the corrupted load mismatches");

  const uint32_t group_ids[] = {kGroup};
  const uint32_t block_sizes[] = {kBlockSize};
  std::vector<kvcs_repair_block> plan = corrupted.repair_plan(consumer.blocks, kRequest, group_ids, block_sizes);
  std::printf("repair plan: %zu block(s) to load again\n", plan.size());
  for (const kvcs_repair_block &block : plan) {
    std::printf("  group %u, position %llu: block id %u, tokens [%llu, %llu)\n", block.group_id,
                static_cast<unsigned long long>(block.position), block.block_id,
                static_cast<unsigned long long>(block.start_token), static_cast<unsigned long long>(block.end_token));
  }
  expect(plan.size() == 1 && plan[0].block_id == bad_block && plan[0].position == bad_position &&
             plan[0].start_token == bad_position * kBlockSize && plan[0].end_token == (bad_position + 1) * kBlockSize,
         "the plan names the corrupted block and its tokens");

  // 4. Load the planned blocks again (every rank: the plan is per block,
  //    not per rank) and judge the load again.
  for (const kvcs_repair_block &block : plan)
    for (rank &r : consumer.ranks) r.load_block(block.position, block.block_id);
  consumer.report_checksums(kvcs::role::consumer);
  kvcs::report repaired = consumer.verifier.check(kRequest, payload);
  print_report("consumer, after the repair", repaired);
  expect(repaired.verdict() == kvcs::verdict::match, "the repaired load matches");

  if (failures != 0) {
    std::fprintf(stderr, "flash_transfer: %d failures\n", failures);
    return 1;
  }
  std::printf("flash_transfer: OK (kvcsum %s)\n", kvcs::version().c_str());
  return 0;
}

}  // namespace

int main() {
  try {
    return run();
  } catch (const kvcs::error &error) {
    std::fprintf(stderr, "flash_transfer: %s\n", error.what());
    return 2;
  }
}
