/*
 * The topology calls and the completion counter (SPEC section 11) through
 * the C boundary: each rule on a few sizes against values worked out by
 * hand from the rules, every error with the argument its message names,
 * size queries, NULLs, and state left unchanged by a failed call.
 */
#include "check.h"

static void test_free_functions(void) {
  int64_t ratio = 0;
  EXPECT_OK(kvcs_tp_ratio(8, 2, &ratio));
  CHECK(ratio == 4);
  EXPECT_OK(kvcs_tp_ratio(2, 8, &ratio));
  CHECK(ratio == -4);
  EXPECT(kvcs_tp_ratio(6, 4, &ratio), KVCS_ERR_INVALID_ARGUMENT, "local_tp 6 is not a multiple of remote_tp 4");
  EXPECT(kvcs_tp_ratio(0, 4, &ratio), KVCS_ERR_INVALID_ARGUMENT, "local_tp is 0");
  EXPECT(kvcs_tp_ratio(4, 4, NULL), KVCS_ERR_INVALID_ARGUMENT, "ratio");

  /* Size query, then a short buffer, then the ranks. */
  uint32_t ranks[4] = {99, 99, 99, 99};
  size_t len = 0;
  EXPECT(kvcs_remote_ranks(1, 2, 8, NULL, 0, &len), KVCS_ERR_BUFFER_TOO_SMALL, "cap 0");
  CHECK(len == 4);
  EXPECT(kvcs_remote_ranks(1, 2, 8, ranks, 3, &len), KVCS_ERR_BUFFER_TOO_SMALL, "cap 3");
  CHECK(len == 4 && ranks[0] == 99);
  EXPECT_OK(kvcs_remote_ranks(1, 2, 8, ranks, 4, &len));
  CHECK(len == 4 && ranks[0] == 4 && ranks[1] == 5 && ranks[2] == 6 && ranks[3] == 7);
  EXPECT_OK(kvcs_handshake_targets(5, 8, 2, ranks, 4, &len));
  EXPECT(kvcs_handshake_targets(8, 8, 2, ranks, 4, &len), KVCS_ERR_OUT_OF_BOUNDS, "local_rank 8");
  EXPECT(kvcs_handshake_targets(0, 6, 4, ranks, 4, &len), KVCS_ERR_INVALID_ARGUMENT, "not a multiple");
  CHECK(len == 1 && ranks[0] == 1);
  EXPECT(kvcs_remote_ranks(2, 2, 8, ranks, 4, &len), KVCS_ERR_OUT_OF_BOUNDS, "local_rank 2");
  EXPECT(kvcs_remote_ranks(0, 2, 8, ranks, 4, NULL), KVCS_ERR_INVALID_ARGUMENT, "len");
  EXPECT(kvcs_remote_ranks(0, 2, 8, NULL, 4, &len), KVCS_ERR_INVALID_ARGUMENT, "buf is NULL with cap 4");

  uint32_t value = 0;
  EXPECT_OK(kvcs_block_size_ratio(64, 16, &value));
  CHECK(value == 4);
  EXPECT(kvcs_block_size_ratio(16, 64, &value), KVCS_ERR_INVALID_ARGUMENT, "local_block_size 16");
  EXPECT_OK(kvcs_remote_kv_replicated(16, 8, &value));
  EXPECT(kvcs_remote_kv_replicated(0, 8, &value), KVCS_ERR_INVALID_ARGUMENT, "remote_tp is 0");
  EXPECT(kvcs_remote_kv_replicated(16, 8, NULL), KVCS_ERR_INVALID_ARGUMENT, "replicated");
  CHECK(value == 1);
  EXPECT_OK(kvcs_remote_kv_replicated(8, 8, &value));
  CHECK(value == 0);
  EXPECT_OK(kvcs_local_kv_replicated(2, 8, 1, &value));
  CHECK(value == 1);
  EXPECT_OK(kvcs_local_kv_replicated(2, 8, 0, &value));
  CHECK(value == 0);
  EXPECT(kvcs_local_kv_replicated(2, 8, 2, &value), KVCS_ERR_INVALID_ARGUMENT, "is_mla 2");

  uint32_t first = 0, count = 0;
  EXPECT_OK(kvcs_rank_heads(3, 4, 8, 0, &first, &count));
  CHECK(first == 6 && count == 2);
  EXPECT_OK(kvcs_rank_heads(5, 16, 8, 0, &first, &count));
  CHECK(first == 2 && count == 1);
  EXPECT_OK(kvcs_rank_heads(5, 16, 1, 1, &first, &count));
  CHECK(first == 0 && count == 1);
  EXPECT(kvcs_rank_heads(0, 3, 8, 0, &first, &count), KVCS_ERR_INVALID_ARGUMENT, "total_kv_heads 8");
  EXPECT(kvcs_rank_heads(4, 4, 8, 0, &first, &count), KVCS_ERR_OUT_OF_BOUNDS, "rank 4");

  /* Local TP 1 with 2 heads, remote TP 4 (each head on 2 remote ranks):
   * head 0 from remote rank 0, head 1 from remote rank 2. */
  kvcs_head_source sources[2];
  EXPECT_OK(kvcs_head_sources(0, 1, 4, 2, 0, sources, 2, &len));
  CHECK(len == 2);
  CHECK(sources[0].remote_rank == 0 && sources[0].first_head == 0 && sources[0].num_heads == 1);
  CHECK(sources[1].remote_rank == 2 && sources[1].first_head == 1 && sources[1].local_offset == 1 &&
        sources[1].remote_offset == 0);
  EXPECT(kvcs_head_sources(0, 2, 4, 6, 0, sources, 2, &len), KVCS_ERR_INVALID_ARGUMENT, "total_kv_heads 6");

  /* TP sizes run to KVCS_MAX_TP_SIZE: a handshake's 2^31 is refused, not
   * 8 GiB of ranks; *len stays as it was. */
  len = 5;
  EXPECT(kvcs_remote_ranks(0, 1, 1u << 31, NULL, 0, &len), KVCS_ERR_INVALID_ARGUMENT, "remote_tp 2147483648");
  EXPECT(kvcs_handshake_targets(0, 1, KVCS_MAX_TP_SIZE + 1, NULL, 0, &len), KVCS_ERR_INVALID_ARGUMENT,
         "remote_tp 65537");
  EXPECT(kvcs_head_sources(0, 1, 1u << 31, 1u << 31, 0, NULL, 0, &len), KVCS_ERR_INVALID_ARGUMENT,
         "remote_tp 2147483648");
  EXPECT(kvcs_tp_ratio(1u << 31, 1, &ratio), KVCS_ERR_INVALID_ARGUMENT, "local_tp 2147483648");
  EXPECT(kvcs_rank_heads(0, 1u << 31, 1, 0, &first, &count), KVCS_ERR_INVALID_ARGUMENT, "tp 2147483648");
  CHECK(len == 5);
  EXPECT(kvcs_remote_ranks(0, 1, KVCS_MAX_TP_SIZE, NULL, 0, &len), KVCS_ERR_BUFFER_TOO_SMALL, "cap 0");
  CHECK(len == KVCS_MAX_TP_SIZE);
  /* Runs, not heads: 2^31 heads from 65536 ranks are 65536 runs. */
  EXPECT(kvcs_head_sources(0, 1, KVCS_MAX_TP_SIZE, 1u << 31, 0, NULL, 0, &len), KVCS_ERR_BUFFER_TOO_SMALL, "cap 0");
  CHECK(len == KVCS_MAX_TP_SIZE);
}

