#include "tmrun/net.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <stdexcept>

namespace tmrun {

void Fd::reset() noexcept {
  if (fd_ >= 0) {
    ::close(fd_);
    fd_ = -1;
  }
}

std::pair<std::string, int> split_address(const std::string& addr) {
  auto pos = addr.rfind(':');
  if (pos == std::string::npos || pos == 0 || pos + 1 >= addr.size())
    throw std::invalid_argument("address must be host:port, got '" + addr + "'");
  std::string host = addr.substr(0, pos);
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']') host = host.substr(1, host.size() - 2);
  int port = 0;
  try {
    port = std::stoi(addr.substr(pos + 1));
  } catch (...) {
    throw std::invalid_argument("bad port in address '" + addr + "'");
  }
  if (port <= 0 || port > 65535) throw std::invalid_argument("bad port in address '" + addr + "'");
  return {host, port};
}

void set_nonblocking(int fd) {
  int fl = ::fcntl(fd, F_GETFL, 0);
  if (fl < 0 || ::fcntl(fd, F_SETFL, fl | O_NONBLOCK) < 0)
    throw std::runtime_error(std::string("fcntl(O_NONBLOCK): ") + std::strerror(errno));
}

void tune_socket(int fd, int buffer_bytes) {
  int one = 1;
  ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
  ::setsockopt(fd, SOL_SOCKET, SO_KEEPALIVE, &one, sizeof(one));
  if (buffer_bytes > 0) {
    ::setsockopt(fd, SOL_SOCKET, SO_SNDBUF, &buffer_bytes, sizeof(buffer_bytes));
    ::setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &buffer_bytes, sizeof(buffer_bytes));
  }
  set_nonblocking(fd);
}

namespace {

struct AddrInfo {
  addrinfo* res = nullptr;
  ~AddrInfo() {
    if (res) ::freeaddrinfo(res);
  }
};

void resolve(const std::string& host, int port, bool passive, AddrInfo* out) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  if (passive) hints.ai_flags = AI_PASSIVE;
  std::string ps = std::to_string(port);
  const char* h = host.empty() ? nullptr : host.c_str();
  int rc = ::getaddrinfo(h, ps.c_str(), &hints, &out->res);
  if (rc != 0 || out->res == nullptr)
    throw std::runtime_error("cannot resolve '" + host + "': " + ::gai_strerror(rc));
}

}  // namespace

Fd listen_tcp(const std::string& host, int port, int* bound_port) {
  AddrInfo ai;
  resolve(host, port, true, &ai);
  std::string last = "no address";
  for (addrinfo* p = ai.res; p; p = p->ai_next) {
    Fd fd(::socket(p->ai_family, p->ai_socktype | SOCK_CLOEXEC, p->ai_protocol));
    if (!fd.valid()) {
      last = std::strerror(errno);
      continue;
    }
    int one = 1;
    ::setsockopt(fd.get(), SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    if (::bind(fd.get(), p->ai_addr, p->ai_addrlen) != 0 || ::listen(fd.get(), 128) != 0) {
      last = std::strerror(errno);
      continue;
    }
    set_nonblocking(fd.get());
    sockaddr_storage ss{};
    socklen_t sl = sizeof(ss);
    ::getsockname(fd.get(), reinterpret_cast<sockaddr*>(&ss), &sl);
    if (ss.ss_family == AF_INET)
      *bound_port = ntohs(reinterpret_cast<sockaddr_in*>(&ss)->sin_port);
    else
      *bound_port = ntohs(reinterpret_cast<sockaddr_in6*>(&ss)->sin6_port);
    return fd;
  }
  throw std::runtime_error("cannot listen on " + host + ":" + std::to_string(port) + ": " + last);
}

int ms_until(Clock::time_point deadline, int cap_ms) {
  auto now = Clock::now();
  if (deadline <= now) return 0;
  auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - now).count() + 1;
  return static_cast<int>(ms < cap_ms ? ms : cap_ms);
}

namespace {

// poll() one descriptor until it is ready or the deadline passes, calling the tick (when set)
// between slices of at most tick.ms. Returns poll's result (0: deadline).
int poll_ticking(pollfd* pf, Clock::time_point deadline, const WaitTick& tick) {
  const int cap = tick.fn ? std::max(1, tick.ms) : (1 << 30);
  for (;;) {
    int ms = ms_until(deadline, cap);
    int pr = ::poll(pf, 1, ms);
    if (pr < 0 && errno == EINTR) continue;
    if (pr != 0 || ms == 0 || !tick.fn) return pr;
    tick.fn();
  }
}

}  // namespace

Fd dial_tcp(const std::string& host, int port, Clock::time_point deadline, const WaitTick& tick) {
  AddrInfo ai;
  resolve(host, port, false, &ai);
  std::string last = "no address";
  for (addrinfo* p = ai.res; p; p = p->ai_next) {
    Fd fd(::socket(p->ai_family, p->ai_socktype | SOCK_CLOEXEC, p->ai_protocol));
    if (!fd.valid()) {
      last = std::strerror(errno);
      continue;
    }
    set_nonblocking(fd.get());
    int rc = ::connect(fd.get(), p->ai_addr, p->ai_addrlen);
    if (rc != 0 && errno != EINPROGRESS) {
      last = std::strerror(errno);
      continue;
    }
    if (rc != 0) {
      pollfd pf{fd.get(), POLLOUT, 0};
      int pr = poll_ticking(&pf, deadline, tick);
      if (pr <= 0) {
        last = "connect timed out";
        continue;
      }
      int err = 0;
      socklen_t el = sizeof(err);
      ::getsockopt(fd.get(), SOL_SOCKET, SO_ERROR, &err, &el);
      if (err != 0) {
        last = std::strerror(err);
        continue;
      }
    }
    return fd;
  }
  throw std::runtime_error("cannot connect to " + host + ":" + std::to_string(port) + ": " + last);
}

void write_all(int fd, const void* data, size_t len, Clock::time_point deadline, const WaitTick& tick) {
  const auto* p = static_cast<const uint8_t*>(data);
  while (len > 0) {
    ssize_t n = ::send(fd, p, len, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (n > 0) {
      p += n;
      len -= size_t(n);
      continue;
    }
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
      pollfd pf{fd, POLLOUT, 0};
      if (ms_until(deadline, 1) == 0 || poll_ticking(&pf, deadline, tick) == 0)
        throw std::runtime_error("write timed out");
      continue;
    }
    throw std::runtime_error(std::string("write failed: ") + std::strerror(errno));
  }
}

void read_exact(int fd, void* data, size_t len, Clock::time_point deadline, const WaitTick& tick) {
  auto* p = static_cast<uint8_t*>(data);
  while (len > 0) {
    ssize_t n = ::recv(fd, p, len, MSG_DONTWAIT);
    if (n > 0) {
      p += n;
      len -= size_t(n);
      continue;
    }
    if (n == 0) throw std::runtime_error("connection closed by peer");
    if (errno == EINTR) continue;
    if (errno == EAGAIN || errno == EWOULDBLOCK) {
      pollfd pf{fd, POLLIN, 0};
      if (ms_until(deadline, 1) == 0 || poll_ticking(&pf, deadline, tick) == 0)
        throw std::runtime_error("read timed out");
      continue;
    }
    throw std::runtime_error(std::string("read failed: ") + std::strerror(errno));
  }
}

}  // namespace tmrun
