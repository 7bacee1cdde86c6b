/*
 * kvcsum.hpp: header-only C++17 convenience over the C API of kvcsum.h.
 *
 * - kvcs::error: every non-OK status becomes this exception, carrying the
 *   status and a copy of kvcs_last_error() taken at once (the C message is
 *   per thread and the next failing call overwrites it).
 * - RAII owners of the handle types (kvcs::blocks, kvcs::worker,
 *   kvcs::result, kvcs::verifier, kvcs::report; kvcs::topology,
 *   kvcs::completion): move-only, destroyed with their owner; get() gives
 *   the C handle for any call not wrapped here.
 * - Size-query helpers that run the (NULL, 0) query and the real call:
 *   kvcs::encode (a result's record), kvcs::payload (a producer's
 *   payload), kvcs::base64_encode / kvcs::base64_decode.
 *
 * Thread safety and ownership are those of the C handles (kvcsum.h).
 */
#ifndef KVCSUM_HPP
#define KVCSUM_HPP

#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "kvcsum.h"

namespace kvcs {

/// A failed kvcsum call: its status and message.
class error : public std::runtime_error {
 public:
  error(kvcs_status status, const std::string &message)
      : std::runtime_error(std::string(kvcs_status_name(status)) + ": " + message), status_(status) {}
  /// The status the call returned.
  kvcs_status status() const noexcept { return status_; }

 private:
  kvcs_status status_;
};

/// Throws kvcs::error for any status but KVCS_OK, copying kvcs_last_error()
/// before anything else can overwrite it.
inline void check(kvcs_status status) {
  if (status != KVCS_OK) {
    throw error(status, kvcs_last_error());
  }
}

/// Throws unless the library loaded at run time has the header's ABI.
inline void check_abi() {
  if (kvcs_abi_version() != KVCS_ABI_VERSION) {
    throw error(KVCS_ERR_UNSUPPORTED, "the loaded kvcsum has ABI version " + std::to_string(kvcs_abi_version()) +
                                          ", this program was built for " + std::to_string(KVCS_ABI_VERSION));
  }
}

namespace detail {

/// A move-only owner of a C handle freed by `Destroy`.
template <typename T, void (*Destroy)(T *)>
class owner {
 public:
  owner() noexcept = default;
  explicit owner(T *handle) noexcept : handle_(handle) {}
  owner(const owner &) = delete;
  owner &operator=(const owner &) = delete;
  owner(owner &&other) noexcept : handle_(std::exchange(other.handle_, nullptr)) {}
  owner &operator=(owner &&other) noexcept {
    if (this != &other) {
      Destroy(handle_);
      handle_ = std::exchange(other.handle_, nullptr);
    }
    return *this;
  }
  ~owner() { Destroy(handle_); }

  /// The C handle (still owned here).
  T *get() const noexcept { return handle_; }
  /// Gives up ownership; the caller destroys the handle.
  T *release() noexcept { return std::exchange(handle_, nullptr); }
  explicit operator bool() const noexcept { return handle_ != nullptr; }

 private:
  T *handle_ = nullptr;
};

/// Runs `call(buf, cap, &len)` once as a size query and once for real.
template <typename Byte, typename Call>
std::vector<Byte> read_sized(Call call) {
  size_t len = 0;
  kvcs_status status = call(nullptr, 0, &len);
  if (status != KVCS_OK && status != KVCS_ERR_BUFFER_TOO_SMALL) {
    check(status);
  }
  std::vector<Byte> out(len);
  if (len != 0) {
    check(call(out.data(), out.size(), &len));
    out.resize(len);
  }
  return out;
}

}  // namespace detail

/// A request block set (kvcs_blocks).
class blocks : public detail::owner<kvcs_blocks, kvcs_blocks_destroy> {
 public:
  blocks() : owner(create()) {}
  /// kvcs_blocks_add_request.
  void add_request(const std::string &req_id, uint64_t num_tokens) {
    check(kvcs_blocks_add_request(get(), req_id.c_str(), num_tokens));
  }
  /// kvcs_blocks_add_group.
  void add_group(const std::string &req_id, uint32_t group_id, uint64_t first_position,
                 const std::vector<uint32_t> &block_ids) {
    check(kvcs_blocks_add_group(get(), req_id.c_str(), group_id, first_position, block_ids.data(),
                                block_ids.size()));
  }

