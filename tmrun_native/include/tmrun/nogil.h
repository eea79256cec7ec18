// The GIL released around a blocking call, and taken back only while the interpreter lives.
//
// pybind11's gil_scoped_release takes the GIL back in its destructor. A thread whose blocking
// call returns while the interpreter finalizes (a Python daemon thread in wait_failure(), a
// Work's wait, a communicator closed by the module's teardown) is then ended by CPython
// (< 3.14) with pthread_exit from inside that noexcept destructor: the forced unwind reaches a
// noexcept frame and the process aborts, "terminate called without an active exception"
// (reproduced: tests/native/test_exit_race.py). Here, as CPython 3.14 does itself, such a thread
// is parked instead: the process is exiting, and exit() does not wait for it. The thread that
// finalizes (the main thread: a module's teardown may close a communicator) takes it back as usual.
#pragma once

#include <Python.h>
#include <pythread.h>

#include <chrono>
#include <thread>

namespace tmrun {

// threading.main_thread().ident, set when the module loads (module.cpp): the thread that runs
// the interpreter's finalization
inline unsigned long main_thread_ident = 0;

inline bool interpreter_finalizing() {
#if PY_VERSION_HEX >= 0x030D0000
  return Py_IsFinalizing() != 0;
#else
  return _Py_IsFinalizing() != 0;
#endif
}

class NoGil {
 public:
  NoGil() : state_(PyEval_SaveThread()) {}
  NoGil(const NoGil&) = delete;
  NoGil& operator=(const NoGil&) = delete;
  ~NoGil() {
    if (interpreter_finalizing() && PyThread_get_thread_ident() != main_thread_ident) {
      for (;;) std::this_thread::sleep_for(std::chrono::hours(1));  // parked until the process exits
    }
    PyEval_RestoreThread(state_);
  }

 private:
  PyThreadState* state_;
};

}  // namespace tmrun
