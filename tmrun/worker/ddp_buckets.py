"""A DDP model built after a promotion takes its donors' gradient buckets before it trains.

DDP assigns a model's gradients to buckets twice: at construction, in reverse parameter order,
and once more at the start of its second iteration, in the order the gradients became ready in
the first (rank 0's, broadcast to the group). Every member's all-reduce of bucket *k* must hold
the same gradients. A joiner that builds its DDP model after its promotion (a job with
subgroups: its standby runs the script's set-up again as its rank, docs/mesh.md) holds the first
assignment while the survivors hold the second: its first step's all-reduces would pair other
gradients with theirs, a silently wrong value (found 2026-12-07, eleventh session).

So such a member (``needs_buckets``) says so in the healing's agreement; a donor of its shard
publishes its models' buckets (:func:`layout`: DDP's ``GradBucket.parameters()`` per bucket, as
the reducer's parameter indices), and the joiner makes its reducer build the same ones
(:func:`adopt`): it replays DDP's gradient-ready hooks in the donor's bucket order, inside one
backward of a marker tensor, then has the reducer rebuild its buckets from that order, with
every collective of it served locally (:func:`tmrun.comm.backend.served_locally`: its gradients
are zeros and its bucket indices its own). The result is read back and compared with the
donor's; a difference, a static graph or a registered comm hook (whose state the replay would
move) stops the in-place path on every member at once (:class:`BucketLayoutError`), never a
job trained on. Then the healing resets every member's reducer as after any such change
(``reset_models``): all rebuild their buckets, with DDP's broadcast, in the same later step.

DDP's construction itself, on a joiner, is served locally too (:class:`LocalConstructions`): its
all-gather of the parameters' shapes and its broadcast of rank 0's module states reach no peer
(the healing then overwrites every parameter and buffer the model holds, by identity).
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel

from tmrun.comm.backend import served_locally

__all__ = ["BucketLayoutError", "adopt", "layout", "needs_buckets", "refusal", "LocalConstructions"]


class BucketLayoutError(RuntimeError):
    """A DDP model could not take its donors' gradient buckets."""


def reducer_parameters(model: DistributedDataParallel) -> list[torch.nn.Parameter]:
    """The parameters DDP's reducer indexes, in its order: DDP's own list, the one it built its
    reducer from (each module's own parameters that require a gradient and are not ignored,
    shared ones once; it also re-reads the module's buffers, as DDP does before each sync)."""
    return list(model._build_params_for_reducer()[0])


def layout(model: DistributedDataParallel) -> list[list[int]]:
    """The model's gradient buckets, each as the reducer's parameter indices in bucket order."""
    index = {id(param): i for i, param in enumerate(reducer_parameters(model))}
    try:
        return [[index[id(param)] for param in bucket.parameters()]
                for bucket in model.reducer._get_zeros_like_grad_buckets()]
    except KeyError:
        raise BucketLayoutError("a gradient bucket holds a parameter the reducer does not index") from None


def needs_buckets(models: list[DistributedDataParallel]) -> bool:
    """Whether a model has DDP's first bucket assignment still (built and not yet rebuilt: a
    joiner that built it after its promotion; DDP with ``find_unused_parameters`` never rebuilds,
    and is checked the same way)."""
    return any(not getattr(model, "_has_rebuilt_buckets", False) for model in models)


def refusal(model: DistributedDataParallel) -> str:
    """Why ``model``'s buckets could not be taken from a donor ('' when they can)."""
    if getattr(model, "static_graph", False):
        return "it runs DDP with static_graph=True (DDP counts its iterations)"
    if getattr(model, "_comm_hooks", None):
        return "it has a DDP comm hook (whose state the bucket replay would move)"
    return ""


class _ReadyInOrder(torch.autograd.Function):
    """Inside one backward: DDP's gradient-ready hook of each parameter, in the given order."""

    @staticmethod
    def forward(ctx: Any, marker: torch.Tensor, reducer: Any, order: list[int]) -> torch.Tensor:
        ctx.reducer, ctx.order = reducer, order
        return marker.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, None, None]:
        for index in ctx.order:
            ctx.reducer._autograd_hook(index)
        return None, None, None


def adopt(model: DistributedDataParallel, target: list[list[int]]) -> bool:
    """Give ``model``'s reducer the buckets ``target`` (a donor's :func:`layout`); returns
    whether it had to change. Its gradients are left as they were. Raises
    :class:`BucketLayoutError` where it cannot, or where the buckets read back differ."""
    current = layout(model)
    if current == target:
        return False
    why = refusal(model) or ("it runs DDP with find_unused_parameters=True (DDP never rebuilds its buckets)"
                             if getattr(model, "find_unused_parameters", False) else "")
    if why:
        raise BucketLayoutError(f"its buckets differ from the donor's and cannot be rebuilt: {why}")
    params = reducer_parameters(model)
    order = [index for bucket in target for index in bucket]
    if sorted(order) != list(range(len(params))):
        raise BucketLayoutError(f"the donor's buckets index {len(order)} parameters, this model's reducer "
                                f"{len(params)}")
    grads = [None if p.grad is None else p.grad.detach().clone() for p in params]
    with served_locally():
        model.reducer.prepare_for_backward([])
        marker = torch.zeros(1, requires_grad=True)
        _ReadyInOrder.apply(marker, model.reducer, order).sum().backward()
        model.reducer._rebuild_buckets()
    for param, grad in zip(params, grads):
        param.grad = grad
    model._has_rebuilt_buckets = True
    got = layout(model)
    if got != target:
        raise BucketLayoutError(f"rebuilt as {_short(got)}, the donor's are {_short(target)}")
    return True


def _short(buckets: list[list[int]]) -> str:
    text = str(buckets)
    return text if len(text) <= 80 else text[:77] + "..."


class LocalConstructions:
    """From :meth:`start` to :meth:`stop`, every ``DistributedDataParallel`` constructed in this
    process has its collectives served locally (a promoted joiner's set-up: no peer issues them;
    on its own thread only: :func:`tmrun.comm.backend.served_locally`)."""

    def __init__(self) -> None:
        self._original: Any = None
        self.built = 0  # DDP models constructed meanwhile

    def start(self) -> None:
        if self._original is not None:
            return
        original = self._original = DistributedDataParallel.__init__
        memo = self

        @functools.wraps(original)
        def constructed_locally(model: DistributedDataParallel, *args: Any, **kwargs: Any) -> None:
            with served_locally():
                original(model, *args, **kwargs)
            memo.built += 1

        DistributedDataParallel.__init__ = constructed_locally  # type: ignore[method-assign]

    def stop(self) -> int:
        """DDP's constructor again; returns how many models were built since :meth:`start`."""
        if self._original is not None:
            DistributedDataParallel.__init__ = self._original  # type: ignore[method-assign]
            self._original = None
        built, self.built = self.built, 0
        return built
