// Private to the TCP communicator's implementation (src/tcp/*.cpp): the engine behind
// tmrun::tcp::Communicator's pimpl. Links, plans, receive contexts, the threads and their locks.
//
// Threads: the caller's (connect, prepare, introspection), the worker (operations and commit,
// one at a time, under op_mu_), the service thread (accepts and handshakes connections; idle
// ticks under op_mu_ when no operation holds it) and prepare's background thread (dials and
// awaits the joiners' links).
//
// Locks: op_mu_ serialises every access to link I/O state. table_mu_ guards the link table's
// structure and each link's broken / error / fd for readers without op_mu_ (links(), counters(),
// the acceptor). Lock order: op_mu_ before table_mu_. fail_mu_ guards the sticky failure for
// failure(); accept_mu_ the accepted connections and the pending replacement; q_mu_ the queue.
#pragma once
#include <atomic>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <poll.h>
#include <sys/types.h>

#include "tmrun/auth.h"
#include "tmrun/frame.h"
#include "tmrun/net.h"
#include "tmrun/reduce.h"
#include "tmrun/tcp_comm.h"

namespace tmrun {
namespace tcp {

// ---------------------------------------------------------------- small shared helpers
constexpr size_t kScratchBytes = 256 * 1024;  // per-link reduce staging; discard buffer
constexpr uint32_t kKindAllreduce = 1, kKindBroadcast = 2, kKindAllgather = 3, kKindReduceScatter = 4,
                   kKindBarrier = 5, kKindP2P = 7;

// Abort notice tag when no rank was lost: an operation timed out on some rank (lost = -1).
constexpr uint32_t kAbortUnknown = 0xFFFFFFFFu;
inline uint32_t abort_tag(int lost) { return lost < 0 ? kAbortUnknown : uint32_t(lost); }
inline int abort_lost(uint32_t tag) { return tag == kAbortUnknown ? -1 : int(tag); }

inline Clock::duration secs(double s) {
  return std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(s));
}
inline double to_secs(Clock::duration d) { return std::chrono::duration<double>(d).count(); }

inline std::string errno_str(const char* what) { return std::string(what) + ": " + std::strerror(errno); }

// ---------------------------------------------------------------- links
// One TCP connection to a peer. Owned by the link table (or retired_, accepted_, pending
// replacement); never copied.
struct Link {
  Link(int peer_, uint64_t epoch_, Fd fd_, bool ring_);
  int peer;
  uint64_t id;            // process-wide unique: the same id means the same link object
  uint64_t opened_epoch;  // epoch in which the link was opened
  bool ring;              // ring-neighbour link (else: lazily opened point-to-point link)
  Fd fd;
  bool broken = false;
  bool peer_left = false;  // a goodbye arrived: the peer closed its communicator (no heartbeats to it)
  std::string error;

  // transmit state: the frame in flight
  bool tx_busy = false;
  bool tx_is_data = false;
  uint8_t tx_hdr[kHeaderSize];
  size_t tx_hdr_off = 0;
  const uint8_t* tx_payload = nullptr;
  size_t tx_len = 0, tx_off = 0;
  uint64_t tx_seq = 1;
  bool sync_sent = false;

  // receive state
  bool rx_have = false;  // a parsed header waits in rx_h (data payload pending, or stashed sync)
  uint8_t rx_hdr[kHeaderSize];
  size_t rx_hdr_off = 0;
  FrameHeader rx_h;
  size_t rx_off = 0;     // payload bytes read
  size_t rx_done = 0;    // payload bytes delivered (copied or reduced)
  size_t rx_carry = 0;   // partial element bytes at the front of scratch
  uint32_t rx_crc = 0;
  bool rx_bound = false;
  uint64_t rx_seq = 1;
  std::vector<uint64_t> scratch;  // receive staging for reductions (8-byte aligned)

