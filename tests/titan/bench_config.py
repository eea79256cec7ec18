"""BENCH-ONLY ``--module`` for bench/torchtitan_failover.py: the small CPU config of
:mod:`tests.titan.config` (torchtitan's llama3 debug model, the CPU shim, the offline assets)
with a step log made for timing instead of the tests' probes::

    tmrun --standalone --nproc-per-node 2 --standby 1 -m torchtitan.train --module tests.titan.bench_config \\
        --config titan_bench_tmrun --parallelism.data_parallel_replicate_degree 2 --training.steps 20
    torchrun --standalone --nproc-per-node 2 --max-restarts 3 -m torchtitan.train \\
        --module tests.titan.bench_config --config titan_bench_plain \\
        --parallelism.data_parallel_replicate_degree 2 --training.steps 20 \\
        --checkpoint.enable --checkpoint.interval 5 --checkpoint.folder DIR

Environment: ``TITAN_TEST_ASSETS`` and ``TITAN_TEST_OUT`` as for tests/titan/config.py.

In TITAN_TEST_OUT: ``steps-{rank}.log``, one line ``step unix_time pid`` per step *completed*
(written after the step's optimizer step; torchtitan's 1-based step; not for a step tmrun
aborted, nor for a standby's shadow steps), the format bench/inplace_failover.py's
``read_steps`` reads; ``final-{rank}``: tests/titan/config.py's digest of the rank's local model
shards, buffers, optimizer state and learning rates, once every step trained.

``titan_bench_tmrun``: the integration's trainer (:class:`tmrun.integrations.torchtitan.TmrunTrainer`),
no checkpoint. ``titan_bench_plain``: torchtitan's own ``Trainer`` (no tmrun), whose
checkpointing the command line turns on."""

from __future__ import annotations

import dataclasses
import os
import time
from pathlib import Path
from typing import Any

import torch
from torchtitan.trainer import Trainer

from tests.titan.config import _small_cpu_config, _write_final  # installs the CPU shim
from tmrun.integrations.torchtitan import TmrunTrainer, tmrun_config


def _log_step(trainer: Trainer, rank: int) -> None:
    with open(Path(os.environ["TITAN_TEST_OUT"]) / f"steps-{rank}.log", "a") as log:
        log.write(f"{trainer.step} {time.time():.6f} {os.getpid()}\n")


class TimedTmrunTrainer(TmrunTrainer):
    """The integration's trainer with the completion log and the final digest."""

    @dataclasses.dataclass(kw_only=True, slots=True)
    class Config(TmrunTrainer.Config):
        pass

    def train_step(self, data_iterator: Any) -> None:
        super().train_step(data_iterator)
        if not self._quiet:  # not an aborted step (it is redone), not a standby's shadow step
            _log_step(self, self.tm.rank)

    def close(self) -> None:
        super().close()
        _write_final(self, Path(os.environ["TITAN_TEST_OUT"]) / f"final-{self.tm.rank}")


class TimedPlainTrainer(Trainer):
    """torchtitan's own trainer (no tmrun) with the completion log and the final digest."""

    @dataclasses.dataclass(kw_only=True, slots=True)
    class Config(Trainer.Config):
        pass

    def _rank(self) -> int:
        return torch.distributed.get_rank() if torch.distributed.is_initialized() else 0

    def train_step(self, data_iterator: Any) -> None:
        super().train_step(data_iterator)
        _log_step(self, self._rank())

    def close(self) -> None:
        super().close()
        _write_final(self, Path(os.environ["TITAN_TEST_OUT"]) / f"final-{self._rank()}")


def titan_bench_tmrun() -> TimedTmrunTrainer.Config:
    """The small CPU config on tmrun's integration, no checkpoint (``--config titan_bench_tmrun``)."""
    return tmrun_config(_small_cpu_config(), TimedTmrunTrainer)


def titan_bench_plain() -> TimedPlainTrainer.Config:
    """The same on torchtitan's own trainer (``--config titan_bench_plain``); checkpointing is
    off unless the command line turns it on (``--checkpoint.enable ...``)."""
    config = _small_cpu_config()
    return TimedPlainTrainer.Config(**{f.name: getattr(config, f.name) for f in dataclasses.fields(config) if f.init})
