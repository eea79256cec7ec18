"""The device plane of a tmrun group: device tensors on one torch process group per generation.

The "tmrun" backend's own communicator (TCP) is the group's membership authority: it sees a
lost peer, and the worker runtime repairs it into a new *generation* (its epoch). Device tensors
(CUDA) do not go through it: they go through an *inner* torch process group, torch's own
``ProcessGroupNCCL``, so steady-state collectives run on NCCL streams with torch's semantics
(Works that complete on CUDA events, ``wait()`` makes the current stream wait, no host
synchronisation per call). Nothing of NCCL's collectives is re-implemented here.

One inner group per generation:

* created the first time a collective of that generation needs it (every rank issues the same
  collectives in the same order, so every member of the generation creates it at the same
  point), bootstrapped through the group's store under ``tmrun/dp/e<epoch>``: a survivor and
  the joiner that took a lost rank's place meet there with the same ranks as the TCP
  communicator of that generation;
* aborted (``abort()``: NCCL's ``ncclCommAbort`` through torch; local, no barrier with the
  dead rank) the moment the tmrun group gives up the generation's collectives (its *aborted*
  state): queued device work is dropped, the survivor keeps its process, CUDA context, tensors
  and caching allocator;
* never reused after an abort: the next generation builds a fresh one with the joiner
  (:meth:`DevicePlane.prepare` builds it ahead of a planned migration's switch).

Which plane a job uses (``TMRUN_DEVICE_PLANE``):

* ``auto`` (default): CUDA tensors on NCCL when torch has it; without NCCL a CUDA tensor is a
  one-line error (:class:`DevicePlaneError`) that names the way out;
* ``nccl``: the same, and an error at once if torch has no NCCL;
* ``staging``: CUDA tensors through host copies over the TCP communicator (tmrun.comm.staging;
  slow, for machines whose NCCL is broken);
* ``gloo``: CPU tensors on one gloo group per generation instead of the TCP communicator. A
  test mode: it runs the plane's whole life (creation per generation, abort, fresh build with
  the joiner, a build ahead of a switch) on machines without a GPU (tests/comm, tests/e2e).
"""

from __future__ import annotations

import datetime
import os
import socket
import threading
import time
from typing import Any, Callable, Iterable, Optional

import torch
import torch.distributed as dist

from tmrun.console import say
from tmrun.protocol import environment

ENV_PLANE = environment.ENV_DEVICE_PLANE
ENV_SHARED_GPU = "TMRUN_NCCL_SHARED_GPU"  # "1": several ranks share a GPU (each process its own NCCL_HOSTID)
STORE_PREFIX = "tmrun/dp"  # under the group's plane store: e<generation>/... (one inner group each)


class DevicePlaneError(RuntimeError):
    """A device tensor this process cannot move (no NCCL, a bad ``TMRUN_DEVICE_PLANE``), or a
    device collective in a generation whose device group was aborted and not rebuilt."""


def configured_kind(environ: Optional[dict] = None) -> str:
    """The plane ``TMRUN_DEVICE_PLANE`` asks for (``auto`` when unset)."""
    try:
        return environment.device_plane(environ if environ is not None else os.environ)
    except ValueError as exc:
        raise DevicePlaneError(str(exc)) from None


def resolve_kind(kind: str, nccl_available: bool) -> str:
    """The plane in effect: ``nccl``, ``staging``, ``gloo``, or ``none`` (``auto`` without NCCL:
    CUDA tensors are refused with :func:`no_nccl_error`)."""
    if kind == "auto":
        return "nccl" if nccl_available else "none"
    if kind == "nccl" and not nccl_available:
        raise no_nccl_error()
    return kind


def no_nccl_error() -> DevicePlaneError:
    return DevicePlaneError(
        "tmrun: CUDA tensors need NCCL, and this torch has none (torch.distributed.is_nccl_available() is "
        f"False); install a CUDA build of torch, or set {ENV_PLANE}=staging to move them through host memory "
        "over TCP (many times slower)")


def takes(kind: str, device_types: Iterable[str]) -> bool:
    """True when an operation on tensors of ``device_types`` goes to the plane ``kind``; raises
    :class:`DevicePlaneError` for CUDA tensors without NCCL (plane ``none``) and for an
    operation that mixes the plane's tensors with others."""
    types = set(device_types)
    if not types:
        return False
    mine = {"nccl": "cuda", "gloo": "cpu"}.get(kind)
    if kind == "none" and "cuda" in types:
        raise no_nccl_error()
    if mine is None or mine not in types:
        return False
    if len(types) > 1:
        raise DevicePlaneError(f"tmrun: one collective mixes {mine} tensors with {sorted(types - {mine})} ones; "
                               f"the {kind} plane takes {mine} tensors only")
    return True


def device_types(args: Any) -> set:
    """The device types of every tensor in ``args`` (nested lists and tuples)."""
    found: set = set()
    stack = [args]
    while stack:
        x = stack.pop()
        if isinstance(x, torch.Tensor):
            found.add(x.device.type)
        elif isinstance(x, (list, tuple)):
            stack.extend(x)
    return found