 private:
  static kvcs_blocks *create() {
    kvcs_blocks *handle = nullptr;
    check(kvcs_blocks_create(&handle));
    return handle;
  }
};

/// A worker's partial checksums (kvcs_result).
class result : public detail::owner<kvcs_result, kvcs_result_destroy> {
 public:
  using owner::owner;
  /// True once the values are readable (kvcs_result_query).
  bool ready() const {
    kvcs_status status = kvcs_result_query(get());
    if (status == KVCS_ERR_NOT_READY) {
      return false;
    }
    check(status);
    return true;
  }
  /// kvcs_result_wait.
  void wait() { check(kvcs_result_wait(get())); }
  /// The number of positions of a group (kvcs_result_group).
  size_t num_positions(const std::string &req_id, uint32_t group_id) const {
    size_t positions = 0;
    check(kvcs_result_group(get(), req_id.c_str(), group_id, nullptr, &positions, nullptr));
    return positions;
  }
  /// The number of columns of a group (kvcs_result_group).
  size_t num_columns(const std::string &req_id, uint32_t group_id) const {
    size_t columns = 0;
    check(kvcs_result_group(get(), req_id.c_str(), group_id, nullptr, nullptr, &columns));
    return columns;
  }
  /// The values of one column (kvcs_result_column).
  std::vector<uint64_t> column(const std::string &req_id, uint32_t group_id, size_t column = 0) const {
    std::vector<uint64_t> values(num_positions(req_id, group_id));
    check(kvcs_result_column(get(), req_id.c_str(), group_id, column, nullptr, nullptr, values.data()));
    return values;
  }
};

/// A worker's record of a result (kvcs_result_encode), sized for you.
inline std::vector<uint8_t> encode(const kvcs_result *result) {
  return detail::read_sized<uint8_t>(
      [&](uint8_t *buf, size_t cap, size_t *len) { return kvcs_result_encode(result, buf, cap, len); });
}

/// A worker context (kvcs_worker).
class worker : public detail::owner<kvcs_worker, kvcs_worker_destroy> {
 public:
  explicit worker(const kvcs_worker_options &options) : owner(create(options)) {}
  /// kvcs_worker_add_region.
  void add_region(uint64_t address, uint64_t length) { check(kvcs_worker_add_region(get(), address, length)); }
  /// kvcs_worker_add_region over a host object.
  void add_region(const void *address, size_t length) {
    add_region(static_cast<uint64_t>(reinterpret_cast<uintptr_t>(address)), static_cast<uint64_t>(length));
  }
  /// kvcs_worker_add_group.
  void add_group(uint32_t group_id, uint32_t block_size) { check(kvcs_worker_add_group(get(), group_id, block_size)); }
  /// kvcs_worker_add_layer.
  void add_layer(const kvcs_layer &layer) { check(kvcs_worker_add_layer(get(), &layer)); }
  /// kvcs_worker_set_detail.
  void set_detail(bool on) { check(kvcs_worker_set_detail(get(), on ? 1u : 0u)); }
  /// kvcs_worker_set_algorithm: KVCS_ALGORITHM_MIXED (the default) or
  /// KVCS_ALGORITHM_WEIGHTED, before the first checksum, store or load check.
  void set_algorithm(uint32_t algorithm) { check(kvcs_worker_set_algorithm(get(), algorithm)); }
  /// kvcs_worker_checksum.
  kvcs::result checksum(const blocks &blocks, uint32_t role, void *cuda_stream = nullptr) {
    kvcs_result *out = nullptr;
    check(kvcs_worker_checksum(get(), blocks.get(), role, cuda_stream, &out));
    return kvcs::result(out);
  }

 private:
  static kvcs_worker *create(const kvcs_worker_options &options) {
    kvcs_worker *handle = nullptr;
    check(kvcs_worker_create(&options, &handle));
    return handle;
  }
};

/// A verifier's judgement (kvcs_report).
class report : public detail::owner<kvcs_report, kvcs_report_destroy> {
 public:
  using owner::owner;
  /// The verdict, a kvcs_verdict value.
  uint32_t verdict() const {
    uint32_t value = 0;
    check(kvcs_report_verdict(get(), &value));
    return value;
  }
  /// Whether the load may proceed under the verifier's policy.
  bool passed() const {
    uint32_t value = 0;
    check(kvcs_report_passed(get(), &value));
    return value != 0;
  }
  /// The one-line message for a log.
  std::string message() const {
    const char *text = nullptr;
    check(kvcs_report_message(get(), &text));
    return text;
  }
};

/// A scheduler's verifier (kvcs_verifier).
class verifier : public detail::owner<kvcs_verifier, kvcs_verifier_destroy> {
 public:
  explicit verifier(uint32_t num_workers) : owner(create(num_workers)) {}
  /// kvcs_verifier_expect.
  void expect(const blocks &scheduled, uint32_t role) { check(kvcs_verifier_expect(get(), scheduled.get(), role)); }
  /// kvcs_verifier_add_record.
  void add_record(const std::vector<uint8_t> &record) {
    check(kvcs_verifier_add_record(get(), record.data(), record.size()));
  }
  /// kvcs_verifier_check_base64.
  kvcs::report check_base64(const std::string &req_id, const std::string &payload_base64) {
    kvcs_report *out = nullptr;
    check(kvcs_verifier_check_base64(get(), req_id.c_str(), payload_base64.c_str(), &out));
    return kvcs::report(out);
  }
  /// kvcs_verifier_check_no_payload.
  kvcs::report check_no_payload(const std::string &req_id) {
    kvcs_report *out = nullptr;
    check(kvcs_verifier_check_no_payload(get(), req_id.c_str(), &out));
    return kvcs::report(out);
  }

