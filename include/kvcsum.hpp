/*
 * kvcsum.hpp: header-only C++17 wrapper of every call of kvcsum.h.
 *
 * - kvcs::error: every non-OK status becomes this exception, carrying the
 *   status and a copy of kvcs_last_error() taken at once (the C message is
 *   per thread and the next failing call overwrites it).
 * - RAII owners of the handle types (kvcs::blocks, kvcs::worker,
 *   kvcs::result, kvcs::verifier, kvcs::report, kvcs::topology,
 *   kvcs::completion): move-only, the C handle destroyed with its owner;
 *   get() gives the C handle, release() gives it up.
 * - enum class for the C enums (kvcs::role, kvcs::verdict,
 *   kvcs::unverified_reason, kvcs::algorithm, kvcs::stored_outcome,
 *   kvcs::policy, kvcs::direction), each with kvcs::to_string.
 * - Inputs are views (kvcs::view: pointer and length, made from a
 *   std::vector, a std::array, a C array or (pointer, size)), so that a
 *   vLLM block table of int32 or the bytes of a ZMQ message go in without a
 *   copy; kvcs::as_bytes views any memory as bytes. Block ids are taken as
 *   uint32_t or int32_t (a negative int32 id throws, naming it).
 * - Variable-size outputs (a record, a payload, base64, ranks, a repair
 *   plan) come back as std::vector or std::string: the wrapper runs the
 *   (NULL, 0) size query and then the real call.
 * - kvcs::layer_from_layout describes a layer from its tensors and a layout
 *   string ("BTHD" for FlashAttention's [num_blocks, block_size, heads,
 *   head_dim]); report::repair_plan names the blocks to load again.
 *
 * Thread safety and ownership are those of the C handles (kvcsum.h): a
 * const method may run concurrently with other const methods of the same
 * object; a non-const one needs exclusive access (a kvcs::verifier's
 * methods excepted: every one may run concurrently, as in C).
 */
#ifndef KVCSUM_HPP
#define KVCSUM_HPP

#include <array>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "kvcsum.h"

namespace kvcs {

/// A failed kvcsum call: its status and the library's message.
class error : public std::runtime_error {
 public:
  /// An error of `status` saying `message` (what() is "STATUS_NAME: message").
  error(kvcs_status status, const std::string &message)
      : std::runtime_error(std::string(kvcs_status_name(status)) + ": " + message), status_(status) {}
  /// The status the call returned.
  kvcs_status status() const noexcept { return status_; }

