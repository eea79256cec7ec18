// NCCL transport: a non-blocking NCCL communicator with deadlines and member replacement.
//
// Compiled only when TMRUN_HAVE_NCCL is 1. Every NCCL call is made on a non-blocking
// communicator (config.blocking = 0) and followed by polling ncclCommGetAsyncError until it
// leaves ncclInProgress or a deadline passes. On an asynchronous error or a timeout the
// communicator is revoked (ncclCommRevoke, so it can still be shrunk) or, failing that,
// aborted (ncclCommAbort), and an Error / TimeoutError naming the operation is thrown.
//
// Ranks: callers speak *logical* ranks. rank_map()[i] is the logical rank of NCCL rank i.
// After ncclCommShrink + ncclCommGrow a joiner sits at the end of the NCCL numbering but
// holds the leaver's logical rank; broadcast roots, send/recv peers and the data layout of
// allgather / reduce-scatter follow logical ranks (see nccl_types.h, "positions").
//
// Replacement, with what stock NCCL offers:
//  A. revoke() -> shrink(exclude) -> [coordinator: grow_unique_id()] -> grow_begin(joiners)
//     -> commit(); the joiner calls Communicator::grow_join(). NCCL renumbers; the rank map
//     keeps logical ranks stable.
//  B. fallback: reinit_begin(new unique id, ...) on every member of the new membership while
//     the old communicator keeps running (ncclCommInitRankConfig is non-blocking, so this
//     builds in the background), then commit() swaps at a safe point; the joiner constructs
//     with Communicator::init() and the same new id.
#pragma once

#if TMRUN_HAVE_NCCL

#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "tmrun/nccl_loader.h"

namespace tmrun {
namespace nccl {

struct Options {
  double timeout_s = 300.0;     // default deadline of every operation
  bool revoke_on_error = true;  // on error/timeout: revoke (keeps shrink possible) else abort
  bool shrink_share = true;     // config.shrinkShare: shrinks of a healthy comm reuse its resources
  std::string name;             // config.commName (shows in NCCL logs)
};

class Communicator {
 public:
  enum class State { Initializing, Ready, Revoked, Aborted, Closed };

  // Full init: ncclCommInitRankConfig(nranks, id, nccl rank of `logical_rank`).
  // `map` empty means identity. With wait=false returns while NCCL is still connecting.
  static std::unique_ptr<Communicator> init(const std::string& unique_id, int nranks, int logical_rank,
                                            int device, RankMap map, const Options& opts, bool wait,
                                            std::shared_ptr<const NcclLib> lib);
  // Joiner side of ncclCommGrow(NULL, nranks, &id, nccl_rank, ...). `map` is the grown map
  // (as returned by grow_rank_map on the survivors); the joiner's NCCL rank is the index of
  // `logical_rank` in it and must be >= the pre-grow size.
  static std::unique_ptr<Communicator> grow_join(const std::string& unique_id, int nranks,
                                                 int logical_rank, int device, RankMap map,
                                                 const Options& opts, bool wait,
                                                 std::shared_ptr<const NcclLib> lib);
  ~Communicator();  // aborts whatever is still open (never blocks on peers)
  Communicator(const Communicator&) = delete;
  Communicator& operator=(const Communicator&) = delete;

  // ---- introspection
  int rank() const;  // logical
  int nccl_rank() const;
  int size() const;
  int device() const { return device_; }
  RankMap rank_map() const;
  State state() const;
  std::string state_name() const;
  bool has_pending() const;
  const NcclLib& lib() const { return *lib_; }
  std::map<std::string, double> stats() const;
  double default_timeout() const { return opts_.timeout_s; }

  // ---- readiness / health
  void wait_ready(double timeout_s);  // timeout_s < 0: default
  bool poll_ready();                  // non-blocking; throws on an init error
  void check();                       // polls the async error once; throws on error

