"""NCCL transport of tmrun: availability, library loading, unique-id exchange, thin wrapper.

The C++ side (``tmrun_native.NcclCommunicator``) is compiled only when ``nccl.h`` was found
at build time, and it ``dlopen``s ``libnccl.so.2`` and ``libcuda.so.1`` at run time, so
``import tmrun_native`` works on machines without NCCL or a GPU. Everything here degrades to
``nccl_available() == (False, reason)`` and :class:`NcclUnavailableError` on such machines.

Nothing in this module has run on a GPU yet (see ``docs/nccl.md``).

Ranks are *logical*: a communicator carries a rank map (``rank_map[i]`` is the logical rank of
NCCL rank ``i``) so that, after ``ncclCommShrink`` + ``ncclCommGrow``, a joiner that NCCL
numbers last still holds the leaver's logical rank.

Store keys are epoch-prefixed (``epoch/<epoch>/nccl/<group>/<purpose>``), like the rest of
tmrun's store layout, so a stale epoch never reads a newer unique id or vice versa.
"""

from __future__ import annotations

import json
import os
from datetime import timedelta
from typing import Any, Iterable, Optional, Protocol, Sequence

from tmrun.protocol import keys

__all__ = [
    "NcclComm",
    "NcclError",
    "NcclTimeoutError",
    "NcclUnavailableError",
    "exchange_unique_id",
    "get_unique_id",
    "load_library",
    "nccl_available",
    "nccl_compiled",
    "replace_by_reinit",
    "replace_by_shrink_grow",
    "store_key",
    "wheel_lib_dir",
]

UNIQUE_ID_BYTES = 128
DEFAULT_TIMEOUT_S = 300.0

try:  # the native module is optional at import time (e.g. a source checkout without a build)
    import tmrun_native as _native

    NcclError = _native.NcclError
    NcclTimeoutError = _native.NcclTimeoutError
    NcclUnavailableError = _native.NcclUnavailableError
    _NATIVE_ERROR: Optional[str] = None
except (ImportError, AttributeError) as _exc:  # pragma: no cover - exercised only without a build
    # AttributeError: "tmrun_native" resolved to the source folder (namespace package), e.g.
    # when Python runs from the repository root, or to a build without the NCCL bindings.
    _native = None  # type: ignore[assignment]
    _NATIVE_ERROR = f"tmrun_native is not importable: {_exc}"

    class NcclError(RuntimeError):  # type: ignore[no-redef]
        code = -1

    class NcclTimeoutError(NcclError):  # type: ignore[no-redef]
        pass

    class NcclUnavailableError(NcclError):  # type: ignore[no-redef]
        pass


class Store(Protocol):
    """What we need from a key-value store (torch.distributed.Store satisfies it)."""

    def set(self, key: str, value: bytes) -> None: ...

    def get(self, key: str) -> bytes: ...


# ---------------------------------------------------------------------------------------
# Locating and loading
# ---------------------------------------------------------------------------------------


def _require_native() -> Any:
    if _native is None:
        raise NcclUnavailableError(_NATIVE_ERROR or "tmrun_native is not importable")
    return _native


def nccl_compiled() -> bool:
    """True when tmrun_native was built with the NCCL transport (nccl.h found at build time)."""
    return _native is not None and bool(_native.nccl_compiled())


def wheel_lib_dir() -> Optional[str]:
    """``.../site-packages/nvidia/nccl/lib`` of an installed nvidia-nccl-cu1x wheel, or None.

    ``nvidia`` and ``nvidia.nccl`` are namespace packages (``__file__`` is None), so the
    location comes from ``__path__``.
    """
    try:
        import nvidia.nccl as m  # type: ignore[import-not-found]
    except ImportError:
        return None
    for root in list(getattr(m, "__path__", [])):
        lib = os.path.join(root, "lib")
        if os.path.exists(os.path.join(lib, "libnccl.so.2")):
            return lib
    return None


def load_library(path: Optional[str] = None) -> dict:
    """dlopen libnccl.so.2 and resolve its API; returns the native library info.

    Search order: ``path`` if given; else ``$TMRUN_NCCL_LIBRARY`` (only it, when set); else the
    nvidia-nccl wheel's lib dir; else ``libnccl.so.2`` on the default loader path. The first
    library that loads stays loaded for the process. Raises :class:`NcclUnavailableError`.
    """
    native = _require_native()
    dirs = [d for d in [wheel_lib_dir()] if d]
    return dict(native.nccl_load(path or "", dirs))