 private:
  kvcs_status status_;
};

/// The message of the last failed call on this thread (kvcs_last_error).
inline std::string last_error() { return kvcs_last_error(); }

/// The name of a status ("KVCS_ERR_NOT_FOUND", say; kvcs_status_name).
inline std::string status_name(kvcs_status status) { return kvcs_status_name(status); }

/// Throws kvcs::error for any status but KVCS_OK, copying kvcs_last_error()
/// before anything else can overwrite it.
inline void check(kvcs_status status) {
  if (status != KVCS_OK) {
    throw error(status, kvcs_last_error());
  }
}

/// The loaded library's version ("MAJOR.MINOR.PATCH", kvcs_version); the
/// header's is KVCS_VERSION_MAJOR, KVCS_VERSION_MINOR, KVCS_VERSION_PATCH.
inline std::string version() { return kvcs_version(); }

namespace detail {

/// Throws unless the loaded library's size of a struct is this header's.
inline void check_size(const char *name, size_t library_size, size_t header_size) {
  if (library_size != header_size) {
    throw error(KVCS_ERR_UNSUPPORTED, std::string("the loaded kvcsum's ") + name + " has " +
                                          std::to_string(library_size) + " bytes, this program was built with " +
                                          std::to_string(header_size));
  }
}

/// check_size with the library's size from its layout table
/// (kvcs_struct_layout), for structs that have no size call.
inline void check_layout_size(const char *name, size_t header_size) {
  size_t library_size = 0;
  if (kvcs_struct_layout(name, &library_size, nullptr) != KVCS_OK) {
    throw error(KVCS_ERR_UNSUPPORTED, std::string("the loaded kvcsum has no struct ") + name);
  }
  check_size(name, library_size, header_size);
}

}  // namespace detail

/// Throws kvcs::error (KVCS_ERR_UNSUPPORTED) unless the library loaded at
/// run time has this header's ABI version, the same size of every struct
/// the calls take (kvcs_abi_version, kvcs_*_size) and a function table
/// with every call of this header (kvcs_api_get).
inline void check_abi() {
  if (kvcs_abi_version() != KVCS_ABI_VERSION) {
    throw error(KVCS_ERR_UNSUPPORTED, "the loaded kvcsum has ABI version " + std::to_string(kvcs_abi_version()) +
                                          ", this program was built for " + std::to_string(KVCS_ABI_VERSION));
  }
  detail::check_size("kvcs_worker_options", kvcs_worker_options_size(), sizeof(kvcs_worker_options));
  detail::check_size("kvcs_segment", kvcs_segment_size(), sizeof(kvcs_segment));
  detail::check_size("kvcs_layer", kvcs_layer_size(), sizeof(kvcs_layer));
  detail::check_size("kvcs_state_tensor", kvcs_state_tensor_size(), sizeof(kvcs_state_tensor));
  detail::check_size("kvcs_state", kvcs_state_size(), sizeof(kvcs_state));
  detail::check_size("kvcs_mismatch", kvcs_mismatch_size(), sizeof(kvcs_mismatch));
  detail::check_size("kvcs_layer_difference", kvcs_layer_difference_size(), sizeof(kvcs_layer_difference));
  detail::check_size("kvcs_local_engine", kvcs_local_engine_size(), sizeof(kvcs_local_engine));
  detail::check_size("kvcs_remote_engine", kvcs_remote_engine_size(), sizeof(kvcs_remote_engine));
  detail::check_size("kvcs_head_source", kvcs_head_source_size(), sizeof(kvcs_head_source));
  detail::check_size("kvcs_tensor", kvcs_tensor_size(), sizeof(kvcs_tensor));
  detail::check_size("kvcs_repair_block", kvcs_repair_block_size(), sizeof(kvcs_repair_block));
  // Structs without a size call of their own: the library's layout table.
  detail::check_layout_size("kvcs_payload_summary", sizeof(kvcs_payload_summary));
  detail::check_layout_size("kvcs_group_checksums", sizeof(kvcs_group_checksums));
  detail::check_layout_size("kvcs_layer_checksums", sizeof(kvcs_layer_checksums));
  detail::check_layout_size("kvcs_layer_decoding", sizeof(kvcs_layer_decoding));
  // The function table of this ABI (kvcs_api_get), with every call of this header.
  const kvcs_api *table = nullptr;
  check(kvcs_api_get(KVCS_ABI_VERSION, &table));
  if (table->size < sizeof(kvcs_api)) {  // a newer library's table may be longer, never shorter
    throw error(KVCS_ERR_UNSUPPORTED, "the loaded kvcsum's function table has " + std::to_string(table->size) +
                                          " bytes, this program was built with " + std::to_string(sizeof(kvcs_api)));
  }
}

/// One field of an ABI struct as the loaded library lays it out.
struct field_layout {
  std::string name;  ///< the field's C name
  size_t offset;     ///< offsetof
  size_t size;       ///< sizeof
};

/// The fields of the ABI struct `struct_name` ("kvcs_layer", say) in the
/// loaded library, in order (kvcs_struct_layout, kvcs_struct_field); throws
/// kvcs::error (KVCS_ERR_NOT_FOUND) for a name that is no struct of the ABI.
inline std::vector<field_layout> struct_fields(const char *struct_name) {
  size_t count = 0;
  check(kvcs_struct_layout(struct_name, nullptr, &count));
  std::vector<field_layout> fields;
  for (size_t index = 0; index < count; index++) {
    const char *name = nullptr;
    size_t offset = 0, size = 0;
    check(kvcs_struct_field(struct_name, index, &name, &offset, &size));
    fields.push_back({name, offset, size});
  }
  return fields;
}

// --- Enums -------------------------------------------------------------------

/// Which columns a checksum computes (kvcs_role).
enum class role : uint32_t {
  /// Only columns with replica index 0.
  producer = KVCS_ROLE_PRODUCER,
  /// Every column.
  consumer = KVCS_ROLE_CONSUMER,
};

/// A report's verdict (kvcs_verdict).
enum class verdict : uint32_t {
  /// Every compared block position is equal.
  match = KVCS_VERDICT_MATCH,
  /// Some compared block position differs.
  mismatch = KVCS_VERDICT_MISMATCH,
  /// The load could not be compared; see the report's findings.
  unverified = KVCS_VERDICT_UNVERIFIED,
};

/// Why a load or a group could not be compared (kvcs_unverified_reason).
enum class unverified_reason : uint32_t {
  /// No reason.
  none = KVCS_UNVERIFIED_NONE,
  /// The producer sent no checksums.
  no_checksums = KVCS_UNVERIFIED_NO_CHECKSUMS,
  /// The producer's checksums do not decode.
  invalid_checksums = KVCS_UNVERIFIED_INVALID_CHECKSUMS,
  /// Not every worker reported its checksums of the request.
  workers_missing = KVCS_UNVERIFIED_WORKERS_MISSING,
  /// A worker checksummed other blocks (or tokens) than scheduled.
  other_blocks = KVCS_UNVERIFIED_OTHER_BLOCKS,
  /// A group is checksummed by one side only.
  one_sided_group = KVCS_UNVERIFIED_ONE_SIDED_GROUP,
  /// A group's fingerprint differs.
  fingerprint_differs = KVCS_UNVERIFIED_FINGERPRINT_DIFFERS,
  /// No block position in common.
  no_common_position = KVCS_UNVERIFIED_NO_COMMON_POSITION,
  /// A replica was not checksummed.
  replica_missing = KVCS_UNVERIFIED_REPLICA_MISSING,
  /// TP sizes differ (or are unknown) for shard-keyed state.
  state_tp_differs = KVCS_UNVERIFIED_STATE_TP_DIFFERS,
  /// A worker's record was computed in the other role.
  role_differs = KVCS_UNVERIFIED_ROLE_DIFFERS,
  /// Loaded positions were not compared and coverage is required.
  uncompared_positions = KVCS_UNVERIFIED_UNCOMPARED_POSITIONS,
  /// An offload load was judged from a record that is not a load check's.
  not_load_check = KVCS_UNVERIFIED_NOT_LOAD_CHECK,
  /// The checksums were computed with different algorithms.
  algorithm_differs = KVCS_UNVERIFIED_ALGORITHM_DIFFERS,
  /// The producer's block size is unknown and does not fit.
  block_size_unknown = KVCS_UNVERIFIED_BLOCK_SIZE_UNKNOWN,
  /// No worker of one side registered any cache of a group.
  nothing_read = KVCS_UNVERIFIED_NOTHING_READ,
  /// The producer checksummed other layers or heads than a replica check covers.
  coverage_differs = KVCS_UNVERIFIED_COVERAGE_DIFFERS,
  /// The sides declare that they decode a layer's bytes differently.
  decoding_differs = KVCS_UNVERIFIED_DECODING_DIFFERS,
  /// The sides' caches of a layer have another geometry (heads, cell or K bytes).
  geometry_differs = KVCS_UNVERIFIED_GEOMETRY_DIFFERS,
};

/// A worker's checksum algorithm (kvcs_algorithm).
enum class algorithm : uint32_t {
  /// Each piece as it is: the values vLLM computes and reads.
  weighted = KVCS_ALGORITHM_WEIGHTED,
  /// Each piece mixed by kvcsum 0.2's function first (0.2's default; kept
  /// to verify against a 0.2 peer).
  mixed = KVCS_ALGORITHM_MIXED,
  /// Each piece mixed by a function without a fixed differential first;
  /// the default of new workers.
  mixed2 = KVCS_ALGORITHM_MIXED2,
};

/// A load check's verdict on one block position (kvcs_stored_outcome).
enum class stored_outcome : uint8_t {
  /// The recomputed checksum differs from the stored one.
  failed = KVCS_STORED_FAILED,
  /// The recomputed checksum equals the stored one.
  matched = KVCS_STORED_MATCHED,
  /// Not checked: the position holds no valid token.
  not_checked = KVCS_STORED_NOT_CHECKED,
  /// Not compared: a clean entry stored under another configuration (other
  /// layers, identities, heads or block size). A damaged entry fails.
  other_fingerprint = KVCS_STORED_OTHER_FINGERPRINT,
  /// Not compared: stored with another checksum algorithm.
  other_algorithm = KVCS_STORED_OTHER_ALGORITHM,
  /// Not compared: stored holding another number of valid tokens (a partial block).
  other_tokens = KVCS_STORED_OTHER_TOKENS,
  /// Not compared: kvcsum 0.2.0's format, its value not matching.
  other_format = KVCS_STORED_OTHER_FORMAT,
};

/// A tier check's outcome of one loaded block (kvcs_tier_outcome).
enum class tier_outcome : uint8_t {
  /// Its value is one of those kept for its hash at its position.
  matched = KVCS_TIER_MATCHED,
  /// Values are kept for its hash at its position, and its value is none of them.
  mismatched = KVCS_TIER_MISMATCHED,
  /// Unknown: the block has no hash (a partial block).
  no_block_hash = KVCS_TIER_NO_BLOCK_HASH,
  /// Unknown: no value is kept for its hash (never stored, or dropped).
  unknown_block = KVCS_TIER_UNKNOWN_BLOCK,
  /// Unknown: its hash was stored with more than 4 values, or at two positions.
  too_many_values = KVCS_TIER_TOO_MANY_VALUES,
  /// Unknown: its hash was stored at another position.
  other_position = KVCS_TIER_OTHER_POSITION,
  /// Unknown: the worker does not checksum the block's group.
  not_checksummed = KVCS_TIER_NOT_CHECKSUMMED,
};

/// What a verifier does with an unverified load (kvcs_policy).
enum class policy : uint32_t {
  /// Unverified loads pass.
  fail_open = KVCS_POLICY_FAIL_OPEN,
  /// Unverified loads fail like mismatches (the default).
  fail_closed = KVCS_POLICY_FAIL_CLOSED,
};

/// Which transfer a worker reports finished (kvcs_direction).
enum class direction : uint32_t {
  /// The worker finished sending the request's KV.
  sending = KVCS_DIRECTION_SENDING,
  /// The worker finished receiving the request's KV.
  receiving = KVCS_DIRECTION_RECEIVING,
};

/// The C name of a verdict ("KVCS_VERDICT_MATCH"; kvcs_verdict_name).
inline std::string to_string(verdict value) { return kvcs_verdict_name(static_cast<uint32_t>(value)); }

/// The C name of a reason ("KVCS_UNVERIFIED_WORKERS_MISSING";
/// kvcs_unverified_reason_name).
inline std::string to_string(unverified_reason value) {
  return kvcs_unverified_reason_name(static_cast<uint32_t>(value));
}

/// The C name of a role ("KVCS_ROLE_PRODUCER"), or "unknown kvcs_role".
inline std::string to_string(role value) {
  switch (value) {
    case role::producer: return "KVCS_ROLE_PRODUCER";
    case role::consumer: return "KVCS_ROLE_CONSUMER";
  }
  return "unknown kvcs_role";
}

/// The C name of an algorithm ("KVCS_ALGORITHM_MIXED2"), or "unknown kvcs_algorithm".
inline std::string to_string(algorithm value) {
  switch (value) {
    case algorithm::weighted: return "KVCS_ALGORITHM_WEIGHTED";
    case algorithm::mixed: return "KVCS_ALGORITHM_MIXED";
    case algorithm::mixed2: return "KVCS_ALGORITHM_MIXED2";
  }
  return "unknown kvcs_algorithm";
}

/// The C name of a stored outcome ("KVCS_STORED_MATCHED"), or "unknown kvcs_stored_outcome".
inline std::string to_string(stored_outcome value) {
  switch (value) {
    case stored_outcome::failed: return "KVCS_STORED_FAILED";
    case stored_outcome::matched: return "KVCS_STORED_MATCHED";
    case stored_outcome::not_checked: return "KVCS_STORED_NOT_CHECKED";
    case stored_outcome::other_fingerprint: return "KVCS_STORED_OTHER_FINGERPRINT";
    case stored_outcome::other_algorithm: return "KVCS_STORED_OTHER_ALGORITHM";
    case stored_outcome::other_tokens: return "KVCS_STORED_OTHER_TOKENS";
    case stored_outcome::other_format: return "KVCS_STORED_OTHER_FORMAT";
  }
  return "unknown kvcs_stored_outcome";
}

/// The C name of a policy ("KVCS_POLICY_FAIL_CLOSED"), or "unknown kvcs_policy".
inline std::string to_string(policy value) {
  switch (value) {
    case policy::fail_open: return "KVCS_POLICY_FAIL_OPEN";
    case policy::fail_closed: return "KVCS_POLICY_FAIL_CLOSED";
  }
  return "unknown kvcs_policy";
}

/// The C name of a direction ("KVCS_DIRECTION_SENDING"), or "unknown kvcs_direction".
inline std::string to_string(direction value) {
  switch (value) {
    case direction::sending: return "KVCS_DIRECTION_SENDING";
    case direction::receiving: return "KVCS_DIRECTION_RECEIVING";
  }
  return "unknown kvcs_direction";
}

// --- Views -------------------------------------------------------------------

/// A read-only view of `size()` consecutive `T` owned elsewhere (C++17's
/// stand-in for std::span<const T>): made from a std::vector, a std::array,
/// a C array or (pointer, size). The memory must outlive the view; the
/// calls taking one read it during the call only.
template <typename T>
class view {
 public:
  /// The empty view.
  constexpr view() noexcept = default;
  /// `size` elements at `data` (which may be NULL only when `size` is 0).
  constexpr view(const T *data, size_t size) noexcept : data_(data), size_(size) {}
  /// The elements of a C array.
  template <size_t N>
  constexpr view(const T (&array)[N]) noexcept : data_(array), size_(N) {}  // NOLINT: implicit by design
  /// The elements of a std::array.
  template <size_t N>
  constexpr view(const std::array<T, N> &array) noexcept : data_(array.data()), size_(N) {}  // NOLINT
  /// The elements of a std::vector.
  view(const std::vector<T> &vector) noexcept : data_(vector.data()), size_(vector.size()) {}  // NOLINT

