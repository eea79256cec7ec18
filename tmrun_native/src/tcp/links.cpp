// The link table: opening links (connect, dialling with the hello handshake, lazy point-to-point
// links), installing, closing and retiring them, and the introspection that reads the table.
#include <poll.h>
#include <sys/socket.h>

#include <algorithm>
#include <cstring>
#include <stdexcept>

#include "comm_impl.h"
#include "tmrun/checksum.h"

namespace tmrun {
namespace tcp {

namespace {
std::atomic<uint64_t> g_link_ids{1};
}  // namespace

Link::Link(int peer_, uint64_t epoch_, Fd fd_, bool ring_)
    : peer(peer_), id(g_link_ids.fetch_add(1)), opened_epoch(epoch_), ring(ring_), fd(std::move(fd_)) {
  auto now = Clock::now();
  last_rx = last_tx = last_progress = now;
}

// ---------------------------------------------------------------- opening links
void Communicator::Impl::connect(const std::vector<std::string>& addresses) {
  if (int(addresses.size()) != world_)
    throw std::invalid_argument("connect needs one address per rank (" + std::to_string(world_) + ")");
  if (stop_) throw CommError("communicator is closed");
  auto deadline = Clock::now() + secs(opts_.connect_timeout);
  std::vector<std::unique_ptr<Link>> made;
  uint64_t e = epoch_;
  for (int p : ring_peers())
    if (rank_ < p) made.push_back(dial_peer(addresses[size_t(p)], p, e, true, deadline));
  for (int p : ring_peers())
    if (rank_ > p) made.push_back(await_accepted(p, e, deadline, false));
  std::lock_guard<std::mutex> g(op_mu_);
  addresses_ = addresses;
  for (auto& l : made) install_link(std::move(l));
  sync_links(e);
}

// One connection attempt: connect, send our hello, read the ack (or the reason of a reject).
// Throws std::runtime_error (another attempt may follow) or, from the tick, CommError.
std::unique_ptr<Link> Communicator::Impl::dial_once(const std::string& host, int port, int peer, uint64_t epoch,
                                                    bool ring, Clock::time_point deadline, const WaitTick& tick) {
  Fd fd = dial_tcp(host, port, deadline, tick);
  tune_socket(fd.get(), opts_.socket_buffer);
  std::string address = host + ":" + std::to_string(port);
  uint8_t nonce_a[auth::kNonceSize], nonce_d[auth::kNonceSize];
  uint8_t reply[auth::kReplySize];
  if (!opts_.token.empty()) {
    // the acceptor's challenge first; our proof goes out with the hello below
    uint8_t ch[auth::kChallengeSize];
    try {
      read_exact(fd.get(), ch, sizeof(ch), deadline, tick);
    } catch (const CommError&) {
      throw;
    } catch (const std::exception& e) {
      throw std::runtime_error(std::string("no authentication challenge (does the peer run without the job token?): ") +
                               e.what());
    }
    if (!auth::equal_ct(ch, auth::kChallengeMagic, sizeof(auth::kChallengeMagic))) {
      auth_failures_++;
      throw AuthError("rank " + std::to_string(rank_) + " cannot authenticate rank " + std::to_string(peer) + " at " +
                      address + ": it sent no authentication challenge (not a tmrun communicator with a job token)");
    }
    std::memcpy(nonce_a, ch + sizeof(auth::kChallengeMagic), auth::kNonceSize);
    auth::random_bytes(nonce_d, auth::kNonceSize);
    auto mine = auth::proof(opts_.token, "dial", nonce_a, nonce_d);
    std::memcpy(reply, nonce_d, auth::kNonceSize);
    std::memcpy(reply + auth::kNonceSize, mine.data(), mine.size());
  }
  FrameHeader h;
  h.type = FrameType::kHello;
  h.job_hash = job_hash_;
  h.epoch = epoch;
  h.length = kHelloSize;
  uint8_t out[kHeaderSize + kHelloSize];
  encode_hello(HelloBody{uint32_t(rank_), uint32_t(peer), uint32_t(world_)}, out + kHeaderSize);
  h.flags = kFlagPayloadCrc;
  h.payload_crc = crc32c(0, out + kHeaderSize, kHelloSize);
  encode_header(h, out);
  if (!opts_.token.empty()) {
    write_all(fd.get(), reply, sizeof(reply), deadline, tick);
    write_all(fd.get(), out, sizeof(out), deadline, tick);
    uint8_t verdict[auth::kVerdictSize];
    read_exact(fd.get(), verdict, 1, deadline, tick);
    if (verdict[0] != auth::kVerdictOk) {
      auth_failures_++;
      throw AuthError("rank " + std::to_string(rank_) + " failed authentication with rank " + std::to_string(peer) +
                      " at " + address + ": it refused our proof of the job token (a different job token?)");
    }
    read_exact(fd.get(), verdict + 1, auth::kVerdictSize - 1, deadline, tick);
    auto expect = auth::proof(opts_.token, "acpt", nonce_a, nonce_d);
    if (!auth::equal_ct(expect.data(), verdict + 1, expect.size())) {
      auth_failures_++;
      throw AuthError("rank " + std::to_string(rank_) + " failed authentication with rank " + std::to_string(peer) +
                      " at " + address + ": its proof of the job token is wrong (a different job token?)");
    }
  } else {
    write_all(fd.get(), out, sizeof(out), deadline, tick);
  }
  uint8_t in[kHeaderSize];
  read_exact(fd.get(), in, sizeof(auth::kChallengeMagic), deadline, tick);
  if (std::memcmp(in, auth::kChallengeMagic, sizeof(auth::kChallengeMagic)) == 0)
    throw AuthError("rank " + std::to_string(rank_) + " cannot connect to rank " + std::to_string(peer) + " at " +
                    address + ": it requires authentication and this communicator has no job token");
  read_exact(fd.get(), in + sizeof(auth::kChallengeMagic), kHeaderSize - sizeof(auth::kChallengeMagic), deadline,
             tick);
  FrameHeader r;
  std::string err;
  if (!parse_header(in, kHeaderSize, job_hash_, &r, &err)) throw std::runtime_error("bad handshake reply: " + err);
  if (r.type == FrameType::kReject) {
    std::string why(r.length, '\0');
    read_exact(fd.get(), why.data(), why.size(), deadline, tick);
    throw std::runtime_error("rejected: " + why);
  }
  if (r.type != FrameType::kHelloAck) throw std::runtime_error("unexpected handshake reply");
  uint8_t body[kHelloSize];
  read_exact(fd.get(), body, kHelloSize, deadline, tick);
  if ((r.flags & kFlagPayloadCrc) && crc32c(0, body, kHelloSize) != r.payload_crc)
    throw std::runtime_error("handshake reply checksum mismatch");
  HelloBody b = decode_hello(body);
  if (int(b.from_rank) != peer || int(b.to_rank) != rank_ || r.epoch != epoch)
    throw std::runtime_error("handshake reply from the wrong member");
  return std::make_unique<Link>(peer, epoch, std::move(fd), ring);
}

// tick_idle: the caller holds op_mu_ (a lazy p2p link opened inside an operation), so the service
// thread cannot heartbeat for us. Every wait (connect, handshake reply, the pause between attempts)
// then services the other links at least every min(50 ms, heartbeat/2), as await_accepted does,
// and gives up when that notices a failure of the epoch. Without it a dial retried until
// connect_timeout (30 s) silenced this rank and neighbours waiting on it declared it lost.
std::unique_ptr<Link> Communicator::Impl::dial_peer(const std::string& address, int peer, uint64_t epoch, bool ring,
                                                    Clock::time_point deadline, bool tick_idle,
                                                    const std::atomic<bool>* cancel) {
  auto [host, port] = split_address(address);
  std::string last = "not attempted";
  WaitTick tick;
  if (tick_idle) {
    tick.ms = std::max(1, std::min(50, int(hb_interval_ * 500)));
    tick.fn = [this] {
      idle_tick({});
      if (failed_) raise_failure();  // as in run_plan: the epoch is over, stop dialling
      if (stop_) throw CommError("communicator is closed");
    };
  } else if (cancel != nullptr) {
    tick.ms = 20;
    tick.fn = [this, cancel] {
      if (cancel->load()) throw CommError("superseded by a newer prepare");
      if (stop_) throw CommError("communicator is closed");
    };
  }
  while (!stop_) {
    try {
      auto attempt_deadline = std::min(deadline, Clock::now() + secs(std::max(2.0, opts_.timeout)));
      return dial_once(host, port, peer, epoch, ring, attempt_deadline, tick);
    } catch (const CommError&) {
      throw;  // from the tick: the epoch failed or the communicator closed (never a dial error)
    } catch (const std::exception& e) {
      last = e.what();
    }
    auto retry_at = Clock::now() + std::chrono::milliseconds(50);
    if (retry_at >= deadline) break;
    if (!tick.fn) {
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
      continue;
    }
    while (Clock::now() < retry_at) {
      std::this_thread::sleep_for(std::chrono::milliseconds(std::min(tick.ms, 50)));
      tick.fn();
    }
  }
  throw CommError("rank " + std::to_string(rank_) + " cannot connect to rank " + std::to_string(peer) + " at " +
                  address + " (epoch " + std::to_string(epoch) + "): " + last);
}

void Communicator::Impl::install_link(std::unique_ptr<Link> l) {
  std::lock_guard<std::mutex> t(table_mu_);
  int p = l->peer;
  auto it = links_.find(p);
  if (it != links_.end()) {
    if (it->second->fd.valid()) links_closed_++;
    auto& cb = closed_bytes_[p];
    cb.first += it->second->bytes_sent;
    cb.second += it->second->bytes_recv;
    links_.erase(it);
  }
  links_opened_++;
  links_[p] = std::move(l);
}

Link* Communicator::Impl::ring_link(int peer) {
  std::lock_guard<std::mutex> t(table_mu_);
  auto it = links_.find(peer);
  if (it == links_.end())
    throw CommError("rank " + std::to_string(rank_) + " has no link to rank " + std::to_string(peer) +
                    " (call connect first)");
  return it->second.get();
}

// The link to `peer`, opened now (inside an operation, under op_mu_) when there is none yet.
Link* Communicator::Impl::p2p_link(int peer) {
  {
    std::lock_guard<std::mutex> t(table_mu_);
    auto it = links_.find(peer);
    if (it != links_.end()) return it->second.get();
  }
  if (addresses_.size() != size_t(world_)) throw CommError("communicator is not connected");
  auto deadline = Clock::now() + secs(opts_.connect_timeout);
  std::unique_ptr<Link> l = rank_ < peer ? dial_peer(addresses_[size_t(peer)], peer, epoch_, false, deadline, true)
                                         : await_accepted(peer, epoch_, deadline, true);
  Link* raw = l.get();
  install_link(std::move(l));
  return raw;
}

// ---------------------------------------------------------------- closing links
// Callers hold op_mu_ (every reader of link I/O state does); the fields links() reports (broken,
// error, fd) are also written under table_mu_, which links() holds from any thread without op_mu_.
// Lock order op_mu_ -> table_mu_ (as close() and debug_send_raw): never call with table_mu_ held.
void Communicator::Impl::close_link(Link& l, const std::string& why) {
  {
    std::lock_guard<std::mutex> t(table_mu_);
    if (l.fd.valid()) links_closed_++;
    l.broken = true;
    if (l.error.empty()) l.error = why;
    l.fd.reset();
  }
  l.tx_busy = false;
  l.rx_have = false;
}

// A link to a departing member is shut down gracefully: FIN after our last bytes, then drained
// until the peer closes (or a grace period ends), so that closing never resets a connection whose
// peer is still reading the end of its last operation.
void Communicator::Impl::retire(std::unique_ptr<Link> l) {
  if (!l->fd.valid()) return;
  ::shutdown(l->fd.get(), SHUT_WR);
  l->last_progress = Clock::now();
  retired_.push_back(std::move(l));
}

// Reads and drops what a link we are leaving has for us. Returns true once the peer's end came
// (EOF or an error), false when nothing more is there for now.
bool Communicator::Impl::read_to_end(Link& l) {
  for (;;) {
    ssize_t n = ::recv(l.fd.get(), trash_.data(), trash_.size(), MSG_DONTWAIT);
    if (n > 0) continue;
    if (n < 0 && errno == EINTR) continue;
    return !(n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK));
  }
}

// Closing the communicator: every open link gets a goodbye after the frame in flight, then our
// FIN, and is drained until the peer closes its end or a short grace period ends. A peer reads
// everything we sent and then the goodbye, so our leave right after an operation is not a lost
// rank to it (closing with unread bytes would reset the connection under a peer still reading
// the end of that operation). Bounded: at most kGoodbyeGraceS whatever the peers do.
void Communicator::Impl::say_goodbye() {
  constexpr double kGoodbyeGraceS = 0.5;
  const auto deadline = Clock::now() + secs(std::min(kGoodbyeGraceS, opts_.timeout));
  std::vector<Link*> open;
  {
    std::lock_guard<std::mutex> t(table_mu_);
    for (auto& kv : links_)
      if (!kv.second->broken && kv.second->fd.valid()) open.push_back(kv.second.get());
  }
  auto wait_writable = [&](Link& l) {
    auto left = std::chrono::duration<double>(deadline - Clock::now()).count();
    if (left <= 0) return false;
    pollfd p{l.fd.get(), POLLOUT, 0};
    return ::poll(&p, 1, int(left * 1000) + 1) > 0;
  };
  std::vector<Link*> draining;
  for (Link* l : open) {
    try {
      bool sent = false;
      while (Clock::now() < deadline) {
        tx_pump(*l, nullptr, nullptr, Clock::now(), false);
        if (!l->tx_busy) {
          if (sent) break;
          start_frame(*l, FrameType::kGoodbye, 0, nullptr, 0);
          sent = true;
          continue;
        }
        if (!wait_writable(*l)) break;
      }
      ::shutdown(l->fd.get(), SHUT_WR);
      draining.push_back(l);
    } catch (const LinkFailure&) {  // the peer is gone already: nothing to say goodbye to
    }
  }
  while (!draining.empty()) {
    auto left = std::chrono::duration<double>(deadline - Clock::now()).count();
    if (left <= 0) break;
    std::vector<pollfd> fds;
    for (Link* l : draining) fds.push_back(pollfd{l->fd.get(), POLLIN | POLLRDHUP, 0});
    if (::poll(fds.data(), nfds_t(fds.size()), int(left * 1000) + 1) <= 0) break;
    std::vector<Link*> still;
    for (size_t i = 0; i < draining.size(); ++i)
      if (!fds[i].revents || !read_to_end(*draining[i])) still.push_back(draining[i]);
    draining.swap(still);
  }
}

void Communicator::Impl::drain_retired() {
  auto now = Clock::now();
  for (auto it = retired_.begin(); it != retired_.end();) {
    Link& l = **it;
    bool drop = now - l.last_progress > secs(std::max(5.0, 2 * opts_.timeout)) || read_to_end(l);
    if (drop)
      it = retired_.erase(it);
    else
      ++it;
  }
}

// ---------------------------------------------------------------- introspection
std::vector<LinkInfo> Communicator::Impl::links() const {
  std::lock_guard<std::mutex> t(table_mu_);
  std::vector<LinkInfo> out;
  for (auto& kv : links_) {
    const Link& l = *kv.second;
    out.push_back(LinkInfo{l.peer, l.id, l.opened_epoch, l.ring, !l.broken && l.fd.valid(), l.bytes_sent.load(),
                           l.bytes_recv.load(), l.frames_sent.load(), l.frames_recv.load(), l.error});
  }
  return out;
}

Counters Communicator::Impl::counters() const {
  Counters c;
  c.links_opened = links_opened_;
  c.links_closed = links_closed_;
  c.collectives = collectives_;
  c.p2p_ops = p2p_ops_;
  c.rejected_connections = rejected_;
  c.auth_failures = auth_failures_;
  c.commits = commits_;
  c.prepares_superseded = prepares_superseded_;
  std::lock_guard<std::mutex> t(table_mu_);
  c.per_peer = closed_bytes_;
  for (auto& kv : links_) {
    auto& pp = c.per_peer[kv.first];
    pp.first += kv.second->bytes_sent;
    pp.second += kv.second->bytes_recv;
  }
  for (auto& kv : c.per_peer) {
    c.bytes_sent += kv.second.first;
    c.bytes_recv += kv.second.second;
  }
  c.last_reject_reason = last_reject_;
  return c;
}

void Communicator::Impl::debug_send_raw(int peer, const std::string& bytes) {
  std::lock_guard<std::mutex> g(op_mu_);
  std::lock_guard<std::mutex> t(table_mu_);
  auto it = links_.find(peer);
  if (it == links_.end() || !it->second->fd.valid()) throw CommError("no open link to that peer");
  write_all(it->second->fd.get(), bytes.data(), bytes.size(), Clock::now() + secs(opts_.timeout));
}

}  // namespace tcp
}  // namespace tmrun
