"""The ``torch.distributed`` backend "tmrun": a ProcessGroup over the native TCP communicator.

    import tmrun                                   # registers the backend (idempotent)
    dist.init_process_group("tmrun")               # env:// or store=..., rank=..., world_size=...
    dist.all_reduce(t)                             # CPU tensors on TCP; CUDA tensors on NCCL

Design (see ``docs/backend.md``):

* :class:`TmrunProcessGroup` is a Python subclass of ``torch.distributed.ProcessGroup`` (torch's
  ``PyProcessGroup`` trampoline forwards the C++ virtual calls of DDP's reducer to it). It owns a
  native :class:`tmrun_native.Communicator`, bootstrapped through the store torch hands to the
  backend creator (:func:`tmrun.comm.native.connect_via_store`).
* Every collective checks its arguments on the caller's thread (clear ``ValueError`` /
  ``TypeError``), stages tensors that are not contiguous CPU tensors through host memory, and
  submits a native ``*_async`` operation. The native operations of one communicator run in
  submission order on its own thread. A per-group *completer* thread waits for them in the same
  order, copies staged results back, and completes the ``torch.futures.Future`` of the
  :class:`TmrunWork` the caller got. Synchronous calls (``opts.asyncOp == False``, which is what
  ``dist.all_reduce(t)`` passes) are completed on the caller's thread instead. Tensors (and
  staging buffers) stay referenced by the operation until it is over.
* CUDA tensors go to the group's *device plane* (tmrun.comm.device_plane): torch's own
  ``ProcessGroupNCCL``, one per generation of the communicator, aborted when the group gives up
  a generation and built afresh (with the joiner) in the next. ``TMRUN_DEVICE_PLANE=staging``
  moves them through host copies over TCP instead.
* Resilience hooks for the worker runtime: :meth:`TmrunProcessGroup.attach` (swap the
  communicator), :meth:`~TmrunProcessGroup.set_failure_handler` + the *aborted* state +
  :meth:`~TmrunProcessGroup.clear_aborted`, :meth:`~TmrunProcessGroup.set_local` (sandbox: every
  collective served locally, no network), :meth:`~TmrunProcessGroup.counters` /
  :meth:`~TmrunProcessGroup.links` passthrough, :meth:`~TmrunProcessGroup.synchronize`.

Creating a group in local mode (a standby's sandbox; no store traffic, no communicator)::

    TMRUN_COMM_LOCAL=1  ->  dist.init_process_group("tmrun", store=dist.HashStore(), rank=0, world_size=n)
    or  dist.init_process_group("tmrun", ..., pg_options=tmrun.comm.backend.Options(local=True))
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import os
import queue
import socket
import threading
import time
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Optional, Sequence

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import (
    AllgatherOptions,
    AllreduceCoalescedOptions,
    AllreduceOptions,
    AllToAllOptions,
    BarrierOptions,
    BroadcastOptions,
    GatherOptions,
    ReduceOptions,
    ReduceScatterOptions,
    ScatterOptions,
)

from tmrun.comm import device_plane, staging
from tmrun.comm.device_plane import DevicePlane, DevicePlaneError
from tmrun.comm.staging import UnsupportedError
from tmrun.console import say
from tmrun.protocol import environment, keys

try:  # ``import tmrun`` must work without a build of the native module (the CLI, a source tree)
    import tmrun_native as tn
    from tmrun.comm.native import as_buffer, connect_via_store, join_via_store, make_options

    _NATIVE_ERROR: Optional[BaseException] = None
except (ImportError, AttributeError) as _exc:  # pragma: no cover - only without a build
    tn = None  # type: ignore[assignment]
    _NATIVE_ERROR = _exc

BACKEND_NAME = "tmrun"
ENV_LOCAL = environment.ENV_COMM_LOCAL
ENV_TIMEOUT = environment.ENV_COMM_TIMEOUT
ENV_BIND = environment.ENV_COMM_BIND
ENV_ADVERTISE = environment.ENV_COMM_ADVERTISE
STORE_PREFIX = keys.BACKEND_PREFIX

__all__ = [
    "BACKEND_NAME",
    "Options",
    "TmrunProcessGroup",
    "TmrunWork",
    "BackgroundInterrupted",
    "UnsupportedError",
    "create_process_group",
    "get_group",
    "register",
]


_RED = dist.ReduceOp.RedOpType
_NATIVE_OPS = {} if tn is None else {
    _RED.SUM: tn.ReduceOp.SUM,
    _RED.AVG: tn.ReduceOp.AVG,
    _RED.MIN: tn.ReduceOp.MIN,
    _RED.MAX: tn.ReduceOp.MAX,
    _RED.PRODUCT: tn.ReduceOp.PRODUCT,
}
PLANE_LOSS_GRACE = 3.0  # s: how long a failed device operation waits for the TCP side to name a lost peer
_DEVICE_TYPES = dist.ProcessGroup.__dict__["_device_types"]  # torch's own property (TmrunProcessGroup's answers first)
_REDUCIBLE = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int32, torch.int64, torch.uint8)


# ---------------------------------------------------------------------------------------- options
def _env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


@dataclass
class Options:
    """``pg_options`` of ``init_process_group("tmrun", ...)`` / ``new_group(..., pg_options=...)``.

    local:   create the group in local (sandbox) mode: no store traffic, no communicator; every
             collective is served locally. ``None``: ``TMRUN_COMM_LOCAL=1`` in the environment.
    comm:    use this already connected :class:`tmrun_native.Communicator` instead of
             bootstrapping one (its rank and world size must match the group's).
    job_id:  the native job id (a mismatch rejects connections). Default:
             ``f"{TMRUN_RUN_ID or TORCHELASTIC_RUN_ID or 'tmrun'}/{group_name}"``.
    epoch:   the native epoch of the bootstrap.
    failure_handler: see :meth:`TmrunProcessGroup.set_failure_handler`.
    native:  extra :class:`tmrun_native.Options` fields (``timeout=2.0``, ``bind_address=...``).
    """

    local: Optional[bool] = None
    comm: Any = None
    job_id: Optional[str] = None
    epoch: int = 0
    failure_handler: Optional[Callable[[BaseException], bool]] = None
    native: dict = field(default_factory=dict)


def default_job_id(group_name: str) -> str:
    run = os.environ.get(environment.ENV_RUN_ID) or os.environ.get(environment.ENV_TORCHELASTIC_RUN_ID) or "tmrun"
    return f"{run}/{group_name}"


def _native_options(timeout: Optional[datetime.timedelta], extra: dict) -> tn.Options:
    kw: dict = {}
    if timeout is not None and timeout.total_seconds() > 0:
        secs = timeout.total_seconds()
        kw["op_timeout"] = secs
        kw["connect_timeout"] = secs
    if os.environ.get(ENV_TIMEOUT):
        kw["timeout"] = float(os.environ[ENV_TIMEOUT])
    bind = os.environ.get(ENV_BIND)
    if bind is None and _multi_host():
        bind = "0.0.0.0"
    if bind:
        kw["bind_address"] = bind
    advertise = os.environ.get(ENV_ADVERTISE)
    if advertise is None and bind in ("0.0.0.0", "::"):
        advertise = socket.gethostname()
    if advertise:
        kw["advertise_host"] = advertise
    kw.update(extra)
    return make_options(**kw)


def _multi_host() -> bool:
    """True when torchrun's environment says the job spans several nodes."""
    try:
        world = int(os.environ.get(environment.ENV_WORLD_SIZE, "1"))
        return world > int(os.environ.get(environment.ENV_LOCAL_WORLD_SIZE, "0") or 0) > 0
    except ValueError:
        return False


# ---------------------------------------------------------------------------------------- staging
# Tensors that are not contiguous CPU tensors (CUDA ones included) go through host copies:
# tmrun.comm.staging's to_host before the native operation, from_host in its finish (on the
# completing thread, before the future completes: that future is created with the CUDA devices
# involved, so torch makes the waiter's stream and DDP's callbacks wait for it as with NCCL).


def _raw(t: torch.Tensor) -> memoryview:
    buf, _ = as_buffer(staging.byte_view(t))
    return buf


# ---------------------------------------------------------------------------------------- work
class TmrunWork(dist.Work):
    """The Work of one tmrun operation: completes when every native operation behind it did.

    ``wait(timeout)`` raises the operation's error (a :class:`tmrun_native.CommError` subclass
    for communication failures, message naming the lost rank) or ``TimeoutError``;
    ``get_future()`` is a ``torch.futures.Future`` whose value is the list of output tensors."""

    def __init__(self, op: "_Op") -> None:
        super().__init__()
        self._op = op

    def wait(self, timeout: Any = None) -> bool:
        secs = _seconds(timeout)
        if not self._op.done.wait(secs):
            raise TimeoutError(f"tmrun {self._op.name}: not completed within {secs} s")
        if self._op.error is not None:
            raise self._op.error  # the operation's own error, its type kept
        # The caller's CUDA streams wait for the operation: its future carries the CUDA events
        # of its outputs (NCCL's, or the staging copies'). Without this a caller that reads an
        # output right after wait() (DDP's parameter check reads its all_gather's sizes) raced
        # the NCCL stream: garbage on the H200 ("value cannot be converted to type int").
        self._op.future.wait()
        return True

    def get_future(self) -> torch.futures.Future:
        return self._op.future

    def is_completed(self) -> bool:
        return self._op.done.is_set()

    def is_success(self) -> bool:
        return self._op.done.is_set() and self._op.error is None

    def exception(self) -> Optional[BaseException]:
        return self._op.error

    def result(self) -> list:
        self.wait()
        return self._op.result

    def synchronize(self) -> None:
        self.wait()

    def source_rank(self) -> int:
        return self._op.source_rank

    def __repr__(self) -> str:
        state = "done" if self._op.done.is_set() else "pending"
        return f"<TmrunWork {self._op.name} {state}>"


class CoalescedWork(dist.Work):
    """The Work of several tmrun operations launched inside one coalescing manager: waits for
    each in turn (each makes the caller's streams wait for it), fails with the first error."""

    def __init__(self, works: list) -> None:
        super().__init__()
        self._works = list(works)

    def wait(self, timeout: Any = None) -> bool:
        for work in self._works:
            work.wait(timeout)
        return True

    def get_future(self) -> torch.futures.Future:
        return torch.futures.collect_all([w.get_future() for w in self._works]).then(
            lambda all_done: [t for f in all_done.value() for t in f.wait()])

    def is_completed(self) -> bool:
        return all(w.is_completed() for w in self._works)

    def is_success(self) -> bool:
        return all(w.is_success() for w in self._works)

    def exception(self) -> Optional[BaseException]:
        return next((w.exception() for w in self._works if w.exception() is not None), None)

    def synchronize(self) -> None:
        self.wait()


def _seconds(timeout: Any) -> Optional[float]:
    if timeout is None:
        return None
    secs = timeout.total_seconds() if isinstance(timeout, datetime.timedelta) else float(timeout)
    return None if secs <= 0 else secs  # c10d's kNoTimeout is 0


class CommClock:
    """Time this process spent with at least one collective outstanding (``seconds()``), and
    since when one is (``since()``, 0.0 when none): what sets a rank's own work apart from waiting
    for its peers (the worker's progress record; a straggler waits least). ``listener(since)`` is
    called on every change between none and some outstanding."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._outstanding = 0
        self._since = 0.0
        self._total = 0.0
        self.listener: Optional[Callable[[float], None]] = None

    def begin(self) -> None:
        with self._lock:
            self._outstanding += 1
            if self._outstanding != 1:
                return
            self._since = time.time()
            since = self._since
        if self.listener is not None:
            self.listener(since)

    def end(self) -> None:
        with self._lock:
            if self._outstanding <= 0:
                return
            self._outstanding -= 1
            if self._outstanding:
                return
            self._total += time.time() - self._since
            self._since = 0.0
        if self.listener is not None:
            self.listener(0.0)

    def seconds(self) -> float:
        with self._lock:
            return self._total + (time.time() - self._since if self._outstanding else 0.0)

    def since(self) -> float:
        return self._since


COMM_CLOCK = CommClock()


_RECEIVES = ("recv", "p2p_batch")  # operations whose outputs are receive buffers


def _fill_locally(op: "_Op") -> None:
    """Give ``op`` the result it has when served locally (under no_grad: a pipeline's receive
    buffer is a leaf that requires grad; grad mode is per thread, and this may run on the
    completer's)."""
    with torch.no_grad():
        op.local()


class _Op:
    """One operation: native works, what to run after them, and everything it keeps alive."""

    __slots__ = ("name", "result", "keep", "native", "finish", "future", "_outcome", "done", "error", "abort_seq",
                 "local", "source_rank", "clocked", "on_plane", "background", "epoch")

    def __init__(self, name: str, result: list, local: Optional[Callable[[], None]] = None) -> None:
        self.name = name
        self.result = result
        self.keep: list = []  # tensors and staging buffers referenced until the op is over
        self.native: list = []
        self.finish: list = []
        # The future callers get (DDP's reducer reads it in C++) is a continuation of the one
        # completed here: torch's Python Future.set_exception only stores the exception as the
        # value (a Python-side unwrap raises it), so C++ saw a successful future holding no
        # tensors, and DDP's reducer crashed on it (SIGSEGV in parseCppCommHookResult: a survivor
        # under plain torchrun whose peer died). A continuation that raises is a real error.
        self._outcome: torch.futures.Future = _future_for(result)
        self.future: torch.futures.Future = self._outcome.then(_unwrap_outcome)
        self.done = threading.Event()
        self.error: Optional[BaseException] = None
        self.abort_seq = 0  # the group's abort count when the op was launched
        self.local = local
        self.source_rank = -1
        self.clocked = True
        self.on_plane = False  # launched on the device plane: its failures go to _plane_fail
        self.background = False  # launched by a thread of its own on a background group: never absorbed
        self.epoch = -1  # the communicator's epoch at the launch (background operations)
        COMM_CLOCK.begin()

    def complete(self, error: Optional[BaseException] = None) -> None:
        self.error = error
        if error is None:
            self._outcome.set_result(self.result)
        else:
            self._outcome.set_exception(error)
        self.done.set()
        if self.clocked:
            self.clocked = False
            COMM_CLOCK.end()
        self.keep = []
        self.native = []


def _unwrap_outcome(outcome: torch.futures.Future) -> Any:
    return outcome.wait()  # the result, or raises the operation's error (the continuation's error)


def _future_for(result: list) -> torch.futures.Future:
    """A future for ``result``: CPU-only, or aware of the CUDA devices of its tensors."""
    devices: list = []
    stack = list(result)
    while stack:
        x = stack.pop()
        if isinstance(x, (list, tuple)):
            stack.extend(x)
        elif isinstance(x, torch.Tensor) and x.device.type == "cuda" and x.device not in devices:
            devices.append(x.device)
    return torch.futures.Future(devices=devices) if devices else torch.futures.Future()


def _reraise(exc: BaseException) -> None:
    raise exc


def _device_allreduce(tensors: list, opts: Any) -> tuple[str, tuple]:
    """The inner group's call for an allreduce: several tensors are reduced each on its own
    (torch's ``allreduce_coalesced``; a list given to its ``allreduce`` means one tensor per device)."""
    if len(tensors) == 1:
        return "allreduce", (tensors, opts)
    coalesced = AllreduceCoalescedOptions()
    coalesced.reduceOp = opts.reduceOp
    return "allreduce_coalesced", (tensors, coalesced)


def _call_inner(inner: Any, method: str, args: tuple) -> Any:
    """Launch ``method`` on a generation's inner group. A P2P batch ("p2p_batch": items of (kind,
    tensor, peer, tag), and the device) is one NCCL group call where the inner group coalesces
    (NCCL: over the collective communicator, no 2-rank communicator per pair), else each send and
    receive on its own (gloo's are asynchronous): a list of Works."""
    if method != "p2p_batch":
        return getattr(inner, method)(*args)
    items, _device = args
    coalesces = bool(getattr(inner, "supports_coalescing", False))
    if coalesces:
        inner._start_coalescing()
    works = []
    try:
        for kind, tensor, peer, tag in items:
            works.append((inner.send if kind == "send" else inner.recv)([tensor], peer, tag))
    finally:
        if coalesces:
            batch = inner._end_coalescing()
    return batch if coalesces else [w for w in works if w is not None]


_COALESCING: Optional[bool] = None


def python_coalescing_supported() -> bool:
    """Whether torch hands a Python process group its batches (``start_coalescing`` /
    ``end_coalescing``, torch 2.14's PyProcessGroup): found out once, on a throwaway group. Where it
    does not, batch_isend_irecv sends and receives one by one (as before)."""
    global _COALESCING
    if _COALESCING is None:
        class _Probe(dist.ProcessGroup):
            started = False

            def start_coalescing(self, device: Any = None) -> None:
                type(self).started = True

            def end_coalescing(self, device: Any = None) -> Any:
                return None

        try:
            _Probe(0, 1)._start_coalescing(torch.device("cpu"))
        except Exception:  # noqa: BLE001  torch without the hook: no backend to coalesce on
            pass
        _COALESCING = _Probe.started
    return _COALESCING


def _ask_for_work(args: tuple) -> None:
    """Options of a blocking call (``asyncOp`` False: ``dist.all_reduce(t)``) made asynchronous for
    the inner group: torch's ProcessGroupNCCL then runs it on its own stream and returns a Work
    whose future completes the tmrun operation (with a blocking call it returns None: on torch
    2.11, ``dist.all_reduce`` of a CUDA tensor raised AttributeError on the plane). The caller
    still waits, on the tmrun Work torch gets back."""
    for arg in args:
        if hasattr(arg, "asyncOp"):
            arg.asyncOp = True


def _nothing(_comm: Any) -> None:
    """The launch of an operation that only the device plane serves."""


class _Completer:
    """One thread per group: waits for submitted operations in order and completes them."""

    def __init__(self, group: "TmrunProcessGroup") -> None:
        self._group = group
        self._cv = threading.Condition()
        self._queue: list = []
        self._thread: Optional[threading.Thread] = None
        self._stopping = False

    def put(self, op: _Op) -> None:
        with self._cv:
            if self._stopping:
                raise RuntimeError("tmrun process group was shut down")
            self._queue.append(op)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="tmrun-completer", daemon=True)
                self._thread.start()
            self._cv.notify_all()

    def pending(self) -> int:
        with self._cv:
            return len(self._queue)

    def drain(self, timeout: Optional[float]) -> bool:
        with self._cv:
            return self._cv.wait_for(lambda: not self._queue, timeout)

    def stop(self, timeout: float = 30.0) -> None:
        with self._cv:
            self._stopping = True
            self._cv.notify_all()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)

    def _run(self) -> None:
        while True:
            with self._cv:
                self._cv.wait_for(lambda: self._queue or self._stopping)
                if not self._queue:
                    return  # stopping and drained
                op = self._queue[0]
            try:
                self._group._finish(op)
            except BaseException as exc:  # noqa: BLE001  a bug here must not stall every later op
                say(f"tmrun completer: finishing {op.name} failed", worker=True, error=exc)
                if not op.done.is_set():
                    op.complete(exc)
            with self._cv:
                self._queue.pop(0)
                self._cv.notify_all()


