"""A thread blocked in a native call that returns while the interpreter finalizes must not abort
the process (issue 31: "terminate called without an active exception", SIGABRT at a worker's
exit). CPython < 3.14 ends such a thread with pthread_exit when it takes the GIL back, which from
inside pybind11's noexcept gil_scoped_release destructor aborted the process; tmrun's own guard
(tmrun_native/include/tmrun/nogil.h) parks the thread instead."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("tmrun_native")

pytestmark = pytest.mark.e2e  # an interpreter per case, its teardown timed in seconds: not in the unit subset

# A daemon thread waits in a native call for 1 s; the module teardown (after the finalizing flag)
# takes 2 s, so the call returns in the middle of it.
SCRIPT = textwrap.dedent('''
    import os, sys, threading, time
    import torch
    import tmrun_native as tn
    from tmrun.comm.native import as_buffer

    comms = [tn.Communicator(r, {world}, "exit-race", 0, tn.Options(timeout=5.0)) for r in range({world})]
    threads = [threading.Thread(target=c.connect, args=([c.address for c in comms],)) for c in comms]
    [t.start() for t in threads]
    [t.join() for t in threads]
    comm = comms[0]

    def blocked():
        {call}
        os.write(2, b"returned into Python while finalizing\\n")

    class SlowTeardown:
        def __del__(self, sleep=time.sleep, finalizing=sys.is_finalizing, write=os.write, comm=comm):
            write(2, b"teardown while finalizing: %d\\n" % finalizing())
            {teardown}
            sleep(2.0)

    threading.Thread(target=blocked, daemon=True).start()
    time.sleep(0.2)
    sys.modules["_slow_teardown"] = SlowTeardown()  # torn down with the modules
''')


@pytest.mark.parametrize("world,call,teardown", [
    (1, "comm.wait_failure(1.0, -1)", "pass"),  # the loss watcher's wait, timing out during the teardown
    # an allreduce rank 1 never joins, ended by a close in the teardown (a group closed by its owner's __del__)
    (2, "x = torch.ones(4); comm.allreduce(as_buffer(x)[0], dtype=tn.DType.FLOAT32)", "comm.close()"),
])
def test_a_native_call_returning_during_finalization_does_not_abort(world: int, call: str, teardown: str) -> None:
    script = SCRIPT.format(world=world, call=call, teardown=teardown)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert "teardown while finalizing: 1" in result.stderr, result.stderr  # the race was set up
    assert result.returncode == 0, (result.returncode, result.stderr)
    assert "terminate called" not in result.stderr, result.stderr
