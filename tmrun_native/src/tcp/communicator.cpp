// The public facade of the TCP communicator: Communicator forwards to its Impl; operations are
// queued (submit) and run one at a time by the worker thread. Also construction and close.
#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <stdexcept>
#include <system_error>

#include "comm_impl.h"

namespace tmrun {
namespace tcp {

// ---------------------------------------------------------------- OpState
void OpState::finish(std::exception_ptr err) {
  {
    std::lock_guard<std::mutex> g(mu_);
    done_ = true;
    err_ = std::move(err);
  }
  cv_.notify_all();
}

bool OpState::wait(double seconds) {
  std::unique_lock<std::mutex> g(mu_);
  if (seconds < 0) {
    cv_.wait(g, [&] { return done_; });
    return true;
  }
  return cv_.wait_for(g, secs(seconds), [&] { return done_; });
}

bool OpState::done() const {
  std::lock_guard<std::mutex> g(mu_);
  return done_;
}

std::exception_ptr OpState::error() const {
  std::lock_guard<std::mutex> g(mu_);
  return err_;
}

// ---------------------------------------------------------------- Communicator -> Impl
Communicator::Communicator(int rank, int world_size, std::string job_id, uint64_t epoch, Options opts)
    : impl_(std::make_unique<Impl>(rank, world_size, std::move(job_id), epoch, std::move(opts))) {}

Communicator::~Communicator() = default;

int Communicator::rank() const { return impl_->rank_; }
int Communicator::world_size() const { return impl_->world_; }
uint64_t Communicator::epoch() const { return impl_->epoch_.load(); }
int Communicator::port() const { return impl_->port_; }
std::string Communicator::address() const { return impl_->address(); }
const std::string& Communicator::job_id() const { return impl_->job_id_; }
const Options& Communicator::options() const { return impl_->opts_; }
std::vector<int> Communicator::ring_peers() const { return impl_->ring_peers(); }

void Communicator::connect(const std::vector<std::string>& addresses) { impl_->connect(addresses); }

// The operations' arguments are checked on the worker thread (do_*): their errors, like the
// communication errors, come back through the returned state.
Communicator::Op Communicator::allreduce_async(void* buf, size_t count, DType dt, ReduceOp op) {
  Impl* c = impl_.get();
  return c->submit([c, buf, count, dt, op] { c->do_allreduce(buf, count, dt, op); });
}

Communicator::Op Communicator::broadcast_async(void* buf, size_t count, DType dt, int root) {
  Impl* c = impl_.get();
  return c->submit([c, buf, count, dt, root] { c->do_broadcast(buf, count, dt, root); });
}

Communicator::Op Communicator::allgather_async(void* out, const void* in, size_t count, DType dt) {
  Impl* c = impl_.get();
  return c->submit([c, out, in, count, dt] { c->do_allgather(out, in, count, dt); });
}

Communicator::Op Communicator::reduce_scatter_async(void* out, const void* in, size_t count, DType dt,
                                                    ReduceOp op) {
  Impl* c = impl_.get();
  return c->submit([c, out, in, count, dt, op] { c->do_reduce_scatter(out, in, count, dt, op); });
}

Communicator::Op Communicator::barrier_async() {
  Impl* c = impl_.get();
  return c->submit([c] { c->do_barrier(); });
}

Communicator::Op Communicator::send_async(const void* buf, size_t bytes, int dst, uint32_t tag) {
  Impl* c = impl_.get();
  return c->submit([c, buf, bytes, dst, tag] { c->do_send(buf, bytes, dst, tag); });
}

Communicator::Op Communicator::recv_async(void* buf, size_t bytes, int src, uint32_t tag) {
  Impl* c = impl_.get();
  return c->submit([c, buf, bytes, src, tag] { c->do_recv(buf, bytes, src, tag); });
}

Communicator::Op Communicator::p2p_batch_async(std::vector<P2PItem> items, uint32_t tag) {
  Impl* c = impl_.get();
  return c->submit([c, items = std::move(items), tag] { c->do_p2p_batch(items, tag); });
}

void Communicator::prepare(const std::vector<int>& replaced, const std::map<int, std::string>& new_addresses,
                           uint64_t new_epoch) {
  impl_->prepare(replaced, new_addresses, new_epoch);
}
bool Communicator::prepare_done() const { return impl_->prepare_done(); }
bool Communicator::prepare_pending() const { return impl_->prepare_pending(); }
bool Communicator::cancel_prepare() { return impl_->cancel_prepare(); }

Communicator::Op Communicator::commit_async() {
  Impl* c = impl_.get();
  return c->submit([c] { c->do_commit(); });
}

std::vector<LinkInfo> Communicator::links() const { return impl_->links(); }
Counters Communicator::counters() const { return impl_->counters(); }
std::string Communicator::failure() const { return impl_->failure(); }
bool Communicator::wait_failure(double timeout_s, int64_t ignore_epoch, FailureInfo* out) const {
  return impl_->wait_failure(timeout_s, ignore_epoch, out);
}
void Communicator::close() { impl_->close(); }
void Communicator::debug_vanish() {
  impl_->goodbye_ = false;
  impl_->close();
}
void Communicator::debug_send_raw(int peer, const std::string& bytes) { impl_->debug_send_raw(peer, bytes); }

// ---------------------------------------------------------------- construction
Communicator::Impl::Impl(int rank, int world_size, std::string job_id, uint64_t epoch, Options opts)
    : rank_(rank),
      world_(world_size),
      job_id_(std::move(job_id)),
      job_hash_(job_hash(job_id_)),
      epoch_(epoch),
      opts_(std::move(opts)) {
  if (world_ < 1) throw std::invalid_argument("world_size must be >= 1");
  if (rank_ < 0 || rank_ >= world_) throw std::invalid_argument("rank out of range");
  if (opts_.timeout <= 0) throw std::invalid_argument("timeout must be > 0");
  if (opts_.segment_bytes < 64) opts_.segment_bytes = 64;
  hb_interval_ = opts_.heartbeat_interval > 0 ? opts_.heartbeat_interval : opts_.timeout / 4;
  listen_fd_ = listen_tcp(opts_.bind_address, opts_.port, &port_);
  int wake[2];
  if (::pipe2(wake, O_CLOEXEC | O_NONBLOCK) != 0) throw std::system_error(errno, std::generic_category(), "pipe2");
  wake_r_ = Fd(wake[0]);
  wake_w_ = Fd(wake[1]);
  trash_.resize(kScratchBytes);
  service_ = std::thread([this] { service_loop(); });
  worker_ = std::thread([this] { worker_loop(); });
}

Communicator::Impl::~Impl() { close(); }

void Communicator::Impl::close() {
  if (stop_.exchange(true)) {
    if (worker_.joinable() && worker_.get_id() != std::this_thread::get_id()) worker_.join();
    if (service_.joinable()) service_.join();
    if (prepare_thread_.joinable()) prepare_thread_.join();
    return;
  }
  {
    // stop_ is set outside q_mu_: taking it once orders the store before the notify, so a worker
    // that checked its predicate (stop_ still false) is inside q_cv_.wait by now and is woken.
    // Without it the notify could fall between that check and the wait: the worker slept for
    // good and this close() joined it for ever (seen once in CI, at exit).
    std::lock_guard<std::mutex> g(q_mu_);
  }
  q_cv_.notify_all();
  accept_cv_.notify_all();
  if (wake_w_.valid()) {
    char byte = 1;
    ssize_t n = ::write(wake_w_.get(), &byte, 1);  // the service loop's poll returns now
    (void)n;  // a full pipe (never: one byte per close) wakes it all the same
  }
  {
    std::lock_guard<std::mutex> f(fail_mu_);  // wake wait_failure() callers
    fail_cv_.notify_all();
  }
  if (worker_.joinable()) worker_.join();
  if (service_.joinable()) service_.join();
  if (prepare_thread_.joinable()) prepare_thread_.join();
  std::lock_guard<std::mutex> g(op_mu_);
  if (goodbye_) say_goodbye();
  std::lock_guard<std::mutex> t(table_mu_);
  for (auto& kv : links_) {
    if (kv.second->fd.valid()) links_closed_++;
    kv.second->fd.reset();
  }
  listen_fd_.reset();
}

std::string Communicator::Impl::address() const {
  std::string host = opts_.advertise_host;
  if (host.empty()) {
    host = opts_.bind_address;
    if (host.empty() || host == "0.0.0.0" || host == "::") host = "127.0.0.1";
  }
  if (host.find(':') != std::string::npos) host = "[" + host + "]";
  return host + ":" + std::to_string(port_);
}

std::vector<int> Communicator::Impl::ring_peers() const {
  std::vector<int> out;
  if (world_ == 1) return out;
  int nx = (rank_ + 1) % world_, pv = (rank_ + world_ - 1) % world_;
  out.push_back(pv);
  if (nx != pv) out.push_back(nx);
  std::sort(out.begin(), out.end());
  return out;
}

// ---------------------------------------------------------------- the operation queue
std::shared_ptr<OpState> Communicator::Impl::submit(std::function<void()> fn) {
  auto st = std::make_shared<OpState>();
  {
    std::lock_guard<std::mutex> g(q_mu_);
    if (!stop_) {
      queue_.emplace_back(std::move(fn), st);
      q_cv_.notify_one();
      return st;
    }
  }
  st->finish(std::make_exception_ptr(CommError("communicator is closed")));
  return st;
}

void Communicator::Impl::worker_loop() {
  for (;;) {
    std::pair<std::function<void()>, std::shared_ptr<OpState>> job;
    {
      std::unique_lock<std::mutex> g(q_mu_);
      q_cv_.wait(g, [&] { return stop_ || !queue_.empty(); });
      if (queue_.empty()) return;
      job = std::move(queue_.front());
      queue_.pop_front();
    }
    if (stop_) {
      job.second->finish(std::make_exception_ptr(CommError("communicator is closed")));
      continue;
    }
    try {
      std::lock_guard<std::mutex> g(op_mu_);
      job.first();
      job.second->finish(nullptr);
    } catch (...) {
      job.second->finish(std::current_exception());
    }
  }
}

}  // namespace tcp
}  // namespace tmrun
