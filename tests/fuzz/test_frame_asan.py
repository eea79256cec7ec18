"""The wire-frame parser (tmrun_native/src/frame.cpp) under AddressSanitizer and
UndefinedBehaviorSanitizer: tests/fuzz/frame_asan.cpp feeds it random bytes, mutated valid frames
and every prefix of valid frames, each in a heap buffer of exactly its size (skipped where no C++
compiler with these sanitizers exists). atheris cannot see into the C++ (the module is not built
for it): this is the part of the frame fuzzing that would notice a read out of bounds."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e  # a build (about 7 s on 2 cores) and a run: not in the unit subset

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
SRC = ROOT / "tmrun_native" / "src"
ITERATIONS = 20000  # about 3 s; docs/fuzzing.md has the long run


@pytest.mark.timeout(300)
def test_frame_parser_under_asan_and_ubsan(tmp_path: Path) -> None:
    cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("clang++")
    if not cxx or not (SRC / "frame.cpp").exists():
        pytest.skip("no C++ compiler or no native sources")
    exe = tmp_path / "frame_asan"
    cmd = [cxx, "-std=c++17", "-O1", "-g", "-fsanitize=address,undefined", "-fno-sanitize-recover=all",
           "-I", str(ROOT / "tmrun_native" / "include"), str(HERE / "frame_asan.cpp"), str(SRC / "frame.cpp"),
           str(SRC / "checksum.cpp"), "-o", str(exe)]
    build = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    if build.returncode != 0:
        if "sanitize" in build.stderr or "asan" in build.stderr or "ubsan" in build.stderr:
            pytest.skip("sanitizers unavailable: " + build.stderr[-300:])
        raise AssertionError(build.stderr[-3000:])
    run = subprocess.run([str(exe), str(ITERATIONS), "1"], capture_output=True, text=True, timeout=240,
                         env={**os.environ, "ASAN_OPTIONS": "detect_leaks=1:abort_on_error=0"})
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    assert f"iterations {ITERATIONS}" in run.stdout and "ERROR" not in run.stderr, run.stderr[-4000:]