# ---------------------------------------------------------------------------------------- group
class TmrunProcessGroup(dist.ProcessGroup):
    """torch ProcessGroup over :class:`tmrun_native.Communicator` (see the module docstring)."""

    def __init__(self, rank: int, world_size: int, comm: Any = None, *, local: bool = False,
                 job_id: str = "", failure_handler: Optional[Callable[[BaseException], bool]] = None,
                 joining: bool = False) -> None:
        super().__init__(rank, world_size)
        if comm is None and not local and not joining:
            raise ValueError("a tmrun process group needs a communicator unless it is in local mode (or joining: "
                             "a join attaches it later)")
        self._rank = int(rank)
        self._size = int(world_size)
        self._comm = None
        self._local = bool(local)
        self._aborted = False
        self._abort_seq = 0  # times the group entered the aborted state
        self._handler = failure_handler
        self._handler_lock = threading.Lock()
        self._lock = threading.Lock()
        self._completer = _Completer(self)
        self._closed = False
        self._stats = {"local_ops": 0, "network_ops": 0, "device_ops": 0, "absorbed_errors": 0, "raised_errors": 0,
                       "aborts": 0}
        self._plane: Optional[DevicePlane] = None
        self._plane_kind: Optional[str] = None  # resolved at the first operation on tensors
        self._plane_wanted = False  # an operation's tensors belonged on the device plane
        self.job_id = job_id
        self._group_name = ""
        self._group_desc = ""
        self.joined_in: Optional[int] = None  # the generation whose join created this group (set_joining)
        self._background = False  # set_background(): a group for the script's own threads
        self._sessions = threading.local()  # per thread: (abort count, epoch) at its first operation
        self._batch: Optional[list] = None  # the open P2P batch's items (start_coalescing)
        self._batch_works: list = []  # other operations launched while the batch is open
        if comm is not None:
            self.attach(comm)

    # ------------------------------------------------------------------ identity (torch-visible)
    def getBackendName(self) -> str:  # noqa: N802  (C++ virtual name)
        return BACKEND_NAME

    def name(self) -> str:
        return BACKEND_NAME

    def getRank(self) -> int:  # noqa: N802
        return self._rank

    def getSize(self) -> int:  # noqa: N802
        return self._size

    def getGroupName(self) -> str:  # noqa: N802  (torch names the group after creation)
        return self._group_name

    def setGroupName(self, name: str) -> None:  # noqa: N802
        self._group_name = name

    def getGroupDesc(self) -> str:  # noqa: N802
        return self._group_desc

    def setGroupDesc(self, desc: str) -> None:  # noqa: N802
        self._group_desc = desc

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._size

    # ------------------------------------------------------------------ what torch asks a backend
    # torch 2.14's Python layer asks a group for its backend of a device and reads capabilities
    # off it (``batch_isend_irecv``: ``supports_coalescing``; ``new_group``: ``supports_splitting``;
    # FSDP2's allocator: ``supports_tensor_alloc``). This group is its own backend for every
    # device it serves; torch's C++ lookup knows no backend for it (it raised "No backend type
    # associated with device type cpu" there).
    supports_splitting = False
    supports_time_estimate = False

    def _get_backend(self, device: Any = None) -> "TmrunProcessGroup":
        return self

    def supports_tensor_alloc(self, device: Any = None) -> bool:
        return False

    @property
    def _device_types(self) -> list:  # type: ignore[override]
        """A background group says it serves the CPU (torch's asynchronous DCP save asserts it);
        any other answers as torch's own group does (no backend registered: none)."""
        if self._background:
            return [torch.device("cpu")]
        return _DEVICE_TYPES.__get__(self, type(self))

    def __repr__(self) -> str:
        mode = "local" if self._local else ("aborted" if self._aborted else "network")
        return f"TmrunProcessGroup(rank={self._rank}, size={self._size}, {mode})"

    # ------------------------------------------------------------------ resilience hooks
    @property
    def comm(self) -> Any:
        """The native communicator in use (``None`` for a group created in local mode)."""
        return self._comm

    def attach(self, comm: Any) -> Any:
        """Use ``comm`` for every later operation and return the previous communicator (not
        closed). The group's rank becomes ``comm.rank`` (``pg.rank()`` and ``dist.get_rank()``
        follow it; see docs/backend.md for what torch caches). ``comm.world_size`` must equal the
        group size. Call at a safe point: operations already submitted finish on the old one.
        Local mode and the aborted state are left as they are."""
        if comm is not None and int(comm.world_size) != self._size:
            raise ValueError(f"tmrun attach: communicator world size {comm.world_size} != group size {self._size}")
        with self._lock:
            old, self._comm = self._comm, comm
            if comm is not None:
                self._rank = int(comm.rank)
        return old

    def prepare_replacement(self, replaced: Sequence[int], generation: int,
                            get: Optional[Callable[[Any, str], str]] = None) -> None:
        """Survivor side of a replacement of this group's ranks ``replaced`` (group ranks) in
        ``generation``: publish this rank's address and wait for the joiners' (a joiner creates
        the group in join mode: :func:`set_joining`), then prepare the communicator. Call
        ``pg.comm.commit()`` next (it returns once the joiners are connected) and
        :meth:`clear_aborted`. Groups without a replaced rank need none of this. ``get``: how
        to wait for a joiner's address (:func:`tmrun.comm.native.prepare_replacement`)."""
        store = getattr(self, "store", None)
        if store is None or self._comm is None:
            raise RuntimeError("tmrun prepare_replacement: the group has no store or no communicator")
        from tmrun.comm.native import prepare_replacement

        prepare_replacement(store, self._comm, list(replaced), generation, prefix=REPLACE_PREFIX, get=get)

    def set_local(self, local: bool = True) -> None:
        """Local (sandbox) mode: every later collective is served locally, at once, with no
        network traffic (allreduce leaves the tensor as is, broadcast no-op, allgather copies the
        input into every slot, reduce_scatter takes this rank's block, barrier no-op, recv fills
        zeros; PREMUL_SUM multiplies by its factor: a group of one). Leaving local mode needs an
        attached communicator."""
        with self._lock:
            if not local and self._comm is None:
                raise RuntimeError("tmrun set_local(False): no communicator attached (attach(comm) first)")
            self._local = bool(local)

    @property
    def local(self) -> bool:
        return self._local

    def set_background(self) -> None:
        """Make this a *background* group: one the script's own threads use beside the training
        (a gloo group in its place: torchtitan's asynchronous checkpoint saves through one).
        Operations issued on the main thread follow the step protocol as on any group. Those of
        any other thread never get a value no peer made: one in flight when the job's
        membership changes (a loss, a replacement, a migration's switch), or issued by a thread
        that began using the group before such a change, fails with
        :class:`BackgroundInterrupted` (a background checkpoint save is then not finished,
        rather than finished with made-up plans); a thread that begins after the change
        uses the new membership. A sandbox (local mode) serves them locally, as every group."""
        self._background = True

    @property
    def background(self) -> bool:
        return self._background

    def _background_check(self, op: "_Op") -> None:
        """``op`` from a thread other than the main one on a background group: mark it, and
        raise :class:`BackgroundInterrupted` if the membership changed since the thread's first
        operation here (or is changing now)."""
        if not self._background or self._local or threading.current_thread() is threading.main_thread():
            return
        comm = self._comm
        epoch = -1 if comm is None else int(comm.epoch)
        session = getattr(self._sessions, "began", None)
        if session is None:
            session = self._sessions.began = (self._abort_seq, epoch)
        if self._aborted or session != (self._abort_seq, epoch):
            self._stats["raised_errors"] += 1
            error = BackgroundInterrupted(self._interrupted(op.name))
            op.complete(error)
            raise error
        op.background = True
        op.epoch = epoch

    def _interrupted(self, what: str) -> str:
        return (f"tmrun {what} on group {self._group_name!r} from thread {threading.current_thread().name!r}: the "
                "job's membership changed while this thread used the group (a rank lost or replaced); its "
                "operations cannot complete (a background checkpoint save is not finished, never finished with "
                "values no peer made)")

    def set_failure_handler(self, fn: Optional[Callable[[BaseException], bool]]) -> None:
        """``fn(exc) -> bool`` is called when a native operation fails with a
        :class:`tmrun_native.CommError` (from the completer thread or the calling thread; it must
        not issue collectives on this group). True: the operation's Work completes successfully
        (tensor contents unspecified) and the group enters the *aborted* state, in which every
        later collective completes at once without touching the network (local semantics) and
        operations already in flight complete successfully whatever their outcome, until
        :meth:`clear_aborted`. False or no handler: the error reaches the caller. The handler is
        called once per failure, not for the other operations that the same failure fails."""
        self._handler = fn

    @property
    def aborted(self) -> bool:
        return self._aborted

    def abort_collectives(self) -> None:
        """Enter the aborted state by hand (e.g. the runtime learnt of a failure elsewhere)."""
        with self._handler_lock:
            if not self._aborted:
                self._aborted = True
                self._abort_seq += 1
                self._stats["aborts"] += 1
        self._abort_plane()

    def _abort_plane(self) -> None:
        """The device work of the generation given up is dropped at once (NCCL's abort). Not
        under ``_handler_lock``: the inner group's failing works call back into :meth:`_plane_fail`."""
        plane, comm = self._plane, self._comm
        if plane is not None and comm is not None:
            plane.abort(int(comm.epoch))

    def clear_aborted(self) -> None:
        """Leave the aborted state: later collectives use the network again (typically after the
        communicator was repaired with ``prepare``/``commit`` or replaced with :meth:`attach`)."""
        with self._handler_lock:
            self._aborted = False

    def synchronize(self, timeout: Optional[float] = None) -> bool:
        """Wait until every submitted operation has completed; False on timeout."""
        return self._completer.drain(timeout)

    def pending(self) -> int:
        return self._completer.pending()

    def counters(self) -> dict:
        """The native communicator's counters (zeros when none is attached)."""
        if self._comm is None:
            return {"links_opened": 0, "links_closed": 0, "collectives": 0, "p2p_ops": 0, "bytes_sent": 0,
                    "bytes_recv": 0, "rejected_connections": 0, "auth_failures": 0, "commits": 0,
                    "prepares_superseded": 0, "last_reject_reason": "",
                    "per_peer": {}}
        return self._comm.counters()

    def links(self) -> list:
        return [] if self._comm is None else self._comm.links()

    def stats(self) -> dict:
        """Backend-level counts: local_ops, network_ops (device_ops of them on the device plane),
        absorbed_errors, raised_errors, aborts."""
        return dict(self._stats)

    def plane_counts(self) -> dict:
        """The device plane's counts (builds, aborts, built_on_demand; zeros without one)."""
        if self._plane is None:
            return {"builds": 0, "aborts": 0, "built_on_demand": 0}
        return self._plane.counts()

    # ------------------------------------------------------------------ lifecycle
    def shutdown(self, drain_timeout: float = 10.0, *, device_plane: bool = True, stop_timeout: float = 30.0) -> None:
        """Wait up to ``drain_timeout`` s for submitted operations, close the communicator (what
        is still running fails with "communicator is closed"), stop the completer thread (up to
        ``stop_timeout`` s). ``device_plane``: shut the plane's inner groups down too (NCCL's
        shutdown may wait on dead peers: not at exit, :func:`close_groups_at_exit`)."""
        if self._closed:
            return
        self._closed = True
        if drain_timeout > 0:
            self._completer.drain(drain_timeout)
        if device_plane and self._plane is not None:
            self._plane.shutdown()
        if self._comm is not None:
            try:
                self._comm.close()
            except Exception as exc:  # noqa: BLE001
                say(f"closing the tmrun communicator failed: {exc}", worker=True)
        self._completer.stop(stop_timeout)

    def abort(self) -> None:
        self.shutdown()

    # ------------------------------------------------------------------ machinery
    def _serve_locally(self) -> bool:
        return self._local or self._aborted

    def _serve_here(self, op: _Op, device: Optional[tuple[str, tuple]]) -> TmrunWork:
        """Complete ``op`` with the result it has when served locally (a sandbox's), on no link."""
        if device is not None and not self._plane_wanted:
            self._on_plane(device[1])  # a sandbox learns whether its groups will need the plane
        self._stats["local_ops"] += 1
        if op.local is not None:
            _fill_locally(op)
        op.complete()
        return TmrunWork(op)

    def _comm_or_raise(self) -> Any:
        comm = self._comm
        if comm is None:
            raise RuntimeError("tmrun: no communicator attached (the group was created in local mode, or its "
                               "join has not finished)")
        if self._closed:
            raise RuntimeError("tmrun: the process group was shut down")
        return comm

    def _run(self, op: _Op, opts: Any, launch: Callable[[Any], None],
             device: Optional[tuple[str, tuple]] = None) -> TmrunWork:
        work = self._launch(op, opts, launch, device)
        if self._batch is not None:  # inside a coalescing manager: its Work waits for this one too
            self._batch_works.append(work)
        return work

    def _launch(self, op: _Op, opts: Any, launch: Callable[[Any], None],
                device: Optional[tuple[str, tuple]] = None) -> TmrunWork:
        """Serve ``op`` locally, or launch it on the communicator and complete it (here when the
        caller waits right away, else on the completer thread). ``device``: the inner group's
        method and arguments, when the operation's tensors belong on the device plane."""
        if _SERVED_HERE.depth:  # tmrun's own set-up of a module (served_locally): no peer takes part
            return self._serve_here(op, device)
        if self.joined_in is not None and _JOINING is not None:
            raise JoiningCollectiveError(
                f"tmrun {op.name} on group {self._group_name!r} while this process joins generation {_JOINING} "
                "(a standby building its model as a lost rank): the other ranks are not building theirs, so they "
                "never issue it. Build the model without collectives (every rank the same seed; e.g. "
                "parallelize_module(..., src_data_rank=None), not distribute_tensor's scatter from rank 0)")
        if self._closed and self._local:  # served locally, it would return values no peer made
            raise RuntimeError(f"tmrun: {op.name} on group {self._group_name!r}, which was shut down")
        self._background_check(op)
        if self._serve_locally():
            return self._serve_here(op, device)
        comm = self._comm_or_raise()
        if device is not None and self._on_plane(device[1]) and not self._gloo_refuses(opts):
            return self._run_on_plane(op, comm, *device)
        self._stats["network_ops"] += 1
        op.abort_seq = self._abort_seq
        try:
            launch(comm)
        except BaseException as exc:  # noqa: BLE001
            if op.native:  # part of it was submitted: keep its buffers alive until that part is over
                op.finish = [lambda failure=exc: _reraise(failure)]  # bound now: "exc" is unset after the except
                self._completer.put(op)
            elif isinstance(exc, tn.CommError):
                self._fail(op, exc)
            if isinstance(exc, tn.CommError):
                return TmrunWork(op)
            raise
        if getattr(opts, "asyncOp", True):
            self._completer.put(op)
        else:
            self._finish(op)
        return TmrunWork(op)

    def _finish(self, op: _Op) -> None:
        error: Optional[BaseException] = None
        for w in op.native:
            try:
                w.wait()
            except BaseException as exc:  # noqa: BLE001  keep waiting: buffers must outlive every native op
                error = error or exc
        if error is None:
            try:
                for fn in op.finish:
                    fn()
            except BaseException as exc:  # noqa: BLE001
                error = exc
        if error is None:
            op.complete()
        elif op.on_plane:
            self._plane_fail(op, error)
        else:
            self._fail(op, error)

    def _fail(self, op: _Op, error: BaseException) -> None:
        if op.background:
            self._fail_background(op, error)
            return
        if isinstance(error, tn.CommError) and self._absorb(error, op.abort_seq):
            self._stats["absorbed_errors"] += 1
            if op.name in _RECEIVES and op.local is not None:
                # a receive cut off by the loss holds what its buffer held (torch.empty's bytes:
                # a pipeline's metadata size read from them asked for 94 TB); filled as one
                # served locally instead
                _fill_locally(op)
            op.complete()
            self._abort_plane()
            return
        self._stats["raised_errors"] += 1
        op.complete(_annotate(error, op.name))

    def _fail_background(self, op: _Op, error: BaseException) -> None:
        """A background thread's operation failed: never absorbed. A loss it saw first (the
        membership unchanged since its launch) still goes to the failure handler, which starts
        the change (the group then enters the aborted state); the operation fails either way."""
        comm = self._comm
        unchanged = comm is not None and int(comm.epoch) == op.epoch
        if isinstance(error, tn.CommError) and unchanged:
            self._absorb(error, op.abort_seq)
        self._stats["raised_errors"] += 1
        interrupted = BackgroundInterrupted(f"{self._interrupted(op.name)}: {error}")
        interrupted.__cause__ = error
        op.complete(interrupted)

    # ------------------------------------------------------------------ the device plane
    def _on_plane(self, args: tuple) -> bool:
        if self._plane_kind is None:
            kind = device_plane.configured_kind()
            self._plane_kind = device_plane.resolve_kind(kind, dist.is_nccl_available()) if kind != "gloo" else kind
        wanted = device_plane.takes(self._plane_kind, device_plane.device_types(args))
        self._plane_wanted = self._plane_wanted or wanted
        return wanted

    def _gloo_refuses(self, opts: Any) -> bool:
        """A PREMUL_SUM on the gloo plane (its test mode on CPU), which gloo refuses: the TCP
        path serves it instead (NCCL's plane takes it as it is)."""
        return self._plane_kind == "gloo" and _premul_factor(getattr(opts, "reduceOp", None)) is not None

    def _device_plane(self) -> DevicePlane:
        with self._lock:
            if self._plane is None:
                if getattr(self, "store", None) is None and _PLANE_STORE is None:
                    raise DevicePlaneError("tmrun: a group without a store has no device plane")
                timeout = getattr(self, "join_options", (None, {}))[0] or datetime.timedelta(minutes=10)
                self._plane = DevicePlane(str(self._plane_kind), timeout)
            return self._plane

    def plane_takes(self, tensor: torch.Tensor) -> bool:
        """Whether an operation on ``tensor`` goes to this group's device plane (False where the
        plane cannot take it, e.g. a CUDA tensor without NCCL: the caller keeps its own path)."""
        try:
            return self._on_plane(((tensor,),))
        except DevicePlaneError:
            return False

    def plane_device(self) -> torch.device:
        """Where the plane's tensors live: the current CUDA device for NCCL, the CPU for gloo."""
        if self._plane_kind == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def ensure_device_plane(self) -> None:
        """Create the current generation's inner group now, on every member at the same point
        (healing, before its first stripe: a gloo group bootstraps with all members at once)."""
        comm = self._comm_or_raise()
        self._device_plane().group(self._plane_store, int(comm.epoch), self._rank, self._size)

    def prepare_device_plane(self, generation: int, rank: Optional[int] = None) -> Optional[threading.Thread]:
        """Build ``generation``'s device communicator in the background, as ``rank`` (default:
        this group's rank): a planned migration's members, before the switch step. Only when
        this group's collectives went to the device plane (or would have, in local mode);
        returns the building thread, or None."""
        if not self._plane_wanted:
            return None
        rank = self._rank if rank is None else int(rank)
        return self._device_plane().prepare(self._plane_store, int(generation), rank, self._size)

    def _plane_store(self) -> Any:
        """Where a generation of this group's device plane bootstraps (called once per build):
        under the job's plane store when the runtime set one (:func:`set_plane_store`: a
        promoted standby's group was created over a local store), else the store torch handed
        the group; through a client of its own (``clone``), since the inner group waits in the
        store for its peers while this process's other threads use theirs (a standby waiting
        there for its links' addresses, the loss watcher), and one client serves one wait at a
        time."""
        shared = _PLANE_STORE is not None
        base = _PLANE_STORE if shared else self.store
        try:
            base = base.clone()
        except (AttributeError, RuntimeError, NotImplementedError):  # a store without clients
            pass
        return dist.PrefixStore(f"g{self._group_name}", base) if shared else base

    def _run_on_plane(self, op: _Op, comm: Any, method: str, args: tuple) -> TmrunWork:
        """Launch ``op`` on the inner group of the communicator's generation; its Work completes
        when the inner one does (at once for NCCL, whose future carries CUDA events)."""
        inner = self._device_plane().group(self._plane_store, int(comm.epoch), self._rank, self._size)
        self._stats["network_ops"] += 1
        self._stats["device_ops"] += 1
        op.abort_seq = self._abort_seq
        _ask_for_work(args)
        try:
            work = _call_inner(inner, method, args)
        except Exception as exc:
            with self._handler_lock:  # the inner group was aborted under us: the step is given up
                gave_up = self._aborted or op.abort_seq != self._abort_seq
            if not gave_up and isinstance(exc, dist.DistError):
                # NCCL's error at the launch (a communicator that saw the peer go, torch 2.11:
                # "ncclRemoteError ... remote process exited"): a failure like one of the
                # operation's own, handled as the TCP side names the lost peer, else the caller's
                op.on_plane = True
                self._plane_fail(op, exc)
                if op.error is exc:  # no lost peer: the caller's error, at the launch as torch raises it
                    raise exc        # (deferred to wait(), the script went on into NCCL's next init and hung)
                return TmrunWork(op)
            if not gave_up:  # torch's own refusal of the arguments: the caller's, at once
                op.complete(exc)
                raise
            self._stats["absorbed_errors"] += 1
            op.complete()
            return TmrunWork(op)
        if work is None:  # done in order on the caller's current stream (a blocking call): nothing to wait for
            op.complete()
            return TmrunWork(op)
        if isinstance(work, list):  # a P2P batch on a plane that cannot coalesce: the completer waits for each
            op.keep.extend(work)
            op.native.extend(work)
            op.on_plane = True
            self._completer.put(op)
            return TmrunWork(op)
        op.keep.append(work)
        op.on_plane = True
        try:
            future = work.get_future()
        except RuntimeError:  # a Work without a future (some of gloo's): the completer waits for it
            op.native.append(work)
            self._completer.put(op)
        else:
            future.add_done_callback(lambda fut: self._plane_done(op, fut))
        return TmrunWork(op)

    def _plane_done(self, op: _Op, fut: torch.futures.Future) -> None:
        try:
            fut.value()
        except Exception as exc:  # noqa: BLE001
            self._plane_fail(op, exc)
            return
        op.complete()

    def _plane_fail(self, op: _Op, error: BaseException) -> None:
        """An inner group's operation failed. The TCP communicator is the membership authority:
        a failure it recorded (a lost peer) is handled like one of its own (the failure handler
        absorbs it); with none recorded within ``PLANE_LOSS_GRACE`` s, the error is the caller's."""
        with self._handler_lock:
            if self._aborted or op.abort_seq != self._abort_seq:
                self._stats["absorbed_errors"] += 1
                op.complete()
                return
        found = None
        comm = self._comm
        if comm is not None:
            try:
                found = comm.wait_failure(PLANE_LOSS_GRACE, -1)
            except Exception:  # noqa: BLE001  closed: no loss to report
                found = None
        if found is None:
            self._stats["raised_errors"] += 1
            op.complete(error)
            return
        _, lost, _, message = found
        lost_error = tn.PeerLostError(f"{message} (the device plane's {op.name} failed: {error})")
        lost_error.peer = int(lost)
        self._fail(op, lost_error)

    def _absorb(self, error: BaseException, abort_seq: int) -> bool:
        with self._handler_lock:
            if self._aborted or abort_seq != self._abort_seq:
                return True  # the group already gave up on the operations of before its last abort
            handler = self._handler
            if handler is None:
                return False
            try:
                absorb = bool(handler(error))
            except Exception as exc:  # noqa: BLE001
                say("tmrun failure handler raised; the error goes to the caller", worker=True, error=exc)
                absorb = False
            if absorb:
                self._aborted = True
                self._abort_seq += 1
                self._stats["aborts"] += 1
            return absorb

    # ------------------------------------------------------------------ argument helpers
    def _reduce_args(self, what: str, tensors: Sequence[torch.Tensor], red: Any) -> Any:
        """The native reduction for ``red`` on ``tensors`` (PREMUL_SUM: SUM, of inputs the
        caller premultiplies, :func:`_premultiply`); a clear error for what cannot be reduced."""
        rtype = getattr(red, "op", red)
        if rtype == _RED.PREMUL_SUM:
            _check_factor(what, red)
        elif rtype not in _NATIVE_OPS:
            raise UnsupportedError(
                f"tmrun {what}: reduce op {rtype} is not supported (SUM, AVG, MIN, MAX, PRODUCT, PREMUL_SUM)")
        nop = _NATIVE_OPS.get(rtype, tn.ReduceOp.SUM)
        dtypes = {t.dtype for t in tensors}
        for dt in dtypes:
            if dt == torch.bool and rtype == _RED.PREMUL_SUM:
                raise UnsupportedError(f"tmrun {what}: {rtype} is not defined for torch.bool")
            if dt == torch.bool:
                if nop in (tn.ReduceOp.SUM, tn.ReduceOp.MAX):
                    nop = tn.ReduceOp.MAX  # logical or
                elif nop in (tn.ReduceOp.PRODUCT, tn.ReduceOp.MIN):
                    nop = tn.ReduceOp.MIN  # logical and
                else:
                    raise UnsupportedError(f"tmrun {what}: {rtype} is not defined for torch.bool")
            elif dt.is_complex:
                if nop not in (tn.ReduceOp.SUM, tn.ReduceOp.AVG):
                    raise UnsupportedError(f"tmrun {what}: {rtype} is not defined for complex tensors")
            elif dt not in _REDUCIBLE:
                raise UnsupportedError(
                    f"tmrun {what}: dtype {dt} is not supported for reductions "
                    "(float32, float64, float16, bfloat16, int32, int64, uint8, bool)")
        return nop

    def _check_rank(self, what: str, r: int, name: str = "root") -> int:
        r = int(r)
        if not 0 <= r < self._size:
            raise ValueError(f"tmrun {what}: {name} {r} is not a rank of a group of {self._size}")
        return r

    # ------------------------------------------------------------------ collectives
    def allreduce(self, tensors: Any, opts: Any = None) -> TmrunWork:
        if opts is None or not hasattr(opts, "reduceOp"):
            red = opts if opts is not None else dist.ReduceOp.SUM
            opts = AllreduceOptions()
            opts.reduceOp = red
        tensors = _tensor_list(tensors, "allreduce")
        nop = self._reduce_args("allreduce", tensors, opts.reduceOp)
        factor = _premul_factor(opts.reduceOp)
        op = _Op("allreduce", tensors)
        if factor is not None:
            op.local = lambda: _premultiply_all(tensors, factor)

        def launch(comm: Any) -> None:
            for t in tensors:
                host = staging.to_host(t)
                _premultiply(host, factor)  # the tensor (or its staged copy) is the output anyway
                view = _typed_view(host)
                buf, dt = as_buffer(view)
                op.native.append(comm.allreduce_async(buf, nop, dt))
                op.keep += [t, host, view]
                op.finish.append(lambda t=t, host=host: staging.from_host(t, host))

        return self._run(op, opts, launch, device=_device_allreduce(tensors, opts))

    def allreduce_coalesced(self, tensors: Any, opts: Any = None) -> TmrunWork:
        o = AllreduceOptions()
        if opts is not None:
            o.reduceOp = opts.reduceOp
            o.asyncOp = getattr(opts, "asyncOp", True)
        return self.allreduce(list(tensors), o)

    def broadcast(self, tensors: Any, opts: Any = None) -> TmrunWork:
        if opts is None or not hasattr(opts, "rootRank"):
            root = 0 if opts is None else int(opts)
            opts = BroadcastOptions()
            opts.rootRank = root
        tensors = _tensor_list(tensors, "broadcast")
        root = self._check_rank("broadcast", opts.rootRank)
        op = _Op("broadcast", tensors)
        op.source_rank = root

        def launch(comm: Any) -> None:
            for t in tensors:
                host = staging.to_host(t, copy=self._rank == root)
                buf = _raw(host)
                op.native.append(comm.broadcast_async(buf, root, tn.DType.UINT8))
                op.keep += [t, host]
                op.finish.append(lambda t=t, host=host: staging.from_host(t, host))

        return self._run(op, opts, launch, device=("broadcast", (tensors, opts)))

    def allgather(self, output_tensors: Any, input_tensors: Any, opts: Any = None) -> TmrunWork:
        opts = opts if opts is not None else AllgatherOptions()
        inputs = _tensor_list(input_tensors, "allgather input")
        if len(inputs) != 1 or len(output_tensors) != 1:
            raise ValueError("tmrun allgather: one input tensor and one output list per call")
        inp, outs = inputs[0], list(output_tensors[0])
        if len(outs) != self._size:
            raise ValueError(f"tmrun allgather: the output list holds {len(outs)} tensors, the group has {self._size}")
        for o in outs:
            _same_layout("allgather", o, inp)
        op = _Op("allgather", [outs])

        def local() -> None:
            for o in outs:
                o.copy_(inp)

        op.local = local

        def launch(comm: Any) -> None:
            host_in = staging.to_host(inp)
            nbytes = host_in.numel() * host_in.element_size()
            flat = torch.empty(nbytes * self._size, dtype=torch.uint8)
            op.native.append(comm.allgather_async(_raw(flat), _raw(host_in), tn.DType.UINT8))
            op.keep += [inp, host_in, flat, outs]

            def finish() -> None:
                for i, o in enumerate(outs):
                    o.copy_(flat[i * nbytes:(i + 1) * nbytes].view(o.dtype).view(o.shape))

            op.finish.append(finish)

        return self._run(op, opts, launch, device=("allgather", ([outs], [inp], opts)))

    def all_gather_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> TmrunWork:  # noqa: A002
        opts = opts if opts is not None else AllgatherOptions()
        _check_tensor("all_gather_single output", output)
        _check_tensor("all_gather_single input", input)
        if output.dtype != input.dtype or output.numel() != input.numel() * self._size:
            raise ValueError(
                f"tmrun all_gather_single: output must be {self._size} x input ({input.numel()} x {input.dtype}); "
                f"got {output.numel()} x {output.dtype}")
        op = _Op("all_gather_single", [output])

        def local() -> None:
            if input.numel():
                output.copy_(input.reshape(1, -1).expand(self._size, -1).reshape(output.shape))

        op.local = local

        def launch(comm: Any) -> None:
            host_in = staging.to_host(input)
            host_out = staging.to_host(output, copy=False)
            op.native.append(comm.allgather_async(_raw(host_out), _raw(host_in), tn.DType.UINT8))
            op.keep += [output, input, host_in, host_out]
            op.finish.append(lambda: staging.from_host(output, host_out))

        return self._run(op, opts, launch, device=("_allgather_base", (output, input, opts)))

    _allgather_base = all_gather_single

    def allgather_coalesced(self, output_lists: Any, input_tensors: Any, opts: Any = None) -> TmrunWork:
        opts = opts if opts is not None else AllgatherOptions()
        works = [self.allgather([outs], [inp], _async(AllgatherOptions()))
                 for outs, inp in zip(output_lists, input_tensors)]
        return self._join("allgather_coalesced", works, list(output_lists), opts)

    def all_gather_single_coalesced(self, outputs: Any, inputs: Any, opts: Any = None) -> TmrunWork:
        opts = opts if opts is not None else AllgatherOptions()
        works = [self.all_gather_single(o, i, _async(AllgatherOptions())) for o, i in zip(outputs, inputs)]
        return self._join("all_gather_single_coalesced", works, list(outputs), opts)

    allgather_into_tensor_coalesced = all_gather_single_coalesced

    def reduce_scatter(self, output_tensors: Any, input_tensors: Any, opts: Any = None) -> TmrunWork:
        opts = opts if opts is not None else ReduceScatterOptions()
        outputs = _tensor_list(output_tensors, "reduce_scatter output")
        if len(outputs) != 1 or len(input_tensors) != 1:
            raise ValueError("tmrun reduce_scatter: one output tensor and one input list per call")
        out, ins = outputs[0], list(input_tensors[0])
        if len(ins) != self._size:
            raise ValueError(f"tmrun reduce_scatter: the input list holds {len(ins)} tensors, the group has {self._size}")
        for i in ins:
            _same_layout("reduce_scatter", i, out)
        nop = self._reduce_args("reduce_scatter", [out], opts.reduceOp)
        factor = _premul_factor(opts.reduceOp)
        op = _Op("reduce_scatter", [out])
        op.local = lambda: _premultiply(out.copy_(ins[self._rank]), factor)

        def launch(comm: Any) -> None:
            n = out.numel()
            flat = torch.empty(n * self._size, dtype=out.dtype)
            for r, t in enumerate(ins):
                flat[r * n:(r + 1) * n].copy_(staging.to_host(t).reshape(-1))
            _premultiply(flat, factor)  # a copy: the inputs are left intact
            host_out = staging.to_host(out, copy=False)
            vout, vin = _typed_view(host_out), _typed_view(flat)
            bout, dt = as_buffer(vout)
            bin_, _ = as_buffer(vin)
            op.native.append(comm.reduce_scatter_async(bout, bin_, nop, dt))
            op.keep += [out, ins, flat, host_out, vout, vin]
            op.finish.append(lambda: staging.from_host(out, host_out))

        return self._run(op, opts, launch, device=("reduce_scatter", ([out], [ins], opts)))

    def reduce_scatter_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> TmrunWork:  # noqa: A002
        opts = opts if opts is not None else ReduceScatterOptions()
        _check_tensor("reduce_scatter_single output", output)
        _check_tensor("reduce_scatter_single input", input)
        if output.dtype != input.dtype or input.numel() != output.numel() * self._size:
            raise ValueError(
                f"tmrun reduce_scatter_single: input must be {self._size} x output ({output.numel()} x "
                f"{output.dtype}); got {input.numel()} x {input.dtype}")
        nop = self._reduce_args("reduce_scatter_single", [output], opts.reduceOp)
        factor = _premul_factor(opts.reduceOp)
        op = _Op("reduce_scatter_single", [output])
        n = output.numel()
        op.local = lambda: _premultiply(
            output.copy_(input.reshape(-1)[self._rank * n:(self._rank + 1) * n].view(output.shape)), factor)

        def launch(comm: Any) -> None:
            host_in = staging.to_host(input)
            if factor is not None:
                host_in = _premultiply(host_in.clone() if host_in is input else host_in, factor)  # input intact
            host_out = staging.to_host(output, copy=False)
            vout, vin = _typed_view(host_out), _typed_view(host_in)
            bout, dt = as_buffer(vout)
            bin_, _ = as_buffer(vin)
            op.native.append(comm.reduce_scatter_async(bout, bin_, nop, dt))
            op.keep += [output, input, host_in, host_out, vout, vin]
            op.finish.append(lambda: staging.from_host(output, host_out))

        return self._run(op, opts, launch, device=("_reduce_scatter_base", (output, input, opts)))

    _reduce_scatter_base = reduce_scatter_single

    def reduce_scatter_single_coalesced(self, outputs: Any, inputs: Any, opts: Any = None) -> TmrunWork:
        opts = opts if opts is not None else ReduceScatterOptions()
        works = []
        for o, i in zip(outputs, inputs):
            o2 = ReduceScatterOptions()
            o2.reduceOp = opts.reduceOp
            works.append(self.reduce_scatter_single(o, i, o2))
        return self._join("reduce_scatter_single_coalesced", works, list(outputs), opts)

    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced

    def barrier(self, opts: Any = None) -> TmrunWork:
        opts = opts if opts is not None else BarrierOptions()
        op = _Op("barrier", [])

        def launch(comm: Any) -> None:
            op.native.append(comm.barrier_async())

        return self._run(op, opts, launch)

    def reduce(self, tensors: Any, opts: Any = None) -> TmrunWork:
        """Allreduce on a scratch copy for non-root ranks (their tensors are left unchanged)."""
        opts = opts if opts is not None else ReduceOptions()
        tensors = _tensor_list(tensors, "reduce")
        root = self._check_rank("reduce", opts.rootRank)
        nop = self._reduce_args("reduce", tensors, opts.reduceOp)
        factor = _premul_factor(opts.reduceOp)
        op = _Op("reduce", tensors)
        if factor is not None and self._rank == root:
            op.local = lambda: _premultiply_all(tensors, factor)

        def launch(comm: Any) -> None:
            for t in tensors:
                host = staging.to_host(t)
                if self._rank != root and host is t:
                    host = t.clone()
                _premultiply(host, factor)  # the root's output, or a copy
                view = _typed_view(host)
                buf, dt = as_buffer(view)
                op.native.append(comm.allreduce_async(buf, nop, dt))
                op.keep += [t, host, view]
                if self._rank == root:
                    op.finish.append(lambda t=t, host=host: staging.from_host(t, host))

        return self._run(op, opts, launch, device=("reduce", (tensors, opts)))

    def gather(self, output_tensors: Any, input_tensors: Any, opts: Any = None) -> TmrunWork:
        """An allgather whose result only the root keeps."""
        opts = opts if opts is not None else GatherOptions()
        inputs = _tensor_list(input_tensors, "gather input")
        if len(inputs) != 1:
            raise ValueError("tmrun gather: one input tensor per call")
        inp = inputs[0]
        root = self._check_rank("gather", opts.rootRank)
        if self._rank == root:
            if len(output_tensors) != 1 or len(output_tensors[0]) != self._size:
                raise ValueError(f"tmrun gather: the root needs one output list of {self._size} tensors")
            outs = list(output_tensors[0])
        else:
            if len(output_tensors) and len(output_tensors[0]):
                raise ValueError("tmrun gather: only the root passes output tensors")
            outs = [torch.empty_like(inp, device="cpu") for _ in range(self._size)]
        if self._serve_locally() or self._comm is None or not self._on_plane(([inp],)):
            return self.allgather([outs], [inp], opts)
        gathered = [outs] if self._rank == root else []  # torch's gather: outputs on the root only
        op = _Op("gather", gathered)  # (never served locally: see above)
        return self._run(op, opts, _nothing, device=("gather", (gathered, [inp], opts)))

    def scatter(self, output_tensors: Any, input_tensors: Any, opts: Any = None) -> TmrunWork:
        """The root sends block r to every rank r (point-to-point, in rank order)."""
        opts = opts if opts is not None else ScatterOptions()
        outputs = _tensor_list(output_tensors, "scatter output")
        if len(outputs) != 1:
            raise ValueError("tmrun scatter: one output tensor per call")
        out = outputs[0]
        root = self._check_rank("scatter", opts.rootRank)
        if self._rank == root:
            if len(input_tensors) != 1 or len(input_tensors[0]) != self._size:
                raise ValueError(f"tmrun scatter: the root needs one input list of {self._size} tensors")
            ins = list(input_tensors[0])
            for i in ins:
                _same_layout("scatter", i, out)
        else:
            if len(input_tensors) and len(input_tensors[0]):
                raise ValueError("tmrun scatter: only the root passes input tensors")
            ins = []
        op = _Op("scatter", [out])
        op.source_rank = root
        op.local = (lambda: out.copy_(ins[self._rank])) if ins else (lambda: out.zero_())

        def launch(comm: Any) -> None:
            if self._rank == root:
                for r, t in enumerate(ins):
                    if r == root:
                        continue
                    host = staging.to_host(t)
                    op.native.append(comm.send_async(_raw(host), r, 0))
                    op.keep += [t, host]
                op.finish.append(lambda: out.copy_(ins[root]))
            else:
                host = staging.to_host(out, copy=False)
                op.native.append(comm.recv_async(_raw(host), root, 0))
                op.keep += [out, host]
                op.finish.append(lambda: staging.from_host(out, host))

        return self._run(op, opts, launch, device=("scatter", ([out], [ins] if ins else [], opts)))

    # ------------------------------------------------------------------ P2P batches (coalescing)
    @property
    def supports_coalescing(self) -> bool:  # torch's batch_isend_irecv reads it off the backend
        return python_coalescing_supported()

    def start_coalescing(self, device: Any = None) -> None:
        """torch's ``_coalescing_manager`` (``batch_isend_irecv``) begins a batch: the sends and
        receives until :meth:`end_coalescing` are queued and then move as one operation."""
        if self._batch is not None:
            raise RuntimeError("tmrun: a P2P batch is already open on this group")
        self._batch = []

    def end_coalescing(self, device: Any = None) -> dist.Work:
        """The batch's Work: its sends and receives as one operation, together with any other
        operation launched on this group while the batch was open (torch's coalescing manager
        launches its collectives' coalesced form in between). Nothing at all: a done Work (torch's
        abort path opens and closes an empty batch)."""
        items, self._batch = self._batch, None
        works, self._batch_works = self._batch_works, []
        if items is None:
            raise RuntimeError("tmrun: end_coalescing without start_coalescing")
        if items:
            try:
                batch = self._p2p_batch(items)
            except BaseException as refused:  # each item's Work fails with the batch (nobody waits forever)
                for item in items:
                    item[4].complete(refused)
                raise
            for item_op in [item[4] for item in items]:
                batch.get_future().add_done_callback(
                    lambda _f, item_op=item_op, batch=batch: item_op.complete(batch.exception()))
            works.append(batch)
        if not works:
            done = _Op("coalesced", [])
            done.complete()
            return TmrunWork(done)
        return works[0] if len(works) == 1 else CoalescedWork(works)

    def _queue_in_batch(self, kind: str, tensors: list, peer: int, tag: int) -> Optional[TmrunWork]:
        """Inside a batch: queue the send or receive, return its Work (done with the batch)."""
        if self._batch is None:
            return None
        if len(tensors) != 1:
            raise ValueError(f"tmrun {kind} in a batch: one tensor per operation")
        item_op = _Op(kind, tensors if kind == "recv" else [])
        self._batch.append((kind, tensors[0], peer, _tag(tag), item_op))
        return TmrunWork(item_op)

    def _p2p_batch(self, items: list) -> TmrunWork:
        """The batch's sends and receives as one operation: on the TCP side one native batch (its
        links move together), on the device plane one NCCL group call."""
        received = [t for kind, t, _, _, _ in items if kind == "recv"]
        op = _Op("p2p_batch", received)
        tags = {tag for _, _, _, tag, _ in items}
        if len(tags) > 1:
            raise UnsupportedError(f"tmrun batch_isend_irecv: one tag per batch (got {sorted(tags)})")
        tag = tags.pop() if tags else 0

        def local() -> None:
            for kind, t, peer, _, _ in items:
                if kind == "recv":
                    self._replay_or_zero(t, peer, tag)

        op.local = local

        def launch(comm: Any) -> None:
            native_items = []
            for kind, t, peer, _, _ in items:
                host = staging.to_host(t, copy=kind == "send")
                native_items.append((kind == "send", _raw(host), peer))
                op.keep += [t, host]
                if kind == "recv":
                    op.finish.append(lambda t=t, host=host: staging.from_host(t, host))
                    if _P2P_RECORDERS:
                        op.finish.append(lambda t=t, peer=peer: self._record(t, peer, tag))
            op.native.append(comm.p2p_batch_async(native_items, tag))

        plane_items = [(kind, t, peer, tag) for kind, t, peer, tag, _ in items]
        device = items[0][1].device if items else torch.device("cpu")
        return self._run(op, None, launch, device=("p2p_batch", (plane_items, device)))

    def _replay_or_zero(self, t: torch.Tensor, src: int, tag: int) -> None:
        """A receive served locally: what the replayer has for it (a rehearsal, see
        :func:`set_p2p_replay`), else zeros."""
        replay = _P2P_REPLAYER
        if replay is None or not replay(self._group_name, src, tag, t):
            t.zero_()

    def _record(self, t: torch.Tensor, src: int, tag: int) -> None:
        for record in _P2P_RECORDERS:
            record(self._group_name, src, tag, t)

    def send(self, tensors: Any, dst: int, tag: int = 0) -> TmrunWork:
        tensors = _tensor_list(tensors, "send")
        dst = self._check_rank("send", dst, "destination")
        if dst == self._rank:
            raise ValueError("tmrun send: destination is this rank")
        queued = self._queue_in_batch("send", tensors, dst, tag)
        if queued is not None:
            return queued
        op = _Op("send", tensors)

        def launch(comm: Any) -> None:
            for t in tensors:
                host = staging.to_host(t)
                op.native.append(comm.send_async(_raw(host), dst, _tag(tag)))
                op.keep += [t, host]

        return self._run(op, None, launch, device=("send", (tensors, dst, tag)))

    def recv(self, tensors: Any, src: int, tag: int = 0) -> TmrunWork:
        tensors = _tensor_list(tensors, "recv")
        src = self._check_rank("recv", src, "source")
        if src == self._rank:
            raise ValueError("tmrun recv: source is this rank")
        queued = self._queue_in_batch("recv", tensors, src, tag)
        if queued is not None:
            return queued
        op = _Op("recv", tensors)
        op.source_rank = src

        def local() -> None:
            for t in tensors:
                self._replay_or_zero(t, src, tag)

        op.local = local

        def launch(comm: Any) -> None:
            for t in tensors:
                host = staging.to_host(t, copy=False)
                op.native.append(comm.recv_async(_raw(host), src, _tag(tag)))
                op.keep += [t, host]
                op.finish.append(lambda t=t, host=host: staging.from_host(t, host))
                if _P2P_RECORDERS:
                    op.finish.append(lambda t=t: self._record(t, src, tag))

        return self._run(op, None, launch, device=("recv", (tensors, src, tag)))

    def recv_anysource(self, tensors: Any, tag: int = 0) -> TmrunWork:
        raise UnsupportedError("tmrun: recv from any source is not supported; pass src=")

    def alltoall(self, output_tensors: Any, input_tensors: Any, opts: Any = None) -> TmrunWork:
        """Block ``j`` of ``input_tensors`` goes to rank ``j``, which receives it into its
        ``output_tensors[this rank]`` (point-to-point, in the rounds of :func:`_exchange_rounds`)."""
        outs = _tensor_list(output_tensors, "all_to_all output")
        ins = _tensor_list(input_tensors, "all_to_all input")
        if len(outs) != self._size or len(ins) != self._size:
            raise ValueError(f"tmrun all_to_all: {len(ins)} inputs and {len(outs)} outputs, the group has {self._size}")
        for o, i in zip(outs, ins):
            if o.dtype != i.dtype:
                raise ValueError(f"tmrun all_to_all: dtypes differ ({i.dtype} -> {o.dtype})")
        return self._exchange("all_to_all", outs, ins, [outs], opts,
                              device=("alltoall", (outs, ins, opts if opts is not None else AllToAllOptions())))

    def all_to_all_single(self, output: torch.Tensor, input: torch.Tensor,  # noqa: A002
                          output_split_sizes: Any = None, input_split_sizes: Any = None,
                          opts: Any = None) -> TmrunWork:
        """``input`` split along dim 0 (``input_split_sizes``, or evenly): block ``j`` goes to
        rank ``j``; ``output`` (``output_split_sizes``, or evenly) receives block ``r`` from
        rank ``r``."""
        _check_tensor("all_to_all_single output", output)
        _check_tensor("all_to_all_single input", input)
        if output.dtype != input.dtype:
            raise ValueError(f"tmrun all_to_all_single: dtypes differ ({input.dtype} -> {output.dtype})")
        ins = self._split("all_to_all_single input", input, input_split_sizes)
        outs = self._split("all_to_all_single output", output, output_split_sizes)
        device = ("alltoall_base", (output, input, [int(x) for x in (output_split_sizes or [])],
                                    [int(x) for x in (input_split_sizes or [])],
                                    opts if opts is not None else AllToAllOptions()))
        return self._exchange("all_to_all_single", outs, ins, [output], opts, whole=(output, input), device=device)

    alltoall_base = all_to_all_single

    def _split(self, what: str, t: torch.Tensor, sizes: Any) -> list:
        sizes = [int(x) for x in (sizes or [])]
        rows = t.shape[0] if t.dim() else 1
        if not sizes:
            if rows % self._size:
                raise ValueError(f"tmrun {what}: dim 0 ({rows}) is not divisible by the group size {self._size}")
            sizes = [rows // self._size] * self._size
        if len(sizes) != self._size or sum(sizes) != rows or min(sizes) < 0:
            raise ValueError(f"tmrun {what}: split sizes {sizes} do not split dim 0 ({rows}) into {self._size}")
        if not t.dim():
            return [t]
        return list(torch.split(t, sizes, dim=0))

    def _exchange(self, name: str, outs: list, ins: list, result: list, opts: Any,
                  whole: Optional[tuple] = None, device: Optional[tuple[str, tuple]] = None) -> TmrunWork:
        """Send ``ins[j]`` to rank ``j`` and receive ``outs[j]`` from it, for every ``j``."""
        me = self._rank
        for j, (o, i) in enumerate(zip(outs, ins)):
            if j == me and o.numel() != i.numel():
                raise ValueError(f"tmrun {name}: this rank's own block: {i.numel()} elements in, {o.numel()} out")
        op = _Op(name, result)

        def local() -> None:  # the sandbox: every peer sent what this rank sends itself
            for o, i in zip(outs, ins):
                if o.numel() == i.numel():
                    o.copy_(i.reshape(o.shape))
                else:
                    o.zero_()

        op.local = local

        def launch(comm: Any) -> None:
            outs[me].copy_(ins[me].reshape(outs[me].shape))
            for peer in _exchange_rounds(self._size, me):
                sending = [(ins[peer], True), (outs[peer], False)]
                for t, is_send in (sending if me < peer else sending[::-1]):  # the lower rank sends first
                    if not t.numel():
                        continue
                    if is_send:
                        host = staging.to_host(t)
                        op.native.append(comm.send_async(_raw(host), peer, _A2A_TAG))
                        op.keep += [t, host]
                    else:
                        host = staging.to_host(t, copy=False)
                        op.native.append(comm.recv_async(_raw(host), peer, _A2A_TAG))
                        op.keep += [t, host]
                        if host is not t:
                            op.finish.append(lambda t=t, host=host: staging.from_host(t, host))
            op.keep += [outs, ins, whole]

        return self._run(op, opts, launch, device=device)

    def monitored_barrier(self, *args: Any, **kwargs: Any) -> None:
        raise UnsupportedError("tmrun: monitored_barrier is not supported; use barrier()")

    # ------------------------------------------------------------------ helpers
    def _join(self, name: str, works: list, result: list, opts: Any) -> TmrunWork:
        """One Work that completes when ``works`` did (the first error wins)."""
        op = _Op(name, result)
        ops = [w._op for w in works]

        def finish_all(wait: bool = True) -> None:
            error = None
            for o in ops:
                if wait:
                    o.done.wait()
                error = error or o.error
            op.complete(error)

        if all(o.done.is_set() for o in ops) or not getattr(opts, "asyncOp", True):
            finish_all()
        else:
            remaining = [len(ops)]
            lock = threading.Lock()

            def one_done(_: Any) -> None:
                with lock:
                    remaining[0] -= 1
                    last = remaining[0] == 0
                if last:
                    # not o.done: the last op runs this callback from its own complete(), before
                    # it sets its done event (waiting for it here deadlocked); its error is set
                    finish_all(wait=False)

            for o in ops:
                o.future.add_done_callback(one_done)
        return TmrunWork(op)


# ---------------------------------------------------------------------------------------- helpers
_A2A_TAG = (1 << 28) - 2  # the tag of all-to-all's point-to-point messages (native tags are < 2**28)


def _exchange_rounds(n: int, me: int) -> list:
    """This rank's partner in each round of a round-robin tournament (the circle method): in a
    round every rank exchanges with at most one partner, the lower rank sending first, so a
    pairwise exchange never waits in a cycle however large the blocks (blocking sends included)."""
    m = n + (n % 2)  # a dummy rank n pads an odd group; its partner sits the round out
    partners = []
    for k in range(m - 1):
        if me == m - 1:
            p = next(j for j in range(m - 1) if (2 * j) % (m - 1) == k % (m - 1))
        else:
            p = (k - me) % (m - 1)
            if p == me:
                p = m - 1
        if p < n and p != me:
            partners.append(p)
    return partners


def _async(opts: Any) -> Any:
    opts.asyncOp = True
    return opts


def _tag(tag: int) -> int:
    tag = int(tag)
    if not 0 <= tag < (1 << 32):
        raise ValueError(f"tmrun: tag {tag} is outside 0..2**32-1")
    return tag


def _check_tensor(what: str, t: Any) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"tmrun {what}: expected a torch.Tensor, got {type(t).__name__}")
    if t.device.type not in ("cpu", "cuda"):
        raise UnsupportedError(f"tmrun {what}: tensors on {t.device.type} are not supported (cpu, cuda)")
    if t.is_sparse or t.layout != torch.strided:
        raise UnsupportedError(f"tmrun {what}: only dense (strided) tensors are supported")


