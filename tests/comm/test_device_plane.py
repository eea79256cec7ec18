"""The device plane's choices and its life per generation (tmrun.comm.device_plane), with a
recording factory in place of NCCL; and the NCCL probe (tmrun.comm.nccl_runtime) against stub
libraries built here (what CI can check without a GPU)."""

from __future__ import annotations

import datetime
import shutil
import subprocess
import threading
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from tmrun.comm import device_plane as dp
from tmrun.comm import nccl_runtime

TIMEOUT = datetime.timedelta(seconds=5)


# --------------------------------------------------------------------------------- which plane
def test_the_configured_plane_defaults_to_auto_and_refuses_unknown_values() -> None:
    assert dp.configured_kind({}) == "auto"
    assert dp.configured_kind({"TMRUN_DEVICE_PLANE": " NCCL "}) == "nccl"
    with pytest.raises(dp.DevicePlaneError, match="TMRUN_DEVICE_PLANE='rdma' is not one of auto, nccl"):
        dp.configured_kind({"TMRUN_DEVICE_PLANE": "rdma"})


def test_auto_is_nccl_when_torch_has_it_and_none_otherwise() -> None:
    assert dp.resolve_kind("auto", nccl_available=True) == "nccl"
    assert dp.resolve_kind("auto", nccl_available=False) == "none"
    assert dp.resolve_kind("staging", nccl_available=False) == "staging"
    with pytest.raises(dp.DevicePlaneError, match="CUDA tensors need NCCL"):
        dp.resolve_kind("nccl", nccl_available=False)


def test_cuda_tensors_without_nccl_are_one_clear_line() -> None:
    with pytest.raises(dp.DevicePlaneError) as error:
        dp.takes("none", {"cuda"})
    message = str(error.value)
    assert "\n" not in message and "TMRUN_DEVICE_PLANE=staging" in message
    assert not dp.takes("none", {"cpu"})  # CPU tensors keep the TCP path


def test_which_operations_go_to_the_plane() -> None:
    assert dp.takes("nccl", {"cuda"}) and not dp.takes("nccl", {"cpu"}) and not dp.takes("nccl", set())
    assert dp.takes("gloo", {"cpu"}) and not dp.takes("staging", {"cuda"}) and not dp.takes("staging", {"cpu"})
    with pytest.raises(dp.DevicePlaneError, match="mixes cuda tensors"):
        dp.takes("nccl", {"cuda", "cpu"})


def test_device_types_of_nested_arguments() -> None:
    a, b = torch.zeros(1), torch.zeros(1, device="meta")
    assert dp.device_types(([a], [[b]], 3, "x")) == {"cpu", "meta"}
    assert dp.device_types((None, 1)) == set()


# --------------------------------------------------------------------------------- generations
class Inner:
    """What a factory returns: records abort/shutdown and the thread that aborted it."""

    def __init__(self, prefix: str, rank: int, size: int) -> None:
        self.prefix, self.rank, self.size = prefix, rank, size
        self.aborted = threading.Event()
        self.abort_thread: str = ""
        self.shut = False

    def abort(self) -> None:
        self.abort_thread = threading.current_thread().name
        self.aborted.set()

    def shutdown(self) -> None:
        self.shut = True


class Factory:
    def __init__(self, gate: threading.Event | None = None) -> None:
        self.made: list[Inner] = []
        self.gate = gate

    def __call__(self, store, rank: int, size: int, timeout) -> Inner:
        if self.gate is not None:
            assert self.gate.wait(5)
        store.set("probe", b"1")  # the inner group bootstraps under the generation's prefix
        inner = Inner("", rank, size)
        self.made.append(inner)
        return inner


def _plane(factory: Factory) -> dp.DevicePlane:
    return dp.DevicePlane("gloo", TIMEOUT, factory=factory)


