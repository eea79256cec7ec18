// The plan runner: drives one operation's plan over its links with non-blocking I/O and poll,
// judges the liveness of the peers it waits on, keeps the other links heartbeating, and turns
// every failure into the epoch's sticky failure (announced to the other ranks) before raising it.
#include <poll.h>

#include <algorithm>

#include "comm_impl.h"

namespace tmrun {
namespace tcp {

namespace {

// Splits the plan per link, keeping each link's sends and receives in plan order.
std::vector<LinkQ> queue_plan(const Plan& p) {
  std::vector<LinkQ> qs;
  auto qidx = [&](Link* l) {
    for (size_t i = 0; i < qs.size(); ++i)
      if (qs[i].link == l) return i;
    qs.push_back(LinkQ{l, {}, {}, 0, 0});
    return qs.size() - 1;
  };
  for (size_t i = 0; i < p.sends.size(); ++i) qs[qidx(p.sends[i].link)].sq.push_back(int(i));
  for (size_t i = 0; i < p.recvs.size(); ++i) qs[qidx(p.recvs[i].link)].rq.push_back(int(i));
  return qs;
}

// Whether the link's next send / receive (which must exist) has its dependency done.
bool send_ready(const Plan& p, const LinkQ& q) {
  int d = p.sends[size_t(q.sq[q.si])].dep;
  return d < 0 || p.recvs[size_t(d)].done;
}
bool recv_ready(const Plan& p, const LinkQ& q) {
  int d = p.recvs[size_t(q.rq[q.ri])].dep;
  return d < 0 || p.recvs[size_t(d)].done;
}

// Waits (up to poll_ms) until a link of the operation can move: writable when it has a frame to
// send, readable when it can take what arrives.
void poll_op_links(const Plan& p, const std::vector<LinkQ>& qs, std::vector<pollfd>& pf, int poll_ms) {
  for (size_t i = 0; i < qs.size(); ++i) {
    const LinkQ& q = qs[i];
    const Link& l = *q.link;
    if (q.over()) {
      pf[i] = pollfd{-1, 0, 0};
      continue;
    }
    short ev = 0;
    bool can_send = l.tx_busy || (q.si < q.sq.size() && send_ready(p, q));
    if (can_send) ev |= POLLOUT;
    bool can_recv = !l.rx_have || (l.rx_h.type == FrameType::kData && q.ri < q.rq.size() && recv_ready(p, q));
    if (can_recv) ev |= POLLIN;
    pf[i] = pollfd{l.fd.get(), ev, 0};
  }
  ::poll(pf.data(), pf.size(), poll_ms);
}

}  // namespace

void Communicator::Impl::run_plan(Plan& p) {
  std::vector<LinkQ> qs = queue_plan(p);
  if (qs.empty()) return;
  const auto start = Clock::now();
  std::set<Link*> op_links = begin_op(qs, start);
  try {
    drive_plan(p, qs, op_links, start);
  } catch (const LinkFailure& f) {
    fail_op(f.link, f.reason, f.protocol, f.link->peer, nullptr);
    raise_failure();
  } catch (const AbortReceived& a) {
    fail_op(nullptr, "", false, a.lost, a.from);
    raise_failure();
  } catch (const EpochSwitched& e) {
    // A live peer committed a new epoch while this rank still waits on it in this one (this rank
    // missed the replacement, or its operations are out of step with the peer's). Not a lost rank:
    // the peer is healthy and the link stays open (its stashed sync is consumed by our own commit).
    // Poison the epoch with the lost rank unknown (nobody is fenced for it) and announce it, as for
    // a timed-out operation: the other ranks of the operation, kept alive by our heartbeats, would
    // otherwise wait on us until op_timeout. The peer ignores the notice (an older epoch's).
    std::string msg = "rank " + std::to_string(e.link->peer) + " switched to epoch " + std::to_string(e.epoch) +
                      " while rank " + std::to_string(rank_) + " is in epoch " + std::to_string(epoch_.load()) +
                      " (call prepare/commit)";
    record_failure(-1, rank_, false, std::move(msg));
    notify_abort(-1);
    raise_failure();
  } catch (const CommTimeoutError&) {
    // Unknown peer: poison the epoch so that no rank continues on a half-finished collective, and
    // announce it (abort notice, lost rank unknown) on every link. Otherwise the other ranks of
    // the operation keep receiving our heartbeats and each waits out its own op_timeout (forever
    // with op_timeout=0) instead of raising now.
    record_failure(-1, rank_, false, "operation timed out on rank " + std::to_string(rank_));
    notify_abort(-1);
    throw;
  }
}

// The operation starts on its links (their liveness clocks too); a link already broken fails it.
std::set<Link*> Communicator::Impl::begin_op(std::vector<LinkQ>& qs, Clock::time_point now) {
  std::set<Link*> op_links;
  for (auto& q : qs) {
    op_links.insert(q.link);
    if (q.link->broken) {
      record_failure(q.link->peer, rank_, false, "rank " + std::to_string(q.link->peer) + " lost: " + q.link->error);
      notify_abort(q.link->peer);  // (a no-op when already announced this epoch)
      raise_failure();
    }
    q.link->last_progress = now;
  }
  return op_links;
}

// Pumps until every link's part is over. Throws LinkFailure, AbortReceived, EpochSwitched (from the
// pumps), CommTimeoutError (op_timeout), or the epoch's failure noticed by the idle tick.
void Communicator::Impl::drive_plan(Plan& p, std::vector<LinkQ>& qs, const std::set<Link*>& op_links,
                                    Clock::time_point start) {
  const auto op_deadline = opts_.op_timeout > 0 ? start + secs(opts_.op_timeout) : Clock::time_point::max();
  auto next_idle = start + secs(hb_interval_);
  const int poll_ms = std::max(1, std::min(100, int(hb_interval_ * 1000 / 2)));
  std::vector<pollfd> pf(qs.size());
  for (;;) {
    bool done = true;
    bool prog = pump_op_links(p, qs, Clock::now(), &done);
    if (done) return;
    if (prog) continue;
    auto now = Clock::now();
    check_op_liveness(p, qs, now);
    if (now > op_deadline) {
      std::string msg = "operation timed out after " + std::to_string(opts_.op_timeout) + " s on rank " +
                        std::to_string(rank_);
      throw CommTimeoutError(msg);
    }
    if (stop_) throw CommError("communicator is closed");
    if (now >= next_idle) {
      idle_tick(op_links);
      next_idle = now + secs(hb_interval_);
      // A loss noticed on a link outside this operation (EOF, reset, or an abort notice) poisons
      // the epoch, and idle_tick has already forwarded the notice to every other link, op links
      // included. Raise now: the echo of the ranks it reached may come on a link whose part of
      // this operation is over (not read until it ends) or wait behind data we cannot take yet,
      // while their heartbeats keep our op links alive.
      if (failed_) raise_failure();
    }
    poll_op_links(p, qs, pf, poll_ms);
  }
}

// One pass over the operation's links: send and receive what can move. Returns whether anything
// moved; *done when every link's part is over.
bool Communicator::Impl::pump_op_links(Plan& p, std::vector<LinkQ>& qs, Clock::time_point now, bool* done) {
  bool prog = false;
  for (auto& q : qs) {
    Link& l = *q.link;
    if (q.over()) {  // this link's part is over: do not read further (the peer may already have
      // moved on, even closed the link), but keep heartbeating it (idle_tick skips op links): the
      // peer may already wait on us in its next operation and would declare us lost after
      // `timeout`. A failed write is not this operation's failure (a departing peer closes after
      // its part): judged when next used.
      // Its control frames are still read (kIdle: heartbeats and abort notices; data of the
      // peer's next operation waits, as between operations): an abort notice forwarded on this
      // link (the peer learnt of a loss from a third rank, or echoes ours) must end this operation,
      // or every rank whose only news of the loss comes on such a link waits forever on peers
      // whose heartbeats keep the operation's other links alive (seen under CPU load, when the
      // ranks reach the operation at different moments). End of file here stays a departure.
      if (!q.hb_failed) {
        try {
          tx_pump(l, nullptr, nullptr, now);
          RxCtx c{RxMode::kIdle};
          prog |= rx_pump(l, c);
        } catch (const LinkFailure&) {
          q.hb_failed = true;
        }
      }
      continue;
    }
    prog |= tx_pump(l, &q, &p, now);
    RxCtx c{RxMode::kOp, &q, &p};
    prog |= rx_pump(l, c);
    if (!q.over()) *done = false;
  }
  return prog;
}

// Throws LinkFailure for a peer we wait on that sent nothing for `timeout`.
void Communicator::Impl::check_op_liveness(Plan& p, std::vector<LinkQ>& qs, Clock::time_point now) {
  const auto timeout = secs(opts_.timeout);
  for (auto& q : qs) {
    Link& l = *q.link;
    // Judge a peer only while we are ready to read from it: when its data waits behind a
    // dependency of ours, its heartbeats queue behind that data.
    bool rx_ready = !l.rx_have || (l.rx_h.type == FrameType::kData && q.ri < q.rq.size() && recv_ready(p, q));
    if (!rx_ready) l.last_progress = now;
    if (!q.over() && now - l.last_progress > timeout)
      throw LinkFailure{&l, "no data for " + std::to_string(to_secs(now - l.last_progress)).substr(0, 4) +
                                " s (peer stopped answering)", false};
  }
}

}  // namespace tcp
}  // namespace tmrun
