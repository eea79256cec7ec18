"""Stopping a doomed step at once: a survivor does not finish the forward and backward of a step
that a lost peer has already voided.

Once a step is *doomed* (``ctx.aborted_by`` is set: a collective lost a peer, or the
communicator's watcher thread saw the loss while this rank computed, see
:mod:`tmrun.worker.loss_watch`), the rest of its compute is wasted: its gradients will never be
applied and ``steps()`` yields the step again after the recovery. :class:`StepInterrupter` cuts
that waste short, for the DDP models of the job (``tm.ddp``'s, or the script's own
``DistributedDataParallel`` given to ``tm.track``) and its tracked sharded modules (FSDP2's
``fully_shard``, tensor parallelism; :meth:`StepInterrupter.install_sharded`):

* **forward**: a check at the entry of every submodule's forward (a forward pre-hook). In a
  doomed step it raises :class:`StepInterrupted`, which the DDP model's own forward catches
  (:meth:`StepInterrupter.wrap_forward`): it returns a *placeholder*, zeros shaped like the last
  output, so the script's loss computation and ``backward()`` cost nothing. A forward entered
  in a doomed step returns the placeholder without running. Inside code that ``torch.compile``
  traces (a compiled block's submodules) the check is empty: the compiled part runs whole and
  the forward stops at the next eager module (a stop raised inside dynamo's trace failed the
  whole forward under ``fullgraph=True``, torchtitan's per-block compile).
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

FSDP2 keeps per-iteration state (blocks gathered, training states, the prefetch order, a
post-backward callback queued in the autograd engine) that a stopped forward or backward leaves
mid-step; torch's ``FSDPModule.reset_iter_state`` clears it (tmrun also drops the gradients a
stopped backward left on unsharded parameters, which it keeps up to torch 2.14: a private layout,
checked when the module is tracked, :func:`check_fsdp_layout`). It is local (no collective):
each member resets its own where its backward stops or is skipped (the parameters are the
sharded ones again before the zero gradients are filled in, and the script's ``zero_grad()``
clears them), and at the start of a change if a later forward left it mid-step again
(:meth:`StepInterrupter.reset_sharded`), before the state is read for the transfer.
"""

from __future__ import annotations

import inspect
from dataclasses import asdict, dataclass
from typing import Any, Callable

import torch
import torch.utils._pytree as pytree

