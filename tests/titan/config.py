"""TEST-ONLY ``--module`` for tests/e2e/test_torchtitan.py: torchtitan's llama3 debug model on CPU
(:mod:`tests.titan.cpu_shim`, offline assets from :mod:`tests.titan.assets`), trained by
:class:`tmrun.integrations.torchtitan.TmrunTrainer` with the tests' probes::

    torchrun --standalone --nproc-per-node 2 -m torchtitan.train --module tests.titan.config \\
        --config titan_debug_cpu --parallelism.data_parallel_replicate_degree 2

Environment: ``TITAN_TEST_ASSETS`` (the directory :func:`tests.titan.assets.make_assets`
wrote), ``TITAN_TEST_OUT`` (where the probes write), ``TITAN_TEST_KILL=RANK:STEP`` (that rank
SIGKILLs itself in the forward of the model's middle layer in torchtitan step STEP, 1-based,
once per job: a marker file in TITAN_TEST_OUT keeps its joiner from doing it again;
``RANK:STEP:validate``: in that forward of the step's validation, after its update;
``RANK:STEP:forward=N``: in the step's Nth forward of that layer, a later microbatch of a
gradient accumulation; ``RANK:STEP:save``: as the step's checkpoint save begins, after its
update; ``RANK:STEP:background``: in an asynchronous save of the step's checkpoint, as its
thread writes the rank's files (``--checkpoint.async_mode async``); under ``--compile.enable``
the kill is at the token embedding, before the compiled blocks).

Probes, in TITAN_TEST_OUT: ``steps-{rank}`` (``step pid`` per step started, shadow steps
excepted), ``final-{rank}`` (SHA-256 of the rank's local model shards, buffers, optimizer state
and learning rates, written as the trainer closes after training).

``--config titan_debug_cpu_plain`` trains the same with torchtitan's own ``Trainer`` (no tmrun:
gloo under torchrun, the shim's SUM reductions) and writes ``final-{rank}`` only: the
integration must not change a bit of the result."""

from __future__ import annotations

import dataclasses
import hashlib
import os
import signal
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from tests.titan import cpu_shim

cpu_shim.install()

from torchtitan.models.llama3.config_registry import llama3_debugmodel  # noqa: E402
from torchtitan.trainer import Trainer  # noqa: E402

from tmrun.integrations.torchtitan import TmrunTrainer, tmrun_config  # noqa: E402

STEPS, SEQ_LEN, BATCH = 8, 128, 2


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def _feed(digest: Any, tensor: torch.Tensor) -> None:
    digest.update(_local(tensor).detach().contiguous().cpu().view(-1).view(torch.uint8).numpy().tobytes())


