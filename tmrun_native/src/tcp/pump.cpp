// Framing on a link: the send pump (frames out of the plan's sends, heartbeats) and the receive
// pump (headers checked and dispatched; data payloads copied or reduced into the plan's
// receives, or discarded; control frames turned into AbortReceived / EpochSwitched).
// Non-blocking: both return when the socket would block. Callers hold op_mu_.
#include <sys/socket.h>
#include <sys/uio.h>

#include <algorithm>

#include "comm_impl.h"
#include "tmrun/checksum.h"
#include "tmrun/str_cat.h"

namespace tmrun {
namespace tcp {

// ---------------------------------------------------------------- send
void Communicator::Impl::start_frame(Link& l, FrameType t, uint32_t tag, const uint8_t* payload, size_t len) {
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

// Writes as much as the socket takes: the frame in flight, then the next send of q whose
// dependency is done, else (allow_heartbeat) a heartbeat when one is due. Returns whether any
// byte went out.
bool Communicator::Impl::tx_pump(Link& l, LinkQ* q, Plan* p, Clock::time_point now, bool allow_heartbeat) {
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

// ---------------------------------------------------------------- receive
// Reads what the link has for the context c. Returns whether any byte arrived (or the part of the
// operation, or the sync, completed). Throws LinkFailure, AbortReceived or EpochSwitched.
bool Communicator::Impl::rx_pump(Link& l, RxCtx& c) {
  if (l.broken) return false;
  const uint64_t cur = epoch_;
  bool prog = false;
  for (;;) {
    if (c.mode == RxMode::kOp && c.q && c.q->over() && l.rx_hdr_off == 0)
      return prog;  // this link's part of the operation is over
    if (!l.rx_have) {
      RxStep s = rx_header(l, c, cur, &prog);
      if (s == RxStep::kStop) return prog;
      if (s == RxStep::kAgain) continue;
    }
    // a header is pending
    if (l.rx_h.type == FrameType::kSync) return rx_stashed_sync(l, c) || prog;
    if (c.mode == RxMode::kIdle) return prog;  // data waits for its operation
    RxStep s = c.mode == RxMode::kOp ? rx_op_data(l, c, &prog) : rx_discard(l, &prog);
    if (s == RxStep::kStop) return prog;
    if (s == RxStep::kDone) return true;
  }
}

// One non-blocking read. Returns the bytes read (> 0; counted, and the link's liveness clocks
// set), 0 after EINTR (try again) or -1 when nothing is there. Throws LinkFailure on EOF or error.
ssize_t Communicator::Impl::rx_read(Link& l, void* dst, size_t want, bool* prog) {
  ssize_t n = ::recv(l.fd.get(), dst, want, MSG_DONTWAIT);
  if (n > 0) {
    auto now = Clock::now();
    l.bytes_recv += uint64_t(n);
    l.last_rx = now;
    l.last_progress = now;
    *prog = true;
    return n;
  }
  if (n == 0) {
    if (l.peer_left) throw LinkFailure{&l, "it closed its communicator", false, true};
    throw LinkFailure{&l, "connection closed by peer", false};
  }
  if (errno == EINTR) return 0;
  if (errno == EAGAIN || errno == EWOULDBLOCK) return -1;
  throw LinkFailure{&l, errno_str("recv failed"), false};
}

// Reads (the rest of) a header and, once complete, checks it against the link's sequence and
// the epoch and dispatches it.
RxStep Communicator::Impl::rx_header(Link& l, RxCtx& c, uint64_t cur, bool* prog) {
  ssize_t n = rx_read(l, l.rx_hdr + l.rx_hdr_off, kHeaderSize - l.rx_hdr_off, prog);
  if (n < 0) return RxStep::kStop;
  if (n == 0) return RxStep::kAgain;
  l.rx_hdr_off += size_t(n);
  if (l.rx_hdr_off < kHeaderSize) return RxStep::kAgain;
  l.rx_hdr_off = 0;
  FrameHeader h;
  std::string err;
  if (!parse_header(l.rx_hdr, kHeaderSize, job_hash_, &h, &err))
    throw LinkFailure{&l, "malformed frame: " + err, true};
  if (h.seq != l.rx_seq)
    throw LinkFailure{&l, "frame sequence " + std::to_string(h.seq) + ", expected " + std::to_string(l.rx_seq), true};
  l.rx_seq++;
  l.frames_recv++;
  return rx_accept_header(l, c, h, cur);
}

// kAgain: the frame was consumed (heartbeat, ignored notice or stale sync); kOn: it is pending
// in l.rx_h (a data payload to read, or a sync of a later epoch kept for our own commit).
RxStep Communicator::Impl::rx_accept_header(Link& l, RxCtx& c, const FrameHeader& h, uint64_t cur) {
  if (h.epoch > cur && h.type != FrameType::kSync)
    throw LinkFailure{&l, std::string(frame_type_name(h.type)) + " frame from future epoch " + std::to_string(h.epoch),
                      true};
  switch (h.type) {
    case FrameType::kHeartbeat:
      return RxStep::kAgain;
    case FrameType::kGoodbye:  // its end follows; an operation that still needs this peer fails then
      l.peer_left = true;
      return RxStep::kAgain;
    case FrameType::kAbort:
      if ((c.mode == RxMode::kOp || c.mode == RxMode::kIdle) && h.epoch == cur)
        throw AbortReceived{&l, abort_lost(h.tag)};
      return RxStep::kAgain;
    case FrameType::kSync:
      if (h.epoch <= cur && !(c.mode == RxMode::kSync && h.epoch == c.sync_epoch)) return RxStep::kAgain;  // stale
      l.rx_have = true;
      l.rx_h = h;
      return RxStep::kOn;
    case FrameType::kData:
      if (h.epoch != cur && c.mode != RxMode::kSync && c.mode != RxMode::kDiscard)
        throw LinkFailure{&l, "data frame from epoch " + std::to_string(h.epoch), true};
      l.rx_have = true;
      l.rx_h = h;
      l.rx_off = l.rx_done = l.rx_carry = 0;
      l.rx_crc = 0;
      l.rx_bound = false;
      return RxStep::kOn;
    default:
      throw LinkFailure{&l, std::string("unexpected ") + frame_type_name(h.type) + " frame", true};
  }
}

// A pending sync: consumed (returns true) when it is the one an epoch switch waits for. Else it
// stays stashed; an operation still expecting data on this link gets EpochSwitched.
bool Communicator::Impl::rx_stashed_sync(Link& l, RxCtx& c) {
  if (c.mode == RxMode::kSync && l.rx_h.epoch == c.sync_epoch) {
    l.rx_have = false;
    c.got_sync = true;
    return true;
  }
  if (c.mode == RxMode::kOp && c.q && c.q->ri < c.q->rq.size())
    throw EpochSwitched{&l, l.rx_h.epoch};  // the sync stays stashed for our own commit
  return false;
}

// kDiscard / kSync: a data payload is read and dropped.
RxStep Communicator::Impl::rx_discard(Link& l, bool* prog) {
  const size_t len = size_t(l.rx_h.length);
  size_t want = std::min(len - l.rx_off, trash_.size());
  if (want > 0) {
    ssize_t n = rx_read(l, trash_.data(), want, prog);
    if (n < 0) return RxStep::kStop;
    if (n == 0) return RxStep::kAgain;
    l.rx_off += size_t(n);
  }
  if (l.rx_off == len) l.rx_have = false;
  return RxStep::kAgain;
}

// kOp: the pending data frame feeds the link's next receive (once its dependency is done): copied
// into place, or reduced with the receive's operand through the link's scratch buffer.
RxStep Communicator::Impl::rx_op_data(Link& l, RxCtx& c, bool* prog) {
  LinkQ* q = c.q;
  if (!q || q->ri >= q->rq.size()) return RxStep::kStop;  // belongs to a later operation
  Plan& p = *c.plan;
  RecvSeg& s = p.recvs[size_t(q->rq[q->ri])];
  if (s.dep >= 0 && !p.recvs[size_t(s.dep)].done) return RxStep::kStop;
  const size_t len = size_t(l.rx_h.length);
  if (!l.rx_bound) {
    if (len != s.len || l.rx_h.tag != p.tag) {
      throw LinkFailure{&l,
                        str_cat("frame does not match the operation (length ", len, " tag ", l.rx_h.tag,
                                ", expected length ", s.len, " tag ", p.tag, "): ranks called different collectives"),
                        true};
    }
    l.rx_bound = true;
  }
  const bool crc = (l.rx_h.flags & kFlagPayloadCrc) != 0;
  if (l.rx_off < len) {
    ssize_t n;
    if (!s.reduce) {
      n = rx_read(l, s.out + l.rx_off, len - l.rx_off, prog);
      if (n > 0) {
        if (crc) l.rx_crc = crc32c(l.rx_crc, s.out + l.rx_off, size_t(n));
        l.rx_off += size_t(n);
      }
    } else {
      n = rx_reduce_some(l, p, s, crc, prog);
    }
    if (n < 0) return RxStep::kStop;
    if (n == 0) return RxStep::kAgain;
  }
  if (l.rx_off == len) {
    if (crc && l.rx_crc != l.rx_h.payload_crc) throw LinkFailure{&l, "payload checksum mismatch", true};
    s.done = true;
    q->ri++;
    l.rx_have = false;
    // Nothing more to receive on this link in this operation: stop reading, what follows
    // belongs to the peer's next step (possibly its departure).
    if (q->ri >= q->rq.size()) return RxStep::kDone;
  }
  return RxStep::kAgain;
}

// Reads into the scratch buffer and reduces the whole elements received into s.out (a partial
// element is carried to the front of the buffer). Returns as rx_read.
ssize_t Communicator::Impl::rx_reduce_some(Link& l, const Plan& p, const RecvSeg& s, bool crc, bool* prog) {
  if (l.scratch.empty()) l.scratch.resize(kScratchBytes / 8);
  auto* sc = reinterpret_cast<uint8_t*>(l.scratch.data());
  size_t want = std::min(kScratchBytes - l.rx_carry, size_t(l.rx_h.length) - l.rx_off);
  ssize_t n = rx_read(l, sc + l.rx_carry, want, prog);
  if (n <= 0) return n;
  if (crc) l.rx_crc = crc32c(l.rx_crc, sc + l.rx_carry, size_t(n));
  l.rx_off += size_t(n);
  const size_t es = dtype_size(p.dt);
  size_t avail = l.rx_carry + size_t(n);
  size_t elems = avail / es;
  if (elems) reduce(p.dt, p.op, s.out + l.rx_done, s.a + l.rx_done, sc, elems);
  l.rx_done += elems * es;
  l.rx_carry = avail - elems * es;
  if (l.rx_carry) std::memmove(sc, sc + elems * es, l.rx_carry);
  return n;
}

}  // namespace tcp
}  // namespace tmrun
