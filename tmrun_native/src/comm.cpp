#include "tmrun/comm.h"

#include <poll.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "tmrun/checksum.h"
#include "tmrun/str_cat.h"

namespace tmrun {
namespace {

constexpr size_t kScratchBytes = 256 * 1024;
constexpr uint32_t kKindAllreduce = 1, kKindBroadcast = 2, kKindAllgather = 3, kKindReduceScatter = 4,
                   kKindBarrier = 5, kKindP2P = 7;

std::atomic<uint64_t> g_link_ids{1};

// Abort notice tag when no rank was lost: an operation timed out on some rank (lost = -1).
constexpr uint32_t kAbortUnknown = 0xFFFFFFFFu;
uint32_t abort_tag(int lost) { return lost < 0 ? kAbortUnknown : uint32_t(lost); }
int abort_lost(uint32_t tag) { return tag == kAbortUnknown ? -1 : int(tag); }

Clock::duration secs(double s) {
  return std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(s));
}
double to_secs(Clock::duration d) { return std::chrono::duration<double>(d).count(); }

std::string errno_str(const char* what) { return std::string(what) + ": " + std::strerror(errno); }

}  // namespace

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

// ---------------------------------------------------------------- Link
Link::Link(int peer_, uint64_t epoch_, Fd fd_, bool ring_)
    : peer(peer_), id(g_link_ids.fetch_add(1)), opened_epoch(epoch_), ring(ring_), fd(std::move(fd_)) {
  auto now = Clock::now();
  last_rx = last_tx = last_progress = now;
}

int Communicator::Plan::send(Link* l, const uint8_t* src, size_t len, int dep) {
  sends.push_back(SendSeg{l, src, len, dep});
  return int(sends.size()) - 1;
}
int Communicator::Plan::recv(Link* l, uint8_t* out, const uint8_t* a, size_t len, bool reduce, int dep) {
  recvs.push_back(RecvSeg{l, out, a, len, reduce, dep, false});
  return int(recvs.size()) - 1;
}

// ---------------------------------------------------------------- construction
Communicator::Communicator(int rank, int world_size, std::string job_id, uint64_t epoch, CommOptions opts)
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
  trash_.resize(kScratchBytes);
  service_ = std::thread([this] { service_loop(); });
  worker_ = std::thread([this] { worker_loop(); });
}

Communicator::~Communicator() { close(); }

void Communicator::close() {
  if (stop_.exchange(true)) {
    if (worker_.joinable() && worker_.get_id() != std::this_thread::get_id()) worker_.join();
    if (service_.joinable()) service_.join();
    if (prepare_thread_.joinable()) prepare_thread_.join();
    return;
  }
  q_cv_.notify_all();
  accept_cv_.notify_all();
  if (worker_.joinable()) worker_.join();
  if (service_.joinable()) service_.join();
  if (prepare_thread_.joinable()) prepare_thread_.join();
  std::lock_guard<std::mutex> g(op_mu_);
  std::lock_guard<std::mutex> t(table_mu_);
  for (auto& kv : links_) {
    if (kv.second->fd.valid()) links_closed_++;
    kv.second->fd.reset();
  }
  listen_fd_.reset();
}

std::string Communicator::address() const {
  std::string host = opts_.advertise_host;
  if (host.empty()) {
    host = opts_.bind_address;
    if (host.empty() || host == "0.0.0.0" || host == "::") host = "127.0.0.1";
  }
  if (host.find(':') != std::string::npos) host = "[" + host + "]";
  return host + ":" + std::to_string(port_);
}

std::vector<int> Communicator::ring_peers() const {
  std::vector<int> out;
  if (world_ == 1) return out;
  int nx = (rank_ + 1) % world_, pv = (rank_ + world_ - 1) % world_;
  out.push_back(pv);
  if (nx != pv) out.push_back(nx);
  std::sort(out.begin(), out.end());
  return out;
}

// ---------------------------------------------------------------- threads
std::shared_ptr<OpState> Communicator::submit(std::function<void()> fn) {
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

void Communicator::worker_loop() {
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

void Communicator::service_loop() {
  std::vector<PendingConn> pend;
  auto next_tick = Clock::now();
  while (!stop_) {
    std::vector<pollfd> pf;
    pf.push_back(pollfd{listen_fd_.get(), POLLIN, 0});
    for (auto& p : pend) pf.push_back(pollfd{p.fd.get(), POLLIN, 0});
    int wait_ms = std::min(50, std::max(1, int(hb_interval_ * 1000 / 2)));
    ::poll(pf.data(), pf.size(), wait_ms);
    if (stop_) break;
    auto now = Clock::now();
    if (pf[0].revents & POLLIN) {
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
        pend.push_back(std::move(pc));
      }
    }
    for (size_t i = 0; i < pend.size();) {
      PendingConn& pc = pend[i];
      bool drop = false;
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
          drop = true;
        } else if (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) {
          reject(errno_str("handshake read"));
          drop = true;
        }
        break;
      }
      if (!drop && pc.got >= kHeaderSize) {
        FrameHeader h;
        std::string err;
        if (!parse_header(pc.buf, kHeaderSize, 0, &h, &err)) {
          reject("malformed handshake: " + err);
          drop = true;
        } else if (h.type != FrameType::kHello) {
          reject(std::string("handshake expected hello, got ") + frame_type_name(h.type));
          drop = true;
        }
      }
      if (!drop && pc.got == sizeof(pc.buf)) {
        handle_hello(pc);
        drop = true;
      }
      if (!drop && now > pc.deadline) {
        reject("handshake timed out");
        drop = true;
      }
      if (drop)
        pend.erase(pend.begin() + long(i));
      else
        ++i;
    }
    if (now >= next_tick) {
      next_tick = now + secs(hb_interval_ / 2);
      std::unique_lock<std::mutex> g(op_mu_, std::try_to_lock);
      if (g.owns_lock()) idle_tick({});
    }
  }
}

