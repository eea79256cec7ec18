"""torchtitan on the tmrun worker API, through torchtitan's own ``--module`` extension point.

A torchtitan user enables in-place replacement without editing torchtitan::

    tmrun --standalone --nproc-per-node 2 --standby 1 -m torchtitan.train \\
        --module tmrun.integrations.torchtitan --config llama3_debugmodel --debug.seed 42 ...

``--config NAME`` is any config function of torchtitan's model registries
(``torchtitan.models.<model>.config_registry``, e.g. ``llama3_debugmodel``); this module returns
it as a :class:`TmrunTrainer` config. A config module of one's own converts its config with
:func:`tmrun_config` (or subclasses :class:`TmrunTrainer`). Needs ``pip install tmrun[torchtitan]``
(torchtitan 0.3.0). Under plain torchrun the same trainer trains as torchtitan's own does.

What :class:`TmrunTrainer` changes in torchtitan's ``Trainer``:

* ``tmrun.init()`` runs first, in ``init_distributed``, before the trainer builds anything (a
  standby of such a job, which builds a device mesh, waits there until it is given a rank). The
  default group is then tmrun's; torchtitan's own initialisation sees it and keeps it.
* Tracked for a joiner (``tm.track``): every model part, every optimizer of the
  ``OptimizersContainer`` (``container.optimizers[i]``: the container's own ``.state`` is empty;
  each is guarded, so an aborted step's optimizer step is skipped), the LR schedulers. Per rank
  (``tm.track_per_rank``): the data loader (its state is keyed by data-parallel rank) and the
  trainer's counters (``step``, ``ntokens_seen``). A redone step, or a joiner, restarts the
  batch iterator from the loader's restored position.
* The loop is ``tm.steps(training.steps, start=<the step torchtitan resumed at>)``: torchtitan's
  1-based ``self.step`` is the yielded index + 1. A standby or joiner does not load torchtitan's
  checkpoint (it is healed from the ranks).
* Checkpoint saving, validation and metrics logging are skipped in a step whose collectives
  lost a peer (``tm.void``: aborted, or committed before the loss) and in a standby's shadow
  steps (``tm.is_shadow``). An aborted step is redone, its checkpoint and validation with it; a
  committed one whose checkpoint or validation was void (``tm.voided_step``: a rank lost after
  its update) has them redone by every rank before the next step trains (or after the loop,
  for the last step), the state as that step left it; a rank that had already logged that
  validation does not log it again. The validation runs on a fork of the random generators
  (its data loader's iterator draws a seed), so the training's random stream, which a joiner
  continues, is the one the step's commit recorded.
* A joiner does not initialise its parameters (zeros; it is healed from the replicas): torchtitan's
  initialisation of sharded parameters runs collectives the survivors never join.
* ``lm_head``'s FSDP2 unit reshards after forward from the first step on (torchtitan's chunked
  loss switches it so after its first call): a joiner's first step issues the collectives of
  the survivors' later steps.
* ``--debug.seed`` is required in an in-place job: without it torchtitan broadcasts a seed from
  rank 0 while the model is built, a collective a joiner cannot take part in.
* torchtitan's barrier that shortens the groups' timeouts after a process's first step is not
  run: a joiner's first step is not the survivors' first step, so it would be a collective only
  the joiner calls. tmrun's own link timeout (``TMRUN_COMM_TIMEOUT``) applies.

* Pipeline parallelism: torchtitan's schedule is tracked (its stages are the rank's shard, and
  a joiner's pipelines run torch's start-up again with it); tested with 1F1B and Interleaved
  1F1B over ``pipeline_parallel_degree`` 2 x ``data_parallel_replicate_degree`` 2 (and, by
  hand, with ``data_parallel_shard_degree`` 2 too).

* ``--compile.enable`` (tested with HSDP and TP x DP): tmrun's checks are empty inside compiled
  blocks, and a joiner compiles again for its rank (dynamo folds the rank into its graphs:
  :mod:`tmrun.worker.compiled_code`). Also tested: the zero-bubble schedule ZBV and DeepSeek-V3's
  mixture of experts with experts parallel (both under ``--variants``).

* ``--checkpoint.async_mode async``: torchtitan's gloo group for its background saves is a tmrun
  group here (:mod:`tmrun.worker.gloo_groups`), so a failure is replaced in place. A background
  save that a change cuts off is not finished (DCP writes no ``.metadata``: torchtitan never
  loads it) and is said in one line; at the first step after a recovery every rank agrees
  whether a save was cut and, if so, saves that step at once, out of torchtitan's interval
  (:meth:`TmrunTrainer._save_again_after_a_cut`). Its values are never made up: the save's
  collectives fail rather than being served locally.

Not covered: CUDA graphs, context parallelism (torchtitan requires FlexAttention for it, which
the CPU tests replace), ``--checkpoint.async_mode async_with_pinned_mem`` (a saving process of
DCP's own, with pinned staging: it needs an accelerator, "Non-blocking copy requires that the
current accelerator is available" on the CPU under torchrun too; not run).
"""

