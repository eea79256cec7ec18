// NCCL transport: tables, errors and rank-map arithmetic (no NCCL/CUDA header needed).
#include "tmrun/nccl_types.h"
#include "tmrun/str_cat.h"

#include <algorithm>
#include <cctype>
#include <set>

namespace tmrun {
namespace nccl {

const std::vector<DtypeInfo>& dtypes() {
  static const std::vector<DtypeInfo> t = {
      {"int8", 0, 1},     {"uint8", 1, 1},    {"int32", 2, 4},          {"uint32", 3, 4},
      {"int64", 4, 8},    {"uint64", 5, 8},   {"float16", 6, 2},        {"float32", 7, 4},
      {"float64", 8, 8},  {"bfloat16", 9, 2}, {"float8_e4m3fn", 10, 1}, {"float8_e5m2", 11, 1},
  };
  return t;
}

const std::vector<OpInfo>& ops() {
  static const std::vector<OpInfo> t = {
      {"sum", 0}, {"prod", 1}, {"max", 2}, {"min", 3}, {"avg", 4},
  };
  return t;
}

namespace {
std::string normalise(std::string s) {
  std::transform(s.begin(), s.end(), s.begin(), [](unsigned char c) { return std::tolower(c); });
  const std::string prefix = "torch.";
  if (s.compare(0, prefix.size(), prefix) == 0) s = s.substr(prefix.size());
  return s;
}
}  // namespace

const DtypeInfo& dtype_by_name(const std::string& name) {
  static const std::vector<std::pair<const char*, const char*>> aliases = {
      {"char", "int8"},      {"byte", "uint8"},     {"int", "int32"},
      {"long", "int64"},     {"half", "float16"},   {"float", "float32"},
      {"double", "float64"}, {"bf16", "bfloat16"},  {"fp16", "float16"},
      {"fp32", "float32"},   {"fp64", "float64"},   {"float8_e4m3", "float8_e4m3fn"},
  };
  std::string n = normalise(name);
  for (const auto& a : aliases) {
    if (n == a.first) n = a.second;
  }
  for (const auto& d : dtypes()) {
    if (n == d.name) return d;
  }
  std::string msg = str_cat("unsupported NCCL dtype '", name, "'; supported:");
  for (const auto& d : dtypes()) msg += str_cat(' ', d.name);
  throw std::invalid_argument(msg);
}

const OpInfo& op_by_name(const std::string& name) {
  std::string n = normalise(name);
  if (n == "product") n = "prod";
  if (n == "average" || n == "mean") n = "avg";
  if (n == "maximum") n = "max";
  if (n == "minimum") n = "min";
  // torch.distributed.ReduceOp prints as "RedOpType.SUM" or "ReduceOp.SUM".
  auto dot = n.rfind('.');
  if (dot != std::string::npos) n = n.substr(dot + 1);
  if (n == "product") n = "prod";
  for (const auto& o : ops()) {
    if (n == o.name) return o;
  }
  std::string msg = str_cat("unsupported NCCL reduction op '", name, "'; supported:");
  for (const auto& o : ops()) msg += str_cat(' ', o.name);
  throw std::invalid_argument(msg);
}

const char* result_name(int code) {
  switch (code) {
    case 0: return "ncclSuccess";
    case 1: return "ncclUnhandledCudaError";
    case 2: return "ncclSystemError";
    case 3: return "ncclInternalError";
    case 4: return "ncclInvalidArgument";
    case 5: return "ncclInvalidUsage";
    case 6: return "ncclRemoteError";
    case 7: return "ncclInProgress";
    case 8: return "ncclTimeout";
    default: return "ncclUnknownResult";
  }
}

void validate_rank_map(const RankMap& map) {
  if (map.empty()) throw std::invalid_argument("rank map is empty");
  std::set<int> seen;
  for (int r : map) {
    if (r < 0) throw std::invalid_argument("rank map holds a negative logical rank");
    if (!seen.insert(r).second) {
      throw std::invalid_argument("rank map holds logical rank " + std::to_string(r) + " twice");
    }
  }
}

RankMap identity_rank_map(int n) {
  if (n <= 0) throw std::invalid_argument("world size must be positive");
  RankMap m(static_cast<size_t>(n));
  for (int i = 0; i < n; ++i) m[static_cast<size_t>(i)] = i;
  return m;
}

int nccl_rank_of(const RankMap& map, int logical) {
  for (size_t i = 0; i < map.size(); ++i) {
    if (map[i] == logical) return static_cast<int>(i);
  }
  throw std::invalid_argument("logical rank " + std::to_string(logical) +
                              " is not a member of this communicator");
}

std::vector<int> positions(const RankMap& map) {
  validate_rank_map(map);
  RankMap sorted = map;
  std::sort(sorted.begin(), sorted.end());
  std::vector<int> pos(map.size());
  for (size_t i = 0; i < map.size(); ++i) {
    pos[i] = static_cast<int>(std::lower_bound(sorted.begin(), sorted.end(), map[i]) - sorted.begin());
  }
  return pos;
}

bool is_identity(const RankMap& map) {
  for (size_t i = 0; i < map.size(); ++i) {
    if (map[i] != static_cast<int>(i)) return false;
  }
  return true;
}

std::pair<RankMap, std::vector<int>> shrink_rank_map(const RankMap& map,
                                                     const std::vector<int>& exclude_logical) {
  validate_rank_map(map);
  std::set<int> excl(exclude_logical.begin(), exclude_logical.end());
  if (excl.size() != exclude_logical.size()) {
    throw std::invalid_argument("shrink: a logical rank is listed twice");
  }
  std::vector<int> excl_nccl;
  for (int l : excl) excl_nccl.push_back(nccl_rank_of(map, l));
  std::sort(excl_nccl.begin(), excl_nccl.end());
  RankMap out;
  for (int l : map) {
    if (!excl.count(l)) out.push_back(l);
  }
  if (out.empty()) throw std::invalid_argument("shrink would remove every rank");
  return {out, excl_nccl};
}

RankMap grow_rank_map(const RankMap& map, const std::vector<int>& joiners_logical) {
  validate_rank_map(map);
  if (joiners_logical.empty()) throw std::invalid_argument("grow needs at least one joiner");
  RankMap out = map;
  out.insert(out.end(), joiners_logical.begin(), joiners_logical.end());
  validate_rank_map(out);  // a joiner may not reuse a logical rank still present
  return out;
}

}  // namespace nccl
}  // namespace tmrun
