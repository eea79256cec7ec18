// NCCL transport: non-blocking communicator with deadlines and member replacement.
#include "tmrun/nccl_comm.h"
#include "tmrun/str_cat.h"

#if TMRUN_HAVE_NCCL

#include <algorithm>
#include <cstring>
#include <thread>

namespace tmrun {
namespace nccl {

// The tables in nccl_types.cpp are written without nccl.h; check them against it.
static_assert(ncclInt8 == 0 && ncclUint8 == 1 && ncclInt32 == 2 && ncclUint32 == 3, "dtype table");
static_assert(ncclInt64 == 4 && ncclUint64 == 5 && ncclFloat16 == 6 && ncclFloat32 == 7, "dtype table");
static_assert(ncclFloat64 == 8 && ncclBfloat16 == 9, "dtype table");
#if NCCL_VERSION_CODE >= NCCL_VERSION(2, 24, 0)
static_assert(ncclFloat8e4m3 == 10 && ncclFloat8e5m2 == 11 && ncclNumTypes == 12, "dtype table");
#endif
static_assert(ncclSum == 0 && ncclProd == 1 && ncclMax == 2 && ncclMin == 3 && ncclAvg == 4 &&
                  ncclNumOps == 5,
              "op table");
static_assert(ncclInProgress == 7, "result codes");
#if NCCL_VERSION_CODE >= NCCL_VERSION(2, 30, 0)  // ncclTimeout is newer than 2.28 (the H200's torch build)
static_assert(ncclTimeout == 8, "result codes");
#endif
static_assert(sizeof(ncclUniqueId) == NCCL_UNIQUE_ID_BYTES, "unique id size");

namespace {

ncclUniqueId id_from_bytes(const std::string& b) {
  if (b.size() != sizeof(ncclUniqueId)) {
    throw std::invalid_argument("an NCCL unique id is " + std::to_string(sizeof(ncclUniqueId)) +
                                " bytes, got " + std::to_string(b.size()));
  }
  ncclUniqueId id;
  std::memcpy(&id, b.data(), sizeof(id));
  return id;
}

std::string id_to_bytes(const ncclUniqueId& id) {
  return std::string(reinterpret_cast<const char*>(&id), sizeof(id));
}

cudaStream_t as_stream(uintptr_t s) { return reinterpret_cast<cudaStream_t>(s); }

double seconds_since(std::chrono::steady_clock::time_point t) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
}

}  // namespace

// ---- construction ---------------------------------------------------------------------

Communicator::Communicator(std::shared_ptr<const NcclLib> lib, int device, const Options& opts)
    : lib_(std::move(lib)), device_(device), opts_(opts) {
  if (!lib_) throw UnavailableError("no NCCL library loaded");
  if (opts_.timeout_s <= 0) throw std::invalid_argument("timeout must be positive");
  cuda_ = cuda_driver();  // throws UnavailableError with the reason (no driver / no GPU)
  if (device < 0 || device >= cuda_->device_count) {
    throw UnavailableError("CUDA device " + std::to_string(device) + " does not exist (" +
                           std::to_string(cuda_->device_count) + " visible)");
  }
  cu::Device dev = 0;
  cu::Result r = cuda_->DeviceGet(&dev, device);
  if (r == cu::kSuccess) r = cuda_->DevicePrimaryCtxRetain(&ctx_, dev);
  if (r != cu::kSuccess) {
    throw UnavailableError("cannot open CUDA device " + std::to_string(device) + ": " + cuda_->describe(r));
  }
  for (const char* k : {"inits", "shrinks", "grows", "reinits", "revokes", "aborts", "collectives",
                        "last_init_s", "last_shrink_s", "last_commit_wait_s", "last_pending_ready_s"}) {
    stats_[k] = 0;
  }
}

Communicator::~Communicator() {
  try {
    std::lock_guard<std::mutex> lk(mu_);
    abort_locked();
    if (event_ && cuda_) {
      make_current();
      cuda_->EventDestroy(event_);
    }
    if (ctx_ && cuda_) {
      cu::Device dev = 0;
      if (cuda_->DeviceGet(&dev, device_) == cu::kSuccess) cuda_->DevicePrimaryCtxRelease(dev);
    }
  } catch (...) {
  }
}

void Communicator::make_current() const {
  cu::Result r = cuda_->CtxSetCurrent(ctx_);
  if (r != cu::kSuccess) {
    throw Error("cuCtxSetCurrent(device " + std::to_string(device_) + ") failed: " + cuda_->describe(r), -1);
  }
}

ncclConfig_t Communicator::make_config() const {
  ncclConfig_t c = NCCL_CONFIG_INITIALIZER;
  c.blocking = 0;
  if (!opts_.name.empty()) c.commName = opts_.name.c_str();
#if NCCL_VERSION_CODE >= NCCL_VERSION(2, 27, 0)
  // NCCL decides sharing on a shrink from the *parent's* config.shrinkShare (ncclCommInitChildComm:
  // shareResources = !revoked && !SHRINK_ABORT && parent->config.shrinkShare), so every comm we
  // create carries it, not only shrink children.
  c.shrinkShare = opts_.shrink_share ? 1 : 0;
#endif
  return c;
}

void Communicator::set_map(RankMap map, int my_logical) {
  validate_rank_map(map);
  nccl_rank_ = nccl_rank_of(map, my_logical);
  logical_ = my_logical;
  pos_ = positions(map);
  ordered_ = true;
  for (size_t i = 0; i < pos_.size(); ++i) ordered_ = ordered_ && pos_[i] == static_cast<int>(i);
  map_ = std::move(map);
}

std::unique_ptr<Communicator> Communicator::init(const std::string& unique_id, int nranks, int logical_rank,
                                                 int device, RankMap map, const Options& opts, bool wait,
                                                 std::shared_ptr<const NcclLib> lib) {
  ncclUniqueId id = id_from_bytes(unique_id);
  if (nranks <= 0) throw std::invalid_argument("world size must be positive");
  if (map.empty()) map = identity_rank_map(nranks);
  if (static_cast<int>(map.size()) != nranks) throw std::invalid_argument("rank map size != world size");
  validate_rank_map(map);
  nccl_rank_of(map, logical_rank);  // throws if absent
  std::unique_ptr<Communicator> c(new Communicator(std::move(lib), device, opts));
  std::unique_lock<std::mutex> lk(c->mu_);
  c->set_map(std::move(map), logical_rank);
  c->make_current();
  ncclConfig_t cfg = c->make_config();
  c->init_started_ = Clock::now();
  ncclResult_t r = c->lib_->CommInitRankConfig(&c->comm_, nranks, id, c->nccl_rank_, &cfg);
  if (r != ncclSuccess && r != ncclInProgress) {
    std::string msg = "ncclCommInitRankConfig failed " + c->where() + ": " + c->lib_->error_string(r) +
                      c->last_error(c->comm_);
    if (c->comm_) c->lib_->CommAbort(c->comm_);
    c->comm_ = nullptr;
    c->state_ = State::Aborted;
    throw Error(msg, r);
  }
  c->stats_["inits"] += 1;
  lk.unlock();
  if (wait) c->wait_ready(-1);
  return c;
}

std::unique_ptr<Communicator> Communicator::grow_join(const std::string& unique_id, int nranks,
                                                      int logical_rank, int device, RankMap map,
                                                      const Options& opts, bool wait,
                                                      std::shared_ptr<const NcclLib> lib) {
  ncclUniqueId id = id_from_bytes(unique_id);
  if (!lib) throw UnavailableError("no NCCL library loaded");
  if (!lib->has_grow()) {
    throw UnavailableError("the loaded NCCL (" + std::to_string(lib->version) +
                           ") has no ncclCommGrow/ncclCommGetUniqueId (needs 2.29+)");
  }
  if (static_cast<int>(map.size()) != nranks) throw std::invalid_argument("rank map size != world size");
  validate_rank_map(map);
  nccl_rank_of(map, logical_rank);
  std::unique_ptr<Communicator> c(new Communicator(std::move(lib), device, opts));
  std::unique_lock<std::mutex> lk(c->mu_);
  c->set_map(std::move(map), logical_rank);
  c->make_current();
  ncclConfig_t cfg = c->make_config();
  c->init_started_ = Clock::now();
  ncclResult_t r = c->lib_->CommGrow(nullptr, nranks, &id, c->nccl_rank_, &c->comm_, &cfg);
  if (r != ncclSuccess && r != ncclInProgress) {
    std::string msg = "ncclCommGrow (joiner) failed " + c->where() + ": " + c->lib_->error_string(r);
    if (c->comm_) c->lib_->CommAbort(c->comm_);
    c->comm_ = nullptr;
    c->state_ = State::Aborted;
    throw Error(msg, r);
  }
  c->stats_["grows"] += 1;
  lk.unlock();
  if (wait) c->wait_ready(-1);
  return c;
}

// ---- helpers --------------------------------------------------------------------------

Communicator::Clock::time_point Communicator::deadline(double timeout_s) const {
  double t = timeout_s < 0 ? opts_.timeout_s : timeout_s;
  return Clock::now() + std::chrono::microseconds(static_cast<int64_t>(t * 1e6));
}

ncclResult_t Communicator::poll(ncclComm_t c, Clock::time_point dl, bool* timed_out) const {
  *timed_out = false;
  auto sleep = std::chrono::microseconds(10);
  while (true) {
    ncclResult_t st = ncclInProgress;
    ncclResult_t r = lib_->CommGetAsyncError(c, &st);
    if (r != ncclSuccess) return r;
    if (st != ncclInProgress) return st;
    if (Clock::now() >= dl) {
      *timed_out = true;
      return ncclInProgress;
    }
    std::this_thread::sleep_for(sleep);
    sleep = std::min(sleep * 2, std::chrono::microseconds(1000));
  }
}

std::string Communicator::where() const {
  std::string text = str_cat("(logical rank ", logical_, ", NCCL rank ", nccl_rank_, " of ", map_.size(),
                             ", device ", device_);
  if (!opts_.name.empty()) text += str_cat(", comm '", opts_.name, "'");
  return text + ")";
}

std::string Communicator::last_error(ncclComm_t c) const {
  if (!lib_->GetLastError) return "";
  const char* e = lib_->GetLastError(c);
  if (!e || !*e) return "";
  return std::string("; NCCL says: ") + e;
}

void Communicator::require_usable(const char* what) {
  if (state_ == State::Initializing) {
    bool to = false;
    ncclResult_t st = poll(comm_, deadline(-1), &to);
    if (to) fail(std::string(what) + " (waiting for communicator init)", ncclInProgress, true);
    if (st != ncclSuccess) fail(std::string(what) + " (communicator init)", st, false);
    state_ = State::Ready;
    stats_["last_init_s"] = seconds_since(init_started_);
  }
  if (state_ != State::Ready) {
    throw Error(std::string(what) + ": communicator is " + state_name() + " " + where() +
                    (state_ == State::Revoked ? "; shrink() or reinit_begin()/commit() to recover" : ""),
                ncclInvalidUsage);
  }
}

std::string Communicator::teardown_after_error() {
  if (!comm_) return "no communicator was open";
  if (opts_.revoke_on_error && lib_->has_revoke() &&
      (state_ == State::Ready || state_ == State::Initializing)) {
    ncclResult_t r = lib_->CommRevoke(comm_, NCCL_REVOKE_DEFAULT);
    if (r == ncclSuccess || r == ncclInProgress) {
      bool to = false;
      // Revoke is local; bound its wait independently of a possibly huge op timeout.
      ncclResult_t st = poll(comm_, deadline(std::min(opts_.timeout_s, 30.0)), &to);
      // NCCL's revoke job overwrites the async state with its own result (src/init.cc,
      // commRevokeAsync): ncclSuccess once quiescent, whatever the original failure was.
      if (!to && st == ncclSuccess) {
        state_ = State::Revoked;
        stats_["revokes"] += 1;
        return "communicator revoked (shrink() or reinit to recover)";
      }
    }
  }
  abort_locked();
  return "communicator aborted";
}

void Communicator::fail(const std::string& what, ncclResult_t code, bool timed_out, const std::string& detail) {
  std::string last = comm_ ? last_error(comm_) : "";
  std::string msg = timed_out ? str_cat("NCCL ", what, " did not complete within the deadline ", where())
                              : str_cat("NCCL ", what, " failed ", where(), ": ", lib_->error_string(code));
  if (!detail.empty()) msg += str_cat("; ", detail);
  msg += last;
  msg += str_cat("; ", teardown_after_error());
  if (timed_out) throw TimeoutError(msg);
  throw Error(msg, code);
}

template <typename F>
void Communicator::enqueue(const char* what, F&& call, bool group) {
  require_usable(what);
  make_current();
  ncclResult_t r;
  if (group) {
    r = lib_->GroupStart();
    if (r != ncclSuccess) fail(std::string(what) + " (ncclGroupStart)", r, false);
    ncclResult_t inner = call();
    r = lib_->GroupEnd();
    if (inner != ncclSuccess && inner != ncclInProgress) r = inner;
  } else {
    r = call();
  }
  if (r == ncclInvalidArgument || r == ncclInvalidUsage) {
    // Rejected before anything was enqueued: the communicator is unaffected.
    throw Error("NCCL " + std::string(what) + " rejected " + where() + ": " + lib_->error_string(r) +
                    last_error(comm_),
                r);
  }
  if (r != ncclSuccess && r != ncclInProgress) fail(what, r, false);
  bool to = false;
  ncclResult_t st = poll(comm_, deadline(-1), &to);
  if (to) fail(what, ncclInProgress, true);
  if (st != ncclSuccess) fail(what, st, false);
  stats_["collectives"] += 1;
}

// ---- introspection ----------------------------------------------------------------------

int Communicator::rank() const {
  std::lock_guard<std::mutex> lk(mu_);
  return logical_;
}
int Communicator::nccl_rank() const {
  std::lock_guard<std::mutex> lk(mu_);
  return nccl_rank_;
}
int Communicator::size() const {
  std::lock_guard<std::mutex> lk(mu_);
  return static_cast<int>(map_.size());
}
RankMap Communicator::rank_map() const {
  std::lock_guard<std::mutex> lk(mu_);
  return map_;
}
Communicator::State Communicator::state() const {
  std::lock_guard<std::mutex> lk(mu_);
  return state_;
}
std::string Communicator::state_name() const {
  switch (state_) {
    case State::Initializing: return "initializing";
    case State::Ready: return "ready";
    case State::Revoked: return "revoked";
    case State::Aborted: return "aborted";
    case State::Closed: return "closed";
  }
  return "?";
}
bool Communicator::has_pending() const {
  std::lock_guard<std::mutex> lk(mu_);
  return pending_ != nullptr;
}
std::map<std::string, double> Communicator::stats() const {
  std::lock_guard<std::mutex> lk(mu_);
  return stats_;
}

// ---- readiness ----------------------------------------------------------------------------

void Communicator::wait_ready(double timeout_s) {
  std::lock_guard<std::mutex> lk(mu_);
  if (state_ != State::Initializing) {
    if (state_ != State::Ready) throw Error("communicator is " + state_name() + " " + where(), ncclInvalidUsage);
    return;
  }
  bool to = false;
  ncclResult_t st = poll(comm_, deadline(timeout_s), &to);
  if (to) fail("communicator init", ncclInProgress, true);
  if (st != ncclSuccess) fail("communicator init", st, false);
  state_ = State::Ready;
  stats_["last_init_s"] = seconds_since(init_started_);
}

bool Communicator::poll_ready() {
  std::lock_guard<std::mutex> lk(mu_);
  if (state_ == State::Ready) return true;
  if (state_ != State::Initializing) throw Error("communicator is " + state_name() + " " + where(), ncclInvalidUsage);
  ncclResult_t st = ncclInProgress;
  ncclResult_t r = lib_->CommGetAsyncError(comm_, &st);
  if (r != ncclSuccess) fail("communicator init", r, false);
  if (st == ncclInProgress) return false;
  if (st != ncclSuccess) fail("communicator init", st, false);
  state_ = State::Ready;
  stats_["last_init_s"] = seconds_since(init_started_);
  return true;
}

void Communicator::check() {
  std::lock_guard<std::mutex> lk(mu_);
  if (!comm_) throw Error("communicator is " + state_name() + " " + where(), ncclInvalidUsage);
  ncclResult_t st = ncclInProgress;
  ncclResult_t r = lib_->CommGetAsyncError(comm_, &st);
  if (r != ncclSuccess) fail("health check", r, false);
  if (st != ncclSuccess && st != ncclInProgress && state_ != State::Revoked) fail("health check", st, false);
}

// ---- collectives --------------------------------------------------------------------------

void Communicator::allreduce(uintptr_t send, uintptr_t recv, size_t count, const std::string& dtype,
                             const std::string& op, uintptr_t stream) {
  const auto& dt = dtype_by_name(dtype);
  const auto& o = op_by_name(op);
  std::lock_guard<std::mutex> lk(mu_);
  enqueue("allreduce", [&] {
    return lib_->AllReduce(reinterpret_cast<const void*>(send), reinterpret_cast<void*>(recv), count,
                           static_cast<ncclDataType_t>(dt.nccl), static_cast<ncclRedOp_t>(o.nccl), comm_,
                           as_stream(stream));
  }, false);
}

void Communicator::broadcast(uintptr_t send, uintptr_t recv, size_t count, const std::string& dtype,
                             int root_logical, uintptr_t stream) {
  const auto& dt = dtype_by_name(dtype);
  std::lock_guard<std::mutex> lk(mu_);
  int root = nccl_rank_of(map_, root_logical);
  enqueue("broadcast", [&] {
    return lib_->Broadcast(reinterpret_cast<const void*>(send), reinterpret_cast<void*>(recv), count,
                           static_cast<ncclDataType_t>(dt.nccl), root, comm_, as_stream(stream));
  }, false);
}

void Communicator::allgather(uintptr_t send, uintptr_t recv, size_t count, const std::string& dtype,
                             uintptr_t stream) {
  const auto& dt = dtype_by_name(dtype);
  std::lock_guard<std::mutex> lk(mu_);
  if (ordered_) {
    enqueue("allgather", [&] {
      return lib_->AllGather(reinterpret_cast<const void*>(send), reinterpret_cast<void*>(recv), count,
                             static_cast<ncclDataType_t>(dt.nccl), comm_, as_stream(stream));
    }, false);
    return;
  }
  // NCCL numbering differs from logical order (a grown joiner): grouped send/recv that
  // writes every rank's chunk at its logical position.
  const size_t chunk = count * static_cast<size_t>(dt.size);
  enqueue("allgather (rank-mapped)", [&] {
    ncclResult_t r = ncclSuccess;
    for (int p = 0; p < static_cast<int>(map_.size()) && (r == ncclSuccess || r == ncclInProgress); ++p) {
      uintptr_t dst = recv + static_cast<size_t>(pos_[static_cast<size_t>(p)]) * chunk;
      if (p == nccl_rank_ && dst == send) continue;  // in place: own chunk already there
      r = lib_->Send(reinterpret_cast<const void*>(send), count, static_cast<ncclDataType_t>(dt.nccl), p, comm_,
                     as_stream(stream));
      if (r != ncclSuccess && r != ncclInProgress) break;
      r = lib_->Recv(reinterpret_cast<void*>(dst), count, static_cast<ncclDataType_t>(dt.nccl), p, comm_,
                     as_stream(stream));
    }
    return r;
  }, true);
}

void Communicator::reduce_scatter(uintptr_t send, uintptr_t recv, size_t recv_count, const std::string& dtype,
                                  const std::string& op, uintptr_t stream) {
  const auto& dt = dtype_by_name(dtype);
  const auto& o = op_by_name(op);
  std::lock_guard<std::mutex> lk(mu_);
  if (ordered_) {
    enqueue("reduce_scatter", [&] {
      return lib_->ReduceScatter(reinterpret_cast<const void*>(send), reinterpret_cast<void*>(recv), recv_count,
                                 static_cast<ncclDataType_t>(dt.nccl), static_cast<ncclRedOp_t>(o.nccl), comm_,
                                 as_stream(stream));
    }, false);
    return;
  }
  // Rank-mapped: one grouped ncclReduce per chunk, rooted at the NCCL rank that holds
  // the chunk's logical position.
  const size_t chunk = recv_count * static_cast<size_t>(dt.size);
  enqueue("reduce_scatter (rank-mapped)", [&] {
    ncclResult_t r = ncclSuccess;
    for (int p = 0; p < static_cast<int>(map_.size()) && (r == ncclSuccess || r == ncclInProgress); ++p) {
      uintptr_t src = send + static_cast<size_t>(pos_[static_cast<size_t>(p)]) * chunk;
      r = lib_->Reduce(reinterpret_cast<const void*>(src), reinterpret_cast<void*>(recv), recv_count,
                       static_cast<ncclDataType_t>(dt.nccl), static_cast<ncclRedOp_t>(o.nccl), p, comm_,
                       as_stream(stream));
    }
    return r;
  }, true);
}

void Communicator::send(uintptr_t buf, size_t count, const std::string& dtype, int peer_logical,
                        uintptr_t stream) {
  const auto& dt = dtype_by_name(dtype);
  std::lock_guard<std::mutex> lk(mu_);
  int peer = nccl_rank_of(map_, peer_logical);
  enqueue("send", [&] {
    return lib_->Send(reinterpret_cast<const void*>(buf), count, static_cast<ncclDataType_t>(dt.nccl), peer, comm_,
                      as_stream(stream));
  }, false);
}

void Communicator::recv(uintptr_t buf, size_t count, const std::string& dtype, int peer_logical,
                        uintptr_t stream) {
  const auto& dt = dtype_by_name(dtype);
  std::lock_guard<std::mutex> lk(mu_);
  int peer = nccl_rank_of(map_, peer_logical);
  enqueue("recv", [&] {
    return lib_->Recv(reinterpret_cast<void*>(buf), count, static_cast<ncclDataType_t>(dt.nccl), peer, comm_,
                      as_stream(stream));
  }, false);
}

void Communicator::sendrecv(uintptr_t send_buf, size_t send_count, int send_peer_logical, uintptr_t recv_buf,
                            size_t recv_count, int recv_peer_logical, const std::string& dtype, uintptr_t stream) {
  const auto& dt = dtype_by_name(dtype);
  std::lock_guard<std::mutex> lk(mu_);
  int to = nccl_rank_of(map_, send_peer_logical);
  int from = nccl_rank_of(map_, recv_peer_logical);
  enqueue("sendrecv", [&] {
    ncclResult_t r = lib_->Send(reinterpret_cast<const void*>(send_buf), send_count,
                                static_cast<ncclDataType_t>(dt.nccl), to, comm_, as_stream(stream));
    if (r != ncclSuccess && r != ncclInProgress) return r;
    return lib_->Recv(reinterpret_cast<void*>(recv_buf), recv_count, static_cast<ncclDataType_t>(dt.nccl), from,
                      comm_, as_stream(stream));
  }, true);
}

void Communicator::synchronize(uintptr_t stream, double timeout_s) {
  std::lock_guard<std::mutex> lk(mu_);
  if (!comm_) throw Error("synchronize: communicator is " + state_name() + " " + where(), ncclInvalidUsage);
  make_current();
  if (!event_) {
    cu::Result r = cuda_->EventCreate(&event_, cu::kEventDisableTiming);
    if (r != cu::kSuccess) {
      event_ = nullptr;
      throw Error("cuEventCreate failed: " + cuda_->describe(r), -1);
    }
  }
  cu::Result r = cuda_->EventRecord(event_, reinterpret_cast<cu::Stream>(stream));
  if (r != cu::kSuccess) fail("synchronize", ncclUnhandledCudaError, false, "cuEventRecord: " + cuda_->describe(r));
  const auto dl = deadline(timeout_s);
  auto sleep = std::chrono::microseconds(10);
  while (true) {
    r = cuda_->EventQuery(event_);
    if (r == cu::kSuccess) return;
    if (r != cu::kErrorNotReady) {
      fail("synchronize", ncclUnhandledCudaError, false, "cuEventQuery: " + cuda_->describe(r));
    }
    ncclResult_t st = ncclInProgress;
    ncclResult_t nr = lib_->CommGetAsyncError(comm_, &st);
    if (nr != ncclSuccess) fail("synchronize", nr, false);
    if (st != ncclSuccess && st != ncclInProgress && state_ != State::Revoked) {
      fail("synchronize (async error while waiting for the GPU)", st, false);
    }
    if (Clock::now() >= dl) fail("synchronize (GPU work on the stream)", ncclInProgress, true);
    std::this_thread::sleep_for(sleep);
    sleep = std::min(sleep * 2, std::chrono::microseconds(500));
  }
}

// ---- failure and teardown ----------------------------------------------------------------

void Communicator::revoke(double timeout_s) {
  std::lock_guard<std::mutex> lk(mu_);
  if (!lib_->has_revoke()) {
    throw UnavailableError("the loaded NCCL (" + std::to_string(lib_->version) +
                           ") has no ncclCommRevoke (needs 2.28.7+); use abort() and a re-init");
  }
  if (state_ == State::Revoked) return;
  if (!comm_ || (state_ != State::Ready && state_ != State::Initializing)) {
    throw Error("revoke: communicator is " + state_name() + " " + where(), ncclInvalidUsage);
  }
  make_current();
  ncclResult_t r = lib_->CommRevoke(comm_, NCCL_REVOKE_DEFAULT);
  if (r != ncclSuccess && r != ncclInProgress) {
    std::string msg = "ncclCommRevoke failed " + where() + ": " + lib_->error_string(r) + last_error(comm_);
    abort_locked();
    throw Error(msg + "; communicator aborted", r);
  }
  bool to = false;
  ncclResult_t st = poll(comm_, deadline(timeout_s), &to);
  if (to) {
    abort_locked();
    throw TimeoutError("ncclCommRevoke did not quiesce within the deadline " + where() + "; communicator aborted");
  }
  if (st != ncclSuccess) {
    std::string msg = "ncclCommRevoke failed " + where() + ": " + lib_->error_string(st) + last_error(comm_);
    abort_locked();
    throw Error(msg + "; communicator aborted", st);
  }
  state_ = State::Revoked;
  stats_["revokes"] += 1;
}

void Communicator::abort_locked() {
  bool any = comm_ || pending_ || !retired_.empty();
  if (any && cuda_ && ctx_) {
    try {
      make_current();
    } catch (...) {
    }
  }
  if (pending_) {
    lib_->CommAbort(pending_);
    pending_ = nullptr;
  }
  if (comm_) {
    lib_->CommAbort(comm_);
    comm_ = nullptr;
  }
  // Children before parents.
  for (auto it = retired_.rbegin(); it != retired_.rend(); ++it) lib_->CommAbort(*it);
  retired_.clear();
  if (any) stats_["aborts"] += 1;
  if (state_ != State::Closed) state_ = State::Aborted;
}

void Communicator::abort() {
  std::lock_guard<std::mutex> lk(mu_);
  abort_locked();
}

void Communicator::close(double timeout_s) {
  std::lock_guard<std::mutex> lk(mu_);
  if (state_ == State::Closed) return;
  make_current();
  if (pending_) {
    lib_->CommAbort(pending_);
    pending_ = nullptr;
  }
  bool clean = false;
  if (comm_ && state_ == State::Ready) {
    ncclResult_t r = lib_->CommFinalize(comm_);
    if (r == ncclSuccess || r == ncclInProgress) {
      bool to = false;
      ncclResult_t st = poll(comm_, deadline(timeout_s), &to);
      if (!to && st == ncclSuccess) {
        clean = lib_->CommDestroy(comm_) == ncclSuccess;
        if (clean) comm_ = nullptr;
      }
    }
  }
  abort_locked();  // whatever is left: unhealthy comm, revoked comm, retired parents
  state_ = State::Closed;
  (void)clean;
}

// ---- replacement A: shrink + grow ---------------------------------------------------------

void Communicator::shrink(const std::vector<int>& exclude_logical, bool abort_flag, double timeout_s) {
  std::lock_guard<std::mutex> lk(mu_);
  if (!lib_->has_shrink()) {
    throw UnavailableError("the loaded NCCL (" + std::to_string(lib_->version) +
                           ") has no ncclCommShrink (needs 2.27+); use reinit_begin()/commit()");
  }
  if (!comm_ || (state_ != State::Ready && state_ != State::Revoked)) {
    throw Error("shrink: communicator is " + state_name() + " " + where(), ncclInvalidUsage);
  }
  if (pending_) throw Error("shrink: a " + pending_kind_ + " is pending; commit or cancel it first", ncclInvalidUsage);
  for (int l : exclude_logical) {
    if (l == logical_) throw std::invalid_argument("shrink: this rank is in the exclude list (excluded ranks must not call shrink)");
  }
  auto plan = shrink_rank_map(map_, exclude_logical);
  std::vector<int> excl = plan.second;
  // Mirrors NCCL's rule: a revoked parent never shares resources, NCCL_SHRINK_ABORT shares
  // nothing, otherwise the parent's shrinkShare decides. A sharing child needs its parent alive.
  const bool share = opts_.shrink_share && !abort_flag && state_ == State::Ready;
  ncclConfig_t cfg = make_config();
  make_current();
  const auto t0 = Clock::now();
  ncclComm_t child = nullptr;
  ncclResult_t r = lib_->CommShrink(comm_, excl.data(), static_cast<int>(excl.size()), &child, &cfg,
                                    abort_flag ? NCCL_SHRINK_ABORT : NCCL_SHRINK_DEFAULT);
  if (r != ncclSuccess && r != ncclInProgress) {
    std::string msg = "ncclCommShrink failed " + where() + ": " + lib_->error_string(r) + last_error(comm_);
    if (child) lib_->CommAbort(child);
    throw Error(msg + "; the parent communicator is unchanged", r);
  }
  if (!child) throw Error("ncclCommShrink returned no communicator " + where(), ncclInternalError);
  bool to = false;
  const auto dl = deadline(timeout_s);
  ncclResult_t st = poll(child, dl, &to);
  if (to || st != ncclSuccess) {
    std::string msg = to ? "ncclCommShrink did not complete within the deadline " + where()
                         : "ncclCommShrink failed " + where() + ": " + lib_->error_string(st) + last_error(child);
    lib_->CommAbort(child);
    if (to) throw TimeoutError(msg + "; the new communicator was aborted, the parent is unchanged");
    throw Error(msg + "; the parent communicator is unchanged", st);
  }
  // The parent may report ncclInProgress while the shrink settles; wait for it too.
  poll(comm_, dl, &to);
  ncclComm_t parent = comm_;
  comm_ = child;
  set_map(plan.first, logical_);
  if (share) {
    retired_.push_back(parent);  // keeps the shared resources alive; aborted at commit/close
  } else {
    lib_->CommAbort(parent);  // local, no barrier with the (possibly dead) excluded ranks
  }
  state_ = State::Ready;
  stats_["shrinks"] += 1;
  stats_["last_shrink_s"] = seconds_since(t0);
}

std::string Communicator::grow_unique_id() {
  std::lock_guard<std::mutex> lk(mu_);
  if (!lib_->has_grow()) {
    throw UnavailableError("the loaded NCCL (" + std::to_string(lib_->version) +
                           ") has no ncclCommGrow (needs 2.29+); use reinit_begin()/commit()");
  }
  require_usable("grow_unique_id");
  make_current();
  ncclUniqueId id;
  std::memset(&id, 0, sizeof(id));
  ncclResult_t r = lib_->CommGetUniqueId(comm_, &id);
  if (r == ncclInProgress) {
    bool to = false;
    r = poll(comm_, deadline(-1), &to);
    if (to) fail("ncclCommGetUniqueId", ncclInProgress, true);
  }
  if (r != ncclSuccess) {
    throw Error("ncclCommGetUniqueId failed " + where() + ": " + lib_->error_string(r) + last_error(comm_), r);
  }
  return id_to_bytes(id);
}

void Communicator::grow_begin(const std::vector<int>& joiners_logical, const std::string& unique_id_or_empty) {
  std::lock_guard<std::mutex> lk(mu_);
  if (!lib_->has_grow()) {
    throw UnavailableError("the loaded NCCL (" + std::to_string(lib_->version) +
                           ") has no ncclCommGrow (needs 2.29+); use reinit_begin()/commit()");
  }
  if (pending_) throw Error("grow_begin: a " + pending_kind_ + " is pending", ncclInvalidUsage);
  require_usable("grow_begin");
  if (map_.size() < 2) {
    throw Error("grow_begin: NCCL cannot grow a 1-rank communicator (no bootstrap network); use "
                "reinit_begin()/commit()",
                ncclInvalidUsage);
  }
  RankMap grown = grow_rank_map(map_, joiners_logical);
  ncclUniqueId id;
  const ncclUniqueId* idp = nullptr;
  if (!unique_id_or_empty.empty()) {
    id = id_from_bytes(unique_id_or_empty);
    idp = &id;
  }
  ncclConfig_t cfg = make_config();
  make_current();
  ncclComm_t child = nullptr;
  ncclResult_t r = lib_->CommGrow(comm_, static_cast<int>(grown.size()), idp, -1, &child, &cfg);
  if (r != ncclSuccess && r != ncclInProgress) {
    std::string msg = "ncclCommGrow failed " + where() + ": " + lib_->error_string(r) + last_error(comm_);
    if (child) lib_->CommAbort(child);
    throw Error(msg + "; the current communicator is unchanged", r);
  }
  if (!child) throw Error("ncclCommGrow returned no communicator " + where(), ncclInternalError);
  pending_ = child;
  pending_kind_ = "grow";
  pending_map_ = std::move(grown);
  pending_started_ = Clock::now();
  stats_["grows"] += 1;
}

// ---- replacement B: full re-init in the background -------------------------------------

void Communicator::reinit_begin(const std::string& unique_id, int nranks, RankMap map) {
  ncclUniqueId id = id_from_bytes(unique_id);
  std::lock_guard<std::mutex> lk(mu_);
  if (state_ == State::Closed) throw Error("reinit_begin: communicator is closed", ncclInvalidUsage);
  if (pending_) throw Error("reinit_begin: a " + pending_kind_ + " is pending", ncclInvalidUsage);
  if (map.empty()) map = identity_rank_map(nranks);
  if (static_cast<int>(map.size()) != nranks) throw std::invalid_argument("rank map size != world size");
  validate_rank_map(map);
  int my_nccl = nccl_rank_of(map, logical_);
  ncclConfig_t cfg = make_config();
  make_current();
  ncclComm_t child = nullptr;
  ncclResult_t r = lib_->CommInitRankConfig(&child, nranks, id, my_nccl, &cfg);
  if (r != ncclSuccess && r != ncclInProgress) {
    std::string msg = "ncclCommInitRankConfig (re-init) failed " + where() + ": " + lib_->error_string(r);
    if (child) lib_->CommAbort(child);
    throw Error(msg + "; the current communicator is unchanged", r);
  }
  pending_ = child;
  pending_kind_ = "reinit";
  pending_map_ = std::move(map);
  pending_started_ = Clock::now();
  stats_["reinits"] += 1;
}

bool Communicator::pending_ready() {
  std::lock_guard<std::mutex> lk(mu_);
  if (!pending_) throw Error("pending_ready: nothing is pending", ncclInvalidUsage);
  ncclResult_t st = ncclInProgress;
  ncclResult_t r = lib_->CommGetAsyncError(pending_, &st);
  if (r == ncclSuccess && st == ncclInProgress) return false;
  if (r == ncclSuccess && st == ncclSuccess) {
    stats_["last_pending_ready_s"] = seconds_since(pending_started_);
    return true;
  }
  ncclResult_t code = r != ncclSuccess ? r : st;
  std::string msg = "pending " + pending_kind_ + " failed " + where() + ": " + lib_->error_string(code) +
                    last_error(pending_);
  make_current();
  lib_->CommAbort(pending_);
  pending_ = nullptr;
  throw Error(msg + "; it was aborted, the current communicator is unchanged", code);
}

void Communicator::install_pending_locked() {
  ncclComm_t old = comm_;
  comm_ = pending_;
  pending_ = nullptr;
  set_map(std::move(pending_map_), logical_);
  pending_map_.clear();
  state_ = State::Ready;
  // The new communicator owns fresh resources (grow and init never share), so the old one
  // and every retired parent can go. Abort is local: no barrier with departed ranks.
  if (old) lib_->CommAbort(old);
  for (auto it = retired_.rbegin(); it != retired_.rend(); ++it) lib_->CommAbort(*it);
  retired_.clear();
}

void Communicator::commit(double timeout_s) {
  std::lock_guard<std::mutex> lk(mu_);
  if (!pending_) throw Error("commit: nothing is pending (call grow_begin or reinit_begin)", ncclInvalidUsage);
  make_current();
  const auto t0 = Clock::now();
  const auto dl = deadline(timeout_s);
  bool to = false;
  ncclResult_t st = poll(pending_, dl, &to);
  if (to || st != ncclSuccess) {
    std::string msg = to ? "pending " + pending_kind_ + " not ready within the deadline " + where()
                         : "pending " + pending_kind_ + " failed " + where() + ": " + lib_->error_string(st) +
                               last_error(pending_);
    lib_->CommAbort(pending_);
    pending_ = nullptr;
    msg += "; it was aborted, the current communicator is unchanged";
    if (to) throw TimeoutError(msg);
    throw Error(msg, st);
  }
  if (pending_kind_ == "grow" && comm_) {
    poll(comm_, dl, &to);  // the parent may report ncclInProgress until the grow settled
  }
  stats_["last_commit_wait_s"] = seconds_since(t0);
  stats_["last_pending_ready_s"] = seconds_since(pending_started_);
  install_pending_locked();
}

void Communicator::cancel_pending() {
  std::lock_guard<std::mutex> lk(mu_);
  if (!pending_) return;
  make_current();
  lib_->CommAbort(pending_);
  pending_ = nullptr;
  pending_map_.clear();
}

}  // namespace nccl
}  // namespace tmrun

#endif  // TMRUN_HAVE_NCCL