Factory = Callable[[Any, int, int, datetime.timedelta], Any]


def share_gpu_if_asked() -> None:
    """``TMRUN_NCCL_SHARED_GPU=1`` (several ranks on one GPU: tests, benches): NCCL refuses two
    ranks on one GPU of one host, so before 2.30 each process poses as a host of its own
    (docs/nccl.md). Call before the process's first NCCL communicator."""
    if os.environ.get(ENV_SHARED_GPU, "") == "1":
        os.environ.setdefault("NCCL_HOSTID", f"{socket.gethostname()}-{os.getpid()}")


def _nccl_group(store: Any, rank: int, size: int, timeout: datetime.timedelta) -> Any:
    # torch's watchdog must not end the process when a generation's communicator fails: tmrun
    # aborts it and builds the next generation's (CleanUpOnly). In-place workers get it from the
    # launcher (torch's agent would set 1); this covers a group made outside tmrun's launcher
    for name, value in environment.NCCL_WATCHDOG_DEFAULTS.items():
        os.environ.setdefault(name, value)
    share_gpu_if_asked()
    group_class = nccl_backend_class()
    options = dist.ProcessGroupNCCL.Options()  # both classes take these options (torch's _nccl2_options)
    options._timeout = timeout
    return group_class(store, rank, size, options)


NCCL_BACKEND_METHODS = ("abort", "shutdown", "eager_connect_single_device")  # what the plane calls


def nccl_backend_class(environ: Any = None) -> type:
    """The NCCL process-group class torch itself builds for ``backend="nccl"``: its in-tree
    ``ProcessGroupNCCL2`` (``reconfigure``/``shrink``; chosen by torch 2.14 with
    ``TORCH_DIST_USE_NCCL2=1``, and torch's default on its main branch, where only that class may
    remain) or the classic ``ProcessGroupNCCL``. The plane only builds, connects, aborts and
    shuts down one group per generation, which both classes offer; a class without those methods
    is one line (docs/nccl.md, "torch's NCCL backends")."""
    env = os.environ if environ is None else environ
    classic = getattr(dist, "ProcessGroupNCCL", None)
    nccl2 = getattr(dist.distributed_c10d, "ProcessGroupNCCL2", None)
    chosen = nccl2 if nccl2 is not None and (env.get("TORCH_DIST_USE_NCCL2") == "1" or classic is None) else classic
    if chosen is None:
        raise no_nccl_error()
    missing = [name for name in NCCL_BACKEND_METHODS if not hasattr(chosen, name)]
    if missing:
        raise DevicePlaneError(f"tmrun: torch's NCCL process group {chosen.__name__} lacks {', '.join(missing)}, "
                               "which the device plane needs (docs/nccl.md); TMRUN_DEVICE_PLANE=staging avoids it")
    return chosen


def _gloo_group(store: Any, rank: int, size: int, timeout: datetime.timedelta) -> Any:
    from torch.distributed import ProcessGroupGloo

    options = ProcessGroupGloo._Options()
    options._timeout = timeout
    options._devices = [ProcessGroupGloo.create_default_device()]
    return ProcessGroupGloo(store, rank, size, options)


FACTORIES: dict[str, Factory] = {"nccl": _nccl_group, "gloo": _gloo_group}