class ProbedTrainer(TmrunTrainer):
    """The integration's trainer with the tests' probes (step log, a self-kill, a final digest)."""

    @dataclasses.dataclass(kw_only=True, slots=True)
    class Config(TmrunTrainer.Config):
        pass

    def _out(self, name: str) -> Path:
        return Path(os.environ["TITAN_TEST_OUT"]) / name.format(rank=self.tm.rank)

    def train_step(self, data_iterator: Any) -> None:
        if not self.tm.is_shadow:
            with open(self._out("steps-{rank}"), "a") as log:
                log.write(f"{self.step} {os.getpid()}\n")
            self._arm_kill()
        super().train_step(data_iterator)

    def _arm_kill(self) -> None:
        rank, step, *where = os.environ.get("TITAN_TEST_KILL", "-1:-1").split(":")
        marker = self._out("killed")
        if self.tm.rank != int(rank) or self.step != int(step) or marker.exists():
            return
        marker.write_text(str(os.getpid()))
        layers = list(self.model_parts[0].layers.values())  # type: ignore[union-attr, operator]
        if where == ["save"]:  # at the start of the step's checkpoint save, after its update
            save = self.checkpointer.save

            def killed_in_save(*args: Any, **kwargs: Any) -> Any:
                if self.step == int(step):
                    marker.write_text(f"{os.getpid()} {self.step}\n")
                    os.kill(os.getpid(), signal.SIGKILL)
                return save(*args, **kwargs)

            self.checkpointer.save = killed_in_save  # type: ignore[method-assign]
            return
        if where == ["background"]:  # in the step's asynchronous save, on DCP's thread, as it writes
            from torch.distributed.checkpoint.filesystem import FileSystemWriter

            write = FileSystemWriter.write_data

            def killed_in_write(writer: Any, *args: Any, **kwargs: Any) -> Any:
                if f"step-{step}" in str(writer.path) and threading.current_thread() is not threading.main_thread():
                    marker.write_text(f"{os.getpid()} {step}\n")
                    os.kill(os.getpid(), signal.SIGKILL)
                return write(writer, *args, **kwargs)

            FileSystemWriter.write_data = killed_in_write  # type: ignore[method-assign]
            return
        in_validation = where == ["validate"]  # in the step's validation, after its update
        validating = [False]
        if in_validation:
            validate = self.validator.validate

            def marked(*args: Any, **kwargs: Any) -> Any:
                validating[0] = True
                return validate(*args, **kwargs)

            self.validator.validate = marked  # type: ignore[method-assign]

        # "forward=N": in the step's Nth forward of that layer outside a backward (the Nth
        # microbatch of a gradient accumulation; activation checkpointing's recomputations in a
        # backward are not counted)
        forwards = [int(where[0].split("=", 1)[1]) if where and where[0].startswith("forward=") else 1]

        def kill(*_: Any) -> None:
            if torch._C._current_graph_task_id() != -1:
                return  # a recomputation inside a backward
            forwards[0] -= 1
            if (validating[0] or not in_validation) and forwards[0] <= 0:
                marker.write_text(f"{os.getpid()} {self.step}\n")
                os.kill(os.getpid(), signal.SIGKILL)

        # the middle layer; under torchtitan's compile (each layer compiled whole, fullgraph) the
        # token embedding before the layers, which stays eager: dynamo would trace the kill
        middle = layers[len(layers) // 2]
        compiled = getattr(middle, "_compiled_call_impl", None) is not None
        target = self.model_parts[0].tok_embeddings if compiled else middle  # type: ignore[union-attr]
        target.register_forward_pre_hook(kill)  # type: ignore[union-attr, operator]

    def close(self) -> None:
        super().close()
        _write_final(self, self._out("final-{rank}"))


class PlainTrainer(Trainer):
    """torchtitan's own trainer (no tmrun: gloo under torchrun), with the final digest only."""

    @dataclasses.dataclass(kw_only=True, slots=True)
    class Config(Trainer.Config):
        pass

    def close(self) -> None:
        super().close()
        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        _write_final(self, Path(os.environ["TITAN_TEST_OUT"]) / f"final-{rank}")


def _write_final(trainer: Trainer, path: Path) -> None:
    """SHA-256 of the trainer's local model shards and buffers, optimizer state and learning
    rates, once it trained every step (read by identity: no state_dict hooks, no collectives)."""
    if getattr(trainer, "step", 0) != trainer.config.training.steps:
        return
    digest = hashlib.sha256()
    each: list[str] = []  # one line per tensor (name, its own digest), beside the final digest: where two runs differ
    for part in trainer.model_parts:
        for name, tensor in sorted([*part.named_parameters(), *part.named_buffers()], key=lambda item: item[0]):
            _feed(digest, tensor)
            one = hashlib.sha256()
            _feed(one, tensor)
            each.append(f"{name} {one.hexdigest()[:16]}")
    for optimizer in trainer.optimizers.optimizers:
        for group in optimizer.param_groups:
            digest.update(repr(group["lr"]).encode())
            for param in group["params"]:
                for key, value in sorted(optimizer.state.get(param, {}).items()):
                    digest.update(key.encode())
                    if isinstance(value, torch.Tensor):
                        _feed(digest, value)
                    else:
                        digest.update(repr(value).encode())
    path.write_text(digest.hexdigest() + "\n")
    path.with_name(path.name + ".tensors").write_text("\n".join(each) + "\n")


def _small_cpu_config(base: Callable[[], Trainer.Config] = llama3_debugmodel) -> Trainer.Config:
    """llama3's debug model (or ``base``'s), small and on CPU: SDPA, float32, 128 tokens x 2 per rank,
    8 steps, a seed."""
    config = base()
    assert config.model_spec is not None
    cpu_shim.sdpa_everywhere(config.model_spec.model)
    assets = Path(os.environ["TITAN_TEST_ASSETS"])
    config.hf_assets_path = str(assets / "tokenizer")
    config.dataloader.dataset_path = str(assets / "data")
    config.training.seq_len, config.training.local_batch_size, config.training.steps = SEQ_LEN, BATCH, STEPS
    config.training.mixed_precision_param = "float32"
    config.training.disable_cuda_graphs = True
    config.validator.enable = False
    config.checkpoint.enable = False
    config.debug.seed = 42
    config.dump_folder = os.environ.get("TITAN_TEST_OUT", config.dump_folder)
    return config


def titan_debug_cpu() -> ProbedTrainer.Config:
    """The small CPU config on tmrun's integration (``--config titan_debug_cpu``)."""
    return tmrun_config(_small_cpu_config(), ProbedTrainer)


def titan_moe_cpu() -> ProbedTrainer.Config:
    """DeepSeek-V3's debug model (mixture of experts: a router, routed and shared experts, the
    load-balancing expert bias torchtitan updates outside the optimizer) on the same small CPU
    set-up (``--config titan_moe_cpu``)."""
    from torchtitan.models.deepseek_v3.config_registry import deepseek_v3_debugmodel

    return tmrun_config(_small_cpu_config(deepseek_v3_debugmodel), ProbedTrainer)


def titan_debug_cpu_validate() -> ProbedTrainer.Config:
    """The same with torchtitan's validator after every second step (one batch of the same
    offline data; under PP, ``pp_schedule.eval()`` after the step's training)."""
    config = _small_cpu_config()
    config.validator.enable = True
    config.validator.freq = 2
    config.validator.steps = 1
    config.validator.dataloader = dataclasses.replace(config.dataloader)
    return tmrun_config(config, ProbedTrainer)


def titan_debug_cpu_plain() -> PlainTrainer.Config:
    """The same on torchtitan's own trainer (``--config titan_debug_cpu_plain``: no tmrun at all)."""
    config = _small_cpu_config()
    return PlainTrainer.Config(**{f.name: getattr(config, f.name) for f in dataclasses.fields(config) if f.init})