def test_one_inner_group_per_generation_under_its_own_prefix() -> None:
    store, factory = dist.HashStore(), Factory()
    plane = _plane(factory)
    first = plane.group(store, 0, 1, 2)
    assert plane.group(store, 0, 1, 2) is first and len(factory.made) == 1
    assert store.check(["tmrun/dp/e0/probe"])
    second = plane.group(store, 1, 1, 2)  # a new generation without an abort (a subgroup's repair)
    assert second is not first and store.check(["tmrun/dp/e1/probe"])
    assert first.aborted.wait(5)  # the previous generation's group was let go (the generation only grows)
    assert plane.counts() == {"builds": 2, "aborts": 0, "built_on_demand": 2}


def test_an_aborted_generation_is_never_used_again() -> None:
    store, factory = dist.HashStore(), Factory()
    plane = _plane(factory)
    inner = plane.group(store, 3, 0, 4)
    plane.abort(3)
    assert inner.aborted.wait(5)
    assert inner.abort_thread == "tmrun-device-plane-abort"  # never on the caller's thread
    with pytest.raises(dp.DevicePlaneError, match="generation 3 was aborted"):
        plane.group(store, 3, 0, 4)
    fresh = plane.group(store, 4, 0, 4)  # the next generation builds afresh
    assert fresh is not inner and not fresh.aborted.is_set()
    plane.abort(2)  # an older generation's abort leaves the current one alone
    assert not fresh.aborted.is_set()
    assert plane.counts() == {"builds": 2, "aborts": 1, "built_on_demand": 2}
    plane.shutdown()
    assert fresh.shut


def test_a_generation_built_ahead_is_ready_at_its_first_collective() -> None:
    store, gate = dist.HashStore(), threading.Event()
    factory = Factory(gate)
    plane = _plane(factory)
    thread = plane.prepare(store, 5, 2, 3)
    got: list = []
    waiter = threading.Thread(target=lambda: got.append(plane.group(store, 5, 2, 3)))
    waiter.start()  # the first collective waits for the build under way, it does not build again
    gate.set()
    thread.join(5)
    waiter.join(5)
    assert got and got[0] is factory.made[0] and len(factory.made) == 1
    assert plane.counts() == {"builds": 1, "aborts": 0, "built_on_demand": 0}


def test_the_current_generation_serves_on_while_the_next_is_built_ahead() -> None:
    """A planned migration: generation 1 is built while generation 0 still trains; 0 keeps its
    group until the first collective of 1, which lets 0 go."""
    store, factory = dist.HashStore(), Factory()
    plane = _plane(factory)
    current = plane.group(store, 0, 0, 2)
    plane.prepare(store, 1, 0, 2).join(5)
    assert plane.group(store, 0, 0, 2) is current and not current.aborted.is_set()
    ahead = plane.group(store, 1, 0, 2)
    assert ahead is factory.made[1] and current.aborted.wait(5)
    assert plane.counts() == {"builds": 2, "aborts": 0, "built_on_demand": 1}


def test_a_generation_aborted_while_it_was_built_ahead_is_dropped() -> None:
    store, gate = dist.HashStore(), threading.Event()
    factory = Factory(gate)
    plane = _plane(factory)
    thread = plane.prepare(store, 2, 0, 2)
    plane.abort(2)
    gate.set()
    thread.join(5)
    assert factory.made[0].shut  # built, then released at once
    with pytest.raises(dp.DevicePlaneError):
        plane.group(store, 2, 0, 2)


# --------------------------------------------------------------------------------- the NCCL probe
def test_version_codes() -> None:
    assert nccl_runtime.version_string(22809) == "2.28.9"
    assert nccl_runtime.version_string(23203) == "2.32.3"
    assert nccl_runtime.version_string(2804) == "2.8.4"  # before 2.9: major*1000


def test_the_loaded_library_is_found_in_the_maps(tmp_path: Path) -> None:
    maps = tmp_path / "maps"
    maps.write_text("7f00-7f01 r-xp 00000000 08:01 1 /usr/lib/libc.so.6\n"
                    "7f02-7f03 r-xp 00000000 08:01 2 /site/nvidia/nccl/lib/libnccl.so.2\n")
    assert nccl_runtime.loaded_library(str(maps)) == "/site/nvidia/nccl/lib/libnccl.so.2"
    maps.write_text("7f00-7f01 r-xp 00000000 08:01 1 /usr/lib/libc.so.6\n7f04-7f05 rw-p 00000000 00:00 0\n")
    assert nccl_runtime.loaded_library(str(maps)) is None
    assert nccl_runtime.loaded_library(str(tmp_path / "absent")) is None


