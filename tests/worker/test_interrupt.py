"""The step interrupter (tmrun.worker.interrupt): a doomed step's forward and backward stop at
the next layer, tmrun catches the stop, the script sees an ordinary step."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch

from tmrun.worker.interrupt import StepInterrupted, StepInterrupter, remove_backward_guard

LAYERS = 6


class Reducer:
    def __init__(self) -> None:
        self.resets = 0

    def _reset_state(self) -> None:
        self.resets += 1


class Wrapped(torch.nn.Module):
    """What the interrupter needs of a DDP model: ``module``, ``reducer``, a forward."""

    def __init__(self, module: torch.nn.Module) -> None:
        super().__init__()
        self.module = module
        self.reducer = Reducer()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.module(x)


class Job:
    """A model of LAYERS linear layers, a doom flag, and what ran."""

    def __init__(self) -> None:
        torch.manual_seed(0)
        self.layers = [torch.nn.Linear(4, 4) for _ in range(LAYERS)]
        self.model = Wrapped(torch.nn.Sequential(*self.layers))
        self.doomed = False
        self.forwards = 0
        self.grads = 0
        self.doom_at_forward = -1
        self.doom_at_grad = -1
        for layer in self.layers:
            layer.register_forward_hook(self._forward_ran)
            layer.weight.register_post_accumulate_grad_hook(self._grad_ran)
        self.interrupter = StepInterrupter(doomed=lambda: self.doomed)
        self.interrupter.install(self.model)  # type: ignore[arg-type]

    def _forward_ran(self, *_: Any) -> None:
        self.forwards += 1
        if self.forwards == self.doom_at_forward:
            self.doomed = True

    def _grad_ran(self, _: Any) -> None:
        self.grads += 1
        if self.grads == self.doom_at_grad:
            self.doomed = True

    def step(self) -> torch.Tensor:
        self.forwards = self.grads = 0
        out = self.model(torch.ones(2, 4))
        out.sum().backward()  # never raises: tmrun catches the stop
        return out


@pytest.fixture
def job() -> Iterator[Job]:
    made = Job()
    made.step()  # the first forward gives the placeholder its shape
    yield made
    remove_backward_guard()


def test_a_forward_doomed_midway_stops_at_the_next_layer(job: Job) -> None:
    job.doom_at_forward = 2
    out = job.step()
    assert job.forwards == 2  # layers 3.. never ran
    assert job.interrupter.counts.forwards_stopped == 1
    assert torch.equal(out, torch.zeros(2, 4))  # the placeholder: zeros shaped like the output
    assert job.interrupter.counts.backwards_skipped == 1 and job.grads == 0


def test_a_backward_doomed_midway_stops_and_returns(job: Job) -> None:
    for layer in job.layers:
        layer.weight.grad = None
        layer.bias.grad = None
    job.doom_at_grad = 2
    job.step()
    assert job.forwards == LAYERS
    assert job.grads == 2  # backward did not reach the first layers
    assert job.interrupter.counts.backwards_stopped == 1
    # backward stopped before the first layers: their gradients are missing (nothing filled:
    # some parameters have gradients)
    assert job.layers[0].weight.grad is None and job.layers[-1].weight.grad is not None


def test_a_backward_that_produced_no_gradient_leaves_one_zero_gradient(job: Job) -> None:
    for param in job.model.module.parameters():
        param.grad = None
    job.doomed = True  # doomed at its entry: backward does not run
    job.step()
    grads = [p.grad for p in job.model.module.parameters() if p.grad is not None]
    assert len(grads) == 1 and grads[0].numel() == 4 and not grads[0].any()  # one bias, zeros


def test_a_step_doomed_before_it_starts_runs_nothing(job: Job) -> None:
    job.doomed = True
    out = job.step()
    assert (job.forwards, job.grads) == (0, 0)
    assert torch.equal(out, torch.zeros(2, 4))
    assert job.interrupter.counts.forwards_skipped == 1 and job.interrupter.counts.backwards_skipped == 1


def test_the_stop_is_never_raised_outside_tmrun_wrappers(job: Job) -> None:
    job.doomed = True
    job.forwards = 0
    job.model.module(torch.ones(2, 4))  # the inner module, called by the script directly
    assert job.forwards == LAYERS
    with pytest.raises(StepInterrupted):  # inside the wrappers it is, and they catch it
        job.interrupter._armed += 1
        try:
            job.interrupter.checkpoint()
        finally:
            job.interrupter._armed -= 1


def test_a_healthy_step_is_untouched_and_reducers_reset(job: Job) -> None:
    reference = Job()  # same seed, no interrupter involvement beyond install
    out = job.step()
    expected = reference.step()
    assert torch.equal(out, expected) and job.forwards == LAYERS and job.grads == LAYERS
    assert job.interrupter.counts.as_dict() == dict.fromkeys(job.interrupter.counts.as_dict(), 0)
    job.interrupter.reset_models()
    assert job.model.reducer.resets == 1


def test_the_first_forward_runs_whole_even_when_doomed() -> None:
    made = Job()
    made.doomed = True
    try:
        made.forwards = 0
        made.model(torch.ones(2, 4))  # no placeholder shape yet
        assert made.forwards == LAYERS
    finally:
        remove_backward_guard()


def test_reducers_need_a_reset_only_after_a_stopped_backward_or_before_buckets_were_rebuilt(job: Job) -> None:
    interrupter = job.interrupter
    assert interrupter.reducers_need_reset()  # DDP has not rebuilt its buckets yet (a model just made)
    job.model._has_rebuilt_buckets = True  # what DDP sets once it rebuilt them (its second forward)
    assert not interrupter.reducers_need_reset()

    job.doom_at_forward = 3  # a forward stopped: the reducer never expected a backward
    job.step()
    assert interrupter.counts.forwards_stopped == 1 and not interrupter.reducers_need_reset()
    job.doomed, job.doom_at_forward = False, -1

    job.doom_at_grad = 2  # a backward stopped: the reducer still waits for it to finish
    job.step()
    assert interrupter.counts.backwards_stopped == 1 and interrupter.reducers_need_reset()
    job.doomed, job.doom_at_grad = False, -1
    interrupter.reset_models()
    assert job.model.reducer.resets == 1 and interrupter.counts.reducer_resets == 1
    assert interrupter.reducers_need_reset()  # reset: its buckets are rebuilt two steps later
    job.step()
    job.model._has_rebuilt_buckets = True
    assert not interrupter.reducers_need_reset()

    job.model.static_graph = True  # DDP counts a static graph's backward calls: always reset
    assert interrupter.reducers_need_reset()


def test_ddp_says_when_it_rebuilt_its_buckets_after_a_reset(tmp_path) -> None:
    """The DDP attribute reducers_need_reset() reads: set at the rebuild DDP does in the second
    forward after it was made, and again after a reset (torch 2.13; a change would fail here)."""
    import torch.distributed as dist

    if dist.is_initialized():
        pytest.skip("a default process group exists in this process")
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        ddp = torch.nn.parallel.DistributedDataParallel(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 1)))
        interrupter = StepInterrupter(doomed=lambda: False)
        interrupter.install(ddp)
        seen = []
        for _ in range(3):
            ddp(torch.ones(2, 8)).sum().backward()
            seen.append(interrupter.reducers_need_reset())
        assert seen == [True, False, False]  # rebuilt in the second forward
        interrupter.reset_models()
        seen = []
        for _ in range(3):
            ddp(torch.ones(2, 8)).sum().backward()
            seen.append(interrupter.reducers_need_reset())
        assert seen == [True, False, False]
    finally:
        remove_backward_guard()
        dist.destroy_process_group()


class ShardedJob:
    """FSDP2 (``fully_shard`` per layer but the last, and on the root) on a world of one, gloo: the state the
    interrupter must leave clean, with the doom set at the k-th layer's forward or at the
    gradient of the k-th layer's output in backward (counted from the last layer)."""

    def __init__(self, mesh: Any) -> None:
        from torch.distributed.fsdp import fully_shard

        torch.manual_seed(0)
        self.layers = [torch.nn.Linear(8, 8) for _ in range(LAYERS)]
        self.model = torch.nn.Sequential(*self.layers)
        for layer in self.layers[:-1]:
            fully_shard(layer, mesh=mesh)
        fully_shard(self.model, mesh=mesh)  # the last layer's parameters are the root's (unsharded after forward)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-2)
        self.doomed = False
        self.forwards = self.grads = 0
        self.doom_at_forward = self.doom_at_grad = -1
        for layer in self.layers:
            layer.register_forward_hook(self._forward_ran)
        self.interrupter = StepInterrupter(doomed=lambda: self.doomed)
        self.interrupter.install_sharded(self.model)

    def _forward_ran(self, _module: Any, _inputs: Any, output: torch.Tensor) -> None:
        self.forwards += 1
        if self.forwards == self.doom_at_forward:
            self.doomed = True
        if output.requires_grad:
            output.register_hook(self._grad_ran)

    def _grad_ran(self, _: torch.Tensor) -> None:
        self.grads += 1
        if self.grads == self.doom_at_grad:
            self.doomed = True

    def step(self, seed: int) -> None:
        """One step of the loop: the optimizer steps only where the step was not doomed."""
        self.forwards = self.grads = 0
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(seed))
        self.model(x).square().mean().backward()  # never raises: tmrun catches the stop
        self.every_grad_there = all(param.grad is not None for param in self.model.parameters())
        if not self.doomed:
            self.opt.step()
        self.opt.zero_grad()
        self.left_after_zero_grad = self.mid_step()

    def mid_step(self) -> bool:
        """FSDP left something of a step behind: a state not idle, or a block not resharded."""
        from torch.distributed.fsdp._fully_shard._fsdp_common import TrainingState
        from torch.distributed.fsdp._fully_shard._fsdp_param import ShardedState

        states = [module._get_fsdp_state() for module in [*self.layers[:-1], self.model]]  # type: ignore[operator]
        groups = [group for state in states for group in state._fsdp_param_groups]
        params = [param for group in groups for param in group.fsdp_params]
        return (any(getattr(param, "_unsharded_param", None) is not None and param._unsharded_param.grad is not None
                    for param in params)  # a gradient accumulated but never reduced
                or any(param.unsharded_accumulated_grad is not None for param in params)
                or any(param.grad is not None for param in self.model.parameters()) or (any(state._training_state != TrainingState.IDLE for state in states)
                or any(group._training_state != TrainingState.IDLE for group in groups)
                or any(param.sharded_state != ShardedState.SHARDED for group in groups for param in group.fsdp_params)
                or any(group._post_forward_indices for group in groups)  # the backward's prefetch order
                or bool(states[-1]._comm_ctx.post_forward_order)
                or states[-1]._state_ctx.iter_forward_root is not None
                or bool(states[-1]._state_ctx.post_backward_final_callback_queued)))

    def parameters(self) -> list[torch.Tensor]:
        return [param.to_local().clone() for param in self.model.parameters()]  # type: ignore[operator]