from __future__ import annotations

import dataclasses
import importlib
from typing import Any, Callable

import torch
from torch.distributed.elastic.multiprocessing.errors import record
from torchtitan.components.dataloader import DataloaderExhaustedError
from torchtitan.distributed import ParallelDims
from torchtitan.observability import structured_logger as sl
from torchtitan.tools.logging import logger
from torchtitan.trainer import Trainer

import tmrun

__all__ = ["TmrunTrainer", "tmrun_config"]


class _LoaderPosition:
    """A data loader's position as tmrun tracks it per rank: restoring it (a redone step, a
    joiner's heal) marks the batch iterator stale, so the loop starts a new one from there."""

    def __init__(self, loader: Any) -> None:
        self.loader = loader
        self.restored = True  # no iterator yet

    def state_dict(self) -> dict[str, Any]:
        return self.loader.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.loader.load_state_dict(state)
        self.restored = True


class _Counters:
    """The trainer's own counters (``step``, ``ntokens_seen``), tracked per rank."""

    def __init__(self, trainer: Trainer) -> None:
        self.trainer = trainer

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.trainer.step, "ntokens_seen": self.trainer.ntokens_seen}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.trainer.step, self.trainer.ntokens_seen = state["step"], state["ntokens_seen"]


class TmrunTrainer(Trainer):
    """torchtitan's ``Trainer`` driven by tmrun's worker API (see the module docstring)."""

    @dataclasses.dataclass(kw_only=True, slots=True)
    class Config(Trainer.Config):
        pass

    tm: Any  # tmrun's runtime (tmrun.init())
    _tail_done: int = 0  # the last step whose checkpoint and validation this process ran, not void
    _muted: bool = False  # metrics logging off (a redone validation this process had logged)
    _saved_step: int = 0  # the step of the last checkpoint save this process began
    _background_saves: bool = False  # torchtitan saves in the background (--checkpoint.async_mode async)
    _change_seen: int = -1  # the generation of the last recovery whose cut saves this process settled
    _cut_seen: bool = False  # this process's pending background save was cut off by a change

    @record
    def __init__(self, config: Config) -> None:
        super().__init__(config)
        self._settle_lm_head_resharding()

    def _settle_lm_head_resharding(self) -> None:
        """torchtitan shards ``[norm, lm_head]`` as one FSDP2 unit that does not reshard after
        forward, and its ``ChunkedLossWrapper`` sets ``lm_head`` to reshard after forward at the
        end of its first call, for good: from the second step on each forward all-gathers that
        unit once more. A joiner's first step would then issue one all-gather less than the
        survivors' (the job stops on "ranks called different collectives"). Every rank sets it
        now, as the loss leaves it: all steps then run the same collectives (one all-gather more
        in the first step; the numbers do not change)."""
        from torch.distributed.fsdp import FSDPModule
        from torchtitan.components.loss import ChunkedLossWrapper

        lm_head = getattr(self.loss_fn, "lm_head", None)
        if isinstance(self.loss_fn, ChunkedLossWrapper) and isinstance(lm_head, FSDPModule):
            lm_head.set_reshard_after_forward(True)

    def init_distributed(self) -> ParallelDims:
        self.tm = tmrun.init()  # a standby of a job with a device mesh waits here for its rank
        if self.tm.in_place and self.config.debug.seed is None:
            raise ValueError("tmrun with --standby needs --debug.seed: without it torchtitan broadcasts a seed "
                             "from rank 0 while it builds the model, a collective a joiner cannot take part in")
        # torchtitan's init_distributed skips its setup when a group exists; keep what it does besides
        torch.autograd.set_multithreading_enabled(False)
        parallel_dims = super().init_distributed()
        if self._is_healed():
            self._skip_parameter_init()
        return parallel_dims

    def _skip_parameter_init(self) -> None:
        """A joiner's parameters come from the replicas, and initialising them can run collectives
        (``trunc_normal_`` on a sharded DTensor gathers it), which the survivors, busy recovering,
        never join: the joiner's model parts get zeros instead (buffers are initialised as usual,
        locally; both are then healed)."""
        spec = self.config.model_spec
        assert spec is not None
        parallelize = spec.parallelize_fn

        def parallelize_without_init(model: torch.nn.Module, *args: Any, **kwargs: Any) -> torch.nn.Module:
            model = parallelize(model, *args, **kwargs)
            _zero_parameters_at_init(model)
            return model

        spec.parallelize_fn = parallelize_without_init
        logger.info(f"tmrun: joining as rank {self.tm.rank}: parameters are not initialised, the replicas heal them")

    # -- what steps and logging skip ----------------------------------------------------------

    @property
    def _quiet(self) -> bool:
        """True where a step's side effects must not happen: a step whose collectives lost a peer
        (its values are void; redone if aborted) or a standby's shadow step."""
        return bool(self.tm.void or self.tm.is_shadow)

    def _validate(self, step: int) -> None:
        """torchtitan's validation, on a fork of the random generators: its draws (the iterator
        of its data loader draws a seed) leave the training's stream as the step's commit left it,
        so the random state a rank records at its commit is still its next step's, and a rank lost
        during a validation is healed in place, the validation redone (``tm.voided_step``). (Drawn
        from the training's stream, the lost rank's next random state was unknown: the job fell
        back to its group restart.) The training's numbers are torchtitan's: nothing it computes
        draws from the global generator after a validation."""
        devices = [torch.cuda.current_device()] if torch.cuda.is_available() and torch.cuda.is_initialized() else []
        with torch.random.fork_rng(devices=devices):
            self.validator.validate(self.model_parts, step)

    def _redo_void_tail(self, step: int) -> None:
        """``step`` (torchtitan's 1-based number) committed, but its checkpoint or validation was
        void on some rank (``tm.voided_step``): every rank runs them again now (collectives), the
        model, optimizers and loader as that step left them."""
        logger.info(f"tmrun: step {step}'s checkpoint and validation were void (a rank was lost after its update); "
                    "running them again")
        current, self.step = self.step, step
        self._muted = self._tail_done == step  # this process logged them already
        try:
            self._step_tail(step)
        finally:
            self.step, self._muted = current, False

    def _step_tail(self, step: int) -> None:
        """What follows ``step``'s update: torchtitan's checkpoint and validation (collectives),
        neither in a quiet step; the step's tail is done here once neither was void."""
        config = self.config
        if self._quiet:
            return
        # a rank lost during the save (its plans gathered and broadcast) fails DCP on every
        # survivor: void, the save is done again through tm.voided_step
        with self.tm.tolerate_void(f"step {step}'s checkpoint save"):
            again = self._save_again_after_a_cut(step)
            if self._save(step, last_step=(step == config.training.steps), out_of_interval=again):
                self._saved_step, self._cut_seen = step, False  # a cut save seen before it: this one takes its place
        if not self._quiet and config.validator.enable and self.validator.should_validate(step):
            with self.tm.tolerate_void(f"step {step}'s validation"):
                self._validate(step)
        if not self._quiet:
            self._tail_done = step

    def _save(self, step: int, last_step: bool, out_of_interval: bool) -> bool:
        """torchtitan's save of ``step`` (at its interval, or the last step's), or
        ``out_of_interval``: this step's state now, whatever the interval."""
        checkpointer = self.checkpointer
        if not out_of_interval:
            return bool(checkpointer.save(step, last_step=last_step))
        interval, checkpointer.interval = checkpointer.interval, 1  # torchtitan saves the steps the interval divides
        try:
            return bool(checkpointer.save(step, last_step=last_step))
        finally:
            checkpointer.interval = interval

    def _save_again_after_a_cut(self, step: int) -> bool:
        """At the first step's tail after a recovery, with background saves: whether a save the
        change cut off is to be taken again now, as ``step``'s (out of torchtitan's interval: the
        state the cut save held is gone; waiting for the next interval would leave the job's
        newest checkpoint an interval older than the user asked for). Every rank must save alike
        (DCP's collectives), the joiner too (it has no save of its own in flight), so they agree
        in one all-reduce (MAX) of whether their own save was cut. Once per recovery, at the tail
        of the step every member of that recovery resumed (no planned migration comes between);
        never waits: a save still writing then is settled by torchtitan's own wait, at its
        interval, as before (said in one line if it was cut)."""
        recoveries = self.tm.recoveries if self._background_saves else []
        if not recoveries or recoveries[-1]["gen"] == self._change_seen:
            return False
        future = getattr(self.checkpointer, "save_future", None)
        if future is not None and future.done():
            self.checkpointer.maybe_wait_for_saving()  # returns at once: the guard notes and says a cut
        agreed = torch.tensor([1 if self._cut_seen else 0], dtype=torch.int64)
        torch.distributed.all_reduce(agreed, op=torch.distributed.ReduceOp.MAX)
        if self.tm.void:  # a peer lost in the all-reduce: its value is void, asked again at the redo
            return False
        self._change_seen, self._cut_seen = recoveries[-1]["gen"], False
        if agreed.item():
            logger.warning(f"tmrun: saving step {step}'s checkpoint now, out of the interval: a change of the job's "
                           "members cut off an earlier asynchronous save")
        return bool(agreed.item())

    def _guard_background_saves(self) -> None:
        """torchtitan waits for its last asynchronous save before the next one (and the last
        step's): a save a change cut off (``BackgroundInterrupted`` in its future:
        ``tm.cut_by_a_change``) is said in one line there, not raised: it is not finished (no
        ``.metadata``, so never loaded), the saves after it are whole. Any other failure of a save
        is raised."""
        checkpointer = self.checkpointer
        if not getattr(checkpointer, "enable", False) or getattr(checkpointer, "pg", None) is None:
            return
        wait = checkpointer.maybe_wait_for_saving

        def wait_or_say() -> None:
            try:
                wait()
            except Exception as error:  # noqa: BLE001 (one kind is said; the others raised)
                if not self.tm.cut_by_a_change(error):
                    raise
                checkpointer.save_future = None
                self._cut_seen = True
                logger.warning(f"tmrun: the asynchronous checkpoint save of step {self._saved_step} was cut off by a "
                               "change of the job's members (a rank lost and replaced): not finished, its folder has "
                               "no .metadata and is never loaded; a later step's checkpoint takes its place")

        checkpointer.maybe_wait_for_saving = wait_or_say  # type: ignore[method-assign]
        self._background_saves = True

    def _is_healed(self) -> bool:
        """A standby (sandbox) or a promoted standby that still has to be healed."""
        return bool(self.tm.is_standby or getattr(self.tm.role, "value", None) == "joining")

    def _guard_metrics(self) -> None:
        """Every logging method of the metrics processor (``log``, and ``log_validation``, which
        the validator calls: left unguarded, a validation whose collectives lost a peer logged a
        made-up loss) does nothing in a quiet step."""
        processor = self.metrics_processor
        for name in [n for n in dir(processor) if n == "log" or n.startswith("log_")]:
            method = getattr(processor, name)
            if callable(method):
                setattr(processor, name, self._quieted(method))

    def _quieted(self, method: Callable[..., Any]) -> Callable[..., Any]:
        def guarded(*args: Any, **kwargs: Any) -> Any:
            if self._quiet or self._muted:
                return None
            return method(*args, **kwargs)

        return guarded

    def train_step(self, data_iterator: Any) -> None:
        try:
            super().train_step(data_iterator)
        except RuntimeError as error:  # a void step's loss all-reduce is void, its check too
            if not (self.tm.void and "Loss is not finite" in str(error)):
                raise

    # -- tracking and the loop ------------------------------------------------------------------

    def _track(self) -> _LoaderPosition:
        tm = self.tm
        if self.parallel_dims.pp_enabled:
            # its stages are this rank's shard (their parameters may be plain tensors), and the
            # schedule runs torch's pipeline start-up again with a joiner (docs/user-guide.md)
            tm.track(pp_schedule=self.pp_schedule)
        tm.track(**{f"model_part_{i}": part for i, part in enumerate(self.model_parts)})
        tm.track(**{f"optimizer_{i}": opt for i, opt in enumerate(self.optimizers.optimizers)})
        tm.track(lr_schedulers=self.lr_schedulers)
        position = _LoaderPosition(self.dataloader)
        tm.track_per_rank(dataloader=position, train_state=_Counters(self))
        return position

    @record
    def train(self) -> None:
        tm, config = self.tm, self.config
        sl.log_trace_instant("training_start")
        if not self._is_healed():
            self.checkpointer.load(step=config.checkpoint.load_step)
        loaded_step = self.step  # 0, or the step torchtitan's checkpoint resumed at
        position = self._track()
        self._guard_metrics()
        self._guard_background_saves()
        logger.info(f"Training starts at step {self.step + 1} (tmrun: in place {tm.in_place})")

        with config.profiler.build(global_step=self.step, base_folder=config.dump_folder) as profiler:
            data_iterator = None
            for index in tm.steps(config.training.steps, start=loaded_step):
                if tm.voided_step is not None:  # the last step's checkpoint or validation was void
                    self._redo_void_tail(tm.voided_step + 1)
                if data_iterator is None or position.restored:
                    data_iterator = self.batch_generator(self.dataloader)
                    position.restored = False
                self.step = index + 1
                sl.set_step(self.step, relative_step=self.step - loaded_step)
                with sl.log_trace_span("step"):
                    self.gc_handler.run(self.step)
                    try:
                        self.train_step(data_iterator)
                    except DataloaderExhaustedError:
                        logger.warning("Ran out of data; last step was canceled.")
                        break
                    self._step_tail(self.step)
                    profiler.step()
            if tm.voided_step is not None and not tm.is_standby:  # the last step's
                self._redo_void_tail(tm.voided_step + 1)
        logger.info("Training completed")


