// ThreadSanitizer harness for tcp::Communicator::failure() and links() (built and run by
// test_failure_race.py). Rank 1 vanishes (closes without a goodbye, as a killed process); rank 0's service thread notices the loss in its idle tick,
// closes the link (broken, error, fd) and records the sticky failure while the main thread keeps
// polling failure() and links(), as a Python monitor thread would.
// Exit status 0 when rank 0 reported the failure and showed the link closed with its error;
// ThreadSanitizer adds its own reports (and exit status 66) when the threads touch the failure or
// link state without synchronisation.
#include <chrono>
#include <cstdio>
#include <string>
#include <thread>
#include <vector>

#include "tmrun/tcp_comm.h"

int main() {
  using namespace std::chrono_literals;
  tmrun::tcp::Options o;
  o.timeout = 2.0;
  o.heartbeat_interval = 0.02;
  tmrun::tcp::Communicator a(0, 2, "tsan", 0, o), b(1, 2, "tsan", 0, o);
  std::vector<std::string> addrs{a.address(), b.address()};
  std::thread tb([&] { b.connect(addrs); });
  a.connect(addrs);
  tb.join();
  std::string seen = a.failure();  // "" (healthy): a read before the write
  std::string link_error;
  bool link_closed = false;
  auto poll_links = [&] {
    for (const auto& li : a.links())  // reads open (broken, fd) and error of every link
      if (li.peer == 1 && !li.open) {
        link_closed = true;
        link_error = li.error;
      }
  };
  poll_links();
  b.debug_vanish();  // as a killed process (a close() says goodbye: a clean leave)
  auto deadline = std::chrono::steady_clock::now() + 10s;
  while ((seen.empty() || !link_closed) && std::chrono::steady_clock::now() < deadline) {
    seen = a.failure();
    poll_links();  // no sleep: keep reading while the service thread closes the link
    std::this_thread::yield();
  }
  std::printf("failure: %s\n", seen.c_str());
  std::printf("link: %s %s\n", link_closed ? "closed" : "open", link_error.c_str());
  a.close();
  return seen.empty() || !link_closed ? 1 : 0;
}