  // ---- collectives (device pointers and a CUstream/cudaStream_t as integers; 0 = legacy
  // default stream). They return once NCCL has enqueued the work; call synchronize() to wait
  // for the GPU with a deadline.
  void allreduce(uintptr_t send, uintptr_t recv, size_t count, const std::string& dtype,
                 const std::string& op, uintptr_t stream);
  void broadcast(uintptr_t send, uintptr_t recv, size_t count, const std::string& dtype,
                 int root_logical, uintptr_t stream);
  // count = elements per rank; recv holds size()*count, laid out by logical position.
  void allgather(uintptr_t send, uintptr_t recv, size_t count, const std::string& dtype,
                 uintptr_t stream);
  // recv_count = elements per rank; send holds size()*recv_count, chunk i for position i.
  void reduce_scatter(uintptr_t send, uintptr_t recv, size_t recv_count, const std::string& dtype,
                      const std::string& op, uintptr_t stream);
  void send(uintptr_t buf, size_t count, const std::string& dtype, int peer_logical, uintptr_t stream);
  void recv(uintptr_t buf, size_t count, const std::string& dtype, int peer_logical, uintptr_t stream);
  // Grouped send + recv (ncclGroupStart/End), e.g. a ring exchange that separate send()
  // and recv() calls on one stream would deadlock.
  void sendrecv(uintptr_t send_buf, size_t send_count, int send_peer_logical, uintptr_t recv_buf,
                size_t recv_count, int recv_peer_logical, const std::string& dtype, uintptr_t stream);
  // Records an event on `stream` and polls it (and the communicator's async error) until the
  // GPU got there, an error shows or the deadline passes.
  void synchronize(uintptr_t stream, double timeout_s);

  // ---- failure and teardown
  void revoke(double timeout_s);  // ncclCommRevoke + wait for quiescence
  void abort();                   // ncclCommAbort of everything this object holds
  void close(double timeout_s);   // finalize + destroy when healthy, else abort

  // ---- replacement A: shrink + grow
  void shrink(const std::vector<int>& exclude_logical, bool abort_flag, double timeout_s);
  std::string grow_unique_id();  // coordinator only: ncclCommGetUniqueId(comm)
  void grow_begin(const std::vector<int>& joiners_logical, const std::string& unique_id_or_empty);
  // ---- replacement B: full re-init in the background
  void reinit_begin(const std::string& unique_id, int nranks, RankMap map);
  bool pending_ready();  // non-blocking; throws (and drops the pending comm) on its error
  void commit(double timeout_s);
  void cancel_pending();

 private:
  using Clock = std::chrono::steady_clock;
  Communicator(std::shared_ptr<const NcclLib> lib, int device, const Options& opts);
  void make_current() const;
  ncclConfig_t make_config() const;
  Clock::time_point deadline(double timeout_s) const;
  // Polls `c` until not ncclInProgress or the deadline; sets *timed_out.
  ncclResult_t poll(ncclComm_t c, Clock::time_point dl, bool* timed_out) const;
  std::string where() const;
  std::string last_error(ncclComm_t c) const;
  void require_usable(const char* what);
  void set_map(RankMap map, int my_logical);
  // Enqueue an operation and wait for NCCL to accept it (non-blocking protocol).
  template <typename F>
  void enqueue(const char* what, F&& call, bool group);
  [[noreturn]] void fail(const std::string& what, ncclResult_t code, bool timed_out,
                         const std::string& detail = "");
  std::string teardown_after_error();
  void abort_locked();
  void install_pending_locked();

  mutable std::mutex mu_;
  std::shared_ptr<const NcclLib> lib_;
  std::shared_ptr<const CudaDriver> cuda_;
  int device_ = -1;
  cu::Context ctx_ = nullptr;
  cu::Event event_ = nullptr;
  Options opts_;

  ncclComm_t comm_ = nullptr;
  State state_ = State::Initializing;
  RankMap map_;
  std::vector<int> pos_;
  bool ordered_ = true;  // positions == NCCL ranks (native allgather/reduce-scatter usable)
  int logical_ = -1;
  int nccl_rank_ = -1;
  Clock::time_point init_started_;

  // Parents kept alive for shrinkShare resource sharing; aborted at close/commit.
  std::vector<ncclComm_t> retired_;

  ncclComm_t pending_ = nullptr;
  std::string pending_kind_;
  RankMap pending_map_;
  Clock::time_point pending_started_;

  std::map<std::string, double> stats_;
};

}  // namespace nccl
}  // namespace tmrun

#endif  // TMRUN_HAVE_NCCL
