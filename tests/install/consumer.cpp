// A C++17 program built against an installed kvcsum with CMake's
// find_package(kvcsum) (tests/install/CMakeLists.txt), once with the shared
// and once with the static library, and run by tests/install/run.sh. It
// goes through kvcsum.hpp: RAII handles, exceptions that carry the status
// and message, and the size-query helpers (record, payload, base64), from a
// producer worker's checksums to a consumer verifier's verdict, and checks
// the topology and completion wrappers. Prints "consumer.cpp: OK".
#include <kvcsum.hpp>

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

namespace {

int failures = 0;

void expect(bool ok, const char *what) {
  if (!ok) {
    std::fprintf(stderr, "consumer.cpp: FAIL %s\n", what);
    failures++;
  }
}

constexpr uint32_t kHeads = 2;
constexpr uint32_t kBlock = 16;
constexpr uint32_t kBlocks = 4;
constexpr uint32_t kCell = 16;

/// One host worker over `cache`, HND with one layer.
kvcs::worker make_worker(std::vector<uint64_t> &cache) {
  kvcs_worker_options options{0, 1, 0, KVCS_HOST, 1};
  kvcs::worker worker(options);
  worker.add_region(cache.data(), cache.size() * sizeof(uint64_t));
  worker.add_group(0, kBlock);
  kvcs_segment cell{};
  cell.address = static_cast<uint64_t>(reinterpret_cast<uintptr_t>(cache.data()));
  cell.block_stride = kHeads * kBlock * kCell;
  cell.head_stride = kBlock * kCell;
  cell.token_stride = kCell;
  cell.bytes_per_token = kCell;
  kvcs_layer layer{};
  layer.num_heads = kHeads;
  layer.replicas = 1;
  layer.num_blocks = kBlocks;
  layer.kernel_blocks = 1;
  layer.tokens_per_kernel_block = kBlock;
  layer.num_segments = 1;
  layer.segments = &cell;
  worker.add_layer(layer);
  return worker;
}

}  // namespace

int main() {
  kvcs::check_abi();
  std::mt19937_64 random(0x637070u);
  std::vector<uint64_t> cache(kBlocks * kHeads * kBlock * kCell / 8);
  for (uint64_t &piece : cache) {
    piece = random();
  }

  kvcs::blocks scheduled;
  scheduled.add_request("req", 2 * kBlock + 3);
  scheduled.add_group("req", 0, 0, {2, 0, 3});

  // Producer: record -> verifier -> payload -> base64.
  kvcs::worker producer_worker = make_worker(cache);
  kvcs::result produced = producer_worker.checksum(scheduled, kvcs::role::producer);
  expect(produced.ready(), "a host result is ready at once");
  expect(produced.column("req", 0).size() == 3, "three positions");
  kvcs::verifier producer(1);
  producer.expect(scheduled, kvcs::role::producer);
  producer.add_record(produced.encode());
  std::vector<uint8_t> payload = producer.payload("req");
  std::string text = kvcs::base64_encode(payload);
  expect(kvcs::base64_decode(text) == payload, "base64 round trip");

  // Consumer: the same KV gives a match; one flipped bit a mismatch.
  for (int flip = 0; flip < 2; flip++) {
    std::vector<uint64_t> loaded = cache;
    if (flip) {
      loaded[3 * kHeads * kBlock * kCell / 8 + 5] ^= 1u << 9;  // block 3, a valid token
    }
    kvcs::worker consumer_worker = make_worker(loaded);
    kvcs::result consumed = consumer_worker.checksum(scheduled, kvcs::role::consumer);
    kvcs::verifier consumer(1);
    consumer.expect(scheduled, kvcs::role::consumer);
    consumer.add_record(consumed.encode());
    kvcs::report report = consumer.check_base64("req", text);
    expect(report.verdict() == (flip ? kvcs::verdict::mismatch : kvcs::verdict::match), "verdict");
    expect(report.passed() == !flip, "passed");
  }

  // A failing call throws kvcs::error with the status and the message.
  try {
    kvcs::blocks blocks;
    blocks.add_request("", 1);
    expect(false, "an empty req_id throws");
  } catch (const kvcs::error &error) {
    expect(error.status() == KVCS_ERR_INVALID_ARGUMENT, "status of the exception");
    expect(std::strstr(error.what(), "req_id") != nullptr, "message names req_id");
  }

  kvcs::topology topology("decode", kvcs_local_engine{1, 2, 8, 0, 32});
  expect(topology.add_remote("prefill", kvcs_remote_engine{4096, 4, 16, 1}), "remote added");
  expect(!topology.add_remote("prefill", kvcs_remote_engine{4096, 1, 16, 1}), "second handshake kept out");
  expect(topology.tp_ratio("prefill") == -2, "tp ratio -2");
  expect(topology.remote_ranks("prefill") == std::vector<uint32_t>{2, 3}, "remote ranks 2, 3");
  std::vector<kvcs_head_source> sources = topology.head_sources("prefill");
  expect(sources.size() == 2 && sources[1].remote_rank == 3 && sources[1].first_head == 6 &&
             sources[1].local_offset == 2,
         "head sources");
  try {
    topology.tp_ratio("nobody");
    expect(false, "an unknown engine throws");
  } catch (const kvcs::error &error) {
    expect(error.status() == KVCS_ERR_NOT_FOUND, "unknown engine is NOT_FOUND");
  }

  kvcs::completion completion(2);
  expect(completion.report(0, kvcs::direction::sending, {"a", "b"}) == std::vector<bool>{false, false}, "first");
  expect(completion.report(1, kvcs::direction::sending, {"b"}) == std::vector<bool>{true}, "second completes b");
  expect(completion.invalid_blocks().empty(), "no invalid blocks");

  if (failures != 0) {
    std::fprintf(stderr, "consumer.cpp: %d failures\n", failures);
    return 1;
  }
  std::printf("consumer.cpp: OK (kvcsum %s)\n", kvcs_version());
  return 0;
}
