"""tmrun-ctl plan's model against the numbers TrainMover publishes (shared/research/trainmover.md).

The note gives the restart (4.45 min) and the resulting throughput loss at 64K / 128K GPUs
(16.47% / 31.79%, Fig. 2) but not Meta's MTTFs behind them: the tests derive the job MTTFs the
paper's first-order model implies (27.0 / 14.0 min), check the model returns the paper's losses
for them, and check a second claim of the paper that uses them: at 32K GPUs one standby that
cuts recovery from 4.45 min to 20 s is worth about 2,400 GPUs.
"""

from __future__ import annotations

import pytest

from tmrun.control.projection import PlanInput, ProjectionError, project, throughput_loss

RESTART = 4.45
PAPER = {65536: 0.1647, 131072: 0.3179}  # throughput loss, Fig. 2


def _implied_mttf(loss: float) -> float:
    return RESTART / loss


@pytest.mark.parametrize("gpus", sorted(PAPER))
def test_fig2_throughput_loss(gpus: int) -> None:
    mttf = {65536: 27.0, 131072: 14.0}[gpus]  # the job MTTFs the paper's numbers imply, to 0.1 min
    assert round(_implied_mttf(PAPER[gpus]), 1) == mttf
    result = project(PlanInput(gpus=gpus, job_mttf_min=mttf, restart_min=RESTART, recovery_s=20))
    assert result.restart_only.loss * 100 == pytest.approx(PAPER[gpus] * 100, abs=0.02)
    assert result.restart_only.ettr == pytest.approx(1 - PAPER[gpus], abs=0.0002)
    # GPU-hours a week lost to restarts: loss x GPUs x 168 h
    assert result.restart_only.gpu_hours_lost_week == pytest.approx(PAPER[gpus] * gpus * 168, rel=0.001)


def test_one_standby_at_32k_is_worth_2400_gpus() -> None:
    """§8.3: at 32K GPUs a standby that cuts recovery from 4.45 min to 20 s is worth ~2,400 GPUs
    (job MTTF scaled from 128K's 14.0 min by the node count: 56 min)."""
    mttf_32k = _implied_mttf(PAPER[131072]) * 4
    result = project(PlanInput(gpus=32768, job_mttf_min=mttf_32k, restart_min=RESTART, recovery_s=20, repair_h=0))
    one = result.options[1]
    assert one.p_no_standby == 0.0  # repaired at once: the standby is always there
    saved_gpus = (result.restart_only.loss - one.loss) * 32768
    assert saved_gpus == pytest.approx(2400, rel=0.01)


def test_node_mttf_scales_with_nodes_and_standbys_are_counted() -> None:
    a = project(PlanInput(gpus=1024, node_mttf_h=100, restart_min=5, recovery_s=10, repair_h=1))
    b = project(PlanInput(gpus=2048, node_mttf_h=100, restart_min=5, recovery_s=10, repair_h=24))
    assert a.job_mttf_min == pytest.approx(100 * 60 / 128) and b.job_mttf_min == pytest.approx(a.job_mttf_min / 2)
    assert a.best.standby >= 1 and a.best.gpu_hours_lost_week < a.restart_only.gpu_hours_lost_week
    assert a.break_even >= a.best.standby
    # more standbys than pay off: the idle GPUs dominate
    worst = a.options[-1]
    assert worst.gpu_hours_lost_week >= a.best.gpu_hours_lost_week
    assert throughput_loss(100, 10) == 1.0  # at most everything


@pytest.mark.parametrize(
    "spec,message",
    [
        (PlanInput(gpus=0, node_mttf_h=1), "at least 1"),
        (PlanInput(gpus=12, gpus_per_node=8, node_mttf_h=1), "multiple"),
        (PlanInput(gpus=8), "--node-mttf-hours"),
        (PlanInput(gpus=8, job_mttf_min=0), "positive"),
        (PlanInput(gpus=8, node_mttf_h=1, restart_min=-1), "--restart-minutes"),
        (PlanInput(gpus=8, node_mttf_h=1, recovery_s=float("nan")), "--recovery-seconds"),
    ],
)
def test_bad_inputs(spec: PlanInput, message: str) -> None:
    with pytest.raises(ProjectionError, match=message):
        project(spec)


def test_standbys_in_use_are_poisson() -> None:
    """P(a failure finds no free standby) = P(N >= k), N ~ Poisson(repair / job MTTF)."""
    import math

    result = project(PlanInput(gpus=8 * 100, job_mttf_min=60, restart_min=5, recovery_s=10, repair_h=2))
    mean = 2.0  # 2 h of repair / 1 h between failures
    for k in (1, 2, 5):
        below = sum(math.exp(-mean) * mean**i / math.factorial(i) for i in range(k))
        assert result.options[k].p_no_standby == pytest.approx(1 - below)
    instant = project(PlanInput(gpus=800, job_mttf_min=60, restart_min=5, recovery_s=10, repair_h=0))
    assert instant.options[1].p_no_standby == 0.0
    huge = project(PlanInput(gpus=8 * 20000, job_mttf_min=1, restart_min=5, recovery_s=10, repair_h=24))
    assert 0.0 <= huge.best.p_no_standby <= 1.0  # a mean of 1440 standbys in use: no underflow


def test_at_1k_gpus_a_standby_does_not_pay() -> None:
    """§8.2 Fig. 9: at 1K GPUs the systems are similar and TrainMover with a standby is slightly
    worse (its idle machine costs more than it saves). Node MTTF implied by the 128K figure."""
    node_mttf_h = _implied_mttf(PAPER[131072]) * (131072 // 8) / 60
    small = project(PlanInput(gpus=1024, node_mttf_h=node_mttf_h, restart_min=RESTART, recovery_s=20))
    assert small.best.standby == 0 and small.options[1].gpu_hours_lost_week > small.restart_only.gpu_hours_lost_week
    large = project(PlanInput(gpus=8192, node_mttf_h=node_mttf_h, restart_min=RESTART, recovery_s=20))
    assert large.best.standby >= 1