static void test_topology_handle(void) {
  kvcs_local_engine local = {.tp_rank = 1, .tp_size = 2, .total_kv_heads = 8, .is_mla = 0, .block_size = 32};
  kvcs_topology *topology = NULL;
  EXPECT(kvcs_topology_create(NULL, &local, &topology), KVCS_ERR_INVALID_ARGUMENT, "local_engine_id");
  EXPECT(kvcs_topology_create("decode", NULL, &topology), KVCS_ERR_INVALID_ARGUMENT, "local");
  kvcs_local_engine bad = local;
  bad.tp_rank = 2;
  EXPECT(kvcs_topology_create("decode", &bad, &topology), KVCS_ERR_OUT_OF_BOUNDS, "rank 2");
  CHECK(topology == NULL);
  EXPECT_OK(kvcs_topology_create("decode", &local, &topology));

  kvcs_remote_engine remote = {.block_bytes = 8192, .tp_size = 4, .block_size = 16, .kernel_blocks = 1};
  uint32_t added = 9;
  EXPECT_OK(kvcs_topology_add_remote(topology, "prefill", &remote, &added));
  CHECK(added == 1);
  kvcs_remote_engine other = remote;
  other.tp_size = 1;
  EXPECT_OK(kvcs_topology_add_remote(topology, "prefill", &other, &added));
  CHECK(added == 0);
  EXPECT(kvcs_topology_add_remote(topology, "decode", &remote, &added), KVCS_ERR_INVALID_ARGUMENT, "own id");
  other.kernel_blocks = 3;
  EXPECT(kvcs_topology_add_remote(topology, "x", &other, &added), KVCS_ERR_INVALID_ARGUMENT, "kernel_blocks 3");
  other = remote;
  other.tp_size = 1u << 31;
  EXPECT(kvcs_topology_add_remote(topology, "x", &other, &added), KVCS_ERR_INVALID_ARGUMENT, "tp_size 2147483648");

  kvcs_remote_engine told;
  EXPECT_OK(kvcs_topology_remote(topology, "prefill", &told));
  CHECK(told.tp_size == 4 && told.block_bytes == 8192 && told.block_size == 16);
  EXPECT(kvcs_topology_remote(topology, "x", &told), KVCS_ERR_NOT_FOUND, "\"x\"");
  int64_t ratio = 0;
  EXPECT_OK(kvcs_topology_tp_ratio(topology, "prefill", &ratio));
  CHECK(ratio == -2);
  uint32_t value = 0;
  EXPECT_OK(kvcs_topology_block_size_ratio(topology, "prefill", &value));
  CHECK(value == 2);
  EXPECT_OK(kvcs_topology_remote_kv_replicated(topology, "prefill", &value));
  CHECK(value == 0);
  uint32_t ranks[2];
  size_t len = 0;
  EXPECT_OK(kvcs_topology_remote_ranks(topology, "prefill", ranks, 2, &len));
  CHECK(len == 2 && ranks[0] == 2 && ranks[1] == 3);
  kvcs_head_source sources[2];
  EXPECT_OK(kvcs_topology_head_sources(topology, "prefill", sources, 2, &len));
  CHECK(len == 2 && sources[0].remote_rank == 2 && sources[0].first_head == 4 && sources[0].num_heads == 2 &&
        sources[1].remote_rank == 3 && sources[1].first_head == 6 && sources[1].local_offset == 2);
  EXPECT(kvcs_topology_head_sources(NULL, "prefill", sources, 2, &len), KVCS_ERR_INVALID_ARGUMENT, "topology");
  /* Each per-engine question about an engine no handshake told of. */
  EXPECT(kvcs_topology_tp_ratio(topology, "x", &ratio), KVCS_ERR_NOT_FOUND, "\"x\"");
  EXPECT(kvcs_topology_tp_ratio(topology, "prefill", NULL), KVCS_ERR_INVALID_ARGUMENT, "ratio");
  EXPECT(kvcs_topology_block_size_ratio(topology, "x", &value), KVCS_ERR_NOT_FOUND, "\"x\"");
  EXPECT(kvcs_topology_remote_kv_replicated(topology, "x", &value), KVCS_ERR_NOT_FOUND, "\"x\"");
  EXPECT(kvcs_topology_remote_ranks(topology, "x", ranks, 2, &len), KVCS_ERR_NOT_FOUND, "\"x\"");
  EXPECT(kvcs_topology_remote_ranks(topology, "prefill", ranks, 1, &len), KVCS_ERR_BUFFER_TOO_SMALL, "cap 1");
  kvcs_topology_destroy(topology);
  kvcs_topology_destroy(NULL);
}