  /// The first element (NULL for an empty view made so).
  constexpr const T *data() const noexcept { return data_; }
  /// The number of elements.
  constexpr size_t size() const noexcept { return size_; }
  /// Whether there is no element.
  constexpr bool empty() const noexcept { return size_ == 0; }
  /// The first element, for range-for.
  constexpr const T *begin() const noexcept { return data_; }
  /// Past the last element, for range-for.
  constexpr const T *end() const noexcept { return data_ + size_; }
  /// Element `index` (unchecked, below size()).
  constexpr const T &operator[](size_t index) const noexcept { return data_[index]; }

 private:
  const T *data_ = nullptr;
  size_t size_ = 0;
};

/// `size` bytes at `data` as a byte view (a ZMQ message, a tensor's storage).
inline view<uint8_t> as_bytes(const void *data, size_t size) noexcept {
  return view<uint8_t>(static_cast<const uint8_t *>(data), size);
}

/// The bytes of a string (the identity text of a layer, say).
inline view<uint8_t> as_bytes(std::string_view text) noexcept { return as_bytes(text.data(), text.size()); }

/// The address of host memory as the uint64_t the C calls take.
inline uint64_t address_of(const void *pointer) noexcept {
  return static_cast<uint64_t>(reinterpret_cast<uintptr_t>(pointer));
}

namespace detail {

/// A move-only owner of a C handle freed by `Destroy`.
template <typename T, void (*Destroy)(T *)>
class owner {
 public:
  /// Owns nothing.
  owner() noexcept = default;
  /// Owns `handle` (which may be NULL).
  explicit owner(T *handle) noexcept : handle_(handle) {}
  owner(const owner &) = delete;
  owner &operator=(const owner &) = delete;
  /// Takes `other`'s handle; `other` then owns nothing.
  owner(owner &&other) noexcept : handle_(std::exchange(other.handle_, nullptr)) {}
  /// Destroys the handle held and takes `other`'s.
  owner &operator=(owner &&other) noexcept {
    if (this != &other) {
      Destroy(handle_);
      handle_ = std::exchange(other.handle_, nullptr);
    }
    return *this;
  }
  /// Destroys the handle.
  ~owner() { Destroy(handle_); }

  /// The C handle (still owned here).
  T *get() const noexcept { return handle_; }
  /// Gives up ownership; the caller destroys the handle.
  T *release() noexcept { return std::exchange(handle_, nullptr); }
  /// Whether a handle is held.
  explicit operator bool() const noexcept { return handle_ != nullptr; }

 private:
  T *handle_ = nullptr;
};

/// Runs `call(buf, cap, &len)` once as a size query and once for real.
template <typename Element, typename Call>
std::vector<Element> read_sized(Call call) {
  size_t len = 0;
  kvcs_status status = call(nullptr, 0, &len);
  if (status != KVCS_OK && status != KVCS_ERR_BUFFER_TOO_SMALL) {
    check(status);
  }
  std::vector<Element> out(len);
  if (len != 0) {
    check(call(out.data(), out.size(), &len));
    out.resize(len);
  }
  return out;
}

/// kvcs_stored_outcome bytes as the enum.
inline std::vector<stored_outcome> outcomes(const std::vector<uint8_t> &bytes) {
  std::vector<stored_outcome> out;
  out.reserve(bytes.size());
  for (uint8_t outcome : bytes) {
    out.push_back(static_cast<stored_outcome>(outcome));
  }
  return out;
}

/// The binary64 bits of a scale for kvcs_worker_set_layer_decoding; 0.0
/// (not declared) gives 0 bits.
inline uint64_t scale_bits(double value) noexcept {
  if (value == 0.0) {
    return 0;
  }
  uint64_t bits = 0;
  std::memcpy(&bits, &value, sizeof bits);
  return bits;
}

/// `text` as the NUL-terminated string the C calls take; a `text` holding
/// a NUL throws KVCS_ERR_INVALID_ARGUMENT naming `argument` and the byte,
/// since C would read it only up to there ("job\0A" and "job\0B" would
/// both be "job"), as the Python package refuses such strings.
inline const char *c_string(const std::string &text, const char *argument) {
  size_t nul = text.find('\0');
  if (nul != std::string::npos) {
    throw error(KVCS_ERR_INVALID_ARGUMENT, std::string(argument) + " holds a NUL at byte " + std::to_string(nul) +
                                               " of " + std::to_string(text.size()) +
                                               " (C strings end there, so it would name another string)");
  }
  return text.c_str();
}

/// Block ids of an int32 table (vLLM's) as the uint32 ids the C calls take;
/// a negative one throws KVCS_ERR_INVALID_ARGUMENT naming `argument`, its
/// index and its value.
inline std::vector<uint32_t> unsigned_block_ids(view<int32_t> block_ids, const char *argument) {
  std::vector<uint32_t> ids;
  ids.reserve(block_ids.size());
  for (size_t i = 0; i < block_ids.size(); i++) {
    if (block_ids[i] < 0) {
      throw error(KVCS_ERR_INVALID_ARGUMENT, std::string(argument) + "[" + std::to_string(i) + "] is " +
                                                 std::to_string(block_ids[i]) + ", a negative block id");
    }
    ids.push_back(static_cast<uint32_t>(block_ids[i]));
  }
  return ids;
}

/// The number of `hash_bytes`-byte hashes in `hashes`; throws
/// KVCS_ERR_INVALID_ARGUMENT when the bytes are not a whole number of them.
/// A `hash_bytes` of 0 gives 0, for the C call to refuse with its message.
inline size_t hash_count(view<uint8_t> hashes, size_t hash_bytes) {
  if (hash_bytes == 0) {
    return 0;
  }
  if (hashes.size() % hash_bytes != 0) {
    throw error(KVCS_ERR_INVALID_ARGUMENT, "hashes has " + std::to_string(hashes.size()) +
                                               " bytes, not a multiple of hash_bytes " + std::to_string(hash_bytes));
  }
  return hashes.size() / hash_bytes;
}

/// Throws KVCS_ERR_INVALID_ARGUMENT unless each group has a block size.
inline void check_same_length(size_t num_group_ids, size_t num_block_sizes) {
  if (num_group_ids != num_block_sizes) {
    throw error(KVCS_ERR_INVALID_ARGUMENT, "group_ids has " + std::to_string(num_group_ids) +
                                               " entries, block_sizes " + std::to_string(num_block_sizes));
  }
}

}  // namespace detail

// --- Request block sets --------------------------------------------------------

/// A batch of requests in compressed rows, for blocks::add_arrays
/// (kvcs_blocks_add_arrays): request `i`'s id is `req_ids[req_id_ends[i -
/// 1] .. req_id_ends[i])`, its groups `group_ends[i - 1] .. group_ends[i]`
/// of the group arrays, group `g`'s blocks `block_ends[g - 1] ..
/// block_ends[g]` of `block_ids`; `hashes` (empty: none) has `hash_bytes`
/// bytes per block id.
struct block_arrays {
  std::string_view req_ids;
  view<size_t> req_id_ends;
  view<uint64_t> num_tokens;
  view<size_t> group_ends;
  view<uint32_t> group_ids;
  view<uint64_t> first_positions;
  view<size_t> block_ends;
  view<uint32_t> block_ids;
  view<uint8_t> hashes;
  size_t hash_bytes = 0;
};

namespace detail {

/// Throws KVCS_ERR_INVALID_ARGUMENT unless `array` has `want` entries.
inline void check_entries(const char *array, size_t size, const char *of, size_t want) {
  if (size != want) {
    throw error(KVCS_ERR_INVALID_ARGUMENT, std::string(array) + " has " + std::to_string(size) + " entries, " + of +
                                               " " + std::to_string(want));
  }
}

}  // namespace detail

/// A request block set (kvcs_blocks): per request its token count and, per
/// group, the block ids at consecutive positions.
class blocks : public detail::owner<kvcs_blocks, kvcs_blocks_destroy> {
 public:
  /// An empty set (kvcs_blocks_create).
  blocks() : owner(create()) {}
  /// Adds request `req_id` holding `num_tokens` tokens (kvcs_blocks_add_request).
  void add_request(const std::string &req_id, uint64_t num_tokens) {
    check(kvcs_blocks_add_request(get(), detail::c_string(req_id, "req_id"), num_tokens));
  }
  /// Adds group `group_id`'s blocks of `req_id`: `block_ids[i]` at position
  /// `first_position + i` (kvcs_blocks_add_group).
  void add_group(const std::string &req_id, uint32_t group_id, uint64_t first_position,
                 view<uint32_t> block_ids) {
    check(kvcs_blocks_add_group(get(), detail::c_string(req_id, "req_id"), group_id, first_position, block_ids.data(),
                                block_ids.size()));
  }
  /// add_group over int32 block ids (a vLLM block table); a negative id
  /// throws KVCS_ERR_INVALID_ARGUMENT naming its index and value.
  void add_group(const std::string &req_id, uint32_t group_id, uint64_t first_position, view<int32_t> block_ids) {
    add_group(req_id, group_id, first_position, detail::unsigned_block_ids(block_ids, "block_ids"));
  }
  /// add_group over a braced list of ids.
  void add_group(const std::string &req_id, uint32_t group_id, uint64_t first_position,
                 std::initializer_list<uint32_t> block_ids) {
    add_group(req_id, group_id, first_position, view<uint32_t>(block_ids.begin(), block_ids.size()));
  }
  /// The block hashes of group `group_id`'s blocks in `req_id`, one per
  /// block id, `hash_bytes` bytes each (at least 8), back to back in
  /// `hashes` (kvcs_blocks_set_hashes).
  void set_hashes(const std::string &req_id, uint32_t group_id, view<uint8_t> hashes, size_t hash_bytes) {
    size_t count = detail::hash_count(hashes, hash_bytes);
    check(kvcs_blocks_set_hashes(get(), detail::c_string(req_id, "req_id"), group_id, hashes.data(), hash_bytes, count));
  }