@pytest.fixture
def fsdp_mesh(tmp_path) -> Iterator[Any]:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    if dist.is_initialized():
        pytest.skip("a default process group exists in this process")
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        remove_backward_guard()
        dist.destroy_process_group()


@pytest.mark.parametrize("point", ["forward", "backward", "after forward"])
def test_an_fsdp2_step_doomed_midway_stops_and_its_redo_is_bitwise_a_clean_step(fsdp_mesh: Any, point: str) -> None:
    """A doomed step of an FSDP2 model stops within a layer (forward) or a layer's gradient
    (backward); "after forward": doomed between a whole forward and its backward, which does not
    run. FSDP is left mid-step each time; reset_sharded() (what heal runs first) leaves it as
    after a clean step, and the redone step gives the same bits as a run without the failure."""
    reference = ShardedJob(fsdp_mesh)
    for seed in range(3):
        reference.step(seed)
    job = ShardedJob(fsdp_mesh)
    job.step(0)
    if point == "forward":
        job.doom_at_forward = 2
    elif point == "backward":
        job.doom_at_grad = 2
    else:
        job.doom_at_forward = LAYERS  # doomed once the last layer's forward ran
    job.step(1)
    counts = job.interrupter.counts
    if point == "forward":
        assert job.forwards == 2 and job.grads == 0 and counts.forwards_stopped == 1 and counts.backwards_skipped == 1
    elif point == "backward":
        assert job.forwards == LAYERS and job.grads == 2 and counts.backwards_stopped == 1
    else:
        assert job.grads == 0 and counts.backwards_skipped == 1
    # reset where the backward stopped or was skipped, before the zero gradient for the scaler:
    # zero_grad() left nothing behind (not a zero gradient on an unsharded root parameter)
    assert not job.left_after_zero_grad
    assert job.every_grad_there  # zeros where none came: a script that reduces every p.grad itself works
    assert not job.interrupter.reducers_need_reset()  # no DDP model: nothing for the group to agree on
    assert job.interrupter.reset_sharded() and counts.sharded_resets == 1  # the change's line says so
    assert not job.mid_step()
    assert not job.interrupter.reset_sharded()  # nothing left to reset: no second reset
    job.doomed, job.doom_at_forward, job.doom_at_grad = False, -1, -1
    job.step(1)  # the redo
    job.step(2)
    assert not job.mid_step()
    for mine, theirs in zip(job.parameters(), reference.parameters()):
        assert torch.equal(mine, theirs)


