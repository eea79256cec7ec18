// Failure detection and propagation: the idle tick (heartbeats and control frames while no
// operation runs), the sticky failure of an epoch, and the abort notices that tell every other
// link about a loss.
#include <poll.h>

#include "comm_impl.h"
#include "tmrun/str_cat.h"

namespace tmrun {
namespace tcp {

// Heartbeats every link not in `exclude` and reads its control frames (data waits for its
// operation); a loss found here poisons the epoch and is announced. Callers hold op_mu_.
void Communicator::Impl::idle_tick(const std::set<Link*>& exclude) {
  drain_retired();
  std::vector<Link*> ls;
  {
    std::lock_guard<std::mutex> t(table_mu_);
    for (auto& kv : links_)
      if (!kv.second->broken && !exclude.count(kv.second.get())) ls.push_back(kv.second.get());
  }
  auto now = Clock::now();
  for (Link* l : ls) {
    if (l->broken) continue;
    try {
      if (!l->peer_left) tx_pump(*l, nullptr, nullptr, now);
      RxCtx c{RxMode::kIdle};
      rx_pump(*l, c);
    } catch (const LinkFailure& f) {
      if (f.left) {
        // A goodbye, then the end: the peer left cleanly. Not a failure of the epoch and not
        // announced: a peer still finishing the operation this rank left after has what it needs
        // from it. An operation that does need it fails on its link (begin_op); wait_failure()
        // names it meanwhile (the loss watcher, the device plane).
        int peer = f.link->peer;
        close_link(*f.link, f.reason);
        note_left(peer, str_cat("rank ", peer, " lost: ", f.reason, " (detected by rank ", rank_, " while idle, epoch ",
                                epoch_.load(), ")"));
        continue;
      }
      bool proto = f.protocol;
      std::string reason = f.reason;
      int peer = f.link->peer;
      close_link(*f.link, reason);
      record_failure(peer, rank_, proto,
                     (proto ? "protocol error on the link to rank " : "rank ") + std::to_string(peer) +
                         (proto ? ": " : " lost: ") + reason + " (detected by rank " + std::to_string(rank_) +
                         " while idle, epoch " + std::to_string(epoch_.load()) + ")");
      notify_abort(peer);
    } catch (const AbortReceived& a) {
      record_failure(a.lost, a.from->peer, false, notice_msg(a.lost, a.from->peer));
      notify_abort(a.lost);
    } catch (const std::exception&) {
    }
  }
}

// ---------------------------------------------------------------- the sticky failure
[[noreturn]] void Communicator::Impl::raise_failure() {
  if (failed_protocol_) throw ProtocolError(failed_peer_, failed_msg_);
  throw PeerLostError(failed_peer_, epoch_, failed_reporter_, failed_msg_);
}

void Communicator::Impl::check_healthy() {
  if (stop_) throw CommError("communicator is closed");
  if (failed_) raise_failure();
}

void Communicator::Impl::record_failure(int peer, int reporter, bool protocol, std::string msg) {
  std::lock_guard<std::mutex> g(fail_mu_);  // callers hold op_mu_ too (see failed_ in comm_impl.h)
  if (failed_) return;  // sticky: the first failure of the epoch is the one reported
  failed_ = true;
  failed_epoch_ = epoch_.load();
  failed_peer_ = peer;
  failed_reporter_ = reporter;
  failed_protocol_ = protocol;
  failed_msg_ = std::move(msg);
  fail_cv_.notify_all();
}

// Called from any thread, without op_mu_ (an operation holds it while it runs): fail_mu_ makes the
// flag and the message one consistent snapshot.
std::string Communicator::Impl::failure() const {
  std::lock_guard<std::mutex> g(fail_mu_);
  return failed_ ? failed_msg_ : std::string();
}

bool Communicator::Impl::wait_failure(double timeout_s, int64_t ignore_epoch, FailureInfo* out) const {
  std::unique_lock<std::mutex> g(fail_mu_);
  auto failed = [&] { return failed_ && int64_t(failed_epoch_) != ignore_epoch; };
  auto left = [&] { return left_ && int64_t(left_epoch_) != ignore_epoch; };
  auto wanted = [&] { return stop_.load() || failed() || left(); };
  if (!fail_cv_.wait_for(g, secs(std::max(0.0, timeout_s)), wanted) || stop_) return false;
  if (failed()) {
    out->epoch = failed_epoch_;
    out->peer = failed_peer_;
    out->protocol = failed_protocol_;
    out->message = failed_msg_;
  } else {
    out->epoch = left_epoch_;
    out->peer = left_peer_;
    out->protocol = false;
    out->message = left_msg_;
  }
  return true;
}

void Communicator::Impl::note_left(int peer, std::string msg) {
  std::lock_guard<std::mutex> g(fail_mu_);
  if (left_) return;  // the first of the epoch
  left_ = true;
  left_epoch_ = epoch_.load();
  left_peer_ = peer;
  left_msg_ = std::move(msg);
  fail_cv_.notify_all();
}

// The failure recorded for an abort notice about `lost` (-1: an operation timed out somewhere)
// received from rank `from`.
std::string Communicator::Impl::notice_msg(int lost, int from) const {
  if (lost < 0)
    return str_cat("an operation timed out on another rank (reported by rank ", from, " to rank ", rank_,
                   ", epoch ", epoch_.load(), ")");
  return str_cat("rank ", lost, " lost (reported by rank ", from, " to rank ", rank_, ", epoch ", epoch_.load(),
                 ")");
}

// An operation failed: on `failed_link` (closed here), or by an abort notice from `abort_from`.
void Communicator::Impl::fail_op(Link* failed_link, const std::string& reason, bool protocol, int lost,
                                 Link* abort_from) {
  std::string msg;
  if (failed_link) {
    msg = str_cat(protocol ? "protocol error on the link to rank " : "rank ", lost, protocol ? ": " : " lost: ",
                  reason, " (detected by rank ", rank_, ", epoch ", epoch_.load(), ")");
    close_link(*failed_link, reason);
  } else {
    msg = notice_msg(lost, abort_from ? abort_from->peer : -1);
  }
  record_failure(lost, failed_link ? rank_ : (abort_from ? abort_from->peer : rank_), protocol, std::move(msg));
  notify_abort(lost);
}

// ---------------------------------------------------------------- abort notices
// Sends the abort notice about `lost` (-1: unknown, an operation timed out) once per epoch to every
// open link except the lost rank's, including the link the notice came from: the echo tells a
// sender that this rank gave up too, so a sender still waiting on us (whatever the reason it did
// not stop by itself) does not wait until op_timeout, or forever with op_timeout=0, while our
// heartbeats keep the link alive. The echo cannot loop: every rank sends a notice only after
// recording the failure of that epoch and forwards each loss once (aborted_peers_); a notice of an
// older epoch is ignored (rx_pump), as is one arriving during an epoch switch.
// Bounded by `timeout`: links that could not take the notice by then are closed.
void Communicator::Impl::notify_abort(int lost) {
  if (aborted_peers_.count(lost)) return;
  aborted_peers_.insert(lost);
  std::vector<Link*> targets;
  {
    std::lock_guard<std::mutex> t(table_mu_);
    for (auto& kv : links_) {
      Link* l = kv.second.get();
      if (!l->broken && l->peer != lost) targets.push_back(l);
    }
  }
  std::vector<bool> queued(targets.size(), false);
  auto deadline = Clock::now() + secs(opts_.timeout);
  for (;;) {
    bool all = true;
    auto now = Clock::now();
    std::vector<pollfd> pf;
    for (size_t i = 0; i < targets.size(); ++i) {
      Link& l = *targets[i];
      if (l.broken) continue;
      bool q = queued[i];
      bool pending = push_abort(l, lost, &q, now);
      queued[i] = q;
      if (pending) {
        all = false;
        pf.push_back(pollfd{l.fd.get(), short(POLLIN | POLLOUT), 0});
      }
    }
    if (all) return;
    if (Clock::now() >= deadline || stop_) break;
    ::poll(pf.data(), pf.size(), 10);
  }
  for (size_t i = 0; i < targets.size(); ++i)
    if (!targets[i]->broken && (targets[i]->tx_busy || !queued[i]))
      close_link(*targets[i], "could not deliver abort notice");
}

// Advances the notice on one link: the frame in flight first, then the notice (never a
// heartbeat); drains what the peer sends meanwhile. Returns true while the notice is not written
// (false once it is, or when the link failed: then it is closed or left alone).
bool Communicator::Impl::push_abort(Link& l, int lost, bool* queued, Clock::time_point now) {
  try {
    if (!l.tx_busy && !*queued) {
      start_frame(l, FrameType::kAbort, abort_tag(lost), nullptr, 0);
      *queued = true;
    }
    while (l.tx_busy) {
      if (!tx_pump(l, nullptr, nullptr, now, false)) break;
    }
    if (!l.tx_busy && !*queued) {
      start_frame(l, FrameType::kAbort, abort_tag(lost), nullptr, 0);
      *queued = true;
      while (l.tx_busy && tx_pump(l, nullptr, nullptr, now, false)) {
      }
    }
    RxCtx c{RxMode::kDiscard};
    rx_pump(l, c);
  } catch (const LinkFailure& f) {
    close_link(*f.link, f.reason);
    return false;
  } catch (const std::exception&) {
    return false;
  }
  return l.tx_busy || !*queued;
}

}  // namespace tcp
}  // namespace tmrun
