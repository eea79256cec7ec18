// The operations and their plans: ring allreduce (large), two-arm tree allreduce (small, and
// barrier), chain broadcast, ring allgather and reduce-scatter, point-to-point. Each do_* runs on
// the worker thread: check, build the plan, run_plan, finish (AVG's division).
#include <algorithm>
#include <stdexcept>

#include "comm_impl.h"

namespace tmrun {
namespace tcp {

int Plan::send(Link* l, const uint8_t* src, size_t len, int dep) {
  sends.push_back(SendSeg{l, src, len, dep});
  return int(sends.size()) - 1;
}
int Plan::recv(Link* l, uint8_t* out, const uint8_t* a, size_t len, bool reduce, int dep) {
  recvs.push_back(RecvSeg{l, out, a, len, reduce, dep, false});
  return int(recvs.size()) - 1;
}

// ---------------------------------------------------------------- operations
void Communicator::Impl::do_allreduce(void* buf, size_t count, DType dt, ReduceOp op) {
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

void Communicator::Impl::do_broadcast(void* buf, size_t count, DType dt, int root) {
  if (root < 0 || root >= world_) throw std::invalid_argument("root out of range");
  check_healthy();
  collectives_++;
  Plan p = new_plan(dt, ReduceOp::kSum, kKindBroadcast);
  const size_t bytes = count * dtype_size(dt);
  if (world_ == 1 || bytes == 0) return;
  build_chain_broadcast(p, static_cast<uint8_t*>(buf), bytes, root, bytes <= opts_.small_bytes);
  run_plan(p);
}

void Communicator::Impl::do_allgather(void* out, const void* in, size_t count, DType dt) {
  check_healthy();
  collectives_++;
  Plan p = new_plan(dt, ReduceOp::kSum, kKindAllgather);
  const size_t B = count * dtype_size(dt);
  auto* o = static_cast<uint8_t*>(out);
  if (B && in != o + size_t(rank_) * B) std::memmove(o + size_t(rank_) * B, in, B);
  if (world_ == 1 || B == 0) return;
  build_ring_allgather(p, o, B);
  run_plan(p);
}

void Communicator::Impl::do_reduce_scatter(void* out, const void* in, size_t count, DType dt, ReduceOp op) {
  check_healthy();
  collectives_++;
  Plan p = new_plan(dt, op, kKindReduceScatter);
  const size_t es = dtype_size(dt), B = count * es;
  auto* o = static_cast<uint8_t*>(out);
  const auto* i8 = static_cast<const uint8_t*>(in);
  if (world_ == 1) {
    if (B && o != i8) std::memmove(o, i8, B);
    if (op == ReduceOp::kAvg) divide(dt, out, count, 1);
    return;
  }
  if (B == 0) return;
  build_ring_reduce_scatter(p, o, i8, B, es);
  run_plan(p);
  if (op == ReduceOp::kAvg) divide(dt, out, count, world_);
}

void Communicator::Impl::do_barrier() {
  check_healthy();
  collectives_++;
  Plan p = new_plan(DType::kUInt8, ReduceOp::kMax, kKindBarrier);
  if (world_ == 1) return;
  uint8_t token = 1;
  build_tree_allreduce(p, &token, 1);
  run_plan(p);
}

void Communicator::Impl::do_send(const void* buf, size_t bytes, int dst, uint32_t tag) {
  if (dst < 0 || dst >= world_ || dst == rank_) throw std::invalid_argument("invalid destination rank");
  if (tag >= (1u << 28)) throw std::invalid_argument("tag must be < 2**28");
  check_healthy();
  p2p_ops_++;
  Link* l = p2p_link(dst);
  Plan p;
  p.tag = (tag << 4) | kKindP2P;
  for (auto& s : p2p_segments(bytes)) p.send(l, static_cast<const uint8_t*>(buf) + s.first, s.second, -1);
  run_plan(p);
}

void Communicator::Impl::do_recv(void* buf, size_t bytes, int src, uint32_t tag) {
  if (src < 0 || src >= world_ || src == rank_) throw std::invalid_argument("invalid source rank");
  if (tag >= (1u << 28)) throw std::invalid_argument("tag must be < 2**28");
  check_healthy();
  p2p_ops_++;
  Link* l = p2p_link(src);
  Plan p;
  p.tag = (tag << 4) | kKindP2P;
  for (auto& s : p2p_segments(bytes)) p.recv(l, static_cast<uint8_t*>(buf) + s.first, nullptr, s.second, false, -1);
  run_plan(p);
}

// One plan for the whole batch: run_plan moves every link's sends and receives as they can go.
void Communicator::Impl::do_p2p_batch(const std::vector<Communicator::P2PItem>& items, uint32_t tag) {
  if (tag >= (1u << 28)) throw std::invalid_argument("tag must be < 2**28");
  for (const auto& it : items) {
    if (it.peer < 0 || it.peer >= world_ || it.peer == rank_)
      throw std::invalid_argument(it.send ? "invalid destination rank" : "invalid source rank");
  }
  check_healthy();
  p2p_ops_ += items.size();
  Plan p;
  p.tag = (tag << 4) | kKindP2P;
  for (const auto& it : items) {
    Link* l = p2p_link(it.peer);
    auto* base = static_cast<uint8_t*>(it.buf);
    for (auto& s : p2p_segments(it.bytes)) {
      if (it.send) {
        p.send(l, base + s.first, s.second, -1);
      } else {
        p.recv(l, base + s.first, nullptr, s.second, false, -1);
      }
    }
  }
  run_plan(p);
}

// ---------------------------------------------------------------- plans
// Every collective gets the next sequence number in its tag: a frame of another collective (ranks
// out of step) does not match the receive it arrives for.
Plan Communicator::Impl::new_plan(DType dt, ReduceOp op, uint32_t kind) {
  Plan p;
  p.dt = dt;
  p.op = op;
  p.tag = ((coll_seq_++ & 0x0FFFFFFFu) << 4) | kind;
  return p;
}

// (offset, length) pieces of at most segment_bytes, whole elements of es bytes.
void Communicator::Impl::segments(size_t bytes, size_t es, Segments* out) const {
  out->clear();
  size_t seg = std::max(es, (opts_.segment_bytes / es) * es);
  for (size_t off = 0; off < bytes; off += seg) out->emplace_back(off, std::min(seg, bytes - off));
}

// Ring reduce-scatter then ring allgather over world_size chunks (sizes differ by at most one
// element); segment j of a step depends on segment j of the previous step only.
void Communicator::Impl::build_ring_allreduce(Plan& p, uint8_t* buf, size_t count, size_t es) {
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
  Segments segs;
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
void Communicator::Impl::build_tree_allreduce(Plan& p, uint8_t* buf, size_t bytes) {
  const int n = world_, r = rank_, h = (n - 1) / 2;
  Link* nx = ring_link((r + 1) % n);
  Link* pv = ring_link((r + n - 1) % n);
  Segments segs;
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

// Pipelined chain from the root; bidirectional (both ring directions) for small messages.
void Communicator::Impl::build_chain_broadcast(Plan& p, uint8_t* buf, size_t bytes, int root, bool bidir) {
  const int n = world_, r = rank_;
  const int v = (r - root + n) % n;
  Link* nx = ring_link((r + 1) % n);
  Link* pv = ring_link((r + n - 1) % n);
  Segments segs;
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

// Ring allgather of blocks of B bytes in `out` (block r, this rank's, already in place).
void Communicator::Impl::build_ring_allgather(Plan& p, uint8_t* out, size_t B) {
  const int n = world_, r = rank_;
  Link* nx = ring_link((r + 1) % n);
  Link* pv = ring_link((r + n - 1) % n);
  auto blk = [&](int c) { return out + size_t(((c % n) + n) % n) * B; };
  Segments segs;
  segments(B, 1, &segs);
  std::vector<int> prev, cur;
  for (int s = 0; s < n - 1; ++s) {
    for (size_t j = 0; j < segs.size(); ++j) p.send(nx, blk(r - s) + segs[j].first, segs[j].second, s == 0 ? -1 : prev[j]);
    cur.clear();
    for (auto& sg : segs) cur.push_back(p.recv(pv, blk(r - s - 1) + sg.first, nullptr, sg.second, false, -1));
    prev = cur;
  }
}

// Ring reduce-scatter of `in` (world_size blocks of B bytes) into `out`; the input stays intact:
// partial sums go through work_ (world_size > 2).
void Communicator::Impl::build_ring_reduce_scatter(Plan& p, uint8_t* out, const uint8_t* in, size_t B, size_t es) {
  const int n = world_, r = rank_;
  Link* nx = ring_link((r + 1) % n);
  Link* pv = ring_link((r + n - 1) % n);
  if (n > 2) work_.resize(size_t(n) * B);
  auto mod = [n](int c) { return size_t(((c % n) + n) % n); };
  Segments segs;
  segments(B, es, &segs);
  std::vector<int> prev, cur;
  for (int s = 0; s < n - 1; ++s) {
    size_t sc = mod(r - s - 1);
    const uint8_t* src = s == 0 ? in + sc * B : work_.data() + sc * B;
    for (size_t j = 0; j < segs.size(); ++j) p.send(nx, src + segs[j].first, segs[j].second, s == 0 ? -1 : prev[j]);
    size_t rc = mod(r - s - 2);
    uint8_t* dst = s == n - 2 ? out : work_.data() + rc * B;
    cur.clear();
    for (auto& sg : segs) cur.push_back(p.recv(pv, dst + sg.first, in + rc * B + sg.first, sg.second, true, -1));
    prev = cur;
  }
}

// Point to point: the message in segments (an empty message is still one frame).
Segments Communicator::Impl::p2p_segments(size_t bytes) const {
  Segments segs;
  segments(bytes, 1, &segs);
  if (segs.empty()) segs.emplace_back(0, 0);
  return segs;
}

}  // namespace tcp
}  // namespace tmrun