def _stub(tmp_path: Path, name: str, version: int, symbols: list[str]) -> str:
    if shutil.which("gcc") is None:
        pytest.skip("no gcc to build a stub NCCL library")
    body = [f"int ncclGetVersion(int* v) {{ *v = {version}; return 0; }}"] if version else []
    body += [f"int {s}(void) {{ return 0; }}" for s in symbols]
    src = tmp_path / f"{name}.c"
    src.write_text("\n".join(body) + "\n")
    out = tmp_path / f"{name}.so"
    subprocess.run(["gcc", "-shared", "-fPIC", "-o", str(out), str(src)], check=True, timeout=60)
    return str(out)


@pytest.mark.parametrize("version, symbols, expected", [
    (22809, ["ncclCommRevoke", "ncclCommShrink", "ncclCommInitRankScalable"],
     {"revoke": True, "shrink": True, "grow": False, "init_scalable": True}),
    (22903, ["ncclCommRevoke", "ncclCommShrink", "ncclCommGrow", "ncclCommInitRankScalable"],
     {"revoke": True, "shrink": True, "grow": True, "init_scalable": True}),
    (22704, ["ncclCommShrink", "ncclCommInitRankScalable"],
     {"revoke": False, "shrink": True, "grow": False, "init_scalable": True}),
])
def test_features_are_detected_by_symbol(tmp_path: Path, version: int, symbols: list[str], expected: dict) -> None:
    info = nccl_runtime.probe(_stub(tmp_path, f"nccl{version}", version, symbols))
    assert info.features == expected
    assert info.version == nccl_runtime.version_string(version)
    line = nccl_runtime.summary(info)
    assert f"NCCL {info.version}" in line and "grow " + ("yes" if expected["grow"] else "no") in line
    assert "\n" not in line


def test_a_library_that_is_not_nccl_is_refused(tmp_path: Path) -> None:
    with pytest.raises(OSError, match="not an NCCL library"):
        nccl_runtime.probe(_stub(tmp_path, "notnccl", 0, ["somethingElse"]))


def test_the_nccl_plane_builds_the_class_torch_chooses_for_nccl() -> None:
    """torch's NCCL backend is moving (an in-tree ProcessGroupNCCL2 with reconfigure/shrink,
    chosen by TORCH_DIST_USE_NCCL2=1 on 2.14 and the default on torch's main branch): the plane
    builds whichever class torch would, and refuses a class without what it calls in one line."""
    import types

    import torch.distributed as dist

    from tmrun.comm import device_plane as plane

    if getattr(dist, "ProcessGroupNCCL", None) is None:
        with pytest.raises(plane.DevicePlaneError, match="this torch has none"):  # a CPU-only build
            plane.nccl_backend_class({})
        return
    nccl2 = getattr(dist.distributed_c10d, "ProcessGroupNCCL2", None)
    assert plane.nccl_backend_class({}) is dist.ProcessGroupNCCL
    if nccl2 is not None:
        assert plane.nccl_backend_class({"TORCH_DIST_USE_NCCL2": "1"}) is nccl2
    bare = types.new_class("ProcessGroupNCCL2")
    original = getattr(dist.distributed_c10d, "ProcessGroupNCCL2", None)
    dist.distributed_c10d.ProcessGroupNCCL2 = bare  # type: ignore[attr-defined]
    try:
        with pytest.raises(plane.DevicePlaneError, match="ProcessGroupNCCL2 lacks abort, shutdown"):
            plane.nccl_backend_class({"TORCH_DIST_USE_NCCL2": "1"})
    finally:
        if original is None:
            del dist.distributed_c10d.ProcessGroupNCCL2
        else:
            dist.distributed_c10d.ProcessGroupNCCL2 = original  # type: ignore[attr-defined]
