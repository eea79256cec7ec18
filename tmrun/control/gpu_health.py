"""GPU health through NVML (``pynvml``, from nvidia-ml-py), polled by the agent at a bounded rate.

A GPU is unhealthy when NVML reports, since the monitor started: an Xid event (critical errors,
``nvmlEventSetWait`` on an event set registered for ``nvmlEventTypeXidCriticalError``), a rise of
its volatile ECC error counters (uncorrected, or corrected beyond ``corrected_limit``), or a
thermal or power clock throttle (``nvmlDeviceGetCurrentClocksThrottleReasons``: hardware
slowdown, thermal or power brake). Each unhealthy GPU is reported once.

Where NVML cannot start (no driver, no GPU) the monitor is off, with one log line. Tests inject
a fake NVML: any object with the same function names, or, for a whole job,
``TMRUN_FAKE_NVML=<file>``: a JSON file ``{"count": N, "gpus": {"1": {"xid": 79}}}`` (fields per
GPU: ``xid``, ``ecc_uncorrected``, ``ecc_corrected``, ``throttle``: a list of
``thermal``/``power``), re-read at every poll.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from typing import Any

from tmrun.console import say
from tmrun.protocol import environment

# NVML's constants (nvml.h), so that a fake needs only the functions
XID_CRITICAL = 0x0000000000000008  # nvmlEventTypeXidCriticalError
ECC_CORRECTED, ECC_UNCORRECTED = 0, 1  # nvmlMemoryErrorType_t
VOLATILE_ECC = 0  # nvmlEccCounterType_t: since the driver loaded
THROTTLE = {  # nvmlClocksThrottleReason*
    0x0000000000000008: "hardware slowdown",
    0x0000000000000020: "thermal slowdown (software)",
    0x0000000000000040: "thermal slowdown (hardware)",
    0x0000000000000080: "power brake (hardware)",
    0x0000000000000004: "power cap (software)",
}
SW_POWER_CAP = 0x0000000000000004  # common under a heavy load: counted only with count_power_cap


@dataclass(frozen=True)
class GpuProblem:
    index: int
    what: str


class FakeNvml:
    """NVML's functions over a JSON file (see the module's doc): for tests without a GPU."""

    def __init__(self, path: str) -> None:
        self._path = path

    def _state(self) -> dict[str, Any]:
        try:
            with open(self._path) as f:
                data = json.load(f)
        except (OSError, ValueError):
            return {"count": 0, "gpus": {}}
        return data if isinstance(data, dict) else {"count": 0, "gpus": {}}

    def _gpu(self, handle: int) -> dict[str, Any]:
        return dict(self._state().get("gpus", {}).get(str(handle), {}))

    def nvmlInit(self) -> None:
        if not os.path.exists(self._path):
            raise RuntimeError(f"fake NVML: {self._path} does not exist")

    def nvmlShutdown(self) -> None:
        pass

    def nvmlDeviceGetCount(self) -> int:
        return int(self._state().get("count", 0))

    def nvmlDeviceGetHandleByIndex(self, index: int) -> int:
        return index

    def nvmlEventSetCreate(self) -> list[int]:
        return []

    def nvmlDeviceRegisterEvents(self, handle: int, types: int, event_set: list[int]) -> None:
        event_set.append(handle)

    def nvmlEventSetWait(self, event_set: list[int], timeout_ms: int) -> Any:
        for handle in event_set:
            xid = int(self._gpu(handle).get("xid", 0))
            if xid:
                return _FakeEvent(handle, xid)
        raise TimeoutError("no event")  # pynvml raises NVMLError_Timeout

    def nvmlDeviceGetTotalEccErrors(self, handle: int, error_type: int, counter: int) -> int:
        return int(self._gpu(handle).get("ecc_uncorrected" if error_type == ECC_UNCORRECTED else "ecc_corrected", 0))

    def nvmlDeviceGetCurrentClocksThrottleReasons(self, handle: int) -> int:
        reasons = 0
        for name in self._gpu(handle).get("throttle", []):
            reasons |= {"thermal": 0x40, "power": 0x80}.get(name, 0)
        return reasons


@dataclass
class _FakeEvent:
    device: int
    eventData: int  # noqa: N815 - NVML's name


def load_nvml() -> Any:
    """The NVML module: the fake named by TMRUN_FAKE_NVML, else pynvml (None if not installed)."""
    fake = os.environ.get(environment.ENV_FAKE_NVML, "")
    if fake:
        return FakeNvml(fake)
    try:
        import pynvml
    except ImportError:
        return None
    return pynvml


class GpuHealth:
    """Polls NVML at most every ``interval`` seconds; ``poll()`` returns new problems (each GPU once)."""

    def __init__(self, nvml: Any, interval: float = 1.0, corrected_limit: int = 1000,
                 count_power_cap: bool = False) -> None:
        self._nvml = nvml
        self._interval = interval
        self._corrected_limit = corrected_limit
        self._throttle_mask = sum(THROTTLE) if count_power_cap else sum(THROTTLE) & ~SW_POWER_CAP
        self._next = 0.0
        self._reported: set[int] = set()
        self._handles: list[Any] = []
        self._baseline: dict[int, tuple[int, int]] = {}
        self._events: Any = None
        self.enabled = False
        if nvml is None:
            say("GPU health monitor off: pynvml (nvidia-ml-py) is not installed")
            return
        try:
            nvml.nvmlInit()
            self._handles = [nvml.nvmlDeviceGetHandleByIndex(i) for i in range(nvml.nvmlDeviceGetCount())]
        except Exception as exc:  # noqa: BLE001 - NVMLError_LibraryNotFound, DriverNotLoaded, ...
            if type(exc).__name__ != "NVMLError_LibraryNotFound":
                say(f"GPU health monitor off: NVML could not start ({type(exc).__name__}: {exc})")
            # (no NVIDIA driver's NVML library at all: a machine without GPUs, nothing to watch,
            # and no line in every CPU job's output)
            return
        if not self._handles:
            say("GPU health monitor off: NVML sees no GPU")
            return
        self.enabled = True
        for index, handle in enumerate(self._handles):
            self._baseline[index] = (self._ecc(handle, ECC_CORRECTED), self._ecc(handle, ECC_UNCORRECTED))
        try:
            self._events = nvml.nvmlEventSetCreate()
            for handle in self._handles:
                nvml.nvmlDeviceRegisterEvents(handle, XID_CRITICAL, self._events)
        except Exception:  # noqa: BLE001 - not supported on this GPU: Xids go unseen
            self._events = None

    @property
    def count(self) -> int:
        return len(self._handles)

    def _ecc(self, handle: Any, error_type: int) -> int:
        try:
            return int(self._nvml.nvmlDeviceGetTotalEccErrors(handle, error_type, VOLATILE_ECC))
        except Exception:  # noqa: BLE001 - no ECC on this GPU
            return 0

    def poll(self, now: float | None = None) -> list[GpuProblem]:
        now = time.monotonic() if now is None else now
        if not self.enabled or now < self._next:
            return []
        self._next = now + self._interval
        found: dict[int, str] = {}
        if self._events is not None:
            for _ in range(16):  # drain what is pending, without blocking
                try:
                    event = self._nvml.nvmlEventSetWait(self._events, 0)
                except Exception:  # noqa: BLE001 - NVMLError_Timeout: nothing pending
                    break
                index = self._index_of(event.device)
                if index >= 0:
                    found.setdefault(index, f"Xid {event.eventData}")
        for index, handle in enumerate(self._handles):
            if index in found or index in self._reported:
                continue
            corrected0, uncorrected0 = self._baseline[index]
            uncorrected = self._ecc(handle, ECC_UNCORRECTED) - uncorrected0
            corrected = self._ecc(handle, ECC_CORRECTED) - corrected0
            if uncorrected > 0:
                found[index] = f"{uncorrected} uncorrected ECC errors"
                continue
            if corrected > self._corrected_limit:
                found[index] = f"{corrected} corrected ECC errors"
                continue
            try:
                reasons = int(self._nvml.nvmlDeviceGetCurrentClocksThrottleReasons(handle)) & self._throttle_mask
            except Exception:  # noqa: BLE001
                reasons = 0
            if reasons:
                found[index] = "clocks throttled: " + ", ".join(n for bit, n in THROTTLE.items() if reasons & bit)
        problems = [GpuProblem(i, what) for i, what in sorted(found.items()) if i not in self._reported]
        self._reported.update(p.index for p in problems)
        return problems

    def _index_of(self, device: Any) -> int:
        for index, handle in enumerate(self._handles):
            if handle is device or handle == device:
                return index
        return -1

    def close(self) -> None:
        if self.enabled:
            try:
                self._nvml.nvmlShutdown()
            except Exception:  # noqa: BLE001
                pass
            self.enabled = False
