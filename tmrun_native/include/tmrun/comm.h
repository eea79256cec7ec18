// tmrun TCP communicator: ring-neighbour links, deterministic ring collectives, bounded failure
// detection, and two-phase replacement of members that only reopens links touching them.
#pragma once
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <exception>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "tmrun/frame.h"
#include "tmrun/net.h"
#include "tmrun/reduce.h"

namespace tmrun {

// ---- errors (translated to Python exceptions at the binding boundary) ----
class CommError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// A peer died, reset its connection, stopped answering, or was reported lost by a neighbour.
class PeerLostError : public CommError {
 public:
  PeerLostError(int peer_, uint64_t epoch_, int reporter_, const std::string& what)
      : CommError(what), peer(peer_), epoch(epoch_), reporter(reporter_) {}
  int peer;
  uint64_t epoch;
  int reporter;  // rank that observed the loss (this rank, or the neighbour that reported it)
};

// A malformed or foreign frame arrived on the link to `peer`; that link was closed.
class ProtocolError : public CommError {
 public:
  ProtocolError(int peer_, const std::string& what) : CommError(what), peer(peer_) {}
  int peer;
};

class CommTimeoutError : public CommError {
 public:
  using CommError::CommError;
};

struct CommOptions {
  std::string bind_address = "127.0.0.1";
  int port = 0;                          // 0 = ephemeral
  std::string advertise_host;            // host written into `address` (default: bind address,
                                         // or 127.0.0.1 for 0.0.0.0)
  double timeout = 2.0;                  // s without any byte from a peer we wait on -> lost
  double connect_timeout = 30.0;         // s for connect() / prepare() / lazy p2p links
  double op_timeout = 300.0;             // s cap on one operation (0 = none)
  size_t segment_bytes = 512 * 1024;     // pipelining unit of ring collectives
  size_t small_bytes = 64 * 1024;        // allreduce/broadcast at or below: latency path
  bool payload_checksum = false;         // CRC-32C over every data payload
  int socket_buffer = 4 * 1024 * 1024;   // SO_SNDBUF/SO_RCVBUF (0 = kernel autotuning)
  double heartbeat_interval = 0.0;       // 0 = timeout / 4
};

// Completion state of one queued operation.
class OpState {
 public:
  void finish(std::exception_ptr err);
  // Waits up to `seconds` (< 0: forever). Returns true when done.
  bool wait(double seconds);
  bool done() const;
  std::exception_ptr error() const;

 private:
  mutable std::mutex mu_;
  std::condition_variable cv_;
  bool done_ = false;
  std::exception_ptr err_;
};

// One TCP connection to a peer. Owned by the communicator's link table; never copied.
struct Link {
  Link(int peer_, uint64_t epoch_, Fd fd_, bool ring_);
  int peer;
  uint64_t id;            // process-wide unique: the same id means the same link object
  uint64_t opened_epoch;  // epoch in which the link was opened
  bool ring;              // ring-neighbour link (else: lazily opened point-to-point link)
  Fd fd;
  bool broken = false;
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

struct LinkInfo {
  int peer;
  uint64_t id;
  uint64_t opened_epoch;
  bool ring;
  bool open;
  uint64_t bytes_sent, bytes_recv, frames_sent, frames_recv;
  std::string error;
};

struct CommCounters {
  uint64_t links_opened = 0;
  uint64_t links_closed = 0;
  uint64_t collectives = 0;
  uint64_t p2p_ops = 0;
  uint64_t bytes_sent = 0;
  uint64_t bytes_recv = 0;
  uint64_t rejected_connections = 0;
  uint64_t commits = 0;
  std::map<int, std::pair<uint64_t, uint64_t>> per_peer;  // peer -> (sent, received)
  std::string last_reject_reason;
};

class Communicator {
 public:
  Communicator(int rank, int world_size, std::string job_id, uint64_t epoch, CommOptions opts);
  ~Communicator();
  Communicator(const Communicator&) = delete;
  Communicator& operator=(const Communicator&) = delete;