def nccl_available(library: Optional[str] = None) -> tuple[bool, str]:
    """Whether NCCL collectives can run in this process, and why not (or a summary when so).

    Checks, in order: the native module, that the NCCL transport was compiled in, that
    libnccl.so.2 loads, and that the CUDA driver loads and reports at least one GPU.
    """
    if _native is None:
        return False, _NATIVE_ERROR or "tmrun_native is not importable"
    if not _native.nccl_compiled():
        return False, (
            "tmrun_native was built without the NCCL transport (nccl.h not found at build time; "
            "pip install nvidia-nccl-cu13 or set NCCL_INCLUDE_DIR, then rebuild)"
        )
    try:
        info = load_library(library)
    except NcclError as exc:
        return False, f"NCCL library unavailable: {exc}"
    try:
        cuda = _native.cuda_driver_info()
    except NcclError as exc:
        return False, f"no usable GPU: {exc}"
    v = int(info["version"])
    return True, (
        f"NCCL {v // 10000}.{(v // 100) % 100}.{v % 100} at {info['path']}; "
        f"CUDA driver {cuda['driver_version']} with {cuda['device_count']} GPU(s)"
    )


def get_unique_id(library: Optional[str] = None) -> bytes:
    """``ncclGetUniqueId()`` as 128 bytes. Works without a GPU (it only opens a bootstrap socket)."""
    native = _require_native()
    load_library(library)
    return bytes(native.nccl_get_unique_id(""))


# ---------------------------------------------------------------------------------------
# Store exchange
# ---------------------------------------------------------------------------------------


def store_key(epoch: int, group: str, purpose: str) -> str:
    """Epoch-prefixed store key, e.g. ``epoch/3/nccl/default/init``."""
    return keys.nccl_key(epoch, group, purpose)


def _store_get(store: Store, key: str, timeout: Optional[float]) -> bytes:
    wait = getattr(store, "wait", None)
    if wait is not None and timeout is not None:
        try:
            wait([key], timedelta(seconds=timeout))
        except TypeError:  # a store whose wait() takes no timeout
            wait([key])
    value = store.get(key)
    return value.encode() if isinstance(value, str) else bytes(value)


def exchange_unique_id(
    store: Store,
    *,
    is_root: bool,
    epoch: int,
    group: str = "default",
    purpose: str = "init",
    unique_id: Optional[bytes] = None,
    timeout: Optional[float] = DEFAULT_TIMEOUT_S,
) -> bytes:
    """The root publishes a unique id under ``store_key(epoch, group, purpose)``; others read it.

    The root uses ``unique_id`` when given (e.g. from ``ncclCommGetUniqueId`` for a grow),
    else a fresh ``ncclGetUniqueId()``.
    """
    key = store_key(epoch, group, purpose)
    if is_root:
        uid = bytes(unique_id) if unique_id is not None else get_unique_id()
        if len(uid) != UNIQUE_ID_BYTES:
            raise ValueError(f"an NCCL unique id is {UNIQUE_ID_BYTES} bytes, got {len(uid)}")
        store.set(key, uid)
        return uid
    uid = _store_get(store, key, timeout)
    if len(uid) != UNIQUE_ID_BYTES:
        raise NcclError(f"store key {key!r} holds {len(uid)} bytes, not an NCCL unique id")
    return uid


# ---------------------------------------------------------------------------------------
# Thin wrapper
# ---------------------------------------------------------------------------------------


def _tensor_args(t: Any) -> tuple[int, int, str]:
    """(device pointer, element count, dtype name) of a torch tensor."""
    if not t.is_contiguous():
        raise ValueError("NCCL collectives need contiguous tensors")
    return int(t.data_ptr()), int(t.numel()), str(t.dtype)


def _stream_of(t: Any, stream: Optional[int]) -> int:
    if stream is not None:
        return int(stream)
    if getattr(t, "is_cuda", False):
        import torch

        return int(torch.cuda.current_stream(t.device).cuda_stream)
    return 0