  /// Adds a batch of requests with their groups, blocks and hashes in one
  /// call (kvcs_blocks_add_arrays); the views' lengths are checked against
  /// each other first (KVCS_ERR_INVALID_ARGUMENT), and on any error nothing
  /// is added.
  void add_arrays(const block_arrays &arrays) {
    size_t num_requests = arrays.req_id_ends.size();
    detail::check_entries("num_tokens", arrays.num_tokens.size(), "req_id_ends", num_requests);
    detail::check_entries("group_ends", arrays.group_ends.size(), "req_id_ends", num_requests);
    detail::check_entries("req_ids", arrays.req_ids.size(), "req_id_ends' last",
                          num_requests ? arrays.req_id_ends[num_requests - 1] : 0);
    size_t num_groups = arrays.group_ids.size();
    detail::check_entries("first_positions", arrays.first_positions.size(), "group_ids", num_groups);
    detail::check_entries("block_ends", arrays.block_ends.size(), "group_ids", num_groups);
    const uint8_t *hashes = nullptr;
    if (!arrays.hashes.empty() || arrays.hash_bytes != 0) {
      detail::check_entries("hashes", detail::hash_count(arrays.hashes, arrays.hash_bytes), "block_ids",
                            arrays.block_ids.size());
      hashes = arrays.hashes.data() != nullptr ? arrays.hashes.data() : reinterpret_cast<const uint8_t *>("");
    }
    check(kvcs_blocks_add_arrays(get(), num_requests, arrays.req_ids.data(), arrays.req_id_ends.data(),
                                 arrays.num_tokens.data(), arrays.group_ends.data(), num_groups,
                                 arrays.group_ids.data(), arrays.first_positions.data(), arrays.block_ends.data(),
                                 arrays.block_ids.size(), arrays.block_ids.data(), hashes, arrays.hash_bytes));
  }

 private:
  static kvcs_blocks *create() {
    kvcs_blocks *handle = nullptr;
    check(kvcs_blocks_create(&handle));
    return handle;
  }
};

// --- Results -----------------------------------------------------------------

/// The shape of one group of one request in a result (kvcs_result_group).
struct group_shape {
  /// The first block position.
  uint64_t first_position = 0;
  /// The number of positions (values per column).
  size_t num_positions = 0;
  /// The number of columns (replica keys).
  size_t num_columns = 0;
};

/// One column of a result: its replica key and its values.
struct column_values {
  /// Ranks holding the same heads (R of the key).
  uint32_t replicas = 0;
  /// This copy's index among them (i of the key).
  uint32_t replica_index = 0;
  /// One value per position.
  std::vector<uint64_t> values;
};

/// A worker's partial checksums (kvcs_result): per request and group, one
/// column per replica key, one value per block position.
class result : public detail::owner<kvcs_result, kvcs_result_destroy> {
 public:
  using owner::owner;
  /// True once the values are readable (kvcs_result_query); never blocks.
  bool ready() const {
    kvcs_status status = kvcs_result_query(get());
    if (status == KVCS_ERR_NOT_READY) {
      return false;
    }
    check(status);
    return true;
  }
  /// Blocks until the values are readable (kvcs_result_wait).
  void wait() { check(kvcs_result_wait(get())); }
  /// The shape of group `group_id` of `req_id` (kvcs_result_group).
  group_shape group(const std::string &req_id, uint32_t group_id) const {
    group_shape shape;
    check(kvcs_result_group(get(), detail::c_string(req_id, "req_id"), group_id, &shape.first_position, &shape.num_positions,
                            &shape.num_columns));
    return shape;
  }
  /// The number of positions of a group (kvcs_result_group).
  size_t num_positions(const std::string &req_id, uint32_t group_id) const {
    return group(req_id, group_id).num_positions;
  }
  /// The number of columns of a group (kvcs_result_group).
  size_t num_columns(const std::string &req_id, uint32_t group_id) const {
    return group(req_id, group_id).num_columns;
  }
  /// Column `column` with its replica key (kvcs_result_column_buf).
  column_values column_with_key(const std::string &req_id, uint32_t group_id, size_t column) const {
    column_values out;
    out.values = detail::read_sized<uint64_t>([&](uint64_t *buf, size_t cap, size_t *len) {
      return kvcs_result_column_buf(get(), detail::c_string(req_id, "req_id"), group_id, column, &out.replicas, &out.replica_index,
                                    buf, cap, len);
    });
    return out;  // the call that succeeded (the size query, for no values) wrote the key
  }
  /// The values of column `column` (kvcs_result_column_buf).
  std::vector<uint64_t> column(const std::string &req_id, uint32_t group_id, size_t column = 0) const {
    return column_with_key(req_id, group_id, column).values;
  }
  /// A load check's outcome per position of a group (kvcs_result_stored_buf).
  std::vector<stored_outcome> stored(const std::string &req_id, uint32_t group_id) const {
    return detail::outcomes(detail::read_sized<uint8_t>([&](uint8_t *buf, size_t cap, size_t *len) {
      return kvcs_result_stored_buf(get(), detail::c_string(req_id, "req_id"), group_id, buf, cap, len);
    }));
  }
  /// The entries a store of these blocks would write for a group, value
  /// then stamp per position, for connectors that keep them themselves
  /// (kvcs_result_entries_buf): 2 * num_positions words.
  std::vector<uint64_t> entries(const std::string &req_id, uint32_t group_id) const {
    return detail::read_sized<uint64_t>([&](uint64_t *buf, size_t cap, size_t *len) {
      return kvcs_result_entries_buf(get(), detail::c_string(req_id, "req_id"), group_id, buf, cap, len);
    });
  }
  /// The load check against entries kept by the caller, 2 * num_positions
  /// words as entries() gave them (kvcs_result_check_entries_buf: another
  /// count throws KVCS_ERR_INVALID_ARGUMENT).
  std::vector<stored_outcome> check_entries(const std::string &req_id, uint32_t group_id,
                                            view<uint64_t> entries) const {
    return detail::outcomes(detail::read_sized<uint8_t>([&](uint8_t *buf, size_t cap, size_t *len) {
      return kvcs_result_check_entries_buf(get(), detail::c_string(req_id, "req_id"), group_id, entries.data(), entries.size(), buf,
                                           cap, len);
    }));
  }
  /// The worker's record of this result, for verifier::add_record
  /// (kvcs_result_encode).
  std::vector<uint8_t> encode() const {
    return detail::read_sized<uint8_t>(
        [&](uint8_t *buf, size_t cap, size_t *len) { return kvcs_result_encode(get(), buf, cap, len); });
  }
};

// --- Layout strings --------------------------------------------------------------

/// A strided tensor as layer_from_layout reads it (kvcs_tensor): sizes and
/// strides, outermost dimension first, strides in bytes (a PyTorch stride
/// times the element size). The views must outlive the call only.
struct tensor {
  /// Address of the element whose every index is 0 (host or device memory).
  uint64_t address = 0;
  /// The sizes.
  view<int64_t> shape;
  /// The strides in bytes, any sign.
  view<int64_t> strides;
  /// Bytes per element (2 for fp16/bf16, 1 for fp8).
  uint32_t element_size = 0;
};

/// A layer described from its tensors and a layout string
/// (layer_from_layout): it owns the segments its kvcs_layer points to.
class layout_layer {
 public:
  /// The layer to complete (group_id, layer_number, first_head, replicas,
  /// replica_index, identity) and pass to worker::add_layer. Its segments
  /// point into this object, which must outlive the kvcs_layer's use.
  kvcs_layer layer() const noexcept {
    kvcs_layer out = layer_;
    out.segments = segments_.data();
    return out;
  }
  /// The segments (1, or 2: K region then V region).
  view<kvcs_segment> segments() const noexcept { return view<kvcs_segment>(segments_.data(), layer_.num_segments); }