void Communicator::reject(const std::string& why) {
  rejected_++;
  std::lock_guard<std::mutex> g(table_mu_);
  last_reject_ = why;
}

void Communicator::handle_hello(PendingConn& pc) {
  FrameHeader h;
  std::string err;
  if (!parse_header(pc.buf, kHeaderSize, 0, &h, &err)) return reject("malformed hello: " + err);
  auto refuse = [&](const std::string& why) {
    // Tell the dialer why (best effort), then close.
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
  };
  if (h.job_hash != job_hash_) return refuse("hello from a foreign job");
  if (h.seq != 0) return refuse("hello with nonzero sequence");
  if (h.flags & kFlagPayloadCrc) {
    if (crc32c(0, pc.buf + kHeaderSize, kHelloSize) != h.payload_crc) return refuse("hello payload checksum");
  }
  HelloBody b = decode_hello(pc.buf + kHeaderSize);
  if (int(b.world_size) != world_) return refuse("hello with a different world size");
  if (int(b.to_rank) != rank_) return refuse("hello addressed to rank " + std::to_string(b.to_rank));
  int from = int(b.from_rank);
  if (from < 0 || from >= world_ || from == rank_) return refuse("hello from invalid rank");
  bool ok = false;
  {
    std::lock_guard<std::mutex> g(accept_mu_);
    if (h.epoch == epoch_) ok = true;
    else if (pending_ && h.epoch == pending_epoch_ && pending_replaced_.count(from)) ok = true;
  }
  if (!ok)
    return refuse("hello for epoch " + std::to_string(h.epoch) + " from rank " + std::to_string(from) +
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

// tick_idle: the caller holds op_mu_ (a lazy p2p link opened inside an operation), so the service
// thread cannot heartbeat for us. Every wait (connect, handshake reply, the pause between attempts)
// then services the other links at least every min(50 ms, heartbeat/2), as await_accepted does,
// and gives up when that notices a failure of the epoch. Without it a dial retried until
// connect_timeout (30 s) silenced this rank and neighbours waiting on it declared it lost.
std::unique_ptr<Link> Communicator::dial_peer(const std::string& address, int peer, uint64_t epoch, bool ring,
                                              Clock::time_point deadline, bool tick_idle) {
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
  }
  while (!stop_) {
    try {
      auto attempt_deadline = std::min(deadline, Clock::now() + secs(std::max(2.0, opts_.timeout)));
      Fd fd = dial_tcp(host, port, attempt_deadline, tick);
      tune_socket(fd.get(), opts_.socket_buffer);
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
      write_all(fd.get(), out, sizeof(out), attempt_deadline, tick);
      uint8_t in[kHeaderSize];
      read_exact(fd.get(), in, kHeaderSize, attempt_deadline, tick);
      FrameHeader r;
      std::string err;
      if (!parse_header(in, kHeaderSize, job_hash_, &r, &err)) throw std::runtime_error("bad handshake reply: " + err);
      if (r.type == FrameType::kReject) {
        std::string why(r.length, '\0');
        read_exact(fd.get(), why.data(), why.size(), attempt_deadline, tick);
        throw std::runtime_error("rejected: " + why);
      }
      if (r.type != FrameType::kHelloAck) throw std::runtime_error("unexpected handshake reply");
      uint8_t body[kHelloSize];
      read_exact(fd.get(), body, kHelloSize, attempt_deadline, tick);
      if ((r.flags & kFlagPayloadCrc) && crc32c(0, body, kHelloSize) != r.payload_crc)
        throw std::runtime_error("handshake reply checksum mismatch");
      HelloBody b = decode_hello(body);
      if (int(b.from_rank) != peer || int(b.to_rank) != rank_ || r.epoch != epoch)
        throw std::runtime_error("handshake reply from the wrong member");
      return std::make_unique<Link>(peer, epoch, std::move(fd), ring);
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

std::unique_ptr<Link> Communicator::await_accepted(int peer, uint64_t epoch, Clock::time_point deadline,
                                                   bool tick_idle) {
  std::unique_lock<std::mutex> g(accept_mu_);
  for (;;) {
    auto it = accepted_.find({peer, epoch});
    if (it != accepted_.end()) {
      auto l = std::move(it->second);
      accepted_.erase(it);
      return l;
    }
    if (stop_) throw CommError("communicator is closed");
    if (Clock::now() >= deadline)
      throw CommError("rank " + std::to_string(rank_) + " timed out waiting for rank " + std::to_string(peer) +
                      " to connect (epoch " + std::to_string(epoch) + ")");
    accept_cv_.wait_for(g, secs(std::min(0.05, hb_interval_ / 2)));
    if (tick_idle) {
      g.unlock();
      idle_tick({});
      g.lock();
      if (failed_) raise_failure();  // a lazy p2p link inside an operation: as in run_plan
    }
  }
}

void Communicator::install_link(std::unique_ptr<Link> l) {
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

void Communicator::connect(const std::vector<std::string>& addresses) {
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

// ---------------------------------------------------------------- framing engine
void Communicator::start_frame(Link& l, FrameType t, uint32_t tag, const uint8_t* payload, size_t len) {
  FrameHeader h;
  h.type = t;
  h.tag = tag;
  h.job_hash = job_hash_;
  h.epoch = epoch_;
  h.seq = l.tx_seq++;
  h.length = len;
  if (t == FrameType::kData && opts_.payload_checksum) {
    h.flags = kFlagPayloadCrc;
    h.payload_crc = crc32c(0, payload, len);
  }
  encode_header(h, l.tx_hdr);
  l.tx_busy = true;
  l.tx_is_data = (t == FrameType::kData);
  l.tx_hdr_off = 0;
  l.tx_payload = payload;
  l.tx_len = len;
  l.tx_off = 0;
}

bool Communicator::tx_pump(Link& l, LinkQ* q, Plan* p, Clock::time_point now, bool allow_heartbeat) {
  bool prog = false;
  if (l.broken) return false;
  for (;;) {
    if (!l.tx_busy) {
      if (q && p && q->si < q->sq.size()) {
        SendSeg& s = p->sends[size_t(q->sq[q->si])];
        if (s.dep < 0 || p->recvs[size_t(s.dep)].done) start_frame(l, FrameType::kData, p->tag, s.src, s.len);
      }
      if (!l.tx_busy) {
        if (allow_heartbeat && now - l.last_tx >= secs(hb_interval_))
          start_frame(l, FrameType::kHeartbeat, 0, nullptr, 0);
        else
          return prog;
      }
    }
    iovec iov[2];
    int cnt = 0;
    if (l.tx_hdr_off < kHeaderSize) iov[cnt++] = iovec{l.tx_hdr + l.tx_hdr_off, kHeaderSize - l.tx_hdr_off};
    if (l.tx_off < l.tx_len) iov[cnt++] = iovec{const_cast<uint8_t*>(l.tx_payload) + l.tx_off, l.tx_len - l.tx_off};
    msghdr m{};
    m.msg_iov = iov;
    m.msg_iovlen = size_t(cnt);
    ssize_t n = ::sendmsg(l.fd.get(), &m, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (n < 0) {
      if (errno == EINTR) continue;
      if (errno == EAGAIN || errno == EWOULDBLOCK) return prog;
      throw LinkFailure{&l, errno_str("send failed"), false};
    }
    size_t k = size_t(n);
    size_t h = std::min(k, kHeaderSize - l.tx_hdr_off);
    l.tx_hdr_off += h;
    l.tx_off += k - h;
    l.bytes_sent += k;
    l.last_tx = now;  // (liveness is judged on received bytes only: peers heartbeat while alive)
    prog = true;
    if (l.tx_hdr_off == kHeaderSize && l.tx_off == l.tx_len) {
      l.tx_busy = false;
      l.frames_sent++;
      if (l.tx_is_data && q) q->si++;
      l.tx_is_data = false;
    }
  }
}

bool Communicator::rx_pump(Link& l, RxCtx& c) {
  bool prog = false;
  if (l.broken) return false;
  const uint64_t cur = epoch_;
  auto note = [&](ssize_t n) {
    auto now = Clock::now();
    l.bytes_recv += uint64_t(n);
    l.last_rx = now;
    l.last_progress = now;
    prog = true;
  };
  auto read_err = [&](ssize_t n) -> bool {  // returns true when the caller should return (EAGAIN)
    if (n == 0) throw LinkFailure{&l, "connection closed by peer", false};
    if (errno == EINTR) return false;
    if (errno == EAGAIN || errno == EWOULDBLOCK) return true;
    throw LinkFailure{&l, errno_str("recv failed"), false};
  };
  for (;;) {
    if (c.mode == RxMode::kOp && c.q && c.q->ri >= c.q->rq.size() && c.q->si >= c.q->sq.size() &&
        l.rx_hdr_off == 0)
      return prog;  // this link's part of the operation is over
    if (!l.rx_have) {
      ssize_t n = ::recv(l.fd.get(), l.rx_hdr + l.rx_hdr_off, kHeaderSize - l.rx_hdr_off, MSG_DONTWAIT);
      if (n <= 0) {
        if (read_err(n)) return prog;
        continue;
      }
      note(n);
      l.rx_hdr_off += size_t(n);
      if (l.rx_hdr_off < kHeaderSize) continue;
      l.rx_hdr_off = 0;
      FrameHeader h;
      std::string err;
      if (!parse_header(l.rx_hdr, kHeaderSize, job_hash_, &h, &err))
        throw LinkFailure{&l, "malformed frame: " + err, true};
      if (h.seq != l.rx_seq)
        throw LinkFailure{&l, "frame sequence " + std::to_string(h.seq) + ", expected " + std::to_string(l.rx_seq), true};
      l.rx_seq++;
      l.frames_recv++;
      if (h.epoch > cur && h.type != FrameType::kSync)
        throw LinkFailure{&l, std::string(frame_type_name(h.type)) + " frame from future epoch " + std::to_string(h.epoch), true};
      switch (h.type) {
        case FrameType::kHeartbeat:
          continue;
        case FrameType::kAbort:
          if ((c.mode == RxMode::kOp || c.mode == RxMode::kIdle) && h.epoch == cur)
            throw AbortReceived{&l, abort_lost(h.tag)};
          continue;
        case FrameType::kSync:
          if (h.epoch <= cur && !(c.mode == RxMode::kSync && h.epoch == c.sync_epoch)) continue;  // stale
          l.rx_have = true;
          l.rx_h = h;
          break;
        case FrameType::kData:
          if (h.epoch != cur && c.mode != RxMode::kSync && c.mode != RxMode::kDiscard)
            throw LinkFailure{&l, "data frame from epoch " + std::to_string(h.epoch), true};
          l.rx_have = true;
          l.rx_h = h;
          l.rx_off = l.rx_done = l.rx_carry = 0;
          l.rx_crc = 0;
          l.rx_bound = false;
          break;
        default:
          throw LinkFailure{&l, std::string("unexpected ") + frame_type_name(h.type) + " frame", true};
      }
    }
    // a header is pending
    if (l.rx_h.type == FrameType::kSync) {
      if (c.mode == RxMode::kSync && l.rx_h.epoch == c.sync_epoch) {
        l.rx_have = false;
        c.got_sync = true;
        return true;
      }
      if (c.mode == RxMode::kOp && c.q && c.q->ri < c.q->rq.size())
        throw EpochSwitched{&l, l.rx_h.epoch};  // the sync stays stashed for our own commit
      return prog;
    }
    // data payload
    if (c.mode == RxMode::kIdle) return prog;
    size_t len = size_t(l.rx_h.length);
    if (c.mode == RxMode::kDiscard || c.mode == RxMode::kSync) {
      size_t want = std::min(len - l.rx_off, trash_.size());
      if (want > 0) {
        ssize_t n = ::recv(l.fd.get(), trash_.data(), want, MSG_DONTWAIT);
        if (n <= 0) {
          if (read_err(n)) return prog;
          continue;
        }
        note(n);
        l.rx_off += size_t(n);
      }
      if (l.rx_off == len) l.rx_have = false;
      continue;
    }
    // op mode
    if (!c.q || c.q->ri >= c.q->rq.size()) return prog;  // belongs to a later operation
    RecvSeg& s = c.plan->recvs[size_t(c.q->rq[c.q->ri])];
    if (s.dep >= 0 && !c.plan->recvs[size_t(s.dep)].done) return prog;
    if (!l.rx_bound) {
      if (len != s.len || l.rx_h.tag != c.plan->tag) {
        throw LinkFailure{&l,
                          str_cat("frame does not match the operation (length ", len, " tag ", l.rx_h.tag,
                                  ", expected length ", s.len, " tag ", c.plan->tag,
                                  "): ranks called different collectives"),
                          true};
      }
      l.rx_bound = true;
    }
    const bool crc = (l.rx_h.flags & kFlagPayloadCrc) != 0;
    if (l.rx_off < len) {
      if (!s.reduce) {
        ssize_t n = ::recv(l.fd.get(), s.out + l.rx_off, len - l.rx_off, MSG_DONTWAIT);
        if (n <= 0) {
          if (read_err(n)) return prog;
          continue;
        }
        note(n);
        if (crc) l.rx_crc = crc32c(l.rx_crc, s.out + l.rx_off, size_t(n));
        l.rx_off += size_t(n);
      } else {
        if (l.scratch.empty()) l.scratch.resize(kScratchBytes / 8);
        auto* sc = reinterpret_cast<uint8_t*>(l.scratch.data());
        size_t want = std::min(kScratchBytes - l.rx_carry, len - l.rx_off);
        ssize_t n = ::recv(l.fd.get(), sc + l.rx_carry, want, MSG_DONTWAIT);
        if (n <= 0) {
          if (read_err(n)) return prog;
          continue;
        }
        note(n);
        if (crc) l.rx_crc = crc32c(l.rx_crc, sc + l.rx_carry, size_t(n));
        l.rx_off += size_t(n);
        const size_t es = dtype_size(c.plan->dt);
        size_t avail = l.rx_carry + size_t(n);
        size_t elems = avail / es;
        if (elems) reduce(c.plan->dt, c.plan->op, s.out + l.rx_done, s.a + l.rx_done, sc, elems);
        l.rx_done += elems * es;
        l.rx_carry = avail - elems * es;
        if (l.rx_carry) std::memmove(sc, sc + elems * es, l.rx_carry);
      }
    }
    if (l.rx_off == len) {
      if (crc && l.rx_crc != l.rx_h.payload_crc) throw LinkFailure{&l, "payload checksum mismatch", true};
      s.done = true;
      c.q->ri++;
      l.rx_have = false;
      // Nothing more to receive on this link in this operation: stop reading, what follows
      // belongs to the peer's next step (possibly its departure).
      if (c.q->ri >= c.q->rq.size()) return true;
    }
  }
}

// Callers hold op_mu_ (every reader of link I/O state does); the fields links() reports (broken,
// error, fd) are also written under table_mu_, which links() holds from any thread without op_mu_.
// Lock order op_mu_ -> table_mu_ (as close() and debug_send_raw): never call with table_mu_ held.
void Communicator::close_link(Link& l, const std::string& why) {
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

[[noreturn]] void Communicator::raise_failure() {
  if (failed_protocol_) throw ProtocolError(failed_peer_, failed_msg_);
  throw PeerLostError(failed_peer_, epoch_, failed_reporter_, failed_msg_);
}

void Communicator::check_healthy() {
  if (stop_) throw CommError("communicator is closed");
  if (failed_) raise_failure();
}

void Communicator::record_failure(int peer, int reporter, bool protocol, std::string msg) {
  std::lock_guard<std::mutex> g(fail_mu_);  // callers hold op_mu_ too (see failed_ in comm.h)
  if (failed_) return;  // sticky: the first failure of the epoch is the one reported
  failed_ = true;
  failed_peer_ = peer;
  failed_reporter_ = reporter;
  failed_protocol_ = protocol;
  failed_msg_ = std::move(msg);
}

// The failure recorded for an abort notice about `lost` (-1: an operation timed out somewhere)
// received from rank `from`.
std::string Communicator::notice_msg(int lost, int from) const {
  if (lost < 0)
    return str_cat("an operation timed out on another rank (reported by rank ", from, " to rank ", rank_,
                   ", epoch ", epoch_.load(), ")");
  return str_cat("rank ", lost, " lost (reported by rank ", from, " to rank ", rank_, ", epoch ", epoch_.load(),
                 ")");
}

void Communicator::fail_op(Link* failed_link, const std::string& reason, bool protocol, int lost, Link* abort_from) {
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

// Sends the abort notice about `lost` (-1: unknown, an operation timed out) once per epoch to every
// open link except the lost rank's, including the link the notice came from: the echo tells a
// sender that this rank gave up too, so a sender still waiting on us (whatever the reason it did
// not stop by itself) does not wait until op_timeout, or forever with op_timeout=0, while our
// heartbeats keep the link alive. The echo cannot loop: every rank sends a notice only after
// recording the failure of that epoch and forwards each loss once (aborted_peers_); a notice of an
// older epoch is ignored (rx_pump), as is one arriving during an epoch switch.
void Communicator::notify_abort(int lost) {
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
      try {
        if (!l.tx_busy && !queued[i]) {
          start_frame(l, FrameType::kAbort, abort_tag(lost), nullptr, 0);
          queued[i] = true;
        }
        // finish the frame in flight and the abort; never start a heartbeat here
        while (l.tx_busy) {
          if (!tx_pump(l, nullptr, nullptr, now, false)) break;
        }
        if (!l.tx_busy && !queued[i]) {
          start_frame(l, FrameType::kAbort, abort_tag(lost), nullptr, 0);
          queued[i] = true;
          while (l.tx_busy && tx_pump(l, nullptr, nullptr, now, false)) {
          }
        }
        RxCtx c{RxMode::kDiscard};
        rx_pump(l, c);
      } catch (const LinkFailure& f) {
        close_link(*f.link, f.reason);
        continue;
      } catch (const std::exception&) {
        continue;
      }
      if (l.tx_busy || !queued[i]) {
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

// A link to a departing member is shut down gracefully: FIN after our last bytes, then drained
// until the peer closes (or a grace period ends), so that closing never resets a connection whose
// peer is still reading the end of its last operation.
void Communicator::retire(std::unique_ptr<Link> l) {
  if (!l->fd.valid()) return;
  ::shutdown(l->fd.get(), SHUT_WR);
  l->last_progress = Clock::now();
  retired_.push_back(std::move(l));
}

void Communicator::drain_retired() {
  auto now = Clock::now();
  for (auto it = retired_.begin(); it != retired_.end();) {
    Link& l = **it;
    bool drop = now - l.last_progress > secs(std::max(5.0, 2 * opts_.timeout));
    while (!drop) {
      ssize_t n = ::recv(l.fd.get(), trash_.data(), trash_.size(), MSG_DONTWAIT);
      if (n > 0) continue;
      if (n < 0 && errno == EINTR) continue;
      if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) break;
      drop = true;  // EOF or error: the peer is gone
    }
    if (drop)
      it = retired_.erase(it);
    else
      ++it;
  }
}

void Communicator::idle_tick(const std::set<Link*>& exclude) {
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
      tx_pump(*l, nullptr, nullptr, now);
      RxCtx c{RxMode::kIdle};
      rx_pump(*l, c);
    } catch (const LinkFailure& f) {
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

void Communicator::run_plan(Plan& p) {
  std::vector<LinkQ> qs;
  auto qidx = [&](Link* l) {
    for (size_t i = 0; i < qs.size(); ++i)
      if (qs[i].link == l) return i;
    qs.push_back(LinkQ{l, {}, {}, 0, 0});
    return qs.size() - 1;
  };
  for (size_t i = 0; i < p.sends.size(); ++i) qs[qidx(p.sends[i].link)].sq.push_back(int(i));
  for (size_t i = 0; i < p.recvs.size(); ++i) qs[qidx(p.recvs[i].link)].rq.push_back(int(i));
  if (qs.empty()) return;
  auto now = Clock::now();
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
  const auto timeout = secs(opts_.timeout);
  const auto op_deadline = opts_.op_timeout > 0 ? now + secs(opts_.op_timeout) : Clock::time_point::max();
  auto next_idle = now + secs(hb_interval_);
  const int poll_ms = std::max(1, std::min(100, int(hb_interval_ * 1000 / 2)));
  std::vector<pollfd> pf(qs.size());
  try {
    for (;;) {
      now = Clock::now();
      bool prog = false, done = true;
      for (auto& q : qs) {
        Link& l = *q.link;
        if (q.si == q.sq.size() && q.ri == q.rq.size()) {  // this link's part is over: do not
          // read further (the peer may already have moved on, even closed the link), but keep
          // heartbeating it (idle_tick skips op links): the peer may already wait on us in its next
          // operation and would declare us lost after `timeout`. A failed write is not this
          // operation's failure (a departing peer closes after its part): judged when next used.
          if (!q.hb_failed) {
            try {
              tx_pump(l, nullptr, nullptr, now);
            } catch (const LinkFailure&) {
              q.hb_failed = true;
            }
          }
          continue;
        }
        prog |= tx_pump(l, &q, &p, now);
        RxCtx c{RxMode::kOp, &q, &p};
        prog |= rx_pump(l, c);
        if (q.si < q.sq.size() || q.ri < q.rq.size()) done = false;
      }
      if (done) break;
      if (prog) continue;
      now = Clock::now();
      for (auto& q : qs) {
        Link& l = *q.link;
        bool pending = q.si < q.sq.size() || q.ri < q.rq.size();
        // Judge a peer only while we are ready to read from it: when its data waits behind a
        // dependency of ours, its heartbeats queue behind that data.
        bool rx_ready = !l.rx_have;
        if (!rx_ready && l.rx_h.type == FrameType::kData && q.ri < q.rq.size()) {
          int d = p.recvs[size_t(q.rq[q.ri])].dep;
          rx_ready = d < 0 || p.recvs[size_t(d)].done;
        }
        if (!rx_ready) l.last_progress = now;
        if (pending && now - l.last_progress > timeout)
          throw LinkFailure{&l, "no data for " + std::to_string(to_secs(now - l.last_progress)).substr(0, 4) +
                                    " s (peer stopped answering)", false};
      }
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
      for (size_t i = 0; i < qs.size(); ++i) {
        Link& l = *qs[i].link;
        LinkQ& q = qs[i];
        short ev = 0;
        if (q.si == q.sq.size() && q.ri == q.rq.size()) {
          pf[i] = pollfd{-1, 0, 0};
          continue;
        }
        bool can_send = l.tx_busy;
        if (!can_send && q.si < q.sq.size()) {
          int d = p.sends[size_t(q.sq[q.si])].dep;
          can_send = d < 0 || p.recvs[size_t(d)].done;
        }
        if (can_send) ev |= POLLOUT;
        bool can_recv = !l.rx_have;
        if (!can_recv && l.rx_h.type == FrameType::kData && q.ri < q.rq.size()) {
          int d = p.recvs[size_t(q.rq[q.ri])].dep;
          can_recv = d < 0 || p.recvs[size_t(d)].done;
        }
        if (can_recv) ev |= POLLIN;
        pf[i] = pollfd{l.fd.get(), ev, 0};
      }
      ::poll(pf.data(), pf.size(), poll_ms);
    }
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

void Communicator::sync_links(uint64_t new_epoch) {
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
        while (l.tx_busy && !l.sync_sent) {  // finish a frame left in flight (never expected)
          if (!tx_pump(l, nullptr, nullptr, now, false)) break;
        }
        if (!l.tx_busy && !l.sync_sent) {
          start_frame(l, FrameType::kSync, 0, nullptr, 0);
          l.sync_sent = true;
        }
        if (l.sync_sent) prog |= tx_pump(l, nullptr, nullptr, now);
        if (!got[i]) {
          RxCtx c{RxMode::kSync};
          c.sync_epoch = new_epoch;
          prog |= rx_pump(l, c);
          if (c.got_sync) got[i] = true;
        }
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

// ---------------------------------------------------------------- plans
Link* Communicator::ring_link(int peer) {
  std::lock_guard<std::mutex> t(table_mu_);
  auto it = links_.find(peer);
  if (it == links_.end())
    throw CommError("rank " + std::to_string(rank_) + " has no link to rank " + std::to_string(peer) +
                    " (call connect first)");
  return it->second.get();
}

Link* Communicator::p2p_link(int peer) {
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

Communicator::Plan Communicator::new_plan(DType dt, ReduceOp op, uint32_t kind) {
  Plan p;
  p.dt = dt;
  p.op = op;
  p.tag = ((coll_seq_++ & 0x0FFFFFFFu) << 4) | kind;
  return p;
}

void Communicator::segments(size_t bytes, size_t es, std::vector<std::pair<size_t, size_t>>* out) const {
  out->clear();
  size_t seg = std::max(es, (opts_.segment_bytes / es) * es);
  for (size_t off = 0; off < bytes; off += seg) out->emplace_back(off, std::min(seg, bytes - off));
}

void Communicator::build_ring_allreduce(Plan& p, uint8_t* buf, size_t count, size_t es) {
  const int n = world_, r = rank_;
  Link* nx = ring_link((r + 1) % n);
  Link* pv = ring_link((r + n - 1) % n);
  auto mod = [n](int c) { return ((c % n) + n) % n; };
  auto chunk = [&](int c) {
    size_t cc = size_t(mod(c)), base = count / size_t(n), rem = count % size_t(n);
    size_t off = cc * base + std::min(cc, rem);
    size_t len = base + (cc < rem ? 1 : 0);
    return std::make_pair(off * es, len * es);
  };
  std::vector<std::pair<size_t, size_t>> segs;
  std::vector<int> prev, cur;
  for (int s = 0; s < n - 1; ++s) {  // reduce-scatter
    auto [so, sl] = chunk(r - s);
    segments(sl, es, &segs);
    for (size_t j = 0; j < segs.size(); ++j)
      p.send(nx, buf + so + segs[j].first, segs[j].second, s == 0 ? -1 : prev[j]);
    auto [ro, rl] = chunk(r - s - 1);
    segments(rl, es, &segs);
    cur.clear();
    for (auto& sg : segs) cur.push_back(p.recv(pv, buf + ro + sg.first, buf + ro + sg.first, sg.second, true, -1));
    prev = cur;
  }
  for (int s = 0; s < n - 1; ++s) {  // allgather of the reduced chunks
    auto [so, sl] = chunk(r + 1 - s);
    segments(sl, es, &segs);
    for (size_t j = 0; j < segs.size(); ++j) p.send(nx, buf + so + segs[j].first, segs[j].second, prev[j]);
    auto [ro, rl] = chunk(r - s);
    segments(rl, es, &segs);
    cur.clear();
    for (auto& sg : segs) cur.push_back(p.recv(pv, buf + ro + sg.first, nullptr, sg.second, false, -1));
    prev = cur;
  }
}

// Latency path: two reduction arms meet at rank 0 (ranks 1..h send backwards, h+1..n-1 forwards),
// rank 0 combines (x0 op left) op right, and the result flows back along both arms. n/2 + n/2
// hops instead of 2(n-1); fixed order, so bitwise deterministic.
void Communicator::build_tree_allreduce(Plan& p, uint8_t* buf, size_t bytes) {
  const int n = world_, r = rank_, h = (n - 1) / 2;
  Link* nx = ring_link((r + 1) % n);
  Link* pv = ring_link((r + n - 1) % n);
  std::vector<std::pair<size_t, size_t>> segs;
  segments(bytes, dtype_size(p.dt), &segs);
  const size_t m = segs.size();
  std::vector<int> in(m, -1), fin(m, -1), left(m, -1);
  if (r == 0) {
    bool L = h >= 1;
    if (L)
      for (size_t j = 0; j < m; ++j) left[j] = p.recv(nx, buf + segs[j].first, buf + segs[j].first, segs[j].second, true, -1);
    for (size_t j = 0; j < m; ++j)
      in[j] = p.recv(pv, buf + segs[j].first, buf + segs[j].first, segs[j].second, true, L ? left[j] : -1);
    if (L)
      for (size_t j = 0; j < m; ++j) p.send(nx, buf + segs[j].first, segs[j].second, in[j]);
    for (size_t j = 0; j < m; ++j) p.send(pv, buf + segs[j].first, segs[j].second, in[j]);
  } else if (r <= h) {  // left arm: partial flows towards rank 0 through lower ranks
    bool has_in = r < h;
    if (has_in)
      for (size_t j = 0; j < m; ++j) in[j] = p.recv(nx, buf + segs[j].first, buf + segs[j].first, segs[j].second, true, -1);
    for (size_t j = 0; j < m; ++j) p.send(pv, buf + segs[j].first, segs[j].second, in[j]);
    for (size_t j = 0; j < m; ++j) fin[j] = p.recv(pv, buf + segs[j].first, nullptr, segs[j].second, false, -1);
    if (has_in)
      for (size_t j = 0; j < m; ++j) p.send(nx, buf + segs[j].first, segs[j].second, fin[j]);
  } else {  // right arm: partial flows towards rank 0 through higher ranks
    bool has_in = r > h + 1;
    if (has_in)
      for (size_t j = 0; j < m; ++j) in[j] = p.recv(pv, buf + segs[j].first, buf + segs[j].first, segs[j].second, true, -1);
    for (size_t j = 0; j < m; ++j) p.send(nx, buf + segs[j].first, segs[j].second, in[j]);
    for (size_t j = 0; j < m; ++j) fin[j] = p.recv(nx, buf + segs[j].first, nullptr, segs[j].second, false, -1);
    if (has_in)
      for (size_t j = 0; j < m; ++j) p.send(pv, buf + segs[j].first, segs[j].second, fin[j]);
  }
}

void Communicator::build_chain_broadcast(Plan& p, uint8_t* buf, size_t bytes, int root, bool bidir) {
  const int n = world_, r = rank_;
  const int v = (r - root + n) % n;
  Link* nx = ring_link((r + 1) % n);
  Link* pv = ring_link((r + n - 1) % n);
  std::vector<std::pair<size_t, size_t>> segs;
  segments(bytes, 1, &segs);
  const int f = bidir ? n / 2 : n - 1;  // ranks v=1..f receive from prev; v=f+1..n-1 from next
  if (v == 0) {
    if (f >= 1)
      for (auto& s : segs) p.send(nx, buf + s.first, s.second, -1);
    if (n - 1 >= f + 1)
      for (auto& s : segs) p.send(pv, buf + s.first, s.second, -1);
  } else if (v <= f) {
    for (auto& s : segs) {
      int d = p.recv(pv, buf + s.first, nullptr, s.second, false, -1);
      if (v < f) p.send(nx, buf + s.first, s.second, d);
    }
  } else {
    for (auto& s : segs) {
      int d = p.recv(nx, buf + s.first, nullptr, s.second, false, -1);
      if (v > f + 1) p.send(pv, buf + s.first, s.second, d);
    }
  }
}

// ---------------------------------------------------------------- operations
void Communicator::do_allreduce(void* buf, size_t count, DType dt, ReduceOp op) {
  check_healthy();
  collectives_++;
  Plan p = new_plan(dt, op, kKindAllreduce);
  const size_t es = dtype_size(dt), bytes = count * es;
  if (world_ == 1 || count == 0) return;
  auto* b = static_cast<uint8_t*>(buf);
  if (bytes <= opts_.small_bytes || count < size_t(world_))
    build_tree_allreduce(p, b, bytes);
  else
    build_ring_allreduce(p, b, count, es);
  run_plan(p);
  if (op == ReduceOp::kAvg) divide(dt, buf, count, world_);
}

void Communicator::do_broadcast(void* buf, size_t count, DType dt, int root) {
  if (root < 0 || root >= world_) throw std::invalid_argument("root out of range");
  check_healthy();
  collectives_++;
  Plan p = new_plan(dt, ReduceOp::kSum, kKindBroadcast);
  const size_t bytes = count * dtype_size(dt);
  if (world_ == 1 || bytes == 0) return;
  build_chain_broadcast(p, static_cast<uint8_t*>(buf), bytes, root, bytes <= opts_.small_bytes);
  run_plan(p);
}

void Communicator::do_allgather(void* out, const void* in, size_t count, DType dt) {
  check_healthy();
  collectives_++;
  Plan p = new_plan(dt, ReduceOp::kSum, kKindAllgather);
  const int n = world_, r = rank_;
  const size_t B = count * dtype_size(dt);
  auto* o = static_cast<uint8_t*>(out);
  if (B && in != o + size_t(r) * B) std::memmove(o + size_t(r) * B, in, B);
  if (n == 1 || B == 0) return;
  Link* nx = ring_link((r + 1) % n);
  Link* pv = ring_link((r + n - 1) % n);
  auto blk = [&](int c) { return o + size_t(((c % n) + n) % n) * B; };
  std::vector<std::pair<size_t, size_t>> segs;
  segments(B, 1, &segs);
  std::vector<int> prev, cur;
  for (int s = 0; s < n - 1; ++s) {
    for (size_t j = 0; j < segs.size(); ++j) p.send(nx, blk(r - s) + segs[j].first, segs[j].second, s == 0 ? -1 : prev[j]);
    cur.clear();
    for (auto& sg : segs) cur.push_back(p.recv(pv, blk(r - s - 1) + sg.first, nullptr, sg.second, false, -1));
    prev = cur;
  }
  run_plan(p);
}

void Communicator::do_reduce_scatter(void* out, const void* in, size_t count, DType dt, ReduceOp op) {
  check_healthy();
  collectives_++;
  Plan p = new_plan(dt, op, kKindReduceScatter);
  const int n = world_, r = rank_;
  const size_t es = dtype_size(dt), B = count * es;
  auto* o = static_cast<uint8_t*>(out);
  const auto* i8 = static_cast<const uint8_t*>(in);
  if (n == 1) {
    if (B && o != i8) std::memmove(o, i8, B);
    if (op == ReduceOp::kAvg) divide(dt, out, count, 1);
    return;
  }
  if (B == 0) return;
  Link* nx = ring_link((r + 1) % n);
  Link* pv = ring_link((r + n - 1) % n);
  if (n > 2) work_.resize(size_t(n) * B);
  auto mod = [n](int c) { return size_t(((c % n) + n) % n); };
  std::vector<std::pair<size_t, size_t>> segs;
  segments(B, es, &segs);
  std::vector<int> prev, cur;
  for (int s = 0; s < n - 1; ++s) {
    size_t sc = mod(r - s - 1);
    const uint8_t* src = s == 0 ? i8 + sc * B : work_.data() + sc * B;
    for (size_t j = 0; j < segs.size(); ++j) p.send(nx, src + segs[j].first, segs[j].second, s == 0 ? -1 : prev[j]);
    size_t rc = mod(r - s - 2);
    uint8_t* dst = s == n - 2 ? o : work_.data() + rc * B;
    cur.clear();
    for (auto& sg : segs) cur.push_back(p.recv(pv, dst + sg.first, i8 + rc * B + sg.first, sg.second, true, -1));
    prev = cur;
  }
  run_plan(p);
  if (op == ReduceOp::kAvg) divide(dt, out, count, n);
}

void Communicator::do_barrier() {
  check_healthy();
  collectives_++;
  Plan p = new_plan(DType::kUInt8, ReduceOp::kMax, kKindBarrier);
  if (world_ == 1) return;
  uint8_t token = 1;
  build_tree_allreduce(p, &token, 1);
  run_plan(p);
}

void Communicator::do_send(const void* buf, size_t bytes, int dst, uint32_t tag) {
  if (dst < 0 || dst >= world_ || dst == rank_) throw std::invalid_argument("invalid destination rank");
  if (tag >= (1u << 28)) throw std::invalid_argument("tag must be < 2**28");
  check_healthy();
  p2p_ops_++;
  Link* l = p2p_link(dst);
  Plan p;
  p.tag = (tag << 4) | kKindP2P;
  std::vector<std::pair<size_t, size_t>> segs;
  segments(bytes, 1, &segs);
  if (segs.empty()) segs.emplace_back(0, 0);  // an empty message is still one frame
  for (auto& s : segs) p.send(l, static_cast<const uint8_t*>(buf) + s.first, s.second, -1);
  run_plan(p);
}

void Communicator::do_recv(void* buf, size_t bytes, int src, uint32_t tag) {
  if (src < 0 || src >= world_ || src == rank_) throw std::invalid_argument("invalid source rank");
  if (tag >= (1u << 28)) throw std::invalid_argument("tag must be < 2**28");
  check_healthy();
  p2p_ops_++;
  Link* l = p2p_link(src);
  Plan p;
  p.tag = (tag << 4) | kKindP2P;
  std::vector<std::pair<size_t, size_t>> segs;
  segments(bytes, 1, &segs);
  if (segs.empty()) segs.emplace_back(0, 0);
  for (auto& s : segs) p.recv(l, static_cast<uint8_t*>(buf) + s.first, nullptr, s.second, false, -1);
  run_plan(p);
}

// ---------------------------------------------------------------- replacement
void Communicator::prepare(const std::vector<int>& replaced, const std::map<int, std::string>& new_addresses,
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
  if (prepare_thread_.joinable()) prepare_thread_.join();
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
  prepare_thread_ = std::thread([this, needed, new_epoch, new_addresses] {
    std::map<int, std::unique_ptr<Link>> got;
    std::string err;
    auto deadline = Clock::now() + secs(opts_.connect_timeout);
    try {
      for (int p : needed)
        if (rank_ < p) got[p] = dial_peer(new_addresses.at(p), p, new_epoch, true, deadline);
      for (int p : needed)
        if (rank_ > p) got[p] = await_accepted(p, new_epoch, deadline, false);
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
  });
}

bool Communicator::prepare_done() const {
  std::lock_guard<std::mutex> g(const_cast<std::mutex&>(accept_mu_));
  return pending_ && pending_ready_;
}

bool Communicator::prepare_pending() const {
  std::lock_guard<std::mutex> g(const_cast<std::mutex&>(accept_mu_));
  return pending_;
}

void Communicator::do_commit() {
  std::map<int, std::unique_ptr<Link>> fresh;
  std::set<int> replaced;
  std::map<int, std::string> addrs;
  uint64_t new_epoch;
  {
    std::unique_lock<std::mutex> g(accept_mu_);
    if (!pending_) throw CommError("commit() without prepare()");
    auto deadline = Clock::now() + secs(opts_.connect_timeout + 1.0);
    while (!pending_ready_) {
      if (stop_) throw CommError("communicator is closed");
      if (Clock::now() > deadline) throw CommTimeoutError("prepare did not finish in time");
      accept_cv_.wait_for(g, secs(std::min(0.05, hb_interval_ / 2)));
      g.unlock();
      idle_tick({});  // keep heartbeats flowing while we hold the operation lock
      g.lock();
    }
    pending_ = false;
    if (!pending_error_.empty()) throw CommError("prepare failed: " + pending_error_);
    fresh = std::move(pending_links_);
    replaced = pending_replaced_;
    addrs = pending_addresses_;
    new_epoch = pending_epoch_;
  }
  if (prepare_thread_.joinable()) prepare_thread_.join();
  {
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
  }
  aborted_peers_.clear();
  commits_++;
  sync_links(new_epoch);
}

// ---------------------------------------------------------------- introspection
std::vector<LinkInfo> Communicator::links() const {
  std::lock_guard<std::mutex> t(table_mu_);
  std::vector<LinkInfo> out;
  for (auto& kv : links_) {
    const Link& l = *kv.second;
    out.push_back(LinkInfo{l.peer, l.id, l.opened_epoch, l.ring, !l.broken && l.fd.valid(), l.bytes_sent.load(),
                           l.bytes_recv.load(), l.frames_sent.load(), l.frames_recv.load(), l.error});
  }
  return out;
}

CommCounters Communicator::counters() const {
  CommCounters c;
  c.links_opened = links_opened_;
  c.links_closed = links_closed_;
  c.collectives = collectives_;
  c.p2p_ops = p2p_ops_;
  c.rejected_connections = rejected_;
  c.commits = commits_;
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

// Called from any thread, without op_mu_ (an operation holds it while it runs): fail_mu_ makes the
// flag and the message one consistent snapshot.
std::string Communicator::failure() const {
  std::lock_guard<std::mutex> g(fail_mu_);
  return failed_ ? failed_msg_ : std::string();
}

void Communicator::debug_send_raw(int peer, const std::string& bytes) {
  std::lock_guard<std::mutex> g(op_mu_);
  std::lock_guard<std::mutex> t(table_mu_);
  auto it = links_.find(peer);
  if (it == links_.end() || !it->second->fd.valid()) throw CommError("no open link to that peer");
  write_all(it->second->fd.get(), bytes.data(), bytes.size(), Clock::now() + secs(opts_.timeout));
}

}  // namespace tmrun
