"""The optimizer guard: an optimizer step is applied only when every rank finished the step.

:class:`GuardedOptimizer` wraps a ``torch.optim.Optimizer`` (like torchft's
``OptimizerWrapper``). It *is* a ``torch.optim.Optimizer`` (LR schedulers, ``isinstance``
checks and checkpoint code accept it) and delegates everything to the wrapped optimizer,
except ``step()``:

* when the step is aborted (a collective of it lost a peer) it returns ``None`` without
  stepping: a partial update is never applied, ``steps()`` yields the step again;
* otherwise it lets the runtime get ready (a migration's joiner waits for the rest of its
  optimizer state; the "optimizer" failure drill fires), steps the wrapped optimizer, and
  records the step as committed.

What it asks of the runtime is the small :class:`StepGate` protocol.

Two ways to use it, and why both exist
--------------------------------------
``opt = tm.optimizer(opt)`` returns the guard; the script then calls ``opt.step()`` on it
(nothing of the user's object is touched).

``tm.track(optimizer=opt)`` followed by ``opt.step()`` on the user's *own* object is how every
existing script is written (examples/train_inplace.py, the tests' scripts), and it must keep
working with bitwise-identical results. That needs the user's object itself to skip a step,
and torch 2.13 offers no public way to do that: ``register_step_pre_hook`` may only rewrite
the step's arguments, a post-hook runs after the update, and undoing an update afterwards
would need a copy of the whole optimizer state at every aborted step. So :func:`guard_in_place`
sets one instance attribute on the user's optimizer: ``step`` becomes :func:`_step_through_guard`
bound to it, which hands the call to the optimizer's guard (one guard per optimizer, found in a
weak registry). It is a plain function bound to the optimizer itself, not the guard's method,
because ``torch.optim.lr_scheduler.LRScheduler`` re-binds ``opt.step.__func__`` to the
optimizer when it is created after the guard was installed (a scheduler created before warns
once, at its first step, that the step was overridden after it; harmless, and as before). The
instance attribute is the only
change to the user's object (``type(opt)``, ``isinstance``, pickling, copies and
``state_dict`` are as before).
"""

from __future__ import annotations

import types
import weakref
from typing import Any, Callable, Protocol

import torch


class StepGate(Protocol):
    """What the guard asks of the runtime."""

    def step_aborted(self) -> bool:
        """True when the current step lost a peer: its update must not be applied."""

    def before_optimizer_step(self) -> None:
        """Make the optimizer's state complete (a migration's joiner), fire the drill."""

    def after_optimizer_step(self) -> None:
        """The update is applied: the current step counts as committed on this rank."""