 private:
  friend layout_layer layer_from_layout(const std::string &, const tensor &, const tensor *, uint32_t);
  kvcs_layer layer_{};
  std::array<kvcs_segment, 2> segments_{};
};

/// Describes an attention layer's cache from its tensor and a layout string
/// (kvcs_layer_from_layout): `layout` names `cache`'s dimensions, outermost
/// first (B blocks, T tokens, H heads, D a head's elements, K for K then
/// V; docs/SPEC.md section 14): FlashAttention's `[2, blocks, 16, heads,
/// 128]` is "KBTHD". Where K and V are two tensors of one layout, `cache` is
/// K's and `v` V's.
inline layout_layer layer_from_layout(const std::string &layout, const tensor &cache, const tensor *v = nullptr,
                                      uint32_t kernel_blocks = 1) {
  auto c_tensor = [](const tensor &t, const char *name) {
    if (t.shape.size() != t.strides.size()) {
      throw error(KVCS_ERR_INVALID_ARGUMENT, std::string(name) + ".shape has " + std::to_string(t.shape.size()) +
                                                 " dimensions, " + name + ".strides " +
                                                 std::to_string(t.strides.size()));
    }
    return kvcs_tensor{t.address, t.shape.data(), t.strides.data(), t.shape.size(), t.element_size};
  };
  kvcs_tensor c_cache = c_tensor(cache, "cache");
  kvcs_tensor c_v{};
  if (v != nullptr) {
    c_v = c_tensor(*v, "v");
  }
  layout_layer out;
  check(kvcs_layer_from_layout(detail::c_string(layout, "layout"), &c_cache, v != nullptr ? &c_v : nullptr, kernel_blocks, &out.layer_,
                               out.segments_.data()));
  return out;
}

// --- Workers -----------------------------------------------------------------

/// A worker context (kvcs_worker): the caches one TP rank / PP stage
/// registered and the engine (host threads or one CUDA device) reading them.
class worker : public detail::owner<kvcs_worker, kvcs_worker_destroy> {
 public:
  /// Creates a worker (kvcs_worker_create).
  explicit worker(const kvcs_worker_options &options) : owner(create(options)) {}
  /// Memory the worker may read (kvcs_worker_add_region).
  void add_region(uint64_t address, uint64_t length) { check(kvcs_worker_add_region(get(), address, length)); }
  /// kvcs_worker_add_region over a host object.
  void add_region(const void *address, size_t length) {
    add_region(address_of(address), static_cast<uint64_t>(length));
  }
  /// Registers a group of `block_size` tokens per block (kvcs_worker_add_group).
  void add_group(uint32_t group_id, uint32_t block_size) { check(kvcs_worker_add_group(get(), group_id, block_size)); }
  /// Where group `group_id`'s tokens sit in this worker's caches: DCP
  /// shard and tokens per slot (kvcs_worker_set_group_placement), after
  /// add_group and before the group's layers.
  void set_group_placement(uint32_t group_id, const kvcs_group_placement &placement) {
    check(kvcs_worker_set_group_placement(get(), group_id, &placement));
  }
  /// set_group_placement from its fields (defaults: no DCP, a slot per token).
  void set_group_placement(uint32_t group_id, uint32_t dcp_size, uint32_t dcp_rank, uint32_t interleave = 1,
                           uint32_t tokens_per_slot = 1) {
    kvcs_group_placement placement = KVCS_GROUP_PLACEMENT_INIT;
    placement.dcp_size = dcp_size;
    placement.dcp_rank = dcp_rank;
    placement.interleave = interleave;
    placement.tokens_per_slot = tokens_per_slot;
    set_group_placement(group_id, placement);
  }
  /// Declares that this worker cannot checksum a group (kvcs_worker_skip_group).
  void skip_group(uint32_t group_id, const std::string &reason) {
    check(kvcs_worker_skip_group(get(), group_id, detail::c_string(reason, "reason")));
  }
  /// Registers an attention layer's cache (kvcs_worker_add_layer).
  void add_layer(const kvcs_layer &layer) { check(kvcs_worker_add_layer(get(), &layer)); }
  /// Registers a state (Mamba) layer (kvcs_worker_add_state).
  void add_state(const kvcs_state &state) { check(kvcs_worker_add_state(get(), &state)); }
  /// Registers a layer that reads another layer's cache (vLLM's KV sharing;
  /// kvcs_worker_add_alias).
  void add_alias(uint32_t group_id, uint32_t layer_number, uint32_t target_layer_number, view<uint8_t> identity) {
    check(kvcs_worker_add_alias(get(), group_id, layer_number, target_layer_number, identity.data(),
                                identity.size()));
  }
  /// Registers the buffer of stored checksums of a group:
  /// KVCS_BLOCK_CHECKSUM_BYTES per block id (kvcs_worker_add_stored).
  void add_stored(uint32_t group_id, uint64_t address, uint64_t num_blocks) {
    check(kvcs_worker_add_stored(get(), group_id, address, num_blocks));
  }
  /// kvcs_worker_add_stored over a host buffer.
  void add_stored(uint32_t group_id, const void *address, uint64_t num_blocks) {
    add_stored(group_id, address_of(address), num_blocks);
  }
  /// Detail mode: per-layer partials, so reports name layers (kvcs_worker_set_detail).
  void set_detail(bool on) { check(kvcs_worker_set_detail(get(), on ? 1u : 0u)); }
  /// The checksum algorithm, before the first checksum, store or load
  /// check (kvcs_worker_set_algorithm).
  void set_algorithm(kvcs::algorithm value) { check(kvcs_worker_set_algorithm(get(), static_cast<uint32_t>(value))); }
  /// Declares how the engine reads layer `layer_number`'s bytes back
  /// (kvcs_worker_set_layer_decoding): its element type (empty: not
  /// declared), head size (0: not declared) and K and V scales (0.0: not
  /// declared; compared bit for bit as binary64).
  void set_layer_decoding(uint32_t group_id, uint32_t layer_number, const std::string &dtype, uint32_t head_size = 0,
                          double k_scale = 0.0, double v_scale = 0.0) {
    check(kvcs_worker_set_layer_decoding(get(), group_id, layer_number, dtype.empty() ? nullptr : detail::c_string(dtype, "dtype"),
                                         head_size, detail::scale_bits(k_scale), detail::scale_bits(v_scale)));
  }
  /// Computes (host) or queues on `cuda_stream` (device) the partial
  /// checksums of `blocks` (kvcs_worker_checksum).
  kvcs::result checksum(const blocks &blocks, kvcs::role role, void *cuda_stream = nullptr) {
    kvcs_result *out = nullptr;
    check(kvcs_worker_checksum(get(), blocks.get(), static_cast<uint32_t>(role), cuda_stream, &out));
    return kvcs::result(out);
  }
  /// Checksums `blocks` and writes their stored checksums (kvcs_worker_store).
  kvcs::result store(const blocks &blocks, void *cuda_stream = nullptr) {
    kvcs_result *out = nullptr;
    check(kvcs_worker_store(get(), blocks.get(), cuda_stream, &out));
    return kvcs::result(out);
  }
  /// The load check: checksums `blocks` and compares them with their stored
  /// checksums; read with result::stored (kvcs_worker_check_stored).
  kvcs::result check_stored(const blocks &blocks, void *cuda_stream = nullptr) {
    kvcs_result *out = nullptr;
    check(kvcs_worker_check_stored(get(), blocks.get(), cuda_stream, &out));
    return kvcs::result(out);
  }
  /// The tags of group `group_id` for `hash_bytes`-byte block hashes back to
  /// back in `hashes`, one per hash (kvcs_block_tags).
  std::vector<uint64_t> block_tags(uint32_t group_id, view<uint8_t> hashes, size_t hash_bytes) const {
    size_t count = detail::hash_count(hashes, hash_bytes);
    std::vector<uint64_t> tags(count + 1);  // never empty, so never NULL
    check(kvcs_block_tags(get(), group_id, hashes.data(), hash_bytes, count, tags.data()));
    tags.resize(count);
    return tags;
  }

 private:
  static kvcs_worker *create(const kvcs_worker_options &options) {
    kvcs_worker *handle = nullptr;
    check(kvcs_worker_create(&options, &handle));
    return handle;
  }
};

// --- Tier index --------------------------------------------------------------

/// The blocks of a tier store or check: block `i` is `block_ids[i]` at
/// position `positions[i]` of group `group_ids[i]`, its block hash bytes
/// `i * hash_bytes ..` of `hashes` (8 to 32 bytes each); `hashed` (empty:
/// every block) a 0/1 flag per block, for a check.
struct tier_blocks {
  view<uint32_t> group_ids;
  view<uint64_t> positions;
  view<uint32_t> block_ids;
  view<uint8_t> hashes;
  size_t hash_bytes = 32;
  view<uint8_t> hashed;
};

/// The counts of a tier index (kvcs_tier_index_info).
struct tier_index_info {
  uint64_t entries = 0;
  uint64_t dropped = 0;
  uint64_t lost_stores = 0;
  uint64_t memory_bytes = 0;
};

/// The values of a worker's full blocks by block hash (kvcs_tier_index):
/// at most `capacity` entries of at most KVCS_TIER_INDEX_ENTRY_BYTES each.
class tier_index : public detail::owner<kvcs_tier_index, kvcs_tier_index_destroy> {
 public:
  /// An empty index of at most `capacity` entries (kvcs_tier_index_create).
  explicit tier_index(uint64_t capacity) : owner(create(capacity)) {}

  /// Checksums the blocks a step filled and keeps their values, in one
  /// call (kvcs_tier_index_store); the views' lengths are checked first.
  void store(worker &on, const tier_blocks &blocks, void *cuda_stream = nullptr) {
    size_t count = checked(blocks);
    check(kvcs_tier_index_store(get(), on.get(), count, blocks.group_ids.data(), blocks.positions.data(),
                                blocks.block_ids.data(), blocks.hashes.data(), blocks.hash_bytes, cuda_stream));
  }