# -- real training code (issue 29): evaluation forwards and losses with their own backward ---------


def test_an_evaluation_forward_in_a_doomed_step_gives_its_true_result(job: Job) -> None:
    """A forward under no_grad or inference_mode (an evaluation inside the loop) is never
    replaced by the placeholder: it used to return zeros, and a script printed "val loss 0.0000"
    and saved a checkpoint as the best one."""
    x = torch.full((2, 4), 0.5)
    with torch.no_grad():
        expected = job.model.module(x)
    job.doomed = True
    for guard in (torch.no_grad, torch.inference_mode):
        with guard():
            got = job.model(x)
        assert torch.equal(got, expected) and got.abs().sum() > 0
    assert job.interrupter.counts.forwards_skipped == 0 and job.interrupter.counts.forwards_stopped == 0


def _chunked_loss(model: torch.nn.Module, head: torch.nn.Linear, x: torch.Tensor, chunks: int) -> torch.Tensor:
    """torchtitan's chunked cross-entropy's shape: the loss of each chunk runs its own backward
    on a detached hidden state, asserts that state got its gradient, then the body's backward
    runs with it."""
    hidden = model(x)
    detached = hidden.detach().requires_grad_(True)
    total = torch.zeros(())
    for part in detached.chunk(chunks):
        loss = head(part).square().mean()
        loss.backward()
        total += loss.detach()
    assert detached.grad is not None, "the hidden state got no gradient"
    hidden.backward(detached.grad)
    return total