class NcclComm:
    """A tmrun NCCL communicator: unique id through the store, logical ranks, replacement.

    ``rank`` is this member's *logical* rank; ``rank_map`` (NCCL rank -> logical rank)
    defaults to the identity. The root of the id exchange is the smallest logical rank.
    Collectives take contiguous CUDA tensors (in place where torch.distributed is in place)
    and enqueue on ``torch.cuda.current_stream()`` unless ``stream`` is given; call
    :meth:`synchronize` to wait with a deadline. Use :attr:`native` for raw pointers.
    """

    def __init__(
        self,
        store: Store,
        rank: int,
        world_size: int,
        device: int,
        *,
        epoch: int = 0,
        group: str = "default",
        rank_map: Optional[Sequence[int]] = None,
        timeout: float = DEFAULT_TIMEOUT_S,
        revoke_on_error: bool = True,
        shrink_share: bool = True,
        library: Optional[str] = None,
        wait: bool = True,
    ) -> None:
        self._configure(group, epoch, timeout, revoke_on_error, shrink_share)
        native = _require_native()
        load_library(library)
        rmap = list(rank_map) if rank_map is not None else list(range(world_size))
        uid = exchange_unique_id(
            store, is_root=(rank == min(rmap)), epoch=epoch, group=group, purpose="init",
            timeout=timeout,
        )
        self._c = native.NcclCommunicator(uid, world_size, rank, device, rmap, wait=wait, **self._opts)

    def _configure(self, group: str, epoch: int, timeout: float, revoke_on_error: bool, shrink_share: bool) -> None:
        """Settings shared by a founding member (``__init__``) and a joiner (``join_by_grow``)."""
        self.group = group
        self.epoch = int(epoch)
        self.timeout = float(timeout)
        self._opts = dict(
            timeout=self.timeout, revoke_on_error=revoke_on_error, shrink_share=shrink_share,
            name=f"tmrun/{group}",
        )

    # ---- introspection
    @property
    def native(self) -> Any:
        return self._c

    @property
    def rank(self) -> int:
        return int(self._c.rank)

    @property
    def size(self) -> int:
        return int(self._c.size)

    @property
    def nccl_rank(self) -> int:
        return int(self._c.nccl_rank)

    @property
    def rank_map(self) -> list[int]:
        return list(self._c.rank_map)

    @property
    def state(self) -> str:
        return str(self._c.state)

    def stats(self) -> dict:
        return dict(self._c.stats())

    # ---- collectives on torch tensors
    def allreduce(self, t: Any, op: str = "sum", stream: Optional[int] = None) -> None:
        p, n, dt = _tensor_args(t)
        self._c.allreduce(p, p, n, dt, _op_name(op), _stream_of(t, stream))

    def broadcast(self, t: Any, root: int, stream: Optional[int] = None) -> None:
        p, n, dt = _tensor_args(t)
        self._c.broadcast(p, p, n, dt, int(root), _stream_of(t, stream))

    def allgather(self, out: Any, inp: Any, stream: Optional[int] = None) -> None:
        """``out`` holds size * inp.numel() elements, chunk i from logical position i."""
        pi, n, dt = _tensor_args(inp)
        po, m, _ = _tensor_args(out)
        if m != n * self.size:
            raise ValueError(f"allgather: output has {m} elements, expected {n * self.size}")
        self._c.allgather(pi, po, n, dt, _stream_of(inp, stream))

    def reduce_scatter(self, out: Any, inp: Any, op: str = "sum", stream: Optional[int] = None) -> None:
        pi, n, dt = _tensor_args(inp)
        po, m, _ = _tensor_args(out)
        if n != m * self.size:
            raise ValueError(f"reduce_scatter: input has {n} elements, expected {m * self.size}")
        self._c.reduce_scatter(pi, po, m, dt, _op_name(op), _stream_of(out, stream))

    def send(self, t: Any, peer: int, stream: Optional[int] = None) -> None:
        p, n, dt = _tensor_args(t)
        self._c.send(p, n, dt, int(peer), _stream_of(t, stream))

    def recv(self, t: Any, peer: int, stream: Optional[int] = None) -> None:
        p, n, dt = _tensor_args(t)
        self._c.recv(p, n, dt, int(peer), _stream_of(t, stream))

    def sendrecv(self, send_t: Any, dst: int, recv_t: Any, src: int, stream: Optional[int] = None) -> None:
        """Grouped send to logical ``dst`` and receive from logical ``src`` (ring-safe)."""
        ps, ns, dt = _tensor_args(send_t)
        pr, nr, dt2 = _tensor_args(recv_t)
        if dt != dt2:
            raise ValueError("sendrecv: send and recv tensors must have the same dtype")
        self._c.sendrecv(ps, ns, int(dst), pr, nr, int(src), dt, _stream_of(send_t, stream))

    def synchronize(self, stream: Optional[int] = None, timeout: Optional[float] = None) -> None:
        self._c.synchronize(int(stream or 0), -1.0 if timeout is None else float(timeout))

    # ---- failure and teardown
    def revoke(self, timeout: Optional[float] = None) -> None:
        self._c.revoke(-1.0 if timeout is None else float(timeout))

    def abort(self) -> None:
        self._c.abort()

    def close(self, timeout: Optional[float] = None) -> None:
        self._c.close(-1.0 if timeout is None else float(timeout))

    # ---- joiner constructors
    @classmethod
    def join_by_grow(
        cls,
        store: Store,
        rank: int,
        device: int,
        *,
        epoch: int,
        group: str = "default",
        timeout: float = DEFAULT_TIMEOUT_S,
        revoke_on_error: bool = True,
        shrink_share: bool = True,
        library: Optional[str] = None,
        wait: bool = True,
    ) -> "NcclComm":
        """Joiner side of :func:`replace_by_shrink_grow`: takes logical ``rank`` (the leaver's)."""
        native = _require_native()
        load_library(library)
        plan = json.loads(_store_get(store, store_key(epoch, group, "grow-plan"), timeout))
        uid = _store_get(store, store_key(epoch, group, "grow"), timeout)
        grown = [int(x) for x in plan["rank_map"]]
        self = cls.__new__(cls)
        self._configure(group, epoch, timeout, revoke_on_error, shrink_share)
        self._c = native.NcclCommunicator.grow_join(
            uid, len(grown), rank, device, grown, wait=wait, **self._opts
        )
        return self