__all__ = ["FsdpLayoutError", "StepInterrupted", "StepInterrupter", "InterruptCounts", "install_backward_guard", "remove_backward_guard"]


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
    sharded_resets: int = 0  # resets of FSDP2's per-iteration state after a doomed step cut it short

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

    def __init__(self, doomed: Callable[[], bool], optimized: Callable[[], set[int]] = set) -> None:
        self._doomed = doomed
        self._optimized = optimized  # ids of the parameters the tracked optimizers step
        self._armed = 0  # > 0 while tmrun's forward or backward wrapper runs (any thread of it)
        self._output_shape: dict[int, Any] = {}  # per model: the last output's structure and shapes
        self._models: list[torch.nn.parallel.DistributedDataParallel] = []
        self._sharded: list[torch.nn.Module] = []  # tracked modules with sharded parameters (FSDP2, TP)
        self._backward_stopped = False  # since the last reset: a reducer waits for a backward that ended early
        # a DDP model's forward completed in sync mode and its backward has not run yet: DDP's
        # reducer prepared for that backward (a backward skipped now leaves it mid-iteration)
        self._ddp_backward_due = False
        self._ddp_grads_seen = False  # the backward under way reached a DDP model's parameters
        self._sharded_dirty = False  # since the last reset: a doomed step cut a sharded module's forward or backward short
        self._sharded_reset_since = False  # an FSDP2 reset since the last change (for its line)
        self.counts = InterruptCounts()

    # -- the checks ----------------------------------------------------------------------------

    def checkpoint(self) -> None:
        """Raise :class:`StepInterrupted` when the step is doomed and tmrun can catch it.

        Nothing inside code that torch.compile traces (a compiled block's own submodules, whose
        hooks dynamo inlines): raised there, under ``fullgraph=True`` (torchtitan's per-block
        compile), dynamo fails the forward with ``Unsupported: Observed exception`` and the
        survivor dies; elsewhere each change of the doomed state would recompile the block.
        Traced, this check is empty: such a forward runs whole and stops at the next eager module."""
        if torch.compiler.is_compiling():
            return
        if self._armed and self._doomed():
            raise StepInterrupted()

    @property
    def ddp_models(self) -> list[torch.nn.parallel.DistributedDataParallel]:
        """The DDP models installed, in the order the script gave them."""
        return list(self._models)

    def install(self, model: torch.nn.parallel.DistributedDataParallel) -> None:
        """Checks at every submodule's forward and every parameter's gradient of ``model``."""
        for module in model.module.modules():
            module.register_forward_pre_hook(lambda *_: self.checkpoint())
        for param in model.module.parameters():
            if param.requires_grad:
                param.register_post_accumulate_grad_hook(self._ddp_grad_checkpoint)
        self.wrap_forward(model)
        self._models.append(model)
        install_backward_guard(self)

    def _ddp_grad_checkpoint(self, _param: torch.Tensor) -> None:
        self._ddp_grads_seen = True  # this backward reaches a DDP model (its reducer's)
        self.checkpoint()

    def install_sharded(self, module: torch.nn.Module) -> None:
        """The same checks for a tracked module with sharded parameters (FSDP2's ``fully_shard``,
        tensor parallelism; the script calls it directly, no DDP): at every submodule's forward,
        ahead of FSDP's own pre-forward hook (a doomed step does not gather the next block's
        parameters), and at the gradient of every layer's output in backward (the layer's own
        backward kernels, and its gradient reduction, come after it). The sharded parameters
        themselves take no part in autograd (FSDP2 computes with unsharded copies and assigns
        the reduced gradients), so their gradient hooks would never fire. Raises
        :class:`FsdpLayoutError` for an FSDP2 module whose torch keeps its state in a layout
        tmrun does not know (:func:`check_fsdp_layout`)."""
        check_fsdp_layout(module)  # before any hook: one clear error, not gradients left behind later
        for sub in module.modules():
            sub.register_forward_pre_hook(lambda *_: self.checkpoint(), prepend=True)
            if next(sub.parameters(recurse=False), None) is not None:
                sub.register_forward_hook(self._check_output_grad)
        self.wrap_forward(module)
        self._sharded.append(module)
        install_backward_guard(self)

    def _check_output_grad(self, _module: torch.nn.Module, _inputs: Any, output: Any) -> None:
        if not torch.is_grad_enabled() or torch.compiler.is_compiling():
            return  # (traced by torch.compile: no hook on its intermediates, see checkpoint)
        for value in pytree.tree_leaves(output):
            if isinstance(value, torch.Tensor) and value.requires_grad:
                value.register_hook(self._grad_checkpoint)

    def _grad_checkpoint(self, _grad: torch.Tensor) -> None:
        self.checkpoint()

    # -- forward ---------------------------------------------------------------------------------

    def wrap_forward(self, model: torch.nn.Module) -> None:
        """``model.forward`` stops (or does not start) in a doomed step and returns the placeholder."""
        inner = model.forward
        key = id(model)

        def forward(*args: Any, **kwargs: Any) -> Any:
            if not torch.is_grad_enabled():
                # an evaluation or metrics forward (no_grad, inference_mode): never a placeholder,
                # it runs whole and gives its true result (its value is the script's, not a step's)
                return inner(*args, **kwargs)
            shape = self._output_shape.get(key)
            if shape is None:  # no placeholder yet (the first forward): run it whole
                output = inner(*args, **kwargs)
            elif self._doomed():
                self.counts.forwards_skipped += 1
                self._sharded_dirty = True
                return pytree.tree_map(_zeros_like, shape)
            else:
                self._armed += 1
                try:
                    output = inner(*args, **kwargs)
                except StepInterrupted:
                    self.counts.forwards_stopped += 1
                    self._sharded_dirty = True
                    return pytree.tree_map(_zeros_like, shape)
                finally:
                    self._armed -= 1
            self._output_shape[key] = pytree.tree_map(_shape_of, output)
            if getattr(model, "require_backward_grad_sync", False) and model in self._models:
                self._ddp_backward_due = True  # not under no_sync: DDP waits for this backward
            return output

        model.forward = forward  # type: ignore[method-assign]

    # -- backward --------------------------------------------------------------------------------

    def run_backward(self, inner: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        if self._doomed():
            self.counts.backwards_skipped += 1
            # a DDP forward that completed expects this backward: its reducer must be reset
            # (left as is, the next backward crashed inside DDP's reducer)
            self._backward_stopped = self._backward_stopped or self._ddp_backward_due
            self._ddp_backward_due = False
            self._after_stopped_backward(_backward_leaves(args, kwargs))
            return None
        self._armed += 1
        self._ddp_grads_seen = False
        try:
            result = inner(*args, **kwargs)
            if self._ddp_grads_seen:  # (a loss's own backward on a detached chunk is not DDP's)
                self._ddp_backward_due = False
            return result
        except StepInterrupted:
            self._ddp_backward_due = False
            self.counts.backwards_stopped += 1
            self._backward_stopped = True
            self._after_stopped_backward(_backward_leaves(args, kwargs))
            return None
        finally:
            self._armed -= 1

    def _after_stopped_backward(self, leaves: list[torch.Tensor]) -> None:
        """FSDP2 modules are reset at once (their parameters are the sharded ones again, the
        ones the optimizer holds: the zero gradient below must land there, where the script's
        ``zero_grad()`` clears it, not on an unsharded parameter left from the forward), then a
        zero gradient where the backward produced none: on the tracked models' parameters
        (:meth:`_fill_missing_grads`) and on every other leaf the stopped backward would have
        reached (``leaves``: tensors, and parameters a tracked optimizer steps): a loss that runs its own backward per chunk on a detached hidden
        state and then reads that state's ``.grad`` (a chunked cross-entropy) finds one, as
        after any backward, and so does a ``backward(inputs=...)``."""
        if self._sharded:
            self._reset_fsdp()
        self._fill_missing_grads()
        optimized: set[int] | None = None
        in_ddp = {id(param) for model in self._models for param in model.module.parameters()}
        with torch.no_grad():
            for leaf in leaves:
                if leaf.grad is not None or id(leaf) in in_ddp:
                    continue  # a DDP model's parameters: _fill_missing_grads (one small one)
                if isinstance(leaf, torch.nn.Parameter):
                    # a parameter outside the tracked models (a loss head whose gradient the
                    # script reduces itself) gets zeros when an optimizer steps it; FSDP2's
                    # unsharded parameters (leaves of the graph, stepped by no optimizer: it
                    # holds the sharded ones) must not, or zero_grad() would never clear them
                    optimized = self._optimized() if optimized is None else optimized
                    if id(leaf) not in optimized:
                        continue
                leaf.grad = torch.zeros_like(leaf)

    def _fill_missing_grads(self) -> None:
        """Gradients of zeros where the stopped backward produced none, so that what the script
        does next with gradients finds them, as after any backward. The gradients are void
        anyway: the step is redone.

        * A DDP model: one small parameter per model and device, when none got one there
          (``GradScaler.step`` wants an infinity check recorded per device, a clip reads their
          norm). Not the whole model: DDP reduces the gradients itself, so scripts do not walk
          them, and zeros for every parameter would cost a write of the model's size on the
          recovery's critical path.
        * A sharded module: every parameter without one (its local shard's size). Scripts reduce
          such gradients themselves (data parallel over tensor-parallel modules: an allreduce of
          every ``p.grad``), which a missing one would break."""
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
            for module in self._sharded:
                for param in module.parameters():
                    if param.requires_grad and param.grad is None:
                        param.grad = torch.zeros_like(param)

    # -- after a change of the group -----------------------------------------------------------------

    def reducers_need_reset(self) -> bool:
        """Whether this member's DDP reducers must be reset in the change under way: a backward
        was stopped since the last reset (its reducer would refuse the next forward), or a
        reducer has not rebuilt its buckets since it was made or reset (DDP sets
        ``_has_rebuilt_buckets`` when it does; never with ``find_unused_parameters``), or one runs
        a static graph (DDP counts its backward calls)."""
        return bool(self._models) and (self._backward_stopped or any(
            not getattr(model, "_has_rebuilt_buckets", False) or getattr(model, "static_graph", False)
            for model in self._models))

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

    def reset_sharded(self) -> bool:
        """Whether FSDP2's state was reset since the last call (the recovery's line says so), after
        resetting what is still left: called at the start of every change, before the state is
        read for the transfer (a block left unsharded would expose its unsharded parameters).
        Local, no collective: each member resets what its own step left."""
        if self._sharded_dirty:
            self._reset_fsdp()
        else:
            self._reshard_fsdp()
        reset, self._sharded_reset_since = self._sharded_reset_since, False
        return reset

    def _reshard_fsdp(self) -> None:
        """Register every tracked FSDP2 module's sharded parameters again (torch's public
        ``FSDPModule.reshard``; nothing where they are): a whole forward leaves the root's
        unsharded (FSDP2 does not reshard the root after its forward), so after an evaluation
        under ``no_grad`` at a step's end the state read for the transfer held the root's full
        parameters, its layout differed from a joiner's and the healing found no replica of the
        lost shard (the group restart)."""
        from torch.distributed.fsdp import FSDPModule

        for module in self._sharded:
            for sub in module.modules():
                if isinstance(sub, FSDPModule):
                    sub.reshard()

    def _reset_fsdp(self) -> None:
        """Put the tracked FSDP2 modules back as after a clean step, once a doomed step cut a
        forward or backward short (or skipped a backward after a whole forward). FSDP2 keeps
        per-iteration state that such a step leaves mid-way: blocks still unsharded (the root
        stays so after its forward), training states, the prefetch order, a post-backward
        callback queued in the autograd engine that never ran. torch's
        ``FSDPModule.reset_iter_state`` (on the root: the tracked module) reshards every block
        and clears that. Up to torch 2.14 it leaves the gradients the stopped backward had
        accumulated on the unsharded parameters (not yet reduced): dropped here too
        (:func:`_drop_unsharded_grads`), or the redone step's backward would add its own to them."""
        from torch.distributed.fsdp import FSDPModule

        self._sharded_dirty = False
        for module in self._sharded:
            if not isinstance(module, FSDPModule):
                continue
            module.reset_iter_state()
            for fsdp_param in _fsdp_params(module):
                _drop_unsharded_grads(fsdp_param)
            self._sharded_reset_since = True
            self.counts.sharded_resets += 1


def _backward_leaves(args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[torch.Tensor]:
    """The leaf tensors (``requires_grad``, no ``grad_fn``) that a call of
    ``torch.autograd.backward(*args, **kwargs)`` accumulates into: its ``inputs`` when given,
    else every leaf its roots' graph reaches (a walk of the autograd graph's nodes; only in a
    doomed step)."""
    inputs = kwargs.get("inputs", args[5] if len(args) > 5 else None)
    if inputs is not None:
        chosen = [inputs] if isinstance(inputs, torch.Tensor) else list(inputs)
        return [t for t in chosen if isinstance(t, torch.Tensor) and t.requires_grad and t.grad_fn is None]
    roots = kwargs.get("tensors", args[0] if args else None)
    roots = [roots] if isinstance(roots, torch.Tensor) else list(roots or ())
    leaves: dict[int, torch.Tensor] = {}
    stack = []
    for root in roots:
        if not isinstance(root, torch.Tensor) or not root.requires_grad:
            continue
        if root.grad_fn is None:
            leaves[id(root)] = root
        else:
            stack.append(root.grad_fn)
    seen: set[int] = set()
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        variable = getattr(node, "variable", None)  # AccumulateGrad: the leaf it accumulates into
        if isinstance(variable, torch.Tensor):
            leaves[id(variable)] = variable
        stack.extend(next_node for next_node, _ in node.next_functions)
    return list(leaves.values())


class FsdpLayoutError(RuntimeError):
    """This torch's FSDP2 keeps its per-parameter state in a layout tmrun does not know: tmrun
    could not drop the gradients a stopped backward leaves (raised by ``tm.track``, before the
    first step, rather than leaving them silently)."""


def _layout_error(what: str) -> FsdpLayoutError:
    return FsdpLayoutError(
        f"tmrun cannot stop a doomed step of an FSDP2 module with torch {torch.__version__}: its FSDP2 "
        f"{what} (tmrun knows the layouts of torch 2.13 to 2.15). Use one of those torch versions, "
        "or leave the FSDP2 module out of tm.track")


def _fsdp_params(module: torch.nn.Module) -> list[Any]:
    """FSDP2's record of every parameter under the FSDP2 module ``module`` (``FSDPParam``). No
    public API lists them: torch 2.13 to 2.15 keep them in each block's state
    (``_get_fsdp_state()._fsdp_param_groups[i].fsdp_params``); another layout raises
    :class:`FsdpLayoutError`."""
    from torch.distributed.fsdp import FSDPModule

    found: list[Any] = []
    for sub in module.modules():
        if not isinstance(sub, FSDPModule):
            continue
        groups = getattr(sub._get_fsdp_state(), "_fsdp_param_groups", None)
        if not isinstance(groups, list) or not all(isinstance(getattr(g, "fsdp_params", None), list) for g in groups):
            raise _layout_error("state has no _fsdp_param_groups[i].fsdp_params")
        found += [fsdp_param for group in groups for fsdp_param in group.fsdp_params]
    return found


def _own_grad_buffer(fsdp_param: Any) -> bool:
    """Whether FSDP2 keeps a stopped backward's gradient in a buffer of its own besides the
    unsharded parameter's ``grad``: torch 2.13 and 2.14 do (``unsharded_accumulated_grad``, an
    attribute: the gradient upcast to the reduce dtype), torch 2.15 does not (a read-only
    property that reads the parameter's ``grad``). Another layout raises :class:`FsdpLayoutError`."""
    if "unsharded_accumulated_grad" in getattr(fsdp_param, "__dict__", {}):
        return True
    if isinstance(inspect.getattr_static(type(fsdp_param), "unsharded_accumulated_grad", None), property):
        return False
    raise _layout_error("parameters have no unsharded_accumulated_grad (attribute or property)")


def check_fsdp_layout(module: torch.nn.Module) -> None:
    """Raise :class:`FsdpLayoutError` unless this torch's FSDP2 keeps the state of ``module``'s
    parameters in a layout :func:`_drop_unsharded_grads` knows (nothing to check for a module
    that is not FSDP2's)."""
    from torch.distributed.fsdp import FSDPModule

    if isinstance(module, FSDPModule):
        for fsdp_param in _fsdp_params(module):
            _own_grad_buffer(fsdp_param)


def _drop_unsharded_grads(fsdp_param: Any) -> None:
    """Drop what a stopped backward accumulated for one FSDP2 parameter and never reduced: the
    unsharded parameter's ``grad`` (the parameter is made at the first all-gather) and, where
    torch keeps one (:func:`_own_grad_buffer`), the upcast copy."""
    if _own_grad_buffer(fsdp_param):
        fsdp_param.unsharded_accumulated_grad = None
    unsharded = getattr(fsdp_param, "_unsharded_param", None)
    if unsharded is not None:
        unsharded.grad = None


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