@pytest.mark.parametrize("doom_at", ["before", "first chunk", "body"])
def test_a_chunked_loss_with_its_own_backward_survives_a_doomed_step(job: Job, doom_at: str) -> None:
    """Stopping (or skipping) a doomed backward must not break a loss that reads the gradient of
    a detached tensor: where a stopped backward produced none, every non-parameter leaf it
    would have reached gets zeros (a survivor died of this assertion, and with two ranks the job
    restarted from step 0)."""
    head = torch.nn.Linear(4, 3)
    x = torch.ones(4, 4)
    if doom_at == "before":
        job.doomed = True
    elif doom_at == "first chunk":
        head.weight.register_post_accumulate_grad_hook(lambda _: setattr(job, "doomed", True))
    else:
        job.forwards = job.grads = 0
        job.doom_at_grad = 1
    _chunked_loss(job.model, head, x, chunks=2)  # raises AssertionError without the fix
    counts = job.interrupter.counts
    assert counts.backwards_skipped + counts.backwards_stopped >= 1


def test_a_doomed_backward_with_inputs_gives_those_inputs_a_gradient(job: Job) -> None:
    leaf = torch.ones(2, 4, requires_grad=True)
    out = job.model(leaf)
    job.doomed = True
    torch.autograd.backward(out.sum(), inputs=[leaf])
    assert leaf.grad is not None and not leaf.grad.any()


