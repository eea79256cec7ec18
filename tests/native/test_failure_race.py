"""Communicator::failure() and links() are read by other threads (a Python monitor, the backend) while the
worker or the service thread records the sticky failure: the read must be synchronised. Checked
with ThreadSanitizer on a small C++ harness (skipped where no C++ compiler with TSan exists)."""

from __future__ import annotations

import glob
import os
import re
import shutil
import subprocess

import pytest

pytestmark = pytest.mark.e2e  # builds a ThreadSanitizer harness (tens of seconds): not in the unit subset

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
SRC = os.path.join(ROOT, "tmrun_native", "src")
# The TCP communicator (every file of src/tcp/) and the helpers it links against.
SOURCES = [*sorted(glob.glob(os.path.join(SRC, "tcp", "*.cpp"))),
           *[os.path.join(SRC, s) for s in ("net.cpp", "frame.cpp", "checksum.cpp", "reduce.cpp", "auth.cpp")]]


def _in(report: str, *functions: str) -> bool:
    """Whether a TSan report has a frame in one of these functions of tcp::Communicator (the public
    method or its Impl's)."""
    return any(re.search(rf"Communicator::(?:Impl::)?{f}\b", report) for f in functions)


def _cxx() -> str:
    cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("clang++")
    if not cxx or not os.path.isdir(os.path.join(SRC, "tcp")):
        pytest.skip("no C++ compiler or no native sources")
    return cxx


@pytest.fixture(scope="module")
def tsan_run(tmp_path_factory):
    """Builds the harness with ThreadSanitizer and runs it once: (stdout, TSan reports)."""
    cxx = _cxx()
    exe = str(tmp_path_factory.mktemp("tsan") / "tsan_failure_race")
    cmd = [cxx, "-std=c++17", "-O1", "-g", "-fsanitize=thread", "-pthread",
           "-I", os.path.join(ROOT, "tmrun_native", "include"),
           os.path.join(HERE, "tsan_failure_race.cpp"), *SOURCES, "-o", exe]
    build = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    if build.returncode != 0:
        if "sanitize" in build.stderr or "tsan" in build.stderr:
            pytest.skip("ThreadSanitizer unavailable: " + build.stderr[-300:])
        raise AssertionError(build.stderr[-3000:])
    env = dict(os.environ, TSAN_OPTIONS="halt_on_error=0 exitcode=66 second_deadlock_stack=1")
    run = subprocess.run([exe], capture_output=True, text=True, timeout=60, env=env)
    if "FATAL: ThreadSanitizer" in run.stderr:  # e.g. an incompatible memory layout (ASLR)
        pytest.skip("ThreadSanitizer cannot run here: " + run.stderr[-300:])
    return run.stdout, run.stderr, run.stderr.split("WARNING: ThreadSanitizer:")[1:]


@pytest.mark.timeout(300)
def test_failure_read_is_race_free_under_tsan(tsan_run):
    """Before the fix failure() read failed_ and failed_msg_ (a std::string) with no lock while
    the service thread wrote them: ThreadSanitizer reported a data race in
    Communicator::failure() (and a torn string could be returned or freed memory read)."""
    out, err, reports = tsan_run
    assert "failure: rank 1 lost" in out, (out, err[-3000:])
    mine = [r for r in reports if _in(r, "failure")]
    assert not mine, mine[0][:3000]


@pytest.mark.timeout(300)
def test_links_read_is_race_free_under_tsan(tsan_run):
    """links() reads each link's broken flag, fd and error (a std::string) under table_mu_.
    Before the fix close_link wrote them under op_mu_ only (the service thread's idle tick, here),
    so a monitor thread calling links() raced with it: ThreadSanitizer reported a data race in
    Communicator::links() against Communicator::close_link. close_link now writes them under
    table_mu_ too."""
    out, err, reports = tsan_run
    assert "link: closed " in out and "connection closed by peer" in out, (out, err[-3000:])
    mine = [r for r in reports if _in(r, "links", "close_link")]
    assert not mine, mine[0][:3000]