  int rank() const { return rank_; }
  int world_size() const { return world_; }
  uint64_t epoch() const { return epoch_.load(); }
  int port() const { return port_; }
  std::string address() const;
  const std::string& job_id() const { return job_id_; }
  const CommOptions& options() const { return opts_; }
  // Ranks this rank holds ring links to (0, 1 or 2 peers).
  std::vector<int> ring_peers() const;

  // Establishes the ring links for the current epoch. addresses[r] = "host:port" of rank r.
  // Also the entry point of a joiner (a communicator created with the new epoch).
  void connect(const std::vector<std::string>& addresses);

  // ---- operations: run on the communicator's worker thread, in submission order ----
  std::shared_ptr<OpState> submit(std::function<void()> fn);

  // Bodies (called on the worker thread by the bindings' jobs).
  void do_allreduce(void* buf, size_t count, DType dt, ReduceOp op);
  void do_broadcast(void* buf, size_t count, DType dt, int root);
  void do_allgather(void* out, const void* in, size_t count, DType dt);
  void do_reduce_scatter(void* out, const void* in, size_t count, DType dt, ReduceOp op);
  void do_barrier();
  void do_send(const void* buf, size_t bytes, int dst, uint32_t tag);
  void do_recv(void* buf, size_t bytes, int src, uint32_t tag);
  void do_commit();

  // Two-phase replacement. Survivors call prepare() (returns at once; links to joiners are
  // built in the background), then commit() (queued behind running operations).
  void prepare(const std::vector<int>& replaced, const std::map<int, std::string>& new_addresses,
               uint64_t new_epoch);
  bool prepare_done() const;
  bool prepare_pending() const;

  std::vector<LinkInfo> links() const;
  CommCounters counters() const;
  std::string failure() const;  // sticky failure of this epoch ("" when healthy)

  void close();
  // Test hook: writes raw bytes on the link to `peer`, bypassing framing.
  void debug_send_raw(int peer, const std::string& bytes);

 private:
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
  struct LinkQ {
    Link* link;
    std::vector<int> sq, rq;
    size_t si = 0, ri = 0;
    bool hb_failed = false;  // heartbeat write failed after this link's part was over
  };
  enum class RxMode { kOp, kIdle, kDiscard, kSync };
  struct RxCtx {
    RxMode mode;
    LinkQ* q = nullptr;
    Plan* plan = nullptr;
    uint64_t sync_epoch = 0;
    bool got_sync = false;
  };
  struct LinkFailure {  // thrown internally: a link-level failure (EOF, reset, timeout, protocol)
    Link* link;
    std::string reason;
    bool protocol;
  };
  struct AbortReceived {
    Link* from;
    int lost;
  };
  struct EpochSwitched {  // thrown by rx_pump: a sync of a later epoch where an operation expects data
    Link* link;
    uint64_t epoch;
  };

  // engine
  void run_plan(Plan& p);
  bool tx_pump(Link& l, LinkQ* q, Plan* p, Clock::time_point now, bool allow_heartbeat = true);
  bool rx_pump(Link& l, RxCtx& c);
  void start_frame(Link& l, FrameType t, uint32_t tag, const uint8_t* payload, size_t len);
  void fail_op(Link* failed_link, const std::string& reason, bool protocol, int lost, Link* abort_from);
  void record_failure(int peer, int reporter, bool protocol, std::string msg);
  std::string notice_msg(int lost, int from) const;
  void notify_abort(int lost);
  void close_link(Link& l, const std::string& why);
  [[noreturn]] void raise_failure();
  void check_healthy();
  void idle_tick(const std::set<Link*>& exclude);
  void retire(std::unique_ptr<Link> l);
  void drain_retired();
  void sync_links(uint64_t new_epoch);

