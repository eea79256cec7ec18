"""Stopping a doomed step at once: a survivor does not finish the forward and backward of a step
that a lost peer has already voided.

Once a step is *doomed* (``ctx.aborted_by`` is set: a collective lost a peer, or the
communicator's watcher thread saw the loss while this rank computed, see
:mod:`tmrun.worker.loss_watch`), the rest of its compute is wasted: its gradients will never be
applied and ``steps()`` yields the step again after the recovery. :class:`StepInterrupter` cuts
that waste short, for the DDP models of the job (``tm.ddp``'s, or the script's own
``DistributedDataParallel`` given to ``tm.track``):

* **forward**: a check at the entry of every submodule's forward (a forward pre-hook). In a
  doomed step it raises :class:`StepInterrupted`, which the DDP model's own forward catches
  (:meth:`StepInterrupter.wrap_forward`): it returns a *placeholder*, zeros shaped like the last
  output, so the script's loss computation and ``backward()`` cost nothing. A forward entered
  in a doomed step returns the placeholder without running.
* **backward**: a check after each parameter's gradient is accumulated (a post-accumulate-grad
  hook; between the layers' backward kernels). It raises :class:`StepInterrupted`, the autograd
  engine stops and re-raises it in ``torch.autograd.backward``, which tmrun wraps
  (:func:`install_backward_guard`) to return normally. A backward entered in a doomed step does
  not run. Either way, where no parameter got a gradient, one small parameter gets zeros, so
  that what the script does with gradients next (a gradient scaler's infinity check, a norm
  clip) finds some.

The script sees a normal step: ``loss.backward()`` returns, ``opt.step()`` is skipped by the
optimizer guard (:mod:`tmrun.worker.optimizer`), ``zero_grad()`` and the rest of the loop body
run, so its ``finally`` blocks and context managers behave as in any step, and nothing is left
half-applied. :class:`StepInterrupted` derives from ``BaseException`` so that a script's
``except Exception`` cannot swallow it on its way; it is raised only while tmrun's forward or
backward wrapper is on the stack (``_armed``), so it never reaches the script.

Why checkpoints at module and parameter boundaries rather than an asynchronous exception
(``PyThreadState_SetAsyncExc``) at any bytecode: an exception at an arbitrary bytecode can land
inside torch's own bookkeeping (DDP's ``_pre_forward`` between two reducer calls, an optimizer's
``step``), and C++ kernels do not run bytecode at all, so it would not come sooner in the
kernels that take the time; module and gradient boundaries are where torch expects hooks to
raise. The grain is one layer.

DDP's reducer, stopped inside backward, still expects that backward to finish: it must be
reset (``_reset_state``), which makes DDP rebuild its buckets in the second step after (new
bucket memory, and a broadcast every member must join: 0.15-0.2 s at 100M parameters on the
2-core machine). So a change of the group resets the reducers only where needed, on every member
together (:meth:`StepInterrupter.reducers_need_reset`, agreed in ``heal``'s allgather): when a
member's backward was stopped, or a member's reducer has not rebuilt its buckets since it was
made or last reset (it would rebuild, with that broadcast, where the others do not). A failure
seen in forward, between steps or during the optimizer step, a standby's promotion and a planned
migration keep the buckets as they are.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Callable

import torch
import torch.utils._pytree as pytree

__all__ = ["StepInterrupted", "StepInterrupter", "InterruptCounts", "install_backward_guard", "remove_backward_guard"]


class StepInterrupted(BaseException):
    """The current step is doomed (a peer was lost): stop its compute. Caught by tmrun's DDP
    forward and by ``torch.autograd.backward``; never reaches the script."""


@dataclass
class InterruptCounts:
    forwards_stopped: int = 0  # a forward stopped at a submodule boundary
    forwards_skipped: int = 0  # a forward entered in a doomed step: not run
    backwards_stopped: int = 0  # a backward stopped between two gradients
    backwards_skipped: int = 0  # a backward entered in a doomed step: not run
    reducer_resets: int = 0  # changes of the group that reset this member's DDP reducers

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


@dataclass(frozen=True)
class _TensorShape:
    shape: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device


def _shape_of(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return _TensorShape(tuple(value.shape), value.dtype, value.device)
    return value


def _zeros_like(value: Any) -> Any:
    if isinstance(value, _TensorShape):
        grad = value.dtype.is_floating_point or value.dtype.is_complex
        return torch.zeros(value.shape, dtype=value.dtype, device=value.device, requires_grad=grad)
    return value


class StepInterrupter:
    """The interruption points of one worker (one per process). ``doomed()``: the current step
    lost a peer."""

    def __init__(self, doomed: Callable[[], bool]) -> None:
        self._doomed = doomed
        self._armed = 0  # > 0 while tmrun's forward or backward wrapper runs (any thread of it)
        self._output_shape: dict[int, Any] = {}  # per model: the last output's structure and shapes
        self._models: list[torch.nn.parallel.DistributedDataParallel] = []
        self._backward_stopped = False  # since the last reset: a reducer waits for a backward that ended early
        self.counts = InterruptCounts()

    # -- the checks ----------------------------------------------------------------------------

    def checkpoint(self) -> None:
        """Raise :class:`StepInterrupted` when the step is doomed and tmrun can catch it."""
        if self._armed and self._doomed():
            raise StepInterrupted()

    def install(self, model: torch.nn.parallel.DistributedDataParallel) -> None:
        """Checks at every submodule's forward and every parameter's gradient of ``model``."""
        for module in model.module.modules():
            module.register_forward_pre_hook(lambda *_: self.checkpoint())
        for param in model.module.parameters():
            if param.requires_grad:
                param.register_post_accumulate_grad_hook(lambda _: self.checkpoint())
        self.wrap_forward(model)
        self._models.append(model)
        install_backward_guard(self)

    # -- forward ---------------------------------------------------------------------------------

    def wrap_forward(self, model: torch.nn.Module) -> None:
        """``model.forward`` stops (or does not start) in a doomed step and returns the placeholder."""
        inner = model.forward
        key = id(model)

        def forward(*args: Any, **kwargs: Any) -> Any:
            shape = self._output_shape.get(key)
            if shape is None:  # no placeholder yet (the first forward): run it whole
                output = inner(*args, **kwargs)
            elif self._doomed():
                self.counts.forwards_skipped += 1
                return pytree.tree_map(_zeros_like, shape)
            else:
                self._armed += 1
                try:
                    output = inner(*args, **kwargs)
                except StepInterrupted:
                    self.counts.forwards_stopped += 1
                    return pytree.tree_map(_zeros_like, shape)
                finally:
                    self._armed -= 1
            self._output_shape[key] = pytree.tree_map(_shape_of, output)
            return output

        model.forward = forward  # type: ignore[method-assign]

    # -- backward --------------------------------------------------------------------------------

    def run_backward(self, inner: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        if self._doomed():
            self.counts.backwards_skipped += 1
            self._fill_missing_grads()
            return None
        self._armed += 1
        try:
            return inner(*args, **kwargs)
        except StepInterrupted:
            self.counts.backwards_stopped += 1
            self._backward_stopped = True
            self._fill_missing_grads()
            return None
        finally:
            self._armed -= 1

    def _fill_missing_grads(self) -> None:
        """A gradient of zeros for one parameter per model and device when the stopped backward
        produced none there: what the script does next with gradients (``GradScaler.step``
        wants an infinity check recorded per device, a clip reads their norm) finds some, as
        after any backward. One small parameter each, not the whole model: zeros for every
        parameter would cost a write of the model's size on the recovery's critical path.
        The gradients are void anyway: the step is redone."""
        with torch.no_grad():
            for model in self._models:
                by_device: dict[torch.device, list[torch.nn.Parameter]] = {}
                for param in model.module.parameters():
                    if param.requires_grad:
                        by_device.setdefault(param.device, []).append(param)
                for params in by_device.values():
                    if all(param.grad is None for param in params):
                        smallest = min(params, key=lambda param: param.numel())
                        smallest.grad = torch.zeros_like(smallest)

    # -- after a change of the group -----------------------------------------------------------------

    def reducers_need_reset(self) -> bool:
        """Whether this member's DDP reducers must be reset in the change under way: a backward
        was stopped since the last reset (its reducer would refuse the next forward), or a
        reducer has not rebuilt its buckets since it was made or reset (DDP sets
        ``_has_rebuilt_buckets`` when it does; never with ``find_unused_parameters``), or one runs
        a static graph (DDP counts its backward calls)."""
        return self._backward_stopped or any(
            not getattr(model, "_has_rebuilt_buckets", False) or getattr(model, "static_graph", False)
            for model in self._models)

    def reset_models(self) -> None:
        """Forget any backward a failure stopped (DDP's reducer would refuse the next forward).
        Called on every member of a change when any needs it (``heal``), so that all rebuild
        DDP's buckets in the same step."""
        for model in self._models:
            model.reducer._reset_state()
            model._has_rebuilt_buckets = False  # DDP sets it again once it rebuilt them
        self._backward_stopped = False
        if self._models:
            self.counts.reducer_resets += 1


_guarded: list[StepInterrupter] = []  # the process's interrupter (the last installed)
_unguarded_backward: list[Callable[..., Any]] = []  # torch's own, while the guard is installed


def install_backward_guard(interrupter: StepInterrupter) -> None:
    """Route ``torch.autograd.backward`` (what ``Tensor.backward`` calls) through
    ``interrupter.run_backward`` (in in-place workers only; the last interrupter installed
    is the one used)."""
    _guarded[:] = [interrupter]
    if _unguarded_backward:
        return
    inner = torch.autograd.backward
    _unguarded_backward.append(inner)

    def backward(*args: Any, **kwargs: Any) -> Any:
        return _guarded[0].run_backward(inner, *args, **kwargs)

    backward.__wrapped__ = inner  # type: ignore[attr-defined]
    backward.__doc__ = inner.__doc__
    torch.autograd.backward = backward  # type: ignore[assignment]


def remove_backward_guard() -> None:
    """Give ``torch.autograd.backward`` back (tests)."""
    if _unguarded_backward:
        torch.autograd.backward = _unguarded_backward.pop()  # type: ignore[assignment]
    _guarded.clear()
