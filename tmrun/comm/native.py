"""Thin Python helpers around :mod:`tmrun_native`'s TCP communicator.

The C++ communicator knows nothing about torch or stores. This module does the two things it
needs from Python:

* **Bootstrap through a store** (any ``torch.distributed.Store``): every rank listens, publishes
  ``host:port`` under ``{prefix}/{job_id}/epoch{epoch}/addr/{rank}``, reads everyone's address and
  calls :meth:`Communicator.connect`. Keys include the epoch, so addresses of different
  memberships never mix.
* **Tensor views**: :func:`as_buffer` turns a contiguous CPU tensor into a writable buffer that
  shares its memory plus the matching :class:`DType` (bfloat16 travels as int16 bits).

Replacement (see ``docs/native.md``)::

    # survivors (every rank except the replaced ones)
    comm = ...                                       # connected in epoch e
    prepare_replacement(store, comm, replaced=[3], new_epoch=e + 1)   # background connect
    ...                                              # collectives may continue here
    comm.commit()                                    # at a step boundary
    # joiner taking rank 3
    comm = join_via_store(store, rank=3, world_size=n, job_id=job, epoch=e + 1)
"""

from __future__ import annotations

import ctypes
from typing import Any, Callable, Iterable, Optional

from tmrun.protocol import auth, keys

from tmrun_native import (  # noqa: F401  (re-exported API)
    AuthenticationError,
    CommError,
    CommTimeoutError,
    Communicator,
    DType,
    FrameError,
    Options,
    PeerLostError,
    ProtocolError,
    ReduceOp,
    Work,
    crc32c,
)

DEFAULT_PREFIX = keys.NATIVE_PREFIX

__all__ = [
    "AuthenticationError",
    "CommError",
    "CommTimeoutError",
    "Communicator",
    "DType",
    "FrameError",
    "Options",
    "PeerLostError",
    "ProtocolError",
    "ReduceOp",
    "Work",
    "address_key",
    "as_buffer",
    "connect_via_store",
    "join_via_store",
    "make_options",
    "prepare_replacement",
    "torch_dtype_to_native",
]


def make_options(options: Optional[Options] = None, **kwargs: Any) -> Options:
    """An :class:`Options` from keyword arguments (``timeout=2.0, bind_address='0.0.0.0'`` …).
    Without a ``token``, the job token of the environment (``TMRUN_JOB_TOKEN_FILE``, else
    ``TMRUN_JOB_TOKEN``: what tmrun's agent gives its workers) is set, in ``options`` too."""
    if options is not None and kwargs:
        raise TypeError("pass either options or keyword arguments")
    opts = options if options is not None else Options(**kwargs)
    if not opts.token:
        token = auth.token_from_environ()
        if token:
            opts.token = token
    return opts


def address_key(job_id: str, epoch: int, rank: int, prefix: str = DEFAULT_PREFIX) -> str:
    return keys.native_address(prefix, job_id, epoch, rank)


def _get(store: Any, key: str) -> str:
    value = store.get(key)  # blocks up to the store's timeout
    return value.decode() if isinstance(value, (bytes, bytearray)) else str(value)


Getter = Callable[[Any, str], str]  # (store, key) -> value: how a waiting caller reads a peer's address


def _addresses(store: Any, job_id: str, epoch: int, world_size: int, prefix: str, get: Getter = _get) -> list[str]:
    return [get(store, address_key(job_id, epoch, r, prefix)) for r in range(world_size)]


def connect_via_store(
    store: Any,
    rank: int,
    world_size: int,
    job_id: str,
    epoch: int = 0,
    options: Optional[Options] = None,
    prefix: str = DEFAULT_PREFIX,
    get: Optional[Getter] = None,
    watch: Optional[Callable[[], None]] = None,
    **kwargs: Any,
) -> Communicator:
    """Create, publish and connect the communicator of ``rank`` for ``epoch``. ``get``: how to
    wait for a peer's address (default: the store's blocking ``get``, up to its timeout; tmrun's
    workers give one that also gives up when a newer generation superseded ``epoch``);
    ``watch``: called every 20 ms while connecting, raises to give up (the connect is ended)."""
    comm = Communicator(rank, world_size, job_id, epoch, make_options(options, **kwargs))
    try:
        store.set(address_key(job_id, epoch, rank, prefix), comm.address)
        addresses = _addresses(store, job_id, epoch, world_size, prefix, get or _get)
        if watch is None:
            comm.connect(addresses)
        else:
            _connect_watched(comm, addresses, watch)
    except BaseException:
        comm.close()
        raise
    return comm