def _zero_parameters_at_init(model: torch.nn.Module) -> None:
    """Make ``model``'s torchtitan modules initialise their buffers only; parameters become zeros
    (local shards, no collective)."""
    from torchtitan.protocols.module import Module

    def zeros(module: torch.nn.Module) -> Callable[[], None]:
        def init() -> None:
            with torch.no_grad():
                for param in module.parameters(recurse=False):
                    (param.to_local() if hasattr(param, "to_local") else param).zero_()
        return init

    for module in model.modules():
        if isinstance(module, Module):
            module._init_self_parameters = zeros(module)  # type: ignore[method-assign]


def tmrun_config(config: Trainer.Config, trainer: type[TmrunTrainer] = TmrunTrainer) -> TmrunTrainer.Config:
    """``config`` (a torchtitan ``Trainer.Config``) as the config of ``trainer``, field by field."""
    values = {f.name: getattr(config, f.name) for f in dataclasses.fields(config) if f.init}
    return trainer.Config(**values)


def _registry_function(name: str) -> Callable[[], TmrunTrainer.Config]:
    """The config function ``name`` of torchtitan's model registries, converted."""
    from torchtitan.models import _supported_models

    # the model whose name starts the config's first (llama3_debugmodel: llama3), then the others
    for model in sorted(_supported_models, key=lambda m: (not name.startswith(m), m)):
        try:
            registry = importlib.import_module(f"torchtitan.models.{model}.config_registry")
        except ImportError:
            continue
        function = getattr(registry, name, None)
        if callable(function):
            return lambda: tmrun_config(function())
    raise AttributeError(name)


def __getattr__(name: str) -> Any:
    """``--config NAME``: torchtitan's ``ConfigManager`` looks the config function up here."""
    if name.startswith("_") or not name[:1].islower():
        raise AttributeError(name)
    return _registry_function(name)