  /// Compares loaded blocks with the values kept: one outcome per block
  /// (kvcs_tier_index_check).
  std::vector<tier_outcome> check_loaded(worker &on, const tier_blocks &blocks, void *cuda_stream = nullptr) {
    size_t count = checked(blocks);
    if (!blocks.hashed.empty()) {
      detail::check_entries("hashed", blocks.hashed.size(), "block_ids", count);
    }
    std::vector<uint8_t> outcomes(count + 1);  // never empty, so never NULL
    check(kvcs_tier_index_check(get(), on.get(), count, blocks.group_ids.data(), blocks.positions.data(),
                                blocks.block_ids.data(), blocks.hashes.data(), blocks.hash_bytes,
                                blocks.hashed.empty() ? nullptr : blocks.hashed.data(), cuda_stream,
                                outcomes.data()));
    std::vector<tier_outcome> out;
    out.reserve(count);
    for (size_t i = 0; i < count; i++) {
      out.push_back(static_cast<tier_outcome>(outcomes[i]));
    }
    return out;
  }

  /// Its counts and the bytes it holds (kvcs_tier_index_info).
  tier_index_info info() const {
    tier_index_info out;
    check(kvcs_tier_index_info(get(), &out.entries, &out.dropped, &out.lost_stores, &out.memory_bytes));
    return out;
  }

  /// The position and values kept for a hash of a group, empty when none
  /// (or too many) are kept (kvcs_tier_index_values).
  std::vector<uint64_t> values(uint32_t group_id, view<uint8_t> hash, uint64_t *position = nullptr) const {
    std::vector<uint64_t> out(4);
    size_t len = 0;
    check(kvcs_tier_index_values(get(), group_id, hash.data(), hash.size(), position, out.data(), out.size(), &len));
    out.resize(len);
    return out;
  }

 private:
  static size_t checked(const tier_blocks &blocks) {
    size_t count = blocks.block_ids.size();
    detail::check_entries("group_ids", blocks.group_ids.size(), "block_ids", count);
    detail::check_entries("positions", blocks.positions.size(), "block_ids", count);
    detail::check_entries("hashes", detail::hash_count(blocks.hashes, blocks.hash_bytes), "block_ids", count);
    return count;
  }
  static kvcs_tier_index *create(uint64_t capacity) {
    kvcs_tier_index *handle = nullptr;
    check(kvcs_tier_index_create(capacity, &handle));
    return handle;
  }
};

// --- Reports -----------------------------------------------------------------

/// A finding of a report: why the load or a group was not compared.
struct finding {
  /// The reason.
  unverified_reason reason = unverified_reason::none;
  /// The group, or KVCS_WHOLE_LOAD for the whole load.
  uint32_t group_id = 0;
  /// What it says, for a log.
  std::string message;
};

/// Consumer block positions of one group that were loaded but not compared
/// (kvcs_report_uncompared).
struct uncompared_range {
  /// The group.
  uint32_t group_id = 0;
  /// The first consumer block position of the range.
  uint64_t first_position = 0;
  /// Consecutive positions in the range.
  uint64_t num_positions = 0;
};

/// A mismatch entry with its failed replica checks and layer differences.
struct mismatch_detail {
  /// The entry (group, positions, tokens, counts).
  kvcs_mismatch entry{};
  /// The replica checks that differ.
  std::vector<uint32_t> failed_checks;
  /// The layer head ranges that differ (detail mode).
  std::vector<kvcs_layer_difference> layers;
};

/// A verifier's judgement of one load (kvcs_report): match, mismatch or
/// unverified, with the positions and findings.
class report : public detail::owner<kvcs_report, kvcs_report_destroy> {
 public:
  using owner::owner;
  /// The verdict (kvcs_report_verdict).
  kvcs::verdict verdict() const {
    uint32_t value = 0;
    check(kvcs_report_verdict(get(), &value));
    return static_cast<kvcs::verdict>(value);
  }
  /// Whether the load may proceed under the verifier's policy (kvcs_report_passed).
  bool passed() const {
    uint32_t value = 0;
    check(kvcs_report_passed(get(), &value));
    return value != 0;
  }
  /// The reason of the first finding, or none (kvcs_report_reason).
  unverified_reason reason() const {
    uint32_t value = 0;
    check(kvcs_report_reason(get(), &value));
    return static_cast<unverified_reason>(value);
  }
  /// The one-line message for a log (kvcs_report_message).
  std::string message() const {
    const char *text = nullptr;
    check(kvcs_report_message(get(), &text));
    return text;
  }
  /// Block positions compared (kvcs_report_compared_positions).
  uint64_t compared_positions() const {
    uint64_t positions = 0;
    check(kvcs_report_compared_positions(get(), &positions));
    return positions;
  }
  /// Loaded positions no comparison covered (kvcs_report_uncompared_positions).
  uint64_t uncompared_positions() const {
    uint64_t positions = 0;
    check(kvcs_report_uncompared_positions(get(), &positions));
    return positions;
  }
  /// The number of uncompared ranges (kvcs_report_num_uncompared).
  size_t num_uncompared() const {
    size_t count = 0;
    check(kvcs_report_num_uncompared(get(), &count));
    return count;
  }
  /// Uncompared range `index` (kvcs_report_uncompared).
  uncompared_range uncompared(size_t index) const {
    uncompared_range range;
    check(kvcs_report_uncompared(get(), index, &range.group_id, &range.first_position, &range.num_positions));
    return range;
  }
  /// Every uncompared range: where the positions uncompared_positions()
  /// counts lie.
  std::vector<uncompared_range> uncompared_ranges() const {
    std::vector<uncompared_range> out(num_uncompared());
    for (size_t i = 0; i < out.size(); i++) {
      out[i] = uncompared(i);
    }
    return out;
  }
  /// The number of mismatch entries (kvcs_report_num_mismatches).
  size_t num_mismatches() const {
    size_t count = 0;
    check(kvcs_report_num_mismatches(get(), &count));
    return count;
  }
  /// Mismatch entry `index` (kvcs_report_mismatch).
  kvcs_mismatch mismatch(size_t index) const {
    kvcs_mismatch entry{};
    check(kvcs_report_mismatch(get(), index, &entry));
    return entry;
  }
  /// Failed replica check `index` of mismatch entry `mismatch` (kvcs_report_failed_check).
  uint32_t failed_check(size_t mismatch, size_t index) const {
    uint32_t value = 0;
    check(kvcs_report_failed_check(get(), mismatch, index, &value));
    return value;
  }
  /// Layer difference `index` of mismatch entry `mismatch` (kvcs_report_layer_difference).
  kvcs_layer_difference layer_difference(size_t mismatch, size_t index) const {
    kvcs_layer_difference difference{};
    check(kvcs_report_layer_difference(get(), mismatch, index, &difference));
    return difference;
  }
  /// Every mismatch entry with its failed checks and layer differences.
  std::vector<mismatch_detail> mismatches() const {
    std::vector<mismatch_detail> out(num_mismatches());
    for (size_t m = 0; m < out.size(); m++) {
      out[m].entry = mismatch(m);
      for (size_t i = 0; i < out[m].entry.num_failed_checks; i++) {
        out[m].failed_checks.push_back(failed_check(m, i));
      }
      for (size_t i = 0; i < out[m].entry.num_layers; i++) {
        out[m].layers.push_back(layer_difference(m, i));
      }
    }
    return out;
  }
  /// The number of findings (kvcs_report_num_unverified).
  size_t num_unverified() const {
    size_t count = 0;
    check(kvcs_report_num_unverified(get(), &count));
    return count;
  }
  /// Finding `index` (kvcs_report_unverified).
  finding unverified(size_t index) const {
    uint32_t reason = 0;
    finding out;
    const char *text = nullptr;
    check(kvcs_report_unverified(get(), index, &reason, &out.group_id, &text));
    out.reason = static_cast<unverified_reason>(reason);
    out.message = text;
    return out;
  }
  /// Every finding.
  std::vector<finding> findings() const {
    std::vector<finding> out;
    size_t count = num_unverified();
    out.reserve(count);
    for (size_t i = 0; i < count; i++) {
      out.push_back(unverified(i));
    }
    return out;
  }
  /// The consumer blocks to load again after this MISMATCH, with their
  /// half-open token ranges (kvcs_report_repair_plan; docs/SPEC.md section
  /// 15); throws for an unverified report, a report of another request than
  /// `req_id`, and a block size other than the one the report was made with.
  /// `consumer_blocks` holds the request's consumer block ids (what the
  /// consumer's verifier was given), and `block_sizes[i]` is the consumer's
  /// block size of group `group_ids[i]`.
  std::vector<kvcs_repair_block> repair_plan(const blocks &consumer_blocks, const std::string &req_id,
                                             view<uint32_t> group_ids, view<uint32_t> block_sizes) const {
    detail::check_same_length(group_ids.size(), block_sizes.size());
    return detail::read_sized<kvcs_repair_block>([&](kvcs_repair_block *buf, size_t cap, size_t *len) {
      return kvcs_report_repair_plan(get(), consumer_blocks.get(), detail::c_string(req_id, "req_id"), group_ids.data(),
                                     block_sizes.data(), group_ids.size(), buf, cap, len);
    });
  }
};

/// The consumer blocks to load again for mismatch entries carried from a
/// report (kvcs_repair_plan), as report::repair_plan; the caller has
/// checked that the report had no findings and was of `req_id`. Throws for
/// an entry that is not the blocks of its tokens under the block size given.
inline std::vector<kvcs_repair_block> repair_plan(view<kvcs_mismatch> mismatches, const blocks &consumer_blocks,
                                                  const std::string &req_id, view<uint32_t> group_ids,
                                                  view<uint32_t> block_sizes) {
  detail::check_same_length(group_ids.size(), block_sizes.size());
  return detail::read_sized<kvcs_repair_block>([&](kvcs_repair_block *buf, size_t cap, size_t *len) {
    return kvcs_repair_plan(mismatches.data(), mismatches.size(), consumer_blocks.get(), detail::c_string(req_id, "req_id"),
                            group_ids.data(), block_sizes.data(), group_ids.size(), buf, cap, len);
  });
}

// --- Verifiers ---------------------------------------------------------------

/// A scheduler's verifier (kvcs_verifier): collects every worker's records;
/// a producer's builds payloads, a consumer's judges finished loads.
class verifier : public detail::owner<kvcs_verifier, kvcs_verifier_destroy> {
 public:
  /// A verifier of an engine of `num_workers` workers (kvcs_verifier_create).
  explicit verifier(uint32_t num_workers) : owner(create(num_workers)) {}
  /// What unverified loads do (kvcs_verifier_set_policy).
  void set_policy(kvcs::policy value) { kvcs::check(kvcs_verifier_set_policy(get(), static_cast<uint32_t>(value))); }
  /// Producer: payloads carry the kvcsum extension (kvcs_verifier_set_extension).
  void set_extension(bool on) { kvcs::check(kvcs_verifier_set_extension(get(), on ? 1u : 0u)); }
  /// Consumer: uncompared loaded positions make a load unverified (true,
  /// the default); false opts out (kvcs_verifier_set_require_coverage).
  void set_require_coverage(bool on) { kvcs::check(kvcs_verifier_set_require_coverage(get(), on ? 1u : 0u)); }
  /// Consumer: the producer's TP size, for plain payloads
  /// (kvcs_verifier_set_producer_tp_size).
  void set_producer_tp_size(uint32_t tp_size) { kvcs::check(kvcs_verifier_set_producer_tp_size(get(), tp_size)); }
  /// Consumer: the producer's block size of a group, for plain payloads
  /// (kvcs_verifier_set_producer_block_size).
  void set_producer_block_size(uint32_t group_id, uint32_t block_size) {
    kvcs::check(kvcs_verifier_set_producer_block_size(get(), group_id, block_size));
  }
  /// Registers every request of `scheduled` in `role` (kvcs_verifier_expect).
  void expect(const blocks &scheduled, kvcs::role role) {
    kvcs::check(kvcs_verifier_expect(get(), scheduled.get(), static_cast<uint32_t>(role)));
  }
  /// Drops a request's state (kvcs_verifier_forget).
  void forget(const std::string &req_id) { kvcs::check(kvcs_verifier_forget(get(), detail::c_string(req_id, "req_id"))); }
  /// Adds a worker's record (kvcs_verifier_add_record).
  void add_record(view<uint8_t> record) { kvcs::check(kvcs_verifier_add_record(get(), record.data(), record.size())); }
  /// Producer: the payload of a request (kvcs_verifier_payload).
  std::vector<uint8_t> payload(const std::string &req_id) {
    return detail::read_sized<uint8_t>([&](uint8_t *buf, size_t cap, size_t *len) {
      return kvcs_verifier_payload(get(), detail::c_string(req_id, "req_id"), buf, cap, len);
    });
  }
  /// Consumer: judges a finished load against the producer's payload bytes
  /// (kvcs_verifier_check).
  kvcs::report check(const std::string &req_id, view<uint8_t> payload) {
    kvcs_report *out = nullptr;
    kvcs::check(kvcs_verifier_check(get(), detail::c_string(req_id, "req_id"), payload.data(), payload.size(), &out));
    return kvcs::report(out);
  }
  /// Consumer: judges a load against the payload's base64 text
  /// (kvcs_verifier_check_base64).
  kvcs::report check_base64(const std::string &req_id, const std::string &payload_base64) {
    kvcs_report *out = nullptr;
    kvcs::check(kvcs_verifier_check_base64(get(), detail::c_string(req_id, "req_id"), detail::c_string(payload_base64, "payload_base64"), &out));
    return kvcs::report(out);
  }
  /// Consumer: judges a load for which the producer sent nothing
  /// (kvcs_verifier_check_no_payload).
  kvcs::report check_no_payload(const std::string &req_id) {
    kvcs_report *out = nullptr;
    kvcs::check(kvcs_verifier_check_no_payload(get(), detail::c_string(req_id, "req_id"), &out));
    return kvcs::report(out);
  }
  /// Consumer: judges an offload load from its workers' load-check records
  /// (kvcs_verifier_check_stored).
  kvcs::report check_stored(const std::string &req_id) {
    kvcs_report *out = nullptr;
    kvcs::check(kvcs_verifier_check_stored(get(), detail::c_string(req_id, "req_id"), &out));
    return kvcs::report(out);
  }