def _tensor_list(tensors: Any, what: str) -> list:
    if isinstance(tensors, torch.Tensor):
        tensors = [tensors]
    tensors = list(tensors)
    for t in tensors:
        _check_tensor(what, t)
    return tensors


def _same_layout(what: str, a: torch.Tensor, b: torch.Tensor) -> None:
    _check_tensor(what, a)
    _check_tensor(what, b)
    if a.dtype != b.dtype or a.numel() != b.numel():
        raise ValueError(f"tmrun {what}: tensors must have the same dtype and number of elements "
                         f"({a.dtype} x {a.numel()} vs {b.dtype} x {b.numel()})")


def _typed_view(host: torch.Tensor) -> torch.Tensor:
    """A view the native reduction understands: bool as uint8, complex as its real parts."""
    if host.dtype == torch.bool:
        return host.view(torch.uint8)
    if host.is_complex():
        return torch.view_as_real(host)
    return host


def _premul_factor(red: Any) -> Any:
    """The factor of a PREMUL_SUM reduce op (``dist._make_nccl_premul_sum(factor)``: a number
    or a one-element tensor); None for any other op."""
    return red.factor if getattr(red, "op", red) == _RED.PREMUL_SUM else None


def _check_factor(what: str, red: Any) -> None:
    factor = getattr(red, "factor", None)
    if (isinstance(factor, torch.Tensor) and factor.numel() == 1) or isinstance(factor, (int, float)):
        return
    raise ValueError(f"tmrun {what}: PREMUL_SUM needs a number or a one-element tensor as its factor, got "
                     f"{type(factor).__name__} (make it with torch.distributed._make_nccl_premul_sum(factor))")


