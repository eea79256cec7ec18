// The acceptor: the service thread accepts connections, reads and checks their hello, answers
// (ack or reject) and parks the new links in accepted_ until connect / prepare / a lazy p2p link
// claims them (await_accepted). Between accepts it runs the idle tick (heartbeats) whenever no
// operation holds op_mu_.
#include <sys/socket.h>

#include <algorithm>
#include <cstring>

#include "comm_impl.h"
#include "tmrun/checksum.h"

namespace tmrun {
namespace tcp {

// Besides the listening socket and pending handshakes, the loop watches every open link for its
// peer's end (POLLRDHUP: a peer process that died closes its sockets): a loss while this rank
// computes is recorded and announced at once, not at the next heartbeat tick, so a watcher
// (wait_failure) can stop the doomed step. Data arriving on a link is left to the operation that
// reads it (only hang-ups wake the loop).
void Communicator::Impl::service_loop() {
  std::vector<PendingConn> pend;
  auto next_tick = Clock::now();
  auto links_quiet_until = Clock::now();  // an operation owns the links: let it see the hang-up
  while (!stop_) {
    std::vector<pollfd> pf;
    pf.push_back(pollfd{listen_fd_.get(), POLLIN, 0});
    pf.push_back(pollfd{wake_r_.get(), POLLIN, 0});  // close(): leave at once
    for (auto& p : pend) pf.push_back(pollfd{p.fd.get(), POLLIN, 0});
    size_t first_link = pf.size();
    if (Clock::now() >= links_quiet_until) {
      std::lock_guard<std::mutex> t(table_mu_);
      for (auto& kv : links_)
        if (!kv.second->broken && kv.second->fd.valid()) pf.push_back(pollfd{kv.second->fd.get(), POLLRDHUP, 0});
    }
    int wait_ms = std::min(50, std::max(1, int(hb_interval_ * 1000 / 2)));
    ::poll(pf.data(), pf.size(), wait_ms);
    if (stop_) break;
    auto now = Clock::now();
    if (pf[0].revents & POLLIN) accept_new(pend, now);
    for (size_t i = 0; i < pend.size();) {
      if (read_hello(pend[i], now))
        pend.erase(pend.begin() + long(i));
      else
        ++i;
    }
    bool hung_up = false;
    for (size_t i = first_link; i < pf.size(); ++i) hung_up = hung_up || pf[i].revents != 0;
    if (hung_up || now >= next_tick) {
      next_tick = now + secs(hb_interval_ / 2);
      std::unique_lock<std::mutex> g(op_mu_, std::try_to_lock);
      if (g.owns_lock())
        idle_tick({});
      else if (hung_up)
        links_quiet_until = now + std::chrono::milliseconds(5);  // the running operation will see it
    }
  }
}

// Accepts up to 16 waiting connections; each must send its hello before a deadline.
void Communicator::Impl::accept_new(std::vector<PendingConn>& pend, Clock::time_point now) {
  for (int i = 0; i < 16; ++i) {
    int fd = ::accept4(listen_fd_.get(), nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK);
    if (fd < 0) break;
    PendingConn pc;
    pc.fd = Fd(fd);
    try {
      tune_socket(fd, opts_.socket_buffer);
    } catch (...) {
      continue;
    }
    pc.deadline = now + secs(std::max(2.0, opts_.timeout));
    if (pend.size() >= 64) {
      reject("too many pending handshakes");
      continue;
    }
    if (!opts_.token.empty()) {
      // the challenge: 40 bytes into an empty socket buffer, so a non-blocking send completes
      uint8_t ch[auth::kChallengeSize];
      try {
        auth::random_bytes(pc.nonce, auth::kNonceSize);
      } catch (const std::exception& e) {
        auth_fail(e.what());
        continue;
      }
      std::memcpy(ch, auth::kChallengeMagic, sizeof(auth::kChallengeMagic));
      std::memcpy(ch + sizeof(auth::kChallengeMagic), pc.nonce, auth::kNonceSize);
      if (::send(fd, ch, sizeof(ch), MSG_NOSIGNAL | MSG_DONTWAIT) != ssize_t(sizeof(ch))) {
        auth_fail("could not send the challenge");
        continue;
      }
      pc.authed = false;
    }
    pend.push_back(std::move(pc));
  }
}

// Reads what arrived of a pending connection's hello. Returns true when the connection is done
// with (handled, rejected, closed or timed out): the caller drops it.
bool Communicator::Impl::read_hello(PendingConn& pc, Clock::time_point now) {
  if (!pc.authed) {
    int r = read_auth(pc, now);
    if (r != 0) return r > 0;  // dropped, or still waiting for the dialer's proof
  }
  for (;;) {
    size_t want = sizeof(pc.buf) - pc.got;
    if (want == 0) break;
    ssize_t n = ::recv(pc.fd.get(), pc.buf + pc.got, want, MSG_DONTWAIT);
    if (n > 0) {
      pc.got += size_t(n);
      continue;
    }
    if (n == 0) {
      reject("connection closed during handshake");
      return true;
    }
    if (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) {
      reject(errno_str("handshake read"));
      return true;
    }
    break;
  }
  if (pc.got >= kHeaderSize) {
    FrameHeader h;
    std::string err;
    if (!parse_header(pc.buf, kHeaderSize, 0, &h, &err)) {
      reject("malformed handshake: " + err);
      return true;
    }
    if (h.type != FrameType::kHello) {
      reject(std::string("handshake expected hello, got ") + frame_type_name(h.type));
      return true;
    }
  }
  if (pc.got == sizeof(pc.buf)) {
    handle_hello(pc);
    return true;
  }
  if (now > pc.deadline) {
    reject("handshake timed out");
    return true;
  }
  return false;
}

// The dialer's answer to our challenge: nonce and proof (nothing of it is parsed as a frame).
// Returns 1 when the connection is done with (it failed: counted, the caller drops it), -1 while
// the answer is incomplete, 0 once the dialer proved the token and our own proof was sent.
int Communicator::Impl::read_auth(PendingConn& pc, Clock::time_point now) {
  while (pc.reply_got < auth::kReplySize) {
    ssize_t n = ::recv(pc.fd.get(), pc.reply + pc.reply_got, auth::kReplySize - pc.reply_got, MSG_DONTWAIT);
    if (n > 0) {
      pc.reply_got += size_t(n);
      continue;
    }
    if (n == 0) {
      auth_fail("connection closed during authentication");
      return 1;
    }
    if (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) {
      auth_fail(errno_str("authentication read"));
      return 1;
    }
    if (errno == EINTR) continue;
    if (now > pc.deadline) {
      auth_fail("authentication timed out");
      return 1;
    }
    return -1;
  }
  const uint8_t* nonce_d = pc.reply;
  auto expect = auth::proof(opts_.token, "dial", pc.nonce, nonce_d);
  if (!auth::equal_ct(expect.data(), pc.reply + auth::kNonceSize, expect.size())) {
    uint8_t no = auth::kVerdictRefused;
    (void)::send(pc.fd.get(), &no, 1, MSG_NOSIGNAL | MSG_DONTWAIT);  // best effort: say why, then close
    auth_fail("wrong proof of the job token");
    return 1;
  }
  uint8_t verdict[auth::kVerdictSize];
  verdict[0] = auth::kVerdictOk;
  auto mine = auth::proof(opts_.token, "acpt", pc.nonce, nonce_d);
  std::memcpy(verdict + 1, mine.data(), mine.size());
  if (::send(pc.fd.get(), verdict, sizeof(verdict), MSG_NOSIGNAL | MSG_DONTWAIT) != ssize_t(sizeof(verdict))) {
    reject(errno_str("authentication verdict"));
    return 1;
  }
  pc.authed = true;
  return 0;
}

void Communicator::Impl::auth_fail(const std::string& why) {
  auth_failures_++;
  reject("authentication failed: " + why);
}

void Communicator::Impl::reject(const std::string& why) {
  rejected_++;
  std::lock_guard<std::mutex> g(table_mu_);
  last_reject_ = why;
}

// Tells the dialer why (best effort, bounded), then counts the rejection; the caller closes.
void Communicator::Impl::refuse(PendingConn& pc, const std::string& why) {
  FrameHeader r;
  r.type = FrameType::kReject;
  r.job_hash = job_hash_;
  r.epoch = epoch_;
  r.length = std::min<size_t>(why.size(), 4096);
  uint8_t hdr[kHeaderSize];
  encode_header(r, hdr);
  try {
    auto dl = Clock::now() + std::chrono::milliseconds(200);
    write_all(pc.fd.get(), hdr, kHeaderSize, dl);
    write_all(pc.fd.get(), why.data(), r.length, dl);
  } catch (...) {
  }
  reject(why);
}

// A complete hello: check it, acknowledge it and park the link for its claimant.
void Communicator::Impl::handle_hello(PendingConn& pc) {
  FrameHeader h;
  std::string err;
  if (!parse_header(pc.buf, kHeaderSize, 0, &h, &err)) return reject("malformed hello: " + err);
  if (h.job_hash != job_hash_) return refuse(pc, "hello from a foreign job");
  if (h.seq != 0) return refuse(pc, "hello with nonzero sequence");
  if (h.flags & kFlagPayloadCrc) {
    if (crc32c(0, pc.buf + kHeaderSize, kHelloSize) != h.payload_crc) return refuse(pc, "hello payload checksum");
  }
  HelloBody b = decode_hello(pc.buf + kHeaderSize);
  if (int(b.world_size) != world_) return refuse(pc, "hello with a different world size");
  if (int(b.to_rank) != rank_) return refuse(pc, "hello addressed to rank " + std::to_string(b.to_rank));
  int from = int(b.from_rank);
  if (from < 0 || from >= world_ || from == rank_) return refuse(pc, "hello from invalid rank");
  bool ok = false;
  {
    std::lock_guard<std::mutex> g(accept_mu_);
    if (h.epoch == epoch_) ok = true;
    else if (pending_ && h.epoch == pending_epoch_ && pending_replaced_.count(from)) ok = true;
  }
  if (!ok)
    return refuse(pc, "hello for epoch " + std::to_string(h.epoch) + " from rank " + std::to_string(from) +
                          " not expected (epoch " + std::to_string(epoch_.load()) + ")");
  // acknowledge
  FrameHeader a;
  a.type = FrameType::kHelloAck;
  a.job_hash = job_hash_;
  a.epoch = h.epoch;
  a.length = kHelloSize;
  uint8_t out[kHeaderSize + kHelloSize];
  HelloBody ab{uint32_t(rank_), uint32_t(from), uint32_t(world_)};
  encode_hello(ab, out + kHeaderSize);
  a.flags = kFlagPayloadCrc;
  a.payload_crc = crc32c(0, out + kHeaderSize, kHelloSize);
  encode_header(a, out);
  try {
    write_all(pc.fd.get(), out, sizeof(out), Clock::now() + secs(opts_.timeout));
  } catch (const std::exception& e) {
    return reject(std::string("hello ack: ") + e.what());
  }
  auto rp = ring_peers();
  bool ring = std::find(rp.begin(), rp.end(), from) != rp.end();
  auto link = std::make_unique<Link>(from, h.epoch, std::move(pc.fd), ring);
  {
    std::lock_guard<std::mutex> g(accept_mu_);
    accepted_[{from, h.epoch}] = std::move(link);
  }
  accept_cv_.notify_all();
}

// Claims the link `peer` opened to us for `epoch`, waiting for it up to `deadline`. tick_idle:
// the caller holds op_mu_ (see dial_peer), so heartbeat the other links while waiting.
std::unique_ptr<Link> Communicator::Impl::await_accepted(int peer, uint64_t epoch, Clock::time_point deadline,
                                                         bool tick_idle, const std::atomic<bool>* cancel) {
  std::unique_lock<std::mutex> g(accept_mu_);
  for (;;) {
    auto it = accepted_.find({peer, epoch});
    if (it != accepted_.end()) {
      auto l = std::move(it->second);
      accepted_.erase(it);
      return l;
    }
    if (stop_) throw CommError("communicator is closed");
    if (cancel != nullptr && cancel->load()) throw CommError("superseded by a newer prepare");
    if (Clock::now() >= deadline) {
      std::string msg = "rank " + std::to_string(rank_) + " timed out waiting for rank " + std::to_string(peer) +
                        " to connect (epoch " + std::to_string(epoch) + ")";
      if (uint64_t n = auth_failures_.load()) {
        g.unlock();  // no accept_mu_ -> table_mu_ nesting
        std::string last;
        {
          std::lock_guard<std::mutex> t(table_mu_);
          last = last_reject_;
        }
        msg += "; " + std::to_string(n) + " connection(s) failed authentication (a different job token?), last: " + last;
        throw AuthError(msg);
      }
      throw CommError(msg);
    }
    accept_cv_.wait_for(g, secs(std::min(0.05, hb_interval_ / 2)));
    if (tick_idle) {
      g.unlock();
      idle_tick({});
      g.lock();
      if (failed_) raise_failure();  // a lazy p2p link inside an operation: as in run_plan
    }
  }
}

}  // namespace tcp
}  // namespace tmrun