 private:
  static kvcs_verifier *create(uint32_t num_workers) {
    kvcs_verifier *handle = nullptr;
    kvcs::check(kvcs_verifier_create(num_workers, &handle));
    return handle;
  }
};

// --- Base64 ------------------------------------------------------------------

/// Standard padded base64 of `bytes`, without the NUL (kvcs_base64_encode).
inline std::string base64_encode(view<uint8_t> bytes) {
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

// --- Payloads ------------------------------------------------------------------

/// A layer decoding a payload carries (kvcs_payload_decoding), its element
/// type as a string (empty where not declared).
struct layer_decoding {
  uint32_t layer_number = 0;  ///< model-wide layer number
  std::string dtype;          ///< element type name; empty: not declared
  uint32_t head_size = 0;     ///< 0: not declared
  uint64_t k_scale_bits = 0;  ///< binary64 bits; 0: not declared
  uint64_t v_scale_bits = 0;  ///< binary64 bits; 0: not declared
};

/// A producer's payload decoded by the library (kvcs_payload_decode), for
/// tools that read what it says.
class payload : public detail::owner<kvcs_payload, kvcs_payload_destroy> {
 public:
  using owner::owner;
  /// Decodes payload bytes (not base64: see base64_decode).
  explicit payload(view<uint8_t> bytes) : owner(decode(bytes)) {}
  /// What it says as a whole (kvcs_payload_info).
  kvcs_payload_summary info() const {
    kvcs_payload_summary out{};
    check(kvcs_payload_info(get(), &out));
    return out;
  }
  /// Group `index`, with its extension entry (kvcs_payload_group).
  kvcs_group_checksums group(size_t index) const {
    kvcs_group_checksums out{};
    check(kvcs_payload_group(get(), index, &out));
    return out;
  }
  /// The values of group `index` (kvcs_payload_values).
  std::vector<uint64_t> values(size_t index) const {
    return detail::read_sized<uint64_t>([&](uint64_t *buf, size_t cap, size_t *len) {
      return kvcs_payload_values(get(), index, buf, cap, len);
    });
  }
  /// The short last value of group `index`: empty, or the one value of its
  /// last position over one token fewer (kvcs_payload_short_last).
  std::vector<uint64_t> short_last(size_t index) const {
    return detail::read_sized<uint64_t>([&](uint64_t *buf, size_t cap, size_t *len) {
      return kvcs_payload_short_last(get(), index, buf, cap, len);
    });
  }
  /// Layer partial `layer` of group `index` (kvcs_payload_layer).
  kvcs_layer_checksums layer(size_t index, size_t layer) const {
    kvcs_layer_checksums out{};
    check(kvcs_payload_layer(get(), index, layer, &out));
    return out;
  }
  /// The values of layer partial `layer` of group `index` (kvcs_payload_layer_values).
  std::vector<uint64_t> layer_values(size_t index, size_t layer) const {
    return detail::read_sized<uint64_t>([&](uint64_t *buf, size_t cap, size_t *len) {
      return kvcs_payload_layer_values(get(), index, layer, buf, cap, len);
    });
  }
  /// Layer decoding `decoding` of group `index` (kvcs_payload_decoding).
  layer_decoding decoding(size_t index, size_t decoding) const {
    kvcs_layer_decoding out{};
    check(kvcs_payload_decoding(get(), index, decoding, &out));
    return layer_decoding{out.layer_number, out.dtype != nullptr ? out.dtype : "", out.head_size, out.k_scale_bits,
                          out.v_scale_bits};
  }

 private:
  static kvcs_payload *decode(view<uint8_t> bytes) {
    kvcs_payload *handle = nullptr;
    kvcs::check(kvcs_payload_decode(bytes.data(), bytes.size(), &handle));
    return handle;
  }
};

// --- Transfer topology ---------------------------------------------------------

/// The global heads a rank holds (kvcs_rank_heads).
struct head_range {
  /// The first global head.
  uint32_t first_head = 0;
  /// The number of heads.
  uint32_t num_heads = 0;
};

/// `local_tp / remote_tp`, or minus the inverse when the remote is larger (kvcs_tp_ratio).
inline int64_t tp_ratio(uint32_t local_tp, uint32_t remote_tp) {
  int64_t ratio = 0;
  check(kvcs_tp_ratio(local_tp, remote_tp, &ratio));
  return ratio;
}

/// The remote ranks local rank `local_rank` reads from (kvcs_remote_ranks).
inline std::vector<uint32_t> remote_ranks(uint32_t local_rank, uint32_t local_tp, uint32_t remote_tp) {
  return detail::read_sized<uint32_t>([&](uint32_t *buf, size_t cap, size_t *len) {
    return kvcs_remote_ranks(local_rank, local_tp, remote_tp, buf, cap, len);
  });
}

/// The remote ranks to handshake with, from the TP sizes alone (kvcs_handshake_targets).
inline std::vector<uint32_t> handshake_targets(uint32_t local_rank, uint32_t local_tp, uint32_t remote_tp) {
  return detail::read_sized<uint32_t>([&](uint32_t *buf, size_t cap, size_t *len) {
    return kvcs_handshake_targets(local_rank, local_tp, remote_tp, buf, cap, len);
  });
}

/// `local_block_size / remote_block_size` (kvcs_block_size_ratio).
inline uint32_t block_size_ratio(uint32_t local_block_size, uint32_t remote_block_size) {
  uint32_t ratio = 0;
  check(kvcs_block_size_ratio(local_block_size, remote_block_size, &ratio));
  return ratio;
}

/// Whether a remote engine of TP size `remote_tp` replicates KV heads
/// (kvcs_remote_kv_replicated).
inline bool remote_kv_replicated(uint32_t remote_tp, uint32_t total_kv_heads) {
  uint32_t replicated = 0;
  check(kvcs_remote_kv_replicated(remote_tp, total_kv_heads, &replicated));
  return replicated != 0;
}

/// Whether the local engine replicates KV heads (kvcs_local_kv_replicated).
inline bool local_kv_replicated(uint32_t tp, uint32_t total_kv_heads, bool is_mla) {
  uint32_t replicated = 0;
  check(kvcs_local_kv_replicated(tp, total_kv_heads, is_mla ? 1u : 0u, &replicated));
  return replicated != 0;
}

/// The global heads rank `rank` of an engine of TP size `tp` holds (kvcs_rank_heads).
inline head_range rank_heads(uint32_t rank, uint32_t tp, uint32_t total_kv_heads, bool is_mla) {
  head_range heads;
  check(kvcs_rank_heads(rank, tp, total_kv_heads, is_mla ? 1u : 0u, &heads.first_head, &heads.num_heads));
  return heads;
}

/// The runs of local rank `local_rank`'s heads with the remote rank that
/// supplies each (kvcs_head_sources).
inline std::vector<kvcs_head_source> head_sources(uint32_t local_rank, uint32_t local_tp, uint32_t remote_tp,
                                                  uint32_t total_kv_heads, bool is_mla) {
  return detail::read_sized<kvcs_head_source>([&](kvcs_head_source *buf, size_t cap, size_t *len) {
    return kvcs_head_sources(local_rank, local_tp, remote_tp, total_kv_heads, is_mla ? 1u : 0u, buf, cap, len);
  });
}

/// One local worker's view of the engines it transfers with (kvcs_topology).
class topology : public detail::owner<kvcs_topology, kvcs_topology_destroy> {
 public:
  /// A topology of local engine `local_engine_id` (kvcs_topology_create).
  topology(const std::string &local_engine_id, const kvcs_local_engine &local)
      : owner(create(local_engine_id, local)) {}
  /// Records a remote engine's handshake; false when the engine was
  /// registered before (kvcs_topology_add_remote).
  bool add_remote(const std::string &engine_id, const kvcs_remote_engine &remote) {
    uint32_t added = 0;
    check(kvcs_topology_add_remote(get(), detail::c_string(engine_id, "engine_id"), &remote, &added));
    return added != 0;
  }
  /// What a remote engine's handshake told (kvcs_topology_remote).
  kvcs_remote_engine remote(const std::string &engine_id) const {
    kvcs_remote_engine out{};
    check(kvcs_topology_remote(get(), detail::c_string(engine_id, "engine_id"), &out));
    return out;
  }
  /// kvcs_topology_tp_ratio.
  int64_t tp_ratio(const std::string &engine_id) const {
    int64_t ratio = 0;
    check(kvcs_topology_tp_ratio(get(), detail::c_string(engine_id, "engine_id"), &ratio));
    return ratio;
  }
  /// kvcs_topology_block_size_ratio.
  uint32_t block_size_ratio(const std::string &engine_id) const {
    uint32_t ratio = 0;
    check(kvcs_topology_block_size_ratio(get(), detail::c_string(engine_id, "engine_id"), &ratio));
    return ratio;
  }
  /// kvcs_topology_remote_kv_replicated.
  bool remote_kv_replicated(const std::string &engine_id) const {
    uint32_t replicated = 0;
    check(kvcs_topology_remote_kv_replicated(get(), detail::c_string(engine_id, "engine_id"), &replicated));
    return replicated != 0;
  }
  /// kvcs_topology_remote_ranks.
  std::vector<uint32_t> remote_ranks(const std::string &engine_id) const {
    return detail::read_sized<uint32_t>([&](uint32_t *buf, size_t cap, size_t *len) {
      return kvcs_topology_remote_ranks(get(), detail::c_string(engine_id, "engine_id"), buf, cap, len);
    });
  }
  /// kvcs_topology_head_sources.
  std::vector<kvcs_head_source> head_sources(const std::string &engine_id) const {
    return detail::read_sized<kvcs_head_source>([&](kvcs_head_source *buf, size_t cap, size_t *len) {
      return kvcs_topology_head_sources(get(), detail::c_string(engine_id, "engine_id"), buf, cap, len);
    });
  }

 private:
  static kvcs_topology *create(const std::string &local_engine_id, const kvcs_local_engine &local) {
    kvcs_topology *handle = nullptr;
    check(kvcs_topology_create(detail::c_string(local_engine_id, "local_engine_id"), &local, &handle));
    return handle;
  }
};

// --- Completion counter ----------------------------------------------------------

/// Counts, per request and direction, the workers that reported it
/// finished (kvcs_completion); unites the invalid block ids they report.
class completion : public detail::owner<kvcs_completion, kvcs_completion_destroy> {
 public:
  /// A counter expecting `expected_workers` reports per request (kvcs_completion_create).
  explicit completion(uint32_t expected_workers) : owner(create(expected_workers)) {}
  /// The expected count for requests first reported from now on
  /// (kvcs_completion_set_expected).
  void set_expected(uint32_t expected_workers) { check(kvcs_completion_set_expected(get(), expected_workers)); }
  /// Worker `worker` reports `req_ids` finished; per request, whether this
  /// report completed it (kvcs_completion_report).
  std::vector<bool> report(uint32_t worker, kvcs::direction direction, view<std::string> req_ids) {
    std::vector<const char *> ids;
    ids.reserve(req_ids.size());
    for (const std::string &id : req_ids) {
      ids.push_back(detail::c_string(id, "req_ids[]"));
    }
    std::vector<uint8_t> done(req_ids.size() + 1);  // never empty, so never NULL
    check(kvcs_completion_report(get(), worker, static_cast<uint32_t>(direction), ids.data(), ids.size(),
                                 done.data()));
    return std::vector<bool>(done.begin(), done.end() - 1);
  }
  /// report over a braced list of request ids.
  std::vector<bool> report(uint32_t worker, kvcs::direction direction, std::initializer_list<std::string> req_ids) {
    return report(worker, direction, view<std::string>(req_ids.begin(), req_ids.size()));
  }
  /// The workers that reported `req_id` finished so far (kvcs_completion_reported).
  uint32_t reported(kvcs::direction direction, const std::string &req_id) const {
    uint32_t count = 0;
    check(kvcs_completion_reported(get(), static_cast<uint32_t>(direction), detail::c_string(req_id, "req_id"), &count));
    return count;
  }
  /// Adds block ids a worker found invalid (kvcs_completion_add_invalid_blocks).
  void add_invalid_blocks(view<uint32_t> block_ids) {
    check(kvcs_completion_add_invalid_blocks(get(), block_ids.data(), block_ids.size()));
  }
  /// add_invalid_blocks over int32 block ids; a negative one throws.
  void add_invalid_blocks(view<int32_t> block_ids) {
    add_invalid_blocks(detail::unsigned_block_ids(block_ids, "block_ids"));
  }
  /// The union of the invalid block ids, ascending (kvcs_completion_invalid_blocks).
  std::vector<uint32_t> invalid_blocks() const {
    return detail::read_sized<uint32_t>([&](uint32_t *buf, size_t cap, size_t *len) {
      return kvcs_completion_invalid_blocks(get(), buf, cap, len);
    });
  }
  /// Forgets the invalid block ids (kvcs_completion_clear_invalid_blocks).
  void clear_invalid_blocks() { check(kvcs_completion_clear_invalid_blocks(get())); }

 private:
  static kvcs_completion *create(uint32_t expected_workers) {
    kvcs_completion *handle = nullptr;
    check(kvcs_completion_create(expected_workers, &handle));
    return handle;
  }
};

}  // namespace kvcs

#endif /* KVCSUM_HPP */