def _premultiply(t: torch.Tensor, factor: Any) -> torch.Tensor:
    """``t`` multiplied in place by ``factor`` (nothing when None), as NCCL's PREMUL_SUM does
    with each input before the sum: the factor cast to the element type first (NCCL's scalar has
    the data's type; for float16 and bfloat16 the product is then rounded once), complex
    tensors as their real parts. Returns ``t``."""
    if factor is not None:
        view = _typed_view(t)
        view.mul_(torch.as_tensor(factor, dtype=view.dtype, device=view.device).reshape(()))
    return t


def _premultiply_all(tensors: Sequence[torch.Tensor], factor: Any) -> None:
    """A PREMUL_SUM served locally (local mode, the aborted state): what a group of one gives,
    its own input premultiplied."""
    for t in tensors:
        _premultiply(t, factor)


def _annotate(error: BaseException, what: str) -> BaseException:
    """The same exception type with the operation's name in front (attributes kept)."""
    if not isinstance(error, tn.CommError):
        return error
    try:
        new = type(error)(f"tmrun {what} failed: {error}")
        new.__dict__.update(getattr(error, "__dict__", {}))
        new.__cause__ = error
        return new
    except Exception:  # noqa: BLE001
        return error


# ---------------------------------------------------------------------------------------- creation
_GROUP_COUNT_KEY = keys.BACKEND_GROUP_COUNT  # counter: every rank of every group created adds 1