class GuardedOptimizer(torch.optim.Optimizer):
    """A proxy of ``optimizer`` whose :meth:`step` goes through ``gate`` (see the module
    docstring). ``Optimizer.__init__`` is deliberately not called: the proxy has no parameter
    groups or state of its own, it shows the wrapped optimizer's."""

    def __init__(self, optimizer: torch.optim.Optimizer, gate: StepGate) -> None:
        if isinstance(optimizer, GuardedOptimizer):
            raise TypeError("this optimizer is guarded already")
        self.optimizer = optimizer
        self._gate = gate
        # the step as it was when the guard was made: the class's, or an LR scheduler's wrapper
        self._inner_step: Callable[..., Any] = optimizer.step

    # -- the guarded step -----------------------------------------------------------------

    def step(self, *args: Any, **kwargs: Any) -> Any:  # type: ignore[override]
        if self._gate.step_aborted():
            return None  # a collective of this step lost a peer: never apply a partial update
        self._gate.before_optimizer_step()
        result = self._inner_step(*args, **kwargs)
        self._gate.after_optimizer_step()
        return result

    # -- everything else is the wrapped optimizer's ------------------------------------------

    @property  # type: ignore[override]
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, value: list[dict[str, Any]]) -> None:
        self.optimizer.param_groups = value

    @property  # type: ignore[override]
    def state(self) -> Any:
        return self.optimizer.state

    @state.setter
    def state(self, value: Any) -> None:
        self.optimizer.state = value

    @property  # type: ignore[override]
    def defaults(self) -> dict[str, Any]:
        return self.optimizer.defaults

    @defaults.setter
    def defaults(self, value: dict[str, Any]) -> None:
        self.optimizer.defaults = value

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state_dict)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        self.optimizer.add_param_group(param_group)

    def register_step_pre_hook(self, hook: Any) -> Any:
        return self.optimizer.register_step_pre_hook(hook)

    def register_step_post_hook(self, hook: Any) -> Any:
        return self.optimizer.register_step_post_hook(hook)

    def register_state_dict_pre_hook(self, hook: Any, prepend: bool = False) -> Any:
        return self.optimizer.register_state_dict_pre_hook(hook, prepend)

    def register_state_dict_post_hook(self, hook: Any, prepend: bool = False) -> Any:
        return self.optimizer.register_state_dict_post_hook(hook, prepend)

    def register_load_state_dict_pre_hook(self, hook: Any, prepend: bool = False) -> Any:
        return self.optimizer.register_load_state_dict_pre_hook(hook, prepend)

    def register_load_state_dict_post_hook(self, hook: Any, prepend: bool = False) -> Any:
        return self.optimizer.register_load_state_dict_post_hook(hook, prepend)

    def __getattr__(self, name: str) -> Any:  # attributes of a custom optimizer
        if name in ("optimizer", "_gate", "_inner_step"):  # not set yet (copy, unpickling)
            raise AttributeError(name)
        return getattr(self.optimizer, name)

    def __getstate__(self) -> dict[str, Any]:
        raise TypeError("a guarded optimizer cannot be pickled; save its state_dict()")

    def __repr__(self) -> str:
        return f"GuardedOptimizer({self.optimizer!r})"


def unwrap(optimizer: Any) -> Any:
    """The user's optimizer behind a guard (anything else as it is)."""
    return optimizer.optimizer if isinstance(optimizer, GuardedOptimizer) else optimizer


_guards: weakref.WeakKeyDictionary[torch.optim.Optimizer, GuardedOptimizer] = weakref.WeakKeyDictionary()


def guard(optimizer: torch.optim.Optimizer, gate: StepGate) -> GuardedOptimizer:
    """The guard of ``optimizer`` (made once per optimizer; a guard is returned as it is)."""
    if isinstance(optimizer, GuardedOptimizer):
        return optimizer
    found = _guards.get(optimizer)
    if found is None:
        found = _guards[optimizer] = GuardedOptimizer(optimizer, gate)
    return found


def _step_through_guard(optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
    """``step`` of a user's optimizer given to ``tm.track``: its guard's step."""
    return _guards[optimizer].step(*args, **kwargs)


def guarded_in_place(optimizer: torch.optim.Optimizer) -> bool:
    """True when ``optimizer.step`` goes through its guard (possibly under an LR scheduler's
    wrapper, which keeps the function it wraps as ``__wrapped__``)."""
    step: Any = optimizer.__dict__.get("step")
    while step is not None:
        step = getattr(step, "__func__", step)
        if step is _step_through_guard:
            return True
        step = getattr(step, "__wrapped__", None)
    return False


def guard_in_place(optimizer: torch.optim.Optimizer, gate: StepGate) -> GuardedOptimizer:
    """Make ``optimizer.step()`` on the user's own object go through its guard (the usage of
    ``tm.track(optimizer=opt)``; why it sets an instance attribute: the module docstring).
    Idempotent. Returns the guard."""
    found = guard(optimizer, gate)
    if not guarded_in_place(optimizer):
        optimizer.step = types.MethodType(_step_through_guard, optimizer)  # type: ignore[method-assign]
    return found


def scheduled(optimizer: torch.optim.Optimizer) -> bool:
    """Whether an LR scheduler was made for ``optimizer``: torch's ``LRScheduler`` marks the step
    it wraps with ``_wrapped_by_lr_sched`` (on the optimizer's ``step``, or under the guard when
    the scheduler came first)."""
    steps: list[Any] = [optimizer.__dict__.get("step")]
    found = _guards.get(optimizer)
    if found is not None:
        steps.append(found._inner_step)
    return any(step is not None and hasattr(step, "_wrapped_by_lr_sched") for step in steps)
