// ThreadSanitizer harness for Communicator::failure() (built and run by test_failure_race.py).
// Rank 1 closes; rank 0's service thread notices the loss in its idle tick and records the sticky
// failure while the main thread keeps polling failure(), as a Python monitor thread would.
// Exit status 0 when rank 0 reported the failure; ThreadSanitizer adds its own reports (and exit
// status 66) when the two threads touch the failure state without synchronisation.
#include <chrono>
#include <cstdio>
#include <string>
#include <thread>
#include <vector>

#include "tmrun/comm.h"

int main() {
  using namespace std::chrono_literals;
  tmrun::CommOptions o;
  o.timeout = 2.0;
  o.heartbeat_interval = 0.02;
  tmrun::Communicator a(0, 2, "tsan", 0, o), b(1, 2, "tsan", 0, o);
  std::vector<std::string> addrs{a.address(), b.address()};
  std::thread tb([&] { b.connect(addrs); });
  a.connect(addrs);
  tb.join();
  std::string seen = a.failure();  // "" (healthy): a read before the write
  b.close();
  auto deadline = std::chrono::steady_clock::now() + 10s;
  while (seen.empty() && std::chrono::steady_clock::now() < deadline) {
    seen = a.failure();
    std::this_thread::sleep_for(1ms);
  }
  std::printf("failure: %s\n", seen.c_str());
  a.close();
  return seen.empty() ? 1 : 0;
}