def create_process_group(store: Any, rank: int, world_size: int, timeout: Optional[datetime.timedelta] = None,
                         group_name: str = "0", options: Optional[Options] = None) -> TmrunProcessGroup:
    """Build a :class:`TmrunProcessGroup` (what the registered creator does).

    Network mode: every rank publishes its communicator's address in ``store`` (keys under
    ``tmrun/pg/g{group_seq}/...``, where ``group_seq`` numbers the groups created through this
    store: a re-created group never reads the addresses of a previous one) and connects. Local
    mode touches neither store nor network."""
    if tn is None:
        raise ImportError(f"the tmrun backend needs the tmrun_native extension: {_NATIVE_ERROR}")
    options = options if options is not None else Options()
    if not isinstance(options, Options):
        raise TypeError(f"tmrun backend: pg_options must be tmrun.comm.backend.Options, got {type(options).__name__}")
    local = options.local if options.local is not None else (_env_flag(ENV_LOCAL) or _sandboxed())
    job_id = options.job_id or default_job_id(group_name)
    comm = options.comm
    joining = _JOINING
    join: Optional[Callable[[], Any]] = None
    if comm is None and not local and joining is not None:
        # a joiner re-creating the job's groups: take this rank in the survivors' repaired
        # communicator of the same group (they called pg.prepare_replacement(..., joining)),
        # in the background: see _JoinQueue
        get, watch = _JOIN_WAITS
        native_options = _native_options(timeout, options.native)

        def join() -> Any:
            return join_via_store(store, rank, world_size, job_id, joining, options=native_options,
                                  prefix=REPLACE_PREFIX, get=get, watch=watch)
    elif comm is None and not local:
        # every rank adds 1: ranks of the same creation read the same group_seq
        group_seq = (int(store.add(_GROUP_COUNT_KEY, 1)) - 1) // world_size
        comm = connect_via_store(store, rank, world_size, job_id, options.epoch,
                                 options=_native_options(timeout, options.native),
                                 prefix=f"{STORE_PREFIX}/g{group_seq}")
    elif comm is not None and (int(comm.rank) != rank or int(comm.world_size) != world_size):
        raise ValueError(f"tmrun backend: Options.comm is rank {comm.rank} of {comm.world_size}, "
                         f"the group wants rank {rank} of {world_size}")
    pg = TmrunProcessGroup(rank, world_size, comm, local=local, job_id=job_id,
                           failure_handler=options.failure_handler, joining=join is not None)
    pg.setGroupName(str(group_name))
    pg.store = store  # the store torch handed over (prefixed with the group's name): replacements use it
    pg.joined_in = joining  # created in join mode: no collective until the joiner is healed (set_joining(None))
    pg.join_options = (timeout, options.native)  # a group created in local mode may join later (join_later)
    _CREATED.append(weakref.ref(pg))
    if join is not None:
        _JOINS.submit(pg, join)
    return pg