def test_reentrant_activation_checkpointing_and_retain_graph_survive_a_doomed_step(job: Job) -> None:
    """Reentrant checkpointing runs a nested backward inside backward; retain_graph keeps the
    graph for a second backward: both go on as after any stopped step."""
    from torch.utils.checkpoint import checkpoint

    x = torch.ones(2, 4, requires_grad=True)
    job.doom_at_forward = LAYERS + 3  # during the recomputation inside backward
    out = checkpoint(job.model, x, use_reentrant=True)
    loss = out.sum()
    loss.backward(retain_graph=True)
    loss.backward()  # the second one is skipped in the doomed step
    assert job.interrupter.counts.backwards_skipped >= 1


def test_a_backward_skipped_after_a_whole_ddp_forward_resets_the_reducers(job: Job) -> None:
    """Doomed between a DDP forward that completed (its reducer prepared for the backward) and
    that backward (during the loss: a chunked loss's head): the reducer is left mid-iteration,
    and the redone step's backward crashed inside it (SIGSEGV) unless it is reset. A loss's
    own backward on a detached chunk before it does not count as DDP's backward."""
    model = job.model
    model._has_rebuilt_buckets = True  # type: ignore[attr-defined]  (buckets built: no reset for that)
    model.require_backward_grad_sync = True  # type: ignore[attr-defined]  (not under no_sync)
    head = torch.nn.Linear(4, 2)
    out = model(torch.ones(2, 4))
    hidden = out.detach().requires_grad_(True)
    head(hidden).sum().backward()  # the loss's own backward, not DDP's: the reducer still waits
    assert not job.interrupter.reducers_need_reset()
    job.doomed = True
    out.backward(hidden.grad)  # skipped
    assert job.interrupter.reducers_need_reset()
    job.interrupter.reset_models()
    model._has_rebuilt_buckets = True  # type: ignore[attr-defined]  (as DDP sets it once rebuilt)
    assert not job.interrupter.reducers_need_reset()
    # under no_sync DDP expects no reduction: a skipped backward needs no reset
    job.doomed = False
    model.require_backward_grad_sync = False  # type: ignore[attr-defined]
    out = model(torch.ones(2, 4))
    job.doomed = True
    out.sum().backward()
    assert not job.interrupter.reducers_need_reset()


def test_a_head_outside_the_models_that_an_optimizer_steps_gets_a_zero_gradient() -> None:
    """A loss head outside the DDP model, stepped by the tracked optimizer, whose gradient the
    script all-reduces itself: a skipped backward must leave it a gradient (``None`` broke the
    script's ``all_reduce(p.grad)``); a parameter no optimizer steps (FSDP2's unsharded ones)
    gets none."""
    head, stray = torch.nn.Linear(4, 2), torch.nn.Linear(4, 2)
    interrupter = StepInterrupter(doomed=lambda: True, optimized=lambda: {id(p) for p in head.parameters()})
    from tmrun.worker.interrupt import install_backward_guard

    install_backward_guard(interrupter)
    try:
        x = torch.ones(3, 4)
        (head(x).sum() + stray(x).sum()).backward()  # doomed: skipped
        assert all(p.grad is not None and not p.grad.any() for p in head.parameters())
        assert all(p.grad is None for p in stray.parameters())
    finally:
        remove_backward_guard()


