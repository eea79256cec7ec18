// Two-phase replacement of members: prepare() builds the links to the joiners in the background,
// commit (queued like an operation) retires the replaced ranks' links, installs the new ones,
// switches the epoch and resynchronises every link (sync_links, also the end of connect()).
#include <poll.h>

#include <algorithm>
#include <stdexcept>

#include "comm_impl.h"

namespace tmrun {
namespace tcp {

// ---------------------------------------------------------------- phase 1
void Communicator::Impl::prepare(const std::vector<int>& replaced, const std::map<int, std::string>& new_addresses,
                                 uint64_t new_epoch) {
  if (stop_) throw CommError("communicator is closed");
  if (new_epoch <= epoch_) throw std::invalid_argument("new_epoch must be greater than the current epoch");
  std::set<int> rs;
  for (int r : replaced) {
    if (r < 0 || r >= world_) throw std::invalid_argument("replaced rank out of range");
    if (r == rank_)
      throw std::invalid_argument("rank " + std::to_string(r) +
                                  " is replaced: the joiner creates a new Communicator and calls connect()");
    rs.insert(r);
  }
  std::vector<int> needed;
  for (int p : ring_peers())
    if (rs.count(p)) {
      if (!new_addresses.count(p)) throw std::invalid_argument("no new address for replaced rank " + std::to_string(p));
      split_address(new_addresses.at(p));
      needed.push_back(p);
    }
  if (prepare_thread_.joinable()) {
    // A newer prepare supersedes the pending one (a joiner was lost before the switch, and the
    // controller replaced it): the pending dials and waits end now instead of at connect_timeout.
    cancel_prepare();
    prepare_thread_.join();
    prepare_cancel_ = false;
  }
  {
    std::lock_guard<std::mutex> g(accept_mu_);
    pending_ = true;
    pending_epoch_ = new_epoch;
    pending_replaced_ = rs;
    pending_addresses_ = new_addresses;
    pending_links_.clear();
    pending_error_.clear();
    pending_ready_ = false;
    for (auto it = accepted_.begin(); it != accepted_.end();)  // drop stale offers
      it = it->first.second < epoch_ ? accepted_.erase(it) : std::next(it);
  }
  prepare_thread_ = std::thread(&Communicator::Impl::prepare_links, this, std::move(needed), new_epoch, new_addresses);
}

// prepare's background thread: dials (lower rank) or awaits (higher rank) every joiner among
// our ring neighbours, up to connect_timeout, and hands the links (or the error) to commit.
void Communicator::Impl::prepare_links(std::vector<int> needed, uint64_t new_epoch,
                                       std::map<int, std::string> new_addresses) {
  std::map<int, std::unique_ptr<Link>> got;
  std::string err;
  auto deadline = Clock::now() + secs(opts_.connect_timeout);
  try {
    for (int p : needed)
      if (rank_ < p) got[p] = dial_peer(new_addresses.at(p), p, new_epoch, true, deadline, false, &prepare_cancel_);
    for (int p : needed)
      if (rank_ > p) got[p] = await_accepted(p, new_epoch, deadline, false, &prepare_cancel_);
  } catch (const std::exception& e) {
    err = e.what();
  }
  {
    std::lock_guard<std::mutex> g(accept_mu_);
    if (pending_ && pending_epoch_ == new_epoch) {
      pending_links_ = std::move(got);
      pending_error_ = err;
      pending_ready_ = true;
    }
  }
  accept_cv_.notify_all();
}

bool Communicator::Impl::prepare_done() const {
  std::lock_guard<std::mutex> g(accept_mu_);
  return pending_ && pending_ready_;
}

bool Communicator::Impl::prepare_pending() const {
  std::lock_guard<std::mutex> g(accept_mu_);
  return pending_;
}

bool Communicator::Impl::cancel_prepare() {
  {
    std::lock_guard<std::mutex> g(accept_mu_);
    if (!pending_ || pending_ready_) return false;
    prepare_cancel_ = true;
  }
  accept_cv_.notify_all();
  prepares_superseded_++;
  return true;
}

// ---------------------------------------------------------------- phase 2
void Communicator::Impl::do_commit() {
  std::map<int, std::unique_ptr<Link>> fresh;
  std::set<int> replaced;
  std::map<int, std::string> addrs;
  uint64_t new_epoch;
  {
    std::unique_lock<std::mutex> g(accept_mu_);
    if (!pending_) throw CommError("commit() without prepare()");
    await_prepared(g);
    pending_ = false;
    if (!pending_error_.empty()) throw CommError("prepare failed: " + pending_error_);
    fresh = std::move(pending_links_);
    replaced = pending_replaced_;
    addrs = pending_addresses_;
    new_epoch = pending_epoch_;
  }
  if (prepare_thread_.joinable()) prepare_thread_.join();
  prepare_cancel_ = false;
  retire_replaced(replaced);
  for (auto& kv : fresh) install_link(std::move(kv.second));
  for (auto& kv : addrs)
    if (kv.first >= 0 && size_t(kv.first) < addresses_.size()) addresses_[size_t(kv.first)] = kv.second;
  epoch_ = new_epoch;
  coll_seq_ = 0;
  {
    std::lock_guard<std::mutex> g(fail_mu_);
    failed_ = false;
    failed_peer_ = failed_reporter_ = -1;
    failed_protocol_ = false;
    failed_msg_.clear();
    left_ = false;
    left_peer_ = -1;
    left_msg_.clear();
  }
  aborted_peers_.clear();
  commits_++;
  sync_links(new_epoch);
}

// Waits (holding accept_mu_ through g, op_mu_ by the caller) until prepare's links are ready,
// heartbeating the other links meanwhile; bounded by connect_timeout + 1 s.
void Communicator::Impl::await_prepared(std::unique_lock<std::mutex>& g) {
  auto deadline = Clock::now() + secs(opts_.connect_timeout + 1.0);
  while (!pending_ready_) {
    if (stop_) throw CommError("communicator is closed");
    if (Clock::now() > deadline) throw CommTimeoutError("prepare did not finish in time");
    accept_cv_.wait_for(g, secs(std::min(0.05, hb_interval_ / 2)));
    g.unlock();
    idle_tick({});  // keep heartbeats flowing while we hold the operation lock
    g.lock();
  }
}

// The links to replaced ranks leave the table (their bytes are kept per peer) and are retired.
void Communicator::Impl::retire_replaced(const std::set<int>& replaced) {
  std::lock_guard<std::mutex> t(table_mu_);
  for (int r : replaced) {
    auto it = links_.find(r);
    if (it == links_.end()) continue;
    if (it->second->fd.valid()) links_closed_++;
    auto& cb = closed_bytes_[r];
    cb.first += it->second->bytes_sent;
    cb.second += it->second->bytes_recv;
    retire(std::move(it->second));
    links_.erase(it);
  }
}

// ---------------------------------------------------------------- epoch switch
// Every open link exchanges a sync frame of new_epoch; what the peer sent before its sync (data
// of the old epoch) is dropped. Kept links (whose peers heartbeat while idle) are judged by
// `timeout`; the whole switch by max(op_timeout or 1 h, connect_timeout).
void Communicator::Impl::sync_links(uint64_t new_epoch) {
  std::vector<Link*> ls;
  {
    std::lock_guard<std::mutex> t(table_mu_);
    for (auto& kv : links_)
      if (!kv.second->broken) ls.push_back(kv.second.get());
  }
  std::vector<bool> got(ls.size(), false);
  auto now = Clock::now();
  for (Link* l : ls) {
    l->sync_sent = false;
    l->last_progress = now;
  }
  const auto deadline = now + secs(std::max(opts_.op_timeout > 0 ? opts_.op_timeout : 3600.0, opts_.connect_timeout));
  const auto timeout = secs(opts_.timeout);
  try {
    for (;;) {
      now = Clock::now();
      bool prog = false, done = true;
      std::vector<pollfd> pf;
      for (size_t i = 0; i < ls.size(); ++i) {
        Link& l = *ls[i];
        if (sync_step(l, got[i], new_epoch, now, &prog)) got[i] = true;
        bool mine = !l.sync_sent || l.tx_busy;
        if (mine || !got[i]) {
          done = false;
          pf.push_back(pollfd{l.fd.get(), short((got[i] ? 0 : POLLIN) | (l.tx_busy ? POLLOUT : 0)), 0});
        }
        // Links opened in this epoch belong to joiners that may wait long for survivors to commit:
        // only kept links (whose peers heartbeat while idle) are subject to the liveness timeout.
        if (!got[i] && l.opened_epoch < new_epoch && now - l.last_progress > timeout)
          throw LinkFailure{&l, "no data for " + std::to_string(to_secs(now - l.last_progress)).substr(0, 4) +
                                    " s during epoch switch", false};
      }
      if (done) return;
      if (prog) continue;
      if (now > deadline) throw CommTimeoutError("epoch switch timed out on rank " + std::to_string(rank_));
      if (stop_) throw CommError("communicator is closed");
      ::poll(pf.data(), pf.size(), std::max(1, std::min(50, int(hb_interval_ * 500))));
    }
  } catch (const LinkFailure& f) {
    fail_op(f.link, f.reason, f.protocol, f.link->peer, nullptr);
    raise_failure();
  } catch (const AbortReceived& a) {  // not produced in sync mode; kept for completeness
    fail_op(nullptr, "", false, a.lost, a.from);
    raise_failure();
  }
}

// One link's step of the switch: our sync out (after a frame left in flight), the peer's in.
// Returns whether the peer's sync arrived in this step; *prog when bytes moved.
bool Communicator::Impl::sync_step(Link& l, bool got, uint64_t new_epoch, Clock::time_point now, bool* prog) {
  while (l.tx_busy && !l.sync_sent) {  // finish a frame left in flight (never expected)
    if (!tx_pump(l, nullptr, nullptr, now, false)) break;
  }
  if (!l.tx_busy && !l.sync_sent) {
    start_frame(l, FrameType::kSync, 0, nullptr, 0);
    l.sync_sent = true;
  }
  if (l.sync_sent) *prog |= tx_pump(l, nullptr, nullptr, now);
  if (got) return false;
  RxCtx c{RxMode::kSync};
  c.sync_epoch = new_epoch;
  *prog |= rx_pump(l, c);
  return c.got_sync;
}

}  // namespace tcp
}  // namespace tmrun
