"""Which device a single-node standby gets (tmrun.launcher.standby_devices) and how the pool
hands them out (tmrun.launcher.standby_pool, with a recording starter instead of processes)."""

from __future__ import annotations

import pytest

from tmrun.launcher import standby_devices as sd
from tmrun.launcher.standby_pool import StandbyMember, StandbyPool


def test_a_standby_gets_a_spare_gpu_of_its_own() -> None:
    assert sd.standby_local_rank(nproc=7, gpus=8, live=set(), held=set()) == 7  # --nproc-per-node 7 --standby 1
    assert sd.standby_local_rank(nproc=6, gpus=8, live={6}, held=set()) == 7


def test_a_promoted_standbys_gpu_is_not_reused() -> None:
    # the standby on GPU 7 took over a failed rank: the refill has no spare GPU left
    assert sd.standby_local_rank(nproc=7, gpus=8, live=set(), held={7}) is None
    assert sd.standby_local_rank(nproc=6, gpus=8, live=set(), held={6}) == 7
    line = sd.no_spare_gpu(7, 8, {7})
    assert "no spare GPU" in line and "TMRUN_STANDBY_SHARE_GPU=1" in line and "\n" not in line


def test_sharing_and_cpu_nodes_have_no_limit() -> None:
    assert sd.standby_local_rank(nproc=8, gpus=8, live=set(), held=set()) is None  # every GPU is active
    assert sd.standby_local_rank(nproc=8, gpus=8, live=set(), held=set(), share=True) == 8  # asked to share
    assert sd.standby_local_rank(nproc=2, gpus=0, live={2}, held={3}) == 4  # a CPU node: labels


@pytest.mark.parametrize("environ, expected", [
    ({"CUDA_VISIBLE_DEVICES": "0,1,2"}, 3), ({"CUDA_VISIBLE_DEVICES": ""}, 0), ({"CUDA_VISIBLE_DEVICES": "-1"}, 0),
])
def test_visible_gpus_from_the_environment(environ: dict, expected: int) -> None:
    assert sd.visible_gpus(environ) == expected


class _Process:
    """Stands in for a standby's Popen: alive until signalled."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        return self.returncode

    def send_signal(self, _signal: int) -> None:
        self.returncode = -15

    kill = send_signal

    def wait(self, timeout: float | None = None) -> int | None:
        return self.returncode


def _pool(monkeypatch: pytest.MonkeyPatch, size: int, nproc: int, gpus: int) -> tuple[StandbyPool, list[int]]:
    started: list[int] = []
    pool = StandbyPool(size, "run", nproc=nproc, gpus=gpus)

    def start(index: int, local_rank: int) -> StandbyMember:
        started.append(local_rank)
        return StandbyMember(index, _Process(1000 + index), f"/nonexistent/{index}", local_rank)  # type: ignore[arg-type]

    monkeypatch.setattr(pool, "_start", start)
    return pool, started


def test_the_pool_places_standbys_after_the_active_ranks(monkeypatch: pytest.MonkeyPatch,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.delenv(sd.ENV_SHARE, raising=False)
    pool, started = _pool(monkeypatch, size=2, nproc=6, gpus=8)
    pool.fill()
    assert started == [6, 7]
    pool.take(pool.members[0])  # promoted: GPU 6 now runs a rank
    pool.fill()
    assert started == [6, 7]  # no spare GPU for a refill: none started
    assert "no spare GPU for a standby worker: 8 GPUs, 6 active ranks" in capsys.readouterr().err
    pool.stop(final=False)  # a new worker group: every device is the group's or spare again
    pool.fill()
    assert started[2:] == [6, 7]

