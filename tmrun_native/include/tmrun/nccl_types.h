// NCCL transport: parts that need no NCCL or CUDA header (always compiled).
//
// * dtype / reduction-op tables with NCCL's enum values (checked against nccl.h by
//   static_assert when the transport is compiled),
// * the exception types surfaced to Python,
// * the logical-rank <-> NCCL-rank map arithmetic used by shrink/grow replacement.
#pragma once

#include <cstddef>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace tmrun {
namespace nccl {

struct DtypeInfo {
  const char* name;  // canonical name (torch spelling without "torch.")
  int nccl;          // ncclDataType_t value
  int size;          // bytes per element
};

struct OpInfo {
  const char* name;  // canonical name
  int nccl;          // ncclRedOp_t value
};

// Every ncclDataType_t of NCCL 2.32 (ncclNumTypes == 12) and every built-in ncclRedOp_t
// (ncclNumOps == 5).
const std::vector<DtypeInfo>& dtypes();
const std::vector<OpInfo>& ops();
// Accepts canonical names and aliases ("float", "half", "torch.float32", "double", ...).
// Throws std::invalid_argument naming the accepted values.
const DtypeInfo& dtype_by_name(const std::string& name);
const OpInfo& op_by_name(const std::string& name);
// Name of an ncclResult_t value ("ncclSuccess", ..., "ncclTimeout").
const char* result_name(int code);

// ---- errors -------------------------------------------------------------------------
// A failed NCCL call or an asynchronous communicator error. `code` is the ncclResult_t
// (or -1 when the failure is not an NCCL result, e.g. a CUDA driver error).
class Error : public std::runtime_error {
 public:
  Error(const std::string& what, int code) : std::runtime_error(what), code_(code) {}
  int code() const { return code_; }

 private:
  int code_;
};
// An operation that did not finish before its deadline (the communicator was revoked or
// aborted before this was thrown).
class TimeoutError : public Error {
 public:
  explicit TimeoutError(const std::string& what) : Error(what, 8 /* ncclTimeout */) {}
};
// NCCL or CUDA cannot be used in this process: not compiled in, libnccl not found,
// libcuda not found, no GPU, ...
class UnavailableError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// ---- rank maps -------------------------------------------------------------------------
// A rank map lists, for each NCCL rank i (the index), the logical rank it plays.
// Logical ranks are distinct non-negative ints; they need not be dense (after a shrink the
// leaver's logical rank is missing until a joiner takes it). The "position" of a logical
// rank is its index in sorted order: allgather / reduce-scatter lay data out by position,
// which equals the logical rank when the map is a permutation of 0..n-1.
using RankMap = std::vector<int>;

void validate_rank_map(const RankMap& map);  // throws std::invalid_argument
RankMap identity_rank_map(int n);
// NCCL rank of a logical rank (throws std::invalid_argument if absent).
int nccl_rank_of(const RankMap& map, int logical);
// Positions (see above): positions(map)[nccl_rank] = index of map[nccl_rank] in sorted order.
std::vector<int> positions(const RankMap& map);
bool is_identity(const RankMap& map);
// ncclCommShrink drops the excluded NCCL ranks and renumbers the rest in order.
// Returns {new map, excluded NCCL ranks (sorted)}.
std::pair<RankMap, std::vector<int>> shrink_rank_map(const RankMap& map,
                                                     const std::vector<int>& exclude_logical);
// ncclCommGrow appends new ranks at the end: joiners_logical[i] becomes NCCL rank
// map.size() + i.
RankMap grow_rank_map(const RankMap& map, const std::vector<int>& joiners_logical);

}  // namespace nccl
}  // namespace tmrun