def join_later(pg: TmrunProcessGroup, generation: int) -> None:
    """A group a planned migration's joiner created in local mode (it built its model before the
    switch step, docs/mesh.md): take this rank's link in the survivors' communicator of the same
    group for ``generation`` (they call :meth:`TmrunProcessGroup.prepare_replacement`), then
    leave local mode. Returns once the survivors committed."""
    join_as(pg, pg.store, pg.rank(), generation)


def join_as(pg: TmrunProcessGroup, store: Any, rank: int, generation: int) -> None:
    """A group created in local mode takes group rank ``rank``'s link in the survivors'
    communicator of the same group for ``generation``, through ``store`` (the job's store for
    this group, as torch handed it to the survivors), then leaves local mode. Returns once the
    survivors committed. (A warm standby's background group of the whole world: it was made in
    the sandbox as rank 0.)"""
    timeout, native = getattr(pg, "join_options", (None, {}))
    comm = join_via_store(store, int(rank), pg.size(), pg.job_id, generation,
                          options=_native_options(timeout, native), prefix=REPLACE_PREFIX)
    pg.store = store
    pg.attach(comm)
    pg.set_local(False)


class BackgroundInterrupted(RuntimeError):
    """An operation of a script's own thread on a background group (a gloo group's stand-in) that
    the job's membership change cut off: :meth:`TmrunProcessGroup.set_background`."""