  Clock::time_point last_rx, last_tx, last_progress;
  std::atomic<uint64_t> bytes_sent{0}, bytes_recv{0}, frames_sent{0}, frames_recv{0};
};

// An accepted connection whose hello is still being read (service thread).
struct PendingConn {
  Fd fd;
  bool authed = true;                      // false until the dialer proved the job token
  uint8_t nonce[32];                       // our challenge (auth::kNonceSize)
  uint8_t reply[64];                       // the dialer's nonce and proof (auth::kReplySize)
  size_t reply_got = 0;
  uint8_t buf[kHeaderSize + kHelloSize];
  size_t got = 0;
  Clock::time_point deadline;
};

// ---------------------------------------------------------------- plans
// An operation is a plan: send and receive segments per link, each optionally waiting for a
// receive (dep) to complete first. run_plan drives them all with non-blocking I/O.
struct SendSeg {
  Link* link;
  const uint8_t* src;
  size_t len;
  int dep;  // index of the receive that must complete first (-1: none)
};
struct RecvSeg {
  Link* link;
  uint8_t* out;
  const uint8_t* a;  // reduce: out = a (op) incoming
  size_t len;
  bool reduce;
  int dep;  // receive that must complete before this one is consumed (-1: none)
  bool done = false;
};
struct Plan {
  std::vector<SendSeg> sends;
  std::vector<RecvSeg> recvs;
  DType dt = DType::kUInt8;
  ReduceOp op = ReduceOp::kSum;
  uint32_t tag = 0;
  int send(Link* l, const uint8_t* src, size_t len, int dep);
  int recv(Link* l, uint8_t* out, const uint8_t* a, size_t len, bool reduce, int dep);
};
using Segments = std::vector<std::pair<size_t, size_t>>;  // (offset, length)

// One link's share of a plan, in order.
struct LinkQ {
  Link* link;
  std::vector<int> sq, rq;  // indices into Plan::sends / Plan::recvs
  size_t si = 0, ri = 0;    // next send / receive
  bool hb_failed = false;   // heartbeat write failed after this link's part was over
  bool over() const { return si == sq.size() && ri == rq.size(); }
};

// What rx_pump does with incoming frames.
enum class RxMode {
  kOp,       // data belongs to the plan's receives (c.q, c.plan)
  kIdle,     // between operations: heartbeats and control frames only, data waits
  kDiscard,  // read and drop everything (abort notices going out)
  kSync,     // epoch switch: wait for the peer's sync of sync_epoch, drop data
};
struct RxCtx {
  RxMode mode;
  LinkQ* q = nullptr;
  Plan* plan = nullptr;
  uint64_t sync_epoch = 0;
  bool got_sync = false;
};
// One step of rx_pump's loop.
enum class RxStep {
  kAgain,  // loop again
  kOn,     // go on with the pending header in this iteration
  kStop,   // return (progress so far)
  kDone,   // return true: this link's part of the operation (or the sync) is complete
};

// Thrown inside the engine, caught by the run / tick / sync loops.
struct LinkFailure {  // a link-level failure (EOF, reset, timeout, protocol)
  Link* link;
  std::string reason;
  bool protocol;
  bool left = false;  // the peer said goodbye (closed its communicator) before the link ended
};
struct AbortReceived {
  Link* from;
  int lost;
};
struct EpochSwitched {  // thrown by rx_pump: a sync of a later epoch where an operation expects data
  Link* link;
  uint64_t epoch;
};

// ---------------------------------------------------------------- the engine
struct Communicator::Impl {
  Impl(int rank, int world_size, std::string job_id, uint64_t epoch, Options opts);
  ~Impl();  // close()
  Impl(const Impl&) = delete;
  Impl& operator=(const Impl&) = delete;

  // ---- facade (communicator.cpp)
  std::string address() const;
  std::vector<int> ring_peers() const;
  std::shared_ptr<OpState> submit(std::function<void()> fn);
  void worker_loop();
  void close();

  // ---- operations, on the worker thread under op_mu_ (collectives.cpp, replace.cpp)
  void do_allreduce(void* buf, size_t count, DType dt, ReduceOp op);
  void do_broadcast(void* buf, size_t count, DType dt, int root);
  void do_allgather(void* out, const void* in, size_t count, DType dt);
  void do_reduce_scatter(void* out, const void* in, size_t count, DType dt, ReduceOp op);
  void do_barrier();
  void do_send(const void* buf, size_t bytes, int dst, uint32_t tag);
  void do_recv(void* buf, size_t bytes, int src, uint32_t tag);
  void do_p2p_batch(const std::vector<Communicator::P2PItem>& items, uint32_t tag);
  void do_commit();