def _connect_watched(comm: Communicator, addresses: list[str], watch: Callable[[], None]) -> None:
    """``comm.connect(addresses)`` (it releases the GIL) in a helper thread while this one calls
    ``watch()`` every 20 ms; when ``watch`` raises, the communicator is closed, which ends the
    connect's dialling and waiting at once, and the exception propagates."""
    import threading

    outcome: list[BaseException | None] = []

    def run() -> None:
        try:
            comm.connect(addresses)
            outcome.append(None)
        except BaseException as exc:  # noqa: BLE001  (handed to the caller)
            outcome.append(exc)

    thread = threading.Thread(target=run, name="tmrun-connect", daemon=True)
    thread.start()
    try:
        while thread.is_alive():
            thread.join(0.02)
            if thread.is_alive():
                watch()
    except BaseException:
        comm.close()
        thread.join(10.0)
        raise
    if outcome and outcome[0] is not None:
        raise outcome[0]


def join_via_store(
    store: Any,
    rank: int,
    world_size: int,
    job_id: str,
    epoch: int,
    options: Optional[Options] = None,
    prefix: str = DEFAULT_PREFIX,
    get: Optional[Getter] = None,
    watch: Optional[Callable[[], None]] = None,
    **kwargs: Any,
) -> Communicator:
    """The joiner side of a replacement: take ``rank`` in the new ``epoch``.

    Survivors publish their (unchanged) addresses under the new epoch in
    :func:`prepare_replacement`; this returns once the survivors have committed.
    """
    return connect_via_store(store, rank, world_size, job_id, epoch, options, prefix, get, watch, **kwargs)


def prepare_replacement(
    store: Any,
    comm: Communicator,
    replaced: Iterable[int],
    new_epoch: int,
    prefix: str = DEFAULT_PREFIX,
    get: Optional[Getter] = None,
) -> None:
    """The survivor side of phase 1: republish this rank's address under ``new_epoch``, read the
    joiners' addresses and call :meth:`Communicator.prepare` (which connects in the background).
    Call :meth:`Communicator.commit` at the next safe point."""
    replaced = sorted(set(int(r) for r in replaced))
    store.set(address_key(comm.job_id, new_epoch, comm.rank, prefix), comm.address)
    # every joiner's new address, not only the ring neighbours': a point-to-point link to a
    # joiner that is not a neighbour (state transfer) is dialled lazily, at that address
    get = get or _get
    new_addresses = {r: get(store, address_key(comm.job_id, new_epoch, r, prefix)) for r in replaced}
    comm.prepare(replaced, new_addresses, new_epoch)


def commit_unless(comm: Communicator, superseded: Callable[[], bool], poll: float = 0.05) -> None:
    """``comm.commit()``, given up as soon as ``superseded()`` turns true while the commit still
    waits for the links prepared toward a joiner (a joiner that moved on to a newer generation
    never connects): the pending prepare is cancelled and the commit raises :class:`CommError`
    at once instead of after ``connect_timeout``. A commit whose links are up is not touched."""
    work = comm.commit_async()
    asked = False
    while not work.wait(poll):
        if not asked and superseded():
            asked = True
            comm.cancel_prepare()


def torch_dtype_to_native(dtype: Any) -> DType:
    import torch

    table = {
        torch.float32: DType.FLOAT32,
        torch.float64: DType.FLOAT64,
        torch.float16: DType.FLOAT16,
        torch.bfloat16: DType.BFLOAT16,
        torch.int32: DType.INT32,
        torch.int64: DType.INT64,
        torch.uint8: DType.UINT8,
    }
    try:
        return table[dtype]
    except KeyError:
        raise TypeError(f"tmrun_native does not support {dtype}") from None


def crc32c_of(tensors: Iterable[Any], crc: int = 0) -> int:
    """CRC-32C over the bytes of contiguous CPU tensors, in order (the GIL is released); ``crc``:
    the CRC of the bytes before them (continues it)."""
    for tensor in tensors:
        crc = crc32c(as_buffer(tensor)[0], crc)
    return crc


def as_buffer(tensor: Any) -> tuple[memoryview, DType]:
    """``(buffer, dtype)`` sharing the memory of a contiguous CPU tensor (writes go to the tensor).

    The buffer is a byte view built with :mod:`ctypes` over ``tensor.data_ptr()`` (no numpy); the
    communicator reads it with the explicit ``dtype`` returned here (bfloat16 included). The
    tensor must stay alive (and unmodified by others) until the operation using the buffer
    completes: the view does not hold a reference to it."""
    if tensor.device.type != "cpu":
        raise ValueError("as_buffer needs a CPU tensor (stage CUDA tensors through host memory)")
    if not tensor.is_contiguous():
        raise ValueError("as_buffer needs a contiguous tensor")
    dtype = torch_dtype_to_native(tensor.dtype)
    nbytes = tensor.numel() * tensor.element_size()
    if nbytes == 0:
        return memoryview(bytearray(0)), dtype
    raw = (ctypes.c_uint8 * nbytes).from_address(tensor.data_ptr())
    return memoryview(raw).cast("B"), dtype
