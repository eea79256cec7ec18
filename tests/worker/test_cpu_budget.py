"""tmrun.worker.cpu_budget: overlap the optimizer state's read with compute only where cores are idle."""

from __future__ import annotations

import os

import pytest

from tmrun.protocol import environment
from tmrun.worker import cpu_budget
from tmrun.worker.cpu_budget import CpuBudget, overlap_reads


@pytest.mark.parametrize("usable,workers,threads,expected", [
    (2, 2, 1, False),  # this repository's machine: both cores compute
    (3, 2, 1, False),  # one idle core: the read needs two threads
    (4, 2, 1, True),
    (64, 8, 8, False),  # CPU training with every core busy
    (96, 8, 1, True),  # a GPU node: the compute is on the GPUs
    (1, 1, 4, False),  # more threads than cores: never negative
])
def test_auto_overlaps_only_with_cores_to_spare(usable: int, workers: int, threads: int, expected: bool) -> None:
    budget = CpuBudget(usable, workers, threads)
    assert budget.spare == max(0, usable - workers * threads)
    assert overlap_reads("auto", budget) is expected


@pytest.mark.parametrize("budget", [CpuBudget(2, 2, 1), CpuBudget(96, 8, 1)])
def test_on_and_off_decide_whatever_the_cores(budget: CpuBudget) -> None:
    assert overlap_reads("on", budget) is True
    assert overlap_reads("off", budget) is False


def test_this_worker_reads_its_affinity_its_node_and_torch_threads(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    budget = cpu_budget.this_worker({environment.ENV_LOCAL_WORLD_SIZE: "3"})
    assert budget.usable == len(os.sched_getaffinity(0))
    assert budget.local_workers == 3 and budget.threads_per_worker == torch.get_num_threads()
    assert cpu_budget.this_worker({}).local_workers == 1
    assert cpu_budget.this_worker({environment.ENV_LOCAL_WORLD_SIZE: "x"}).local_workers == 1
    assert CpuBudget(2, 2, 1).describe() == "2 usable cores, 2 workers x 1 thread"


@pytest.mark.parametrize("raw,expected", [(None, "auto"), ("", "auto"), ("ON", "on"), (" off ", "off")])
def test_the_policy_comes_from_the_environment(raw: str | None, expected: str) -> None:
    environ = {} if raw is None else {environment.ENV_HEAL_OVERLAP: raw}
    assert environment.heal_overlap(environ) == expected


def test_an_unknown_policy_is_one_line() -> None:
    with pytest.raises(ValueError, match="TMRUN_HEAL_OVERLAP='maybe' is not one of auto, on, off") as caught:
        environment.heal_overlap({environment.ENV_HEAL_OVERLAP: "maybe"})
    assert "\n" not in str(caught.value)
