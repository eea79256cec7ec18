// tmrun TCP communicator: ring-neighbour links, deterministic ring collectives, bounded failure
// detection, and two-phase replacement of members that only reopens links touching them.
//
// This is the whole public surface (used by bind_comm.cpp and the C++ tests). The engine (link
// table, framing, plans, threads, locks) lives behind the pimpl in src/tcp/comm_impl.h.
#pragma once
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "tmrun/errors.h"
#include "tmrun/reduce.h"

namespace tmrun {
namespace tcp {

struct Options {
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
  std::string token;                     // job token: every link proves it (challenge-response
                                         // before any frame); empty = no authentication
};

// Completion state of one queued operation (the handle the *_async calls return).
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

// A snapshot of one link (links()).
struct LinkInfo {
  int peer;
  uint64_t id;            // process-wide unique: the same id means the same connection
  uint64_t opened_epoch;
  bool ring;              // ring-neighbour link (else: lazily opened point-to-point link)
  bool open;
  uint64_t bytes_sent, bytes_recv, frames_sent, frames_recv;
  std::string error;
};

struct Counters {
  uint64_t links_opened = 0;
  uint64_t links_closed = 0;
  uint64_t collectives = 0;
  uint64_t p2p_ops = 0;
  uint64_t bytes_sent = 0;
  uint64_t bytes_recv = 0;
  uint64_t rejected_connections = 0;
  uint64_t auth_failures = 0;  // connections (accepted or dialled) that failed authentication
  uint64_t commits = 0;
  uint64_t prepares_superseded = 0;  // pending prepares whose dials and waits a newer prepare() ended
  std::map<int, std::pair<uint64_t, uint64_t>> per_peer;  // peer -> (sent, received)
  std::string last_reject_reason;
};

struct FailureInfo {  // a recorded failure: the epoch it poisoned, the lost rank (-1 unknown)
  uint64_t epoch = 0;
  int peer = -1;
  bool protocol = false;
  std::string message;
};

class Communicator {
 public:
  using Op = std::shared_ptr<OpState>;

  // Listens at once (Options::bind_address/port); no link exists until connect().
  Communicator(int rank, int world_size, std::string job_id, uint64_t epoch, Options opts);
  ~Communicator();  // close()
  Communicator(const Communicator&) = delete;
  Communicator& operator=(const Communicator&) = delete;

  int rank() const;
  int world_size() const;
  uint64_t epoch() const;
  int port() const;
  std::string address() const;  // "host:port" to publish
  const std::string& job_id() const;
  const Options& options() const;
  // Ranks this rank holds ring links to (0, 1 or 2 peers).
  std::vector<int> ring_peers() const;

  // Establishes the ring links for the current epoch (blocks, up to connect_timeout).
  // addresses[r] = "host:port" of rank r. Also the entry point of a joiner (a communicator
  // created with the new epoch).
  void connect(const std::vector<std::string>& addresses);

  // ---- operations: queued, run one at a time in submission order on the worker thread.
  // Buffers must stay alive and untouched until the returned state is done; argument errors
  // (std::invalid_argument) and communication errors surface through it.
  Op allreduce_async(void* buf, size_t count, DType dt, ReduceOp op);
  Op broadcast_async(void* buf, size_t count, DType dt, int root);
  Op allgather_async(void* out, const void* in, size_t count, DType dt);      // out: world * count
  Op reduce_scatter_async(void* out, const void* in, size_t count, DType dt,  // in: world * count
                          ReduceOp op);
  Op barrier_async();
  Op send_async(const void* buf, size_t bytes, int dst, uint32_t tag);
  Op recv_async(void* buf, size_t bytes, int src, uint32_t tag);
  // Several sends and receives as one operation (NCCL's group call, torch's batch_isend_irecv):
  // they move together, so two ranks that each send the other more than the sockets buffer
  // before receiving do not wait on each other. Per peer and direction, in the items' order.
  struct P2PItem {
    bool send;
    void* buf;  // read for a send, written for a receive
    size_t bytes;
    int peer;
  };
  Op p2p_batch_async(std::vector<P2PItem> items, uint32_t tag);

  // ---- two-phase replacement. Survivors call prepare() (returns at once; links to joiners are
  // built in the background), then commit_async() (queued behind the running operations).
  void prepare(const std::vector<int>& replaced, const std::map<int, std::string>& new_addresses,
               uint64_t new_epoch);
  bool prepare_done() const;
  bool prepare_pending() const;
  // Ends the pending prepare's dials and waits now, if its links are not ready yet (any thread):
  // a commit waiting for them fails at once ("superseded") instead of at connect_timeout.
  // Returns whether there was one to end.
  bool cancel_prepare();
  Op commit_async();

  // ---- introspection (any thread, never waits for a running operation)
  std::vector<LinkInfo> links() const;
  Counters counters() const;
  std::string failure() const;  // sticky failure of this epoch ("" when healthy)
  // Blocks (up to timeout_s) until a failure is recorded in an epoch other than ignore_epoch
  // (-1: any); returns false on timeout or close. Lets a watcher thread learn of a loss at once,
  // without polling, while the owner computes.
  bool wait_failure(double timeout_s, int64_t ignore_epoch, FailureInfo* out) const;

  // Idempotent; fails the operations still queued. Says goodbye on every link first (bounded,
  // 0.5 s at most): a peer then sees a clean leave, not a lost rank, unless it needs this rank.
  void close();
  // Test hook: closes without the goodbye, as a killed process ends its connections.
  void debug_vanish();
  // Test hook: writes raw bytes on the link to `peer`, bypassing framing.
  void debug_send_raw(int peer, const std::string& bytes);

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace tcp
}  // namespace tmrun