 private:
  static kvcs_verifier *create(uint32_t num_workers) {
    kvcs_verifier *handle = nullptr;
    check(kvcs_verifier_create(num_workers, &handle));
    return handle;
  }
};

/// A producer's payload of a request (kvcs_verifier_payload), sized for you.
inline std::vector<uint8_t> payload(kvcs_verifier *verifier, const std::string &req_id) {
  return detail::read_sized<uint8_t>([&](uint8_t *buf, size_t cap, size_t *len) {
    return kvcs_verifier_payload(verifier, req_id.c_str(), buf, cap, len);
  });
}

/// Standard padded base64 of `bytes` (kvcs_base64_encode), without the NUL.
inline std::string base64_encode(const std::vector<uint8_t> &bytes) {
  std::vector<char> text = detail::read_sized<char>([&](char *buf, size_t cap, size_t *len) {
    return kvcs_base64_encode(bytes.data(), bytes.size(), buf, cap, len);
  });
  return std::string(text.data(), text.empty() ? 0 : text.size() - 1);
}

/// The bytes of standard padded base64 `text` (kvcs_base64_decode).
inline std::vector<uint8_t> base64_decode(std::string_view text) {
  return detail::read_sized<uint8_t>([&](uint8_t *buf, size_t cap, size_t *len) {
    return kvcs_base64_decode(text.data(), text.size(), buf, cap, len);
  });
}

/// A transfer topology (kvcs_topology).
class topology : public detail::owner<kvcs_topology, kvcs_topology_destroy> {
 public:
  topology(const std::string &local_engine_id, const kvcs_local_engine &local)
      : owner(create(local_engine_id, local)) {}
  /// kvcs_topology_add_remote; false when the engine was registered before.
  bool add_remote(const std::string &engine_id, const kvcs_remote_engine &remote) {
    uint32_t added = 0;
    check(kvcs_topology_add_remote(get(), engine_id.c_str(), &remote, &added));
    return added != 0;
  }
  /// kvcs_topology_tp_ratio.
  int64_t tp_ratio(const std::string &engine_id) const {
    int64_t ratio = 0;
    check(kvcs_topology_tp_ratio(get(), engine_id.c_str(), &ratio));
    return ratio;
  }
  /// kvcs_topology_remote_ranks.
  std::vector<uint32_t> remote_ranks(const std::string &engine_id) const {
    return detail::read_sized<uint32_t>([&](uint32_t *buf, size_t cap, size_t *len) {
      return kvcs_topology_remote_ranks(get(), engine_id.c_str(), buf, cap, len);
    });
  }
  /// kvcs_topology_head_sources.
  std::vector<kvcs_head_source> head_sources(const std::string &engine_id) const {
    return detail::read_sized<kvcs_head_source>([&](kvcs_head_source *buf, size_t cap, size_t *len) {
      return kvcs_topology_head_sources(get(), engine_id.c_str(), buf, cap, len);
    });
  }

 private:
  static kvcs_topology *create(const std::string &local_engine_id, const kvcs_local_engine &local) {
    kvcs_topology *handle = nullptr;
    check(kvcs_topology_create(local_engine_id.c_str(), &local, &handle));
    return handle;
  }
};

/// A completion counter (kvcs_completion).
class completion : public detail::owner<kvcs_completion, kvcs_completion_destroy> {
 public:
  explicit completion(uint32_t expected_workers) : owner(create(expected_workers)) {}
  /// kvcs_completion_report: per request, whether this report completed it.
  std::vector<bool> report(uint32_t worker, uint32_t direction, const std::vector<std::string> &req_ids) {
    std::vector<const char *> ids;
    ids.reserve(req_ids.size());
    for (const std::string &id : req_ids) {
      ids.push_back(id.c_str());
    }
    std::vector<uint8_t> done(req_ids.size());
    check(kvcs_completion_report(get(), worker, direction, ids.data(), ids.size(), done.data()));
    return std::vector<bool>(done.begin(), done.end());
  }
  /// kvcs_completion_invalid_blocks.
  std::vector<uint32_t> invalid_blocks() const {
    return detail::read_sized<uint32_t>([&](uint32_t *buf, size_t cap, size_t *len) {
      return kvcs_completion_invalid_blocks(get(), buf, cap, len);
    });
  }

 private:
  static kvcs_completion *create(uint32_t expected_workers) {
    kvcs_completion *handle = nullptr;
    check(kvcs_completion_create(expected_workers, &handle));
    return handle;
  }
};

}  // namespace kvcs

#endif /* KVCSUM_HPP */