def _op_name(op: Any) -> str:
    """Accepts "sum"/"avg"/..., or a torch.distributed.ReduceOp."""
    s = str(op)
    if "." in s:
        s = s.rsplit(".", 1)[1]
    return s.lower()


# ---------------------------------------------------------------------------------------
# Replacement flows (store choreography around the native two-phase API)
# ---------------------------------------------------------------------------------------


def replace_by_shrink_grow(
    comm: NcclComm,
    store: Store,
    *,
    leaving: Iterable[int],
    epoch: int,
    failed: bool = True,
    shrink_abort: bool = False,
    timeout: Optional[float] = None,
) -> None:
    """Survivor side: replace the ``leaving`` logical ranks by joiners holding the same ranks.

    ``failed=True`` (a crash): ``ncclCommRevoke`` (if not already revoked) then
    ``ncclCommShrink`` without sharing; ``failed=False`` (planned): ``ncclCommShrink(DEFAULT)``
    with ``shrinkShare``. Then the survivor with the smallest logical rank gets a grow id
    (``ncclCommGetUniqueId``) and publishes it with the grown rank map under ``epoch``; every
    survivor calls ``ncclCommGrow`` and commits. Joiners call :meth:`NcclComm.join_by_grow`
    with the same ``epoch``. NCCL numbers the joiners last; the rank map keeps logical ranks.
    """
    leaving = sorted(int(r) for r in leaving)
    c = comm.native
    if failed and comm.state == "ready":
        c.revoke(-1.0 if timeout is None else timeout)
    c.shrink(leaving, shrink_abort, -1.0 if timeout is None else timeout)
    survivors = comm.rank_map
    if comm.rank == min(survivors):
        gid = bytes(c.grow_unique_id())
        grown = _native.nccl_grow_rank_map(survivors, leaving)
        store.set(store_key(epoch, comm.group, "grow-plan"), json.dumps({"rank_map": grown}).encode())
        store.set(store_key(epoch, comm.group, "grow"), gid)
        c.grow_begin(leaving, gid)
    else:
        c.grow_begin(leaving, None)
    c.commit(-1.0 if timeout is None else timeout)
    comm.epoch = epoch


def replace_by_reinit(
    comm: NcclComm,
    store: Store,
    *,
    epoch: int,
    world_size: int,
    rank_map: Optional[Sequence[int]] = None,
    commit: bool = True,
    timeout: Optional[float] = None,
) -> None:
    """Fallback: build a fresh communicator for the new membership in the background.

    Every member of the new membership calls this (a joiner instead constructs
    ``NcclComm(store, rank, world_size, device, epoch=epoch, rank_map=...)``). The root (smallest
    logical rank) publishes a fresh unique id under ``epoch``. ``ncclCommInitRankConfig`` is
    non-blocking, so with ``commit=False`` this returns at once and the old communicator keeps
    working; call ``comm.native.commit()`` at the switch.
    """
    rmap = list(rank_map) if rank_map is not None else list(range(world_size))
    uid = exchange_unique_id(
        store, is_root=(comm.rank == min(rmap)), epoch=epoch, group=comm.group, purpose="init",
        timeout=timeout if timeout is not None else comm.timeout,
    )
    comm.native.reinit_begin(uid, world_size, rmap)
    if commit:
        comm.native.commit(-1.0 if timeout is None else timeout)
    comm.epoch = epoch