def test_an_fsdp2_layout_tmrun_does_not_know_fails_loudly_when_tracked(fsdp_mesh: Any, monkeypatch: Any) -> None:
    """Without the gradient buffer of any torch tmrun knows (an attribute up to 2.14, a read-only
    property in 2.15), tracking an FSDP2 module raises one clear error before the first step,
    rather than a stopped step leaving gradients behind later. This torch's own layout is known."""
    import inspect

    from torch.distributed.fsdp import fully_shard
    from torch.distributed.fsdp._fully_shard._fsdp_param import FSDPParam

    from tmrun.worker.interrupt import FsdpLayoutError, _fsdp_params

    model = torch.nn.Sequential(torch.nn.Linear(8, 8))
    fully_shard(model, mesh=fsdp_mesh)
    StepInterrupter(doomed=lambda: False).install_sharded(model)  # this torch: a known layout
    if isinstance(inspect.getattr_static(FSDPParam, "unsharded_accumulated_grad", None), property):
        monkeypatch.delattr(FSDPParam, "unsharded_accumulated_grad")
    for fsdp_param in _fsdp_params(model):
        vars(fsdp_param).pop("unsharded_accumulated_grad", None)
    with pytest.raises(FsdpLayoutError, match=r"torch 2\.13 to 2\.15"):
        StepInterrupter(doomed=lambda: False).install_sharded(model)


