"""Runs tests/nccl/gpu_check.py when a GPU is usable (GPU-ONLY; skipped on CPU machines and in CI).

The helpers of the script (value encoding, file store) are checked on CPU so that a syntax or
logic slip in the GPU script shows up without a GPU.
"""

from __future__ import annotations

import os
import subprocess
import sys
from datetime import timedelta

import pytest

from tests.helpers import load_script

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(HERE, "gpu_check.py")


def _load_script():
    return load_script(SCRIPT, "tmrun_gpu_check")


gpu_check = _load_script()


def _gpu_ready() -> tuple[bool, str]:
    try:
        from tmrun.comm.nccl import nccl_available
    except ImportError as exc:
        return False, str(exc)
    return nccl_available()


def test_value_encoding_roundtrips() -> None:
    for dtype in gpu_check.SIZES:
        vals = gpu_check.contrib(2, 37, salt=1)
        data = gpu_check.pack(dtype, vals)
        assert len(data) == 37 * gpu_check.SIZES[dtype]
        assert gpu_check.unpack(dtype, data) == [float(v) if dtype in gpu_check.FLOATS else v for v in vals]
    # 3-way products of contributions stay exact in the narrowest float types.
    assert max(gpu_check.contrib(0, 100)) ** 3 <= 256


def test_file_store(tmp_path) -> None:
    store = gpu_check.FileStore(str(tmp_path), timeout=1.0)
    store.set("epoch/1/nccl/default/init", b"\x00" * 128)
    assert store.get("epoch/1/nccl/default/init") == b"\x00" * 128
    with pytest.raises(TimeoutError):
        store.wait(["missing"], timedelta(seconds=0.05))


@pytest.mark.e2e  # starts processes that import torch: not in the unit subset
def test_script_skips_cleanly_without_gpu() -> None:
    ok, _ = _gpu_ready()
    if ok:
        pytest.skip("a GPU is usable: see test_gpu_check_full")
    out = subprocess.run([sys.executable, SCRIPT], capture_output=True, text=True, timeout=120)
    assert out.returncode == gpu_check.SKIP, out.stdout + out.stderr
    assert "SKIP" in out.stdout


@pytest.mark.timeout(1200)
def test_gpu_check_full() -> None:
    ok, reason = _gpu_ready()
    if not ok:
        pytest.skip(f"GPU-only: {reason}")
    out = subprocess.run([sys.executable, SCRIPT, "--timeout", "60"], capture_output=True, text=True, timeout=1100)
    assert out.returncode == 0, out.stdout[-8000:] + out.stderr[-4000:]