class JoiningCollectiveError(RuntimeError):
    """A collective on a group a joiner re-created, before the joiner was healed: the survivors
    are not building their model, so they would never issue it (the joiner would wait forever)."""


REPLACE_PREFIX = f"{STORE_PREFIX}/replace"  # a group's addresses for a replacement (keys carry the generation)
JOIN_BOUND = 600.0  # s: the longest finish_joins() waits for one group's join (each is bounded by its own waits)


class _Join:
    """One group's join, run by :class:`_JoinQueue`'s thread."""

    def __init__(self, pg: "TmrunProcessGroup", join: Callable[[], Any]) -> None:
        self.pg = pg
        self.join = join
        self.done = threading.Event()
        self.error: Optional[BaseException] = None

    def run(self) -> None:
        try:
            self.pg.attach(self.join())
        except BaseException as exc:  # noqa: BLE001  (raised again by finish_joins, on the script's thread)
            self.error = exc
        finally:
            self.done.set()


class _JoinQueue:
    """The groups a joiner creates in join mode take their links one after another, in creation
    order (the survivors repair them in that order), on one background thread: the script goes
    on building its model meanwhile (a group created in join mode refuses collectives until the
    joiner is healed anyway: :class:`JoiningCollectiveError`). :func:`finish_joins` waits for
    them before the healing. A daemon thread: a joiner that fails meanwhile exits without
    waiting for it (each join is bounded by its own waits)."""

    def __init__(self) -> None:
        self._queue: "queue.SimpleQueue[_Join]" = queue.SimpleQueue()
        self._thread: Optional[threading.Thread] = None
        self._pending: list[_Join] = []

    def submit(self, pg: "TmrunProcessGroup", join: Callable[[], Any]) -> None:
        item = _Join(pg, join)
        self._pending.append(item)
        self._queue.put(item)
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="tmrun-join", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        while True:
            self._queue.get().run()

    def finish(self) -> int:
        pending, self._pending = self._pending, []
        for item in pending:
            if not item.done.wait(JOIN_BOUND):
                raise RuntimeError(f"tmrun: group {item.pg.getGroupName()!r} did not join the survivors' "
                                   f"communicator within {JOIN_BOUND:.0f}s")
            if item.error is not None:
                raise item.error
        return len(pending)