class _Scale(torch.autograd.Function):
    """A custom autograd function with its own backward (as losses and kernels define them)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x * 3

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad * 3


@pytest.mark.parametrize("doomed_before", [True, False])
def test_a_custom_autograd_function_survives_a_doomed_step(job: Job, doomed_before: bool) -> None:
    """A custom Function between the model and the loss: the stopped (or skipped) backward
    returns, the input leaf of the Function gets its zero gradient, the next clean step is whole."""
    x = torch.ones(2, 4, requires_grad=True)
    job.forwards = job.grads = 0
    if doomed_before:
        job.doomed = True
    else:
        job.doom_at_grad = 2
    _Scale.apply(job.model(x)).sum().backward()  # returns
    # doomed in backward: the leaf the graph reaches gets zeros (doomed before the forward, the
    # model's forward was skipped: its placeholder is not connected to x)
    assert doomed_before or x.grad is not None
    job.doomed, job.doom_at_grad = False, -1
    for param in job.model.module.parameters():
        param.grad = None
    _Scale.apply(job.model(x)).sum().backward()
    assert all(p.grad is not None for p in job.model.module.parameters())


@pytest.mark.e2e  # compiles with inductor: tens of seconds on 2 cores
def test_a_compiled_module_survives_a_doomed_step(job: Job) -> None:
    """The script compiled its module (``torch.compile``, inductor on the CPU): a doomed step's
    forward and backward are skipped at their entry, an evaluation forward in it gives its true
    value, and the next clean step computes every gradient."""
    job.model.module = torch.compile(job.model.module)
    x = torch.full((2, 4), 0.5)
    job.model(x).sum().backward()  # compiles
    with torch.no_grad():
        expected = job.model.module(x)
    job.doomed = True
    out = job.model(x)
    out.sum().backward()
    assert job.interrupter.counts.forwards_skipped >= 1 and job.interrupter.counts.backwards_skipped >= 1
    with torch.no_grad():
        assert torch.equal(job.model(x), expected)
    job.doomed = False
    for param in job.model.module.parameters():
        param.grad = None
    job.model(x).sum().backward()
    assert all(p.grad is not None for p in job.model.module.parameters())


@pytest.mark.e2e  # compiles with inductor: tens of seconds on 2 cores
def test_a_compiled_module_whose_step_is_doomed_inside_its_backward_survives(job: Job) -> None:
    """The script compiled its module and the step is doomed while the compiled backward hands
    out its gradients (a peer lost then: the second parameter's gradient hook dooms it). The
    backward stops at the next parameter's hook and returns (no exception reaches the script;
    the optimizer guard skips the doomed step's update), and the next clean step, the compiled
    graph reused, computes every gradient to the value of a step that was never doomed."""
    job.model.module = torch.compile(job.model.module)
    x = torch.full((2, 4), 0.5)
    for param in job.model.module.parameters():
        param.grad = None
    job.model(x).sum().backward()  # compiles
    clean = [p.grad.clone() for p in job.model.module.parameters()]
    for param in job.model.module.parameters():
        param.grad = None
    job.grads, job.doom_at_grad = 0, 2
    job.model(x).sum().backward()  # returns
    assert job.doomed and job.grads == 2  # no parameter after the second got its gradient hook run
    assert job.interrupter.counts.backwards_stopped == 1
    job.doomed, job.doom_at_grad = False, -1
    for param in job.model.module.parameters():
        param.grad = None
    job.model(x).sum().backward()
    got = [p.grad for p in job.model.module.parameters()]
    assert all(a is not None and torch.equal(a, b) for a, b in zip(got, clean)), (got, clean)


def test_an_evaluation_forward_leaves_the_root_unsharded_and_a_change_reshards_it(fsdp_mesh: Any) -> None:
    """A whole FSDP2 forward under no_grad (an evaluation at a step's end) leaves the root's
    parameters unsharded (plain tensors registered on the module): the state a change reads for
    its transfer then had another layout than a joiner's, and the healing found no replica of
    the lost shard (the group restart). reset_sharded(), which a change runs first, registers
    the sharded parameters again, without a reset of the iteration's state (nothing was doomed);
    the next step gives the same bits as a run without the evaluation."""
    from torch.distributed.tensor import DTensor

    reference = ShardedJob(fsdp_mesh)
    job = ShardedJob(fsdp_mesh)
    for seed in range(2):
        reference.step(seed)
        job.step(seed)
    with torch.no_grad():
        job.model(torch.ones(4, 8))
    root = list(job.layers[-1].parameters())
    assert not any(isinstance(param, DTensor) for param in root), "the evaluation left the root sharded already"
    assert job.interrupter.reset_sharded() is False  # resharded, not reset
    assert all(isinstance(param, DTensor) for param in job.layers[-1].parameters())
    reference.step(2)
    job.step(2)
    assert all(torch.equal(a, b) for a, b in zip(reference.parameters(), job.parameters()))


class _CompiledBlocks:
    """torchtitan's shape: a tracked model whose blocks are each compiled whole
    (``block.compile(fullgraph=True)``; dynamo only here, ``backend="eager"``: no inductor), between
    eager layers, the doom set in the first layer's forward."""

    def __init__(self) -> None:
        torch.manual_seed(0)
        self.first, self.last = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)
        self.blocks = [torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh(), torch.nn.Linear(4, 4))
                       for _ in range(2)]
        self.model = torch.nn.Sequential(self.first, *self.blocks, self.last)
        self.doomed = False
        self.doom_in_first = False
        self.first.register_forward_hook(lambda *_: setattr(self, "doomed", self.doomed or self.doom_in_first))
        self.interrupter = StepInterrupter(doomed=lambda: self.doomed)
        self.interrupter.install_sharded(self.model)
        for block in self.blocks:  # after tmrun's hooks, as torchtitan compiles after the model is built
            block.compile(fullgraph=True, backend="eager")

    def step(self) -> list[torch.Tensor | None]:
        for param in self.model.parameters():
            param.grad = None
        self.model(torch.full((2, 4), 0.5)).sum().backward()  # never raises: tmrun catches the stop
        return [None if p.grad is None else p.grad.clone() for p in self.model.parameters()]


def test_a_forward_doomed_before_blocks_compiled_whole_runs_them_and_stops_after() -> None:
    """torch.compile traces tmrun's checks on a compiled block's submodules into the block. Doomed
    before such a block, the traced check raised inside dynamo: under ``fullgraph=True``
    (torchtitan's per-block compile) the forward failed with ``torch._dynamo.exc.Unsupported:
    Observed exception`` and the survivor died (torchtitan's HSDP with ``--compile.enable``: every
    survivor, then the group restart). Traced, the check is empty: the blocks run whole, the
    forward stops at the next eager layer, and the next clean step's gradients are a never-doomed
    step's, the blocks not compiled again."""
    torch._dynamo.reset()
    job = _CompiledBlocks()
    try:
        clean = job.step()  # compiles each block
        frames = torch._dynamo.utils.counters["stats"]["unique_graphs"]
        job.doom_in_first = True
        job.step()
        assert job.interrupter.counts.forwards_stopped == 1, job.interrupter.counts
        job.doomed = job.doom_in_first = False
        again = job.step()
        assert all(a is not None and b is not None and torch.equal(a, b) for a, b in zip(again, clean))
        assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == frames  # no recompilation
    finally:
        remove_backward_guard()
        torch._dynamo.reset()
