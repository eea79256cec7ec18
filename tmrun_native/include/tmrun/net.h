// Small POSIX socket helpers: an owning file descriptor and deadline-bounded I/O.
#pragma once
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <utility>

namespace tmrun {

using Clock = std::chrono::steady_clock;

// Owns a file descriptor; closes it on destruction.
class Fd {
 public:
  Fd() = default;
  explicit Fd(int fd) : fd_(fd) {}
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  Fd(Fd&& o) noexcept : fd_(std::exchange(o.fd_, -1)) {}
  Fd& operator=(Fd&& o) noexcept {
    if (this != &o) {
      reset();
      fd_ = std::exchange(o.fd_, -1);
    }
    return *this;
  }
  ~Fd() { reset(); }
  int get() const { return fd_; }
  bool valid() const { return fd_ >= 0; }
  void reset() noexcept;

 private:
  int fd_ = -1;
};

// "host:port" -> (host, port); throws std::invalid_argument.
std::pair<std::string, int> split_address(const std::string& addr);

// A non-blocking listening socket bound to host:port (port 0 = ephemeral). Returns the port.
Fd listen_tcp(const std::string& host, int port, int* bound_port);

// Called while a helper below waits, at least every tick_ms, when set: lets a caller that holds a
// lock others depend on keep its other duties (the communicator's heartbeats) going. It may throw,
// which abandons the wait (the socket is closed by its owner).
struct WaitTick {
  std::function<void()> fn;
  int ms = 50;
};

// Non-blocking connect with a deadline; returns a connected non-blocking socket or throws
// std::runtime_error.
Fd dial_tcp(const std::string& host, int port, Clock::time_point deadline, const WaitTick& tick = {});

// TCP_NODELAY, keepalive, optional SO_SNDBUF/SO_RCVBUF (bytes, 0 = kernel autotuning), O_NONBLOCK.
void tune_socket(int fd, int buffer_bytes);
void set_nonblocking(int fd);

// Blocking-with-deadline helpers on a non-blocking socket. Throw std::runtime_error on EOF,
// error or deadline.
void write_all(int fd, const void* data, size_t len, Clock::time_point deadline, const WaitTick& tick = {});
void read_exact(int fd, void* data, size_t len, Clock::time_point deadline, const WaitTick& tick = {});

// Milliseconds until `deadline` (>= 0), capped to cap_ms.
int ms_until(Clock::time_point deadline, int cap_ms);

}  // namespace tmrun