static void test_completion(void) {
  kvcs_completion *completion = NULL;
  EXPECT(kvcs_completion_create(0, &completion), KVCS_ERR_INVALID_ARGUMENT, "expected_workers is 0");
  EXPECT_OK(kvcs_completion_create(2, &completion));
  const char *ab[2] = {"a", "b"};
  uint8_t done[2] = {9, 9};
  EXPECT_OK(kvcs_completion_report(completion, 0, KVCS_DIRECTION_SENDING, ab, 2, done));
  CHECK(done[0] == 0 && done[1] == 0);
  /* Worker 0 again for "a": refused, and "b" (listed first) is not counted. */
  const char *ba[2] = {"b", "a"};
  EXPECT(kvcs_completion_report(completion, 0, KVCS_DIRECTION_SENDING, ba, 2, done), KVCS_ERR_INVALID_ARGUMENT,
         "worker 0 already reported");
  uint32_t count = 0;
  EXPECT_OK(kvcs_completion_reported(completion, KVCS_DIRECTION_SENDING, "b", &count));
  CHECK(count == 1);
  EXPECT_OK(kvcs_completion_report(completion, 1, KVCS_DIRECTION_SENDING, ba, 2, done));
  CHECK(done[0] == 1 && done[1] == 1);
  EXPECT(kvcs_completion_report(completion, 1, 2, ba, 2, done), KVCS_ERR_INVALID_ARGUMENT, "direction 2");
  EXPECT(kvcs_completion_report(completion, 1, KVCS_DIRECTION_RECEIVING, ba, 2, NULL), KVCS_ERR_INVALID_ARGUMENT,
         "completed");
  const char *with_null[1] = {NULL};
  EXPECT(kvcs_completion_report(completion, 1, KVCS_DIRECTION_RECEIVING, with_null, 1, done),
         KVCS_ERR_INVALID_ARGUMENT, "req_ids[0]");
  EXPECT(kvcs_completion_set_expected(completion, 0), KVCS_ERR_INVALID_ARGUMENT, "expected_workers is 0");
  EXPECT(kvcs_completion_set_expected(NULL, 1), KVCS_ERR_INVALID_ARGUMENT, "completion");
  EXPECT(kvcs_completion_reported(completion, 5, "b", &count), KVCS_ERR_INVALID_ARGUMENT, "direction 5");
  EXPECT(kvcs_completion_reported(completion, KVCS_DIRECTION_SENDING, "b", NULL), KVCS_ERR_INVALID_ARGUMENT,
         "count");
  EXPECT(kvcs_completion_clear_invalid_blocks(NULL), KVCS_ERR_INVALID_ARGUMENT, "completion");
  EXPECT_OK(kvcs_completion_set_expected(completion, 1));
  EXPECT_OK(kvcs_completion_report(completion, 4, KVCS_DIRECTION_RECEIVING, ab, 1, done));
  CHECK(done[0] == 1);

  const uint32_t first_ids[3] = {7, 3, 7}, second_ids[2] = {1, 3};
  EXPECT_OK(kvcs_completion_add_invalid_blocks(completion, first_ids, 3));
  EXPECT_OK(kvcs_completion_add_invalid_blocks(completion, second_ids, 2));
  EXPECT(kvcs_completion_add_invalid_blocks(completion, NULL, 2), KVCS_ERR_INVALID_ARGUMENT, "block_ids");
  uint32_t ids[3];
  size_t len = 0;
  EXPECT(kvcs_completion_invalid_blocks(completion, NULL, 0, &len), KVCS_ERR_BUFFER_TOO_SMALL, "cap 0");
  CHECK(len == 3);
  EXPECT_OK(kvcs_completion_invalid_blocks(completion, ids, 3, &len));
  CHECK(len == 3 && ids[0] == 1 && ids[1] == 3 && ids[2] == 7);
  EXPECT_OK(kvcs_completion_clear_invalid_blocks(completion));
  EXPECT_OK(kvcs_completion_invalid_blocks(completion, NULL, 0, &len));
  CHECK(len == 0);
  kvcs_completion_destroy(completion);
  kvcs_completion_destroy(NULL);
}

void test_topology(void) {
  test_free_functions();
  test_topology_handle();
  test_completion();
}