  // ---- plans (collectives.cpp)
  Plan new_plan(DType dt, ReduceOp op, uint32_t kind);
  void segments(size_t bytes, size_t es, Segments* out) const;
  void build_ring_allreduce(Plan& p, uint8_t* buf, size_t count, size_t es);
  void build_tree_allreduce(Plan& p, uint8_t* buf, size_t bytes);
  void build_chain_broadcast(Plan& p, uint8_t* buf, size_t bytes, int root, bool bidirectional);
  void build_ring_allgather(Plan& p, uint8_t* out, size_t block);
  void build_ring_reduce_scatter(Plan& p, uint8_t* out, const uint8_t* in, size_t block, size_t es);
  Segments p2p_segments(size_t bytes) const;

  // ---- plan runner (runner.cpp)
  void run_plan(Plan& p);
  std::set<Link*> begin_op(std::vector<LinkQ>& qs, Clock::time_point now);
  void drive_plan(Plan& p, std::vector<LinkQ>& qs, const std::set<Link*>& op_links, Clock::time_point start);
  bool pump_op_links(Plan& p, std::vector<LinkQ>& qs, Clock::time_point now, bool* done);
  void check_op_liveness(Plan& p, std::vector<LinkQ>& qs, Clock::time_point now);

  // ---- framing: the send and receive pumps (pump.cpp)
  void start_frame(Link& l, FrameType t, uint32_t tag, const uint8_t* payload, size_t len);
  bool tx_pump(Link& l, LinkQ* q, Plan* p, Clock::time_point now, bool allow_heartbeat = true);
  bool rx_pump(Link& l, RxCtx& c);
  ssize_t rx_read(Link& l, void* dst, size_t want, bool* prog);
  RxStep rx_header(Link& l, RxCtx& c, uint64_t cur, bool* prog);
  RxStep rx_accept_header(Link& l, RxCtx& c, const FrameHeader& h, uint64_t cur);
  bool rx_stashed_sync(Link& l, RxCtx& c);
  RxStep rx_discard(Link& l, bool* prog);
  RxStep rx_op_data(Link& l, RxCtx& c, bool* prog);
  ssize_t rx_reduce_some(Link& l, const Plan& p, const RecvSeg& s, bool crc, bool* prog);

  // ---- failure detection and propagation (health.cpp)
  void idle_tick(const std::set<Link*>& exclude);
  void fail_op(Link* failed_link, const std::string& reason, bool protocol, int lost, Link* abort_from);
  void record_failure(int peer, int reporter, bool protocol, std::string msg);
  std::string notice_msg(int lost, int from) const;
  void notify_abort(int lost);
  bool push_abort(Link& l, int lost, bool* queued, Clock::time_point now);
  [[noreturn]] void raise_failure();
  void check_healthy();
  std::string failure() const;
  bool wait_failure(double timeout_s, int64_t ignore_epoch, FailureInfo* out) const;

  // ---- link table and dialling (links.cpp)
  void connect(const std::vector<std::string>& addresses);
  std::unique_ptr<Link> dial_peer(const std::string& address, int peer, uint64_t epoch, bool ring,
                                  Clock::time_point deadline, bool tick_idle = false,
                                  const std::atomic<bool>* cancel = nullptr);
  std::unique_ptr<Link> dial_once(const std::string& host, int port, int peer, uint64_t epoch, bool ring,
                                  Clock::time_point deadline, const WaitTick& tick);
  void install_link(std::unique_ptr<Link> l);
  Link* ring_link(int peer);
  Link* p2p_link(int peer);
  void close_link(Link& l, const std::string& why);
  void retire(std::unique_ptr<Link> l);
  void say_goodbye();
  bool read_to_end(Link& l);
  void note_left(int peer, std::string msg);
  void drain_retired();
  std::vector<LinkInfo> links() const;
  Counters counters() const;
  void debug_send_raw(int peer, const std::string& bytes);

  // ---- acceptor: the service thread (acceptor.cpp)
  void service_loop();
  void accept_new(std::vector<PendingConn>& pend, Clock::time_point now);
  bool read_hello(PendingConn& pc, Clock::time_point now);
  int read_auth(PendingConn& pc, Clock::time_point now);
  void auth_fail(const std::string& why);
  void authenticate_dial(int fd, const std::string& address, int peer, Clock::time_point deadline,
                         const WaitTick& tick);
  void handle_hello(PendingConn& pc);
  void refuse(PendingConn& pc, const std::string& why);
  void reject(const std::string& why);
  std::unique_ptr<Link> await_accepted(int peer, uint64_t epoch, Clock::time_point deadline, bool tick_idle,
                                       const std::atomic<bool>* cancel = nullptr);