  Link* ring_link(int peer);
  Link* p2p_link(int peer);
  Plan new_plan(DType dt, ReduceOp op, uint32_t kind);
  void build_ring_allreduce(Plan& p, uint8_t* buf, size_t count, size_t es);
  void build_tree_allreduce(Plan& p, uint8_t* buf, size_t bytes);
  void build_chain_broadcast(Plan& p, uint8_t* buf, size_t bytes, int root, bool bidirectional);
  void segments(size_t bytes, size_t es, std::vector<std::pair<size_t, size_t>>* out) const;

  // bootstrap / accept
  std::unique_ptr<Link> dial_peer(const std::string& address, int peer, uint64_t epoch, bool ring,
                                  Clock::time_point deadline, bool tick_idle = false);
  std::unique_ptr<Link> await_accepted(int peer, uint64_t epoch, Clock::time_point deadline,
                                       bool tick_idle);
  void service_loop();
  void worker_loop();
  struct PendingConn {
    Fd fd;
    uint8_t buf[kHeaderSize + kHelloSize];
    size_t got = 0;
    Clock::time_point deadline;
  };
  void handle_hello(PendingConn& pc);
  void reject(const std::string& why);
  void install_link(std::unique_ptr<Link> l);

  const int rank_, world_;
  const std::string job_id_;
  const uint64_t job_hash_;
  std::atomic<uint64_t> epoch_;
  CommOptions opts_;
  double hb_interval_;
  Fd listen_fd_;
  int port_ = 0;
  std::vector<std::string> addresses_;

  // op_mu_ serialises every access to link I/O state (worker thread and idle service ticks).
  std::mutex op_mu_;
  // table_mu_ guards the link table's structure for readers (links(), counters(), acceptor), and
  // each link's broken, error and fd (written under op_mu_ and table_mu_, read by links()).
  // Lock order: op_mu_ before table_mu_.
  mutable std::mutex table_mu_;
  std::map<int, std::unique_ptr<Link>> links_;
  std::map<int, std::pair<uint64_t, uint64_t>> closed_bytes_;
  std::vector<std::unique_ptr<Link>> retired_;  // shut down, drained until the peer closes  // per peer, from closed links
  std::atomic<uint64_t> links_opened_{0}, links_closed_{0}, collectives_{0}, p2p_ops_{0},
      rejected_{0}, commits_{0};
  std::string last_reject_;
  uint32_t coll_seq_ = 0;

  // sticky failure of the current epoch. Written only by record_failure / do_commit, which hold
  // op_mu_ *and* fail_mu_: code under op_mu_ may read it freely, failure() (any thread, no op_mu_:
  // an operation may hold that for minutes) reads it under fail_mu_.
  mutable std::mutex fail_mu_;
  bool failed_ = false;
  int failed_peer_ = -1;  // -1: unknown (an operation timed out)
  int failed_reporter_ = -1;
  bool failed_protocol_ = false;
  std::string failed_msg_;
  std::set<int> aborted_peers_;  // losses already announced this epoch (op_mu_)

  // accepted, handshaken connections waiting to be claimed: (peer, epoch) -> link
  std::mutex accept_mu_;
  std::condition_variable accept_cv_;
  std::map<std::pair<int, uint64_t>, std::unique_ptr<Link>> accepted_;
  // pending replacement
  bool pending_ = false;
  uint64_t pending_epoch_ = 0;
  std::set<int> pending_replaced_;
  std::map<int, std::string> pending_addresses_;
  std::map<int, std::unique_ptr<Link>> pending_links_;
  std::string pending_error_;
  bool pending_ready_ = false;
  std::thread prepare_thread_;

  // threads
  std::atomic<bool> stop_{false};
  std::thread service_;
  std::mutex q_mu_;
  std::condition_variable q_cv_;
  std::deque<std::pair<std::function<void()>, std::shared_ptr<OpState>>> queue_;
  std::thread worker_;
  std::vector<uint8_t> work_;  // reduce-scatter staging
  std::vector<uint8_t> trash_;
};

}  // namespace tmrun