_JOINS = _JoinQueue()


def finish_joins() -> int:
    """Wait until every group created in join mode joined the survivors' communicator (the
    first join's error is raised); returns how many did (``set_joining(None)`` calls it)."""
    return _JOINS.finish()


class _ServedHere(threading.local):
    depth = 0


_SERVED_HERE = _ServedHere()


@contextlib.contextmanager
def served_locally() -> Iterator[None]:
    """Every operation this thread launches on a tmrun group inside the block is served locally
    (the sandbox's results: an all-gather gives this member's input, a broadcast leaves its own
    tensor), whatever the group's mode, and reaches no peer: for tmrun's own set-up of a module
    whose collectives no other member issues (a joiner's DDP construction, whose parameters the
    healing then overwrites, and its adoption of the survivors' gradient buckets,
    :mod:`tmrun.worker.ddp_buckets`). Other threads' operations are untouched."""
    _SERVED_HERE.depth += 1
    try:
        yield
    finally:
        _SERVED_HERE.depth -= 1


_JOINING: Optional[int] = None
_JOIN_WAITS: tuple[Optional[Callable[[Any, str], str]], Optional[Callable[[], None]]] = (None, None)


def set_joining(generation: Optional[int], get: Optional[Callable[[Any, str], str]] = None,
                watch: Optional[Callable[[], None]] = None) -> None:
    """Join mode (docs/mesh.md): every tmrun group this process creates from now on (the default
    group, ``new_group``, a device mesh's groups) joins the survivors' communicator of that group
    for ``generation`` instead of bootstrapping a new one: the survivors repaired it with
    :meth:`TmrunProcessGroup.prepare_replacement`. The joiner must create its groups in the
    order the job did (torch requires that of every rank anyway): survivors repair them in that
    order, each waiting for the joiner's address. The joins run in the background, one after
    another in that order (:class:`_JoinQueue`), while the script goes on (building its model);
    ``None`` ends join mode once every join finished (:func:`finish_joins`: the first join's
    error is raised here). ``get`` and ``watch``: how each join waits for the survivors'
    addresses and links (:func:`tmrun.comm.native.connect_via_store`); the worker's give up
    when a newer generation is published (a survivor lost meanwhile never publishes), where the
    store's own wait would last its whole timeout."""
    global _JOINING, _JOIN_WAITS
    try:
        if generation is None:
            finish_joins()
    finally:
        _JOINING = None if generation is None else int(generation)
        _JOIN_WAITS = (get, watch) if generation is not None else (None, None)


# A receive's recording and replay (tmrun.worker.startup_replay): an active rank records the
# point-to-point messages it receives in its first step, a standby's rehearsal replays them to
# the same receives served locally (a pipeline's start-up needs its neighbours' metadata).
# Each is called with (group name, source group rank, tag, tensor); the replayer fills the
# tensor and returns True, or returns False (zeros then).
P2PHook = Callable[[str, int, int, torch.Tensor], Any]
_P2P_RECORDERS: tuple[P2PHook, ...] = ()  # several at once: rank 0's first step and a pipeline's start-up
_P2P_REPLAYER: Optional[P2PHook] = None


def add_p2p_recorder(recorder: P2PHook) -> None:
    global _P2P_RECORDERS
    _P2P_RECORDERS = (*_P2P_RECORDERS, recorder)


def remove_p2p_recorder(recorder: P2PHook) -> None:
    global _P2P_RECORDERS
    _P2P_RECORDERS = tuple(r for r in _P2P_RECORDERS if r != recorder)  # bound methods: equal, not identical


def set_p2p_replay(replayer: Optional[P2PHook]) -> None:
    global _P2P_REPLAYER
    _P2P_REPLAYER = replayer


def p2p_replay() -> Optional[P2PHook]:
    """The replayer set now (None: a receive served locally gets zeros)."""
    return _P2P_REPLAYER


_PLANE_STORE: Optional[Any] = None


def set_plane_store(store: Any) -> None:
    """The store under which every tmrun group of this process bootstraps its device plane
    (``g<group name>/e<generation>/...``): the same for every process of the job, survivors and
    promoted standbys alike (the worker runtime sets it; without it, each group uses its own)."""
    global _PLANE_STORE
    _PLANE_STORE = store


_CREATED: list = []  # weak references to every group this process created, in creation order


def created_groups() -> list:
    """The tmrun groups this process created and still alive, in creation order (the default
    group first): what a replacement must repair besides the default group (docs/mesh.md)."""
    alive = [ref() for ref in _CREATED]
    return [pg for pg in alive if pg is not None and not pg._closed]


def forget_groups() -> None:
    """Shut every group of this process down and forget them (a standby's rehearsal is over:
    tmrun.worker.rehearsal; its groups are local, nothing to drain)."""
    close_groups_at_exit()
    _CREATED.clear()


EXIT_STOP_TIMEOUT = 2.0  # s: how long the exit waits for a group's completer thread


def close_groups_at_exit() -> None:
    """At interpreter exit (atexit): every live group's communicator closed (its goodbye said)
    and its completer thread stopped, before the interpreter finalizes. A daemon thread still
    inside the communicator then (waiting for an operation with the GIL released) would take the
    GIL back during finalization and be ended inside native code, which aborts the process
    ("terminate called without an active exception", SIGABRT after a worker's last line). The
    device plane is left alone: NCCL's own shutdown may wait on dead peers."""
    for pg in reversed(created_groups()):
        pg.shutdown(0.0, device_plane=False, stop_timeout=EXIT_STOP_TIMEOUT)


atexit.register(close_groups_at_exit)


def _sandboxed() -> bool:
    """True when this process's default group is a tmrun group in local mode (a standby's
    sandbox): the subgroups it creates (``new_group``, ``init_device_mesh``) are local too; there
    is nobody to connect to."""
    try:
        default = dist.distributed_c10d._get_default_group()
    except (RuntimeError, ValueError):  # not initialised yet: this is the default group itself
        return False
    return isinstance(default, TmrunProcessGroup) and default.local


def _creator(common: Any, backend_options: Any) -> TmrunProcessGroup:
    return create_process_group(common.store, common.group_rank, common.group_size, common.timeout,
                                str(common.group_id), backend_options)


_registered = False
_register_lock = threading.Lock()


def register() -> None:
    """Register the "tmrun" backend with torch.distributed (idempotent; ``import tmrun`` calls it)."""
    global _registered
    with _register_lock:
        if _registered:
            return
        plugins = getattr(dist.Backend, "_plugins", {})
        if BACKEND_NAME.upper() not in plugins:
            dist.Backend.register_backend(BACKEND_NAME, _creator, extended_api=True, devices=["cpu", "cuda"])
        _registered = True


def get_group(group: Any = None) -> TmrunProcessGroup:
    """The :class:`TmrunProcessGroup` behind ``group`` (default: the default group)."""
    pg = group if group is not None else dist.distributed_c10d._get_default_group()
    if not isinstance(pg, TmrunProcessGroup):
        raise ValueError(f"not a tmrun process group: {pg!r} (use init_process_group('tmrun'))")
    return pg


register()  # idempotent; for ``import tmrun.comm.backend`` before torch (tmrun/__init__.py)