  // ---- replacement (replace.cpp)
  void prepare(const std::vector<int>& replaced, const std::map<int, std::string>& new_addresses,
               uint64_t new_epoch);
  void prepare_links(std::vector<int> needed, uint64_t new_epoch, std::map<int, std::string> new_addresses);
  bool prepare_done() const;
  bool prepare_pending() const;
  bool cancel_prepare();
  void await_prepared(std::unique_lock<std::mutex>& g);
  void retire_replaced(const std::set<int>& replaced);
  void sync_links(uint64_t new_epoch);
  bool sync_step(Link& l, bool got, uint64_t new_epoch, Clock::time_point now, bool* prog);

  // ---- state
  const int rank_, world_;
  const std::string job_id_;
  const uint64_t job_hash_;
  std::atomic<uint64_t> epoch_;
  Options opts_;
  double hb_interval_;
  Fd listen_fd_;
  // The service loop's wake-up (a pipe): close() writes a byte, so the loop leaves at once and not at
  // its next poll timeout (up to 50 ms per communicator closed).
  Fd wake_r_, wake_w_;
  int port_ = 0;
  std::vector<std::string> addresses_;

  // op_mu_ serialises every access to link I/O state (worker thread and idle service ticks).
  std::mutex op_mu_;
  // table_mu_ guards the link table's structure for readers (links(), counters(), acceptor), and
  // each link's broken, error and fd (written under op_mu_ and table_mu_, read by links()).
  // Lock order: op_mu_ before table_mu_.
  mutable std::mutex table_mu_;
  std::map<int, std::unique_ptr<Link>> links_;
  std::map<int, std::pair<uint64_t, uint64_t>> closed_bytes_;  // per peer, from closed links
  std::vector<std::unique_ptr<Link>> retired_;  // shut down, drained until the peer closes
  std::atomic<uint64_t> links_opened_{0}, links_closed_{0}, collectives_{0}, p2p_ops_{0},
      rejected_{0}, commits_{0}, auth_failures_{0};
  std::string last_reject_;
  uint32_t coll_seq_ = 0;

  // sticky failure of the current epoch. Written only by record_failure / do_commit, which hold
  // op_mu_ *and* fail_mu_: code under op_mu_ may read it freely, failure() (any thread, no op_mu_:
  // an operation may hold that for minutes) reads it under fail_mu_.
  mutable std::mutex fail_mu_;
  mutable std::condition_variable fail_cv_;  // notified when a failure is recorded, and on close
  bool failed_ = false;
  uint64_t failed_epoch_ = 0;
  int failed_peer_ = -1;  // -1: unknown (an operation timed out)
  int failed_reporter_ = -1;
  bool failed_protocol_ = false;
  std::string failed_msg_;
  // a peer that left cleanly (a goodbye) while no operation needed it: not a failure of the epoch
  // (operations that do not need it go on), but wait_failure() names it (fail_mu_)
  bool left_ = false;
  uint64_t left_epoch_ = 0;
  int left_peer_ = -1;
  std::string left_msg_;
  std::set<int> aborted_peers_;  // losses already announced this epoch (op_mu_)

  // accepted, handshaken connections waiting to be claimed: (peer, epoch) -> link
  mutable std::mutex accept_mu_;
  std::condition_variable accept_cv_;
  std::map<std::pair<int, uint64_t>, std::unique_ptr<Link>> accepted_;
  // pending replacement (accept_mu_)
  bool pending_ = false;
  uint64_t pending_epoch_ = 0;
  std::set<int> pending_replaced_;
  std::map<int, std::string> pending_addresses_;
  std::map<int, std::unique_ptr<Link>> pending_links_;
  std::string pending_error_;
  bool pending_ready_ = false;
  std::thread prepare_thread_;
  // set by a newer prepare() while it ends the pending one's dials and waits (a joiner that may be gone)
  std::atomic<bool> prepare_cancel_{false};
  std::atomic<uint64_t> prepares_superseded_{0};

  // threads
  std::atomic<bool> stop_{false};
  std::atomic<bool> goodbye_{true};  // close() says goodbye (debug_vanish: not)
  std::thread service_;
  std::mutex q_mu_;
  std::condition_variable q_cv_;
  std::deque<std::pair<std::function<void()>, std::shared_ptr<OpState>>> queue_;
  std::thread worker_;
  std::vector<uint8_t> work_;  // reduce-scatter staging
  std::vector<uint8_t> trash_;
};

}  // namespace tcp
}  // namespace tmrun