class DevicePlane:
    """The inner groups of one tmrun group (see the module docstring). Thread-safe: the
    training thread creates, the loss watcher aborts, a migration builds ahead."""

    def __init__(self, kind: str, timeout: datetime.timedelta, factory: Optional[Factory] = None) -> None:
        self.kind = kind
        self._factory = factory or FACTORIES[kind]
        self._timeout = timeout
        self._lock = threading.Lock()
        # generation -> its inner group. Two at a time while a planned migration's next
        # generation is built ahead (the current one still trains); a generation goes once a
        # newer one is in use, or when it is aborted
        self._groups: dict[int, Any] = {}
        self._building: dict[int, threading.Event] = {}
        self._dead_through = -1  # every generation up to this one was aborted
        self._aborting: list[threading.Thread] = []
        # inner groups given up, kept until shutdown: the last reference to one must not go with
        # a Work that one of its own threads completes (its destructor would join that thread)
        self._retired: list = []
        self.builds = 0  # inner groups created (each is one NCCL communicator init)
        self.aborts = 0
        self.built_on_demand = 0  # builds a collective had to wait for (not built ahead)

    def group(self, store: Any, epoch: int, rank: int, size: int) -> Any:
        """The inner group of generation ``epoch``, created (and bootstrapped through ``store``)
        when this is its first use. Older generations' groups are let go: the communicator's
        generation only grows."""
        with self._lock:
            if epoch <= self._dead_through:
                raise DevicePlaneError(
                    f"tmrun: the device communicator of generation {epoch} was aborted and the group was not "
                    "repaired into a new generation")
            inner = self._groups.get(epoch)
            pending = self._building.get(epoch) if inner is None else None
        if inner is None and pending is not None:  # built ahead (prepare), still under way
            pending.wait(self._timeout.total_seconds())
            with self._lock:
                inner = self._groups.get(epoch)
            if inner is None:
                raise DevicePlaneError(f"tmrun: the device communicator of generation {epoch} was not built in time")
        if inner is None:
            self.built_on_demand += 1
            inner = self._build(store, epoch, rank, size)
        self._let_go(lambda e: e < epoch)
        return inner

    def prepare(self, store: Any, epoch: int, rank: int, size: int) -> threading.Thread:
        """Build generation ``epoch``'s inner group in the background (every member of that
        generation calls this: a planned migration's survivors and joiner, before the switch),
        so that the first collective after the switch finds it ready: for NCCL, the
        communicator is initialised then (on the caller's current device), not at the switch.
        The current generation's group goes on serving meanwhile. Returns the thread."""
        done = threading.Event()
        with self._lock:
            self._building[epoch] = done
        device = _current_device() if self.kind == "nccl" else None

        def build() -> None:
            started = time.monotonic()
            try:
                inner = self._build(store, epoch, rank, size)
                if device is not None:
                    inner.eager_connect_single_device(device)  # ncclCommInitRank now, not at the switch
                say(f"device plane: generation {epoch}'s communicator built ahead of the switch "
                    f"({time.monotonic() - started:.2f} s)", worker=True)
            except Exception as exc:  # noqa: BLE001  the first collective builds it, or says why
                say(f"building the device communicator of generation {epoch} ahead failed: {exc}", worker=True)
            finally:
                with self._lock:
                    self._building.pop(epoch, None)
                done.set()

        thread = threading.Thread(target=build, name="tmrun-device-plane-build", daemon=True)
        thread.start()
        return thread

    def _build(self, store: Any, epoch: int, rank: int, size: int) -> Any:
        """``store``: the group's plane store, or a callable that makes it (only called here, when
        a generation is built: e.g. a client of its own, see TmrunProcessGroup._plane_store)."""
        store = store() if callable(store) else store
        inner = self._factory(dist.PrefixStore(f"{STORE_PREFIX}/e{epoch}", store), rank, size, self._timeout)
        with self._lock:
            aborted = epoch <= self._dead_through
            if aborted:
                self._retired.append(inner)
            else:
                self._groups[epoch] = inner
            self.builds += 1
        if aborted:
            _end(inner)
            raise DevicePlaneError(f"tmrun: generation {epoch} was aborted while its device communicator was built")
        if self.builds == 1:
            say(describe(self.kind), worker=True)
        return inner

    def abort(self, epoch: int) -> None:
        """Drop the device work of every generation up to ``epoch`` at once (the tmrun group
        gave them up): abort their inner groups; they are never used again."""
        with self._lock:
            self._dead_through = max(self._dead_through, epoch)
        self.aborts += self._let_go(lambda e: e <= epoch)

    def _let_go(self, which: Callable[[int], bool]) -> int:
        """Abort the inner groups of the generations ``which`` selects, each on a thread of its
        own (the caller may be one of the inner group's threads, a failed work's callback, which
        its abort joins); returns how many."""
        with self._lock:
            gone = [self._groups.pop(e) for e in sorted(self._groups) if which(e)]
            self._retired.extend(gone)
        for inner in gone:
            thread = threading.Thread(target=_abort, args=(inner,), name="tmrun-device-plane-abort", daemon=True)
            self._aborting.append(thread)
            thread.start()
        return len(gone)

    def shutdown(self, timeout: float = 10.0) -> None:
        with self._lock:
            groups, self._groups = list(self._groups.values()), {}
            aborting, self._aborting = self._aborting, []
            self._retired = []
        for thread in aborting:
            thread.join(timeout)
        for inner in groups:
            _end(inner)

    def counts(self) -> dict:
        return {"builds": self.builds, "aborts": self.aborts, "built_on_demand": self.built_on_demand}


def _current_device() -> Any:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None


def _abort(inner: Any) -> None:
    try:
        inner.abort()
    except Exception as exc:  # noqa: BLE001  nothing more can be done for a dead generation
        say(f"aborting a device communicator failed: {exc}", worker=True)


def _end(inner: Any) -> None:
    try:
        inner.shutdown()
    except Exception:  # noqa: BLE001
        _abort(inner)


def describe(kind: str) -> str:
    """The start-up line: which plane, which NCCL, which replacement path."""
    if kind == "nccl":
        from tmrun.comm.nccl_runtime import describe_torch_nccl

        return describe_torch_nccl()
    if kind == "gloo":
        return ("device plane: CPU tensors on one gloo group per generation (test mode); a lost rank: abort the "
                "generation's group, a fresh one with the joiner")
    return f"device plane: {kind}"
