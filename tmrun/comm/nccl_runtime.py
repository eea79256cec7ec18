"""Which NCCL the device plane runs on: the libnccl torch itself loaded, probed by symbol.

The device plane (tmrun.comm.device_plane) drives NCCL through torch's ``ProcessGroupNCCL``, so
the process has one NCCL: the one torch loaded (the ``nvidia-nccl-cu1x`` wheel's, or whatever
the dynamic loader found first). Experts override it with ``TMRUN_NCCL_LIBRARY=/path/libnccl.so.2``:
the launcher preloads that library into the workers (``LD_PRELOAD``), so torch binds to it.

Features are detected by symbol in the loaded library (``ncclCommRevoke``, ``ncclCommShrink``,
``ncclCommGrow``, ``ncclCommInitRankScalable``) and by its ``ncclGetVersion``, never by the
version alone (distributions patch NCCL).
"""

from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass, field
from typing import Optional

FEATURE_SYMBOLS = {
    "revoke": "ncclCommRevoke",
    "shrink": "ncclCommShrink",
    "grow": "ncclCommGrow",
    "init_scalable": "ncclCommInitRankScalable",
}


@dataclass(frozen=True)
class NcclInfo:
    path: str
    version: str  # "2.28.9"
    features: dict = field(default_factory=dict)  # name in FEATURE_SYMBOLS -> present


def version_string(code: int) -> str:
    """``ncclGetVersion``'s code as a.b.c (2.9 on: a*10000+b*100+c; before: a*1000+b*100+c)."""
    if code >= 20900:
        return f"{code // 10000}.{code // 100 % 100}.{code % 100}"
    return f"{code // 1000}.{code // 100 % 10}.{code % 100}"


def loaded_library(maps: str = "/proc/self/maps") -> Optional[str]:
    """The path of the libnccl mapped into this process (None when none is)."""
    try:
        with open(maps, encoding="utf-8", errors="replace") as f:
            for line in f:
                path = line.rstrip("\n").split(None, 5)[-1] if line.count(" ") >= 5 else ""
                if os.path.basename(path).startswith("libnccl.so"):
                    return path
    except OSError:
        return None
    return None


def probe(path: str) -> NcclInfo:
    """Version and features of the NCCL library at ``path`` (loaded if it is not yet).
    Raises ``OSError`` for a file that is no NCCL library."""
    lib = ctypes.CDLL(path)
    get_version = getattr(lib, "ncclGetVersion", None)
    if get_version is None:
        raise OSError(f"{path} has no ncclGetVersion: not an NCCL library")
    code = ctypes.c_int(0)
    if get_version(ctypes.byref(code)) != 0:
        raise OSError(f"{path}: ncclGetVersion failed")
    features = {name: hasattr(lib, symbol) for name, symbol in FEATURE_SYMBOLS.items()}
    return NcclInfo(path=path, version=version_string(int(code.value)), features=features)


def summary(info: NcclInfo) -> str:
    have = ", ".join(f"{name} {'yes' if present else 'no'}" for name, present in info.features.items())
    return (f"device plane: CUDA tensors on NCCL {info.version} (torch's ProcessGroupNCCL, {info.path}; {have}); "
            "a lost rank: abort the generation's communicator, a fresh NCCL init with the joiner through the store")


def describe_torch_nccl() -> str:
    """The start-up line for the NCCL plane, once torch's NCCL is loaded."""
    path = loaded_library()
    if path is None:
        try:
            import torch

            code = torch.cuda.nccl.version()
            version = ".".join(str(x) for x in code) if isinstance(code, tuple) else version_string(int(code))
        except Exception:  # noqa: BLE001
            version = "unknown"
        return f"device plane: CUDA tensors on NCCL {version} (torch's ProcessGroupNCCL; library not found in maps)"
    try:
        return summary(probe(path))
    except OSError as exc:
        return f"device plane: CUDA tensors on torch's ProcessGroupNCCL ({path}: {exc})"
