"""``tmrun-ctl plan``: projected ETTR, GPU-hours lost and standby count, by TrainMover's method.

The model (TrainMover, §2 Fig. 2 and §8.2 Fig. 9; docs/user-guide.md, "tmrun-ctl plan"):

* failures are independent, each node fails at rate 1 / ``node_mttf``, so the job's mean time
  to failure is ``job_mttf = node_mttf / nodes``;
* every failure costs the job a fixed downtime ``D`` (the whole job waits); the throughput lost
  is ``D / job_mttf`` (first order, as the paper's Fig. 2: 4.45 min of restart at 64K / 128K
  GPUs gives 16.47% / 31.79%), and ETTR is ``1 - loss``;
* without standbys every failure is a restart (``restart`` minutes); with ``k`` standby nodes a
  failure is recovered in place in tmrun's ``recovery`` seconds unless every standby is in use.
  A used standby comes back after ``repair`` hours (the failed node repaired, or a new one
  added to the pool): the standbys in use are Poisson with mean ``repair / job_mttf`` (an
  M/G/inf queue), so a failure finds none free with probability ``P(N >= k)``;
* a standby node's GPUs do no training: ``k * gpus_per_node * 168`` GPU-hours a week are counted
  as lost (the paper's "TrainMover w/ standby" counts its idle standby machine the same way).

"How many standbys pay for themselves": the ``k`` with the fewest GPU-hours lost a week (best),
and the largest ``k`` that still loses fewer than none (break-even).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

HOURS_PER_WEEK = 168.0


class ProjectionError(ValueError):
    """Inputs that make no projection (one line for the user)."""


@dataclass(frozen=True)
class PlanInput:
    gpus: int
    gpus_per_node: int = 8
    node_mttf_h: float | None = None  # one node's mean time to failure, hours
    job_mttf_min: float | None = None  # or the job's, minutes (overrides node_mttf_h)
    restart_min: float = 4.45  # downtime of a restart (the paper's framework initialisation)
    recovery_s: float = 20.0  # tmrun's in-place recovery (measure it: tmrun-ctl status)
    repair_h: float = 24.0  # until a used standby is back in the pool
    max_standby: int = 64


@dataclass(frozen=True)
class Option:
    standby: int
    p_no_standby: float  # a failure finds no free standby (restart)
    downtime_min: float  # expected downtime per failure
    loss: float  # share of throughput lost to failures
    ettr: float
    gpu_hours_lost_week: float  # failures plus idle standby GPUs


@dataclass(frozen=True)
class Projection:
    nodes: int
    job_mttf_min: float
    failures_per_week: float
    restart_only: Option
    best: Option
    break_even: int  # the most standbys that still lose fewer GPU-hours than none
    options: list[Option]

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


def throughput_loss(downtime_min: float, job_mttf_min: float) -> float:
    """The paper's first-order loss: downtime per failure over the job's MTTF (at most 1)."""
    return min(downtime_min / job_mttf_min, 1.0)


def project(spec: PlanInput) -> Projection:
    if spec.gpus < 1 or spec.gpus_per_node < 1:
        raise ProjectionError("--gpus and --gpus-per-node must be at least 1")
    if spec.gpus % spec.gpus_per_node:
        raise ProjectionError(f"--gpus {spec.gpus} is not a multiple of --gpus-per-node {spec.gpus_per_node}")
    for name, value in (("--restart-minutes", spec.restart_min), ("--recovery-seconds", spec.recovery_s),
                        ("--repair-hours", spec.repair_h)):
        if not value >= 0 or math.isinf(value):
            raise ProjectionError(f"{name} must be a number >= 0, got {value}")
    nodes = spec.gpus // spec.gpus_per_node
    if spec.job_mttf_min is not None:
        job_mttf = spec.job_mttf_min
    elif spec.node_mttf_h is not None:
        job_mttf = spec.node_mttf_h * 60.0 / nodes
    else:
        raise ProjectionError("give --node-mttf-hours or --job-mttf-minutes")
    if not job_mttf > 0 or math.isinf(job_mttf):
        raise ProjectionError("the MTTF must be a positive number")
    in_use = spec.repair_h * 60.0 / job_mttf

    def option(k: int, p: float) -> Option:
        downtime = p * spec.restart_min + (1 - p) * spec.recovery_s / 60.0
        loss = throughput_loss(downtime, job_mttf)
        lost = loss * spec.gpus * HOURS_PER_WEEK + k * spec.gpus_per_node * HOURS_PER_WEEK
        return Option(k, p, downtime, loss, 1.0 - loss, lost)

    baseline = option(0, 1.0)
    # beyond this many standbys their idle GPUs alone cost more than every failure without them
    most = min(nodes, math.ceil(baseline.gpu_hours_lost_week / (spec.gpus_per_node * HOURS_PER_WEEK)))
    options = [baseline]
    below = 0.0  # P(N < k), N ~ Poisson(in_use); terms in log space (no underflow for large means)
    log_mean = math.log(in_use) if in_use > 0 else -math.inf
    for k in range(1, most + 1):
        below += math.exp(-in_use + (k - 1) * log_mean - math.lgamma(k)) if in_use > 0 else (1.0 if k == 1 else 0.0)
        options.append(option(k, min(1.0, max(0.0, 1.0 - below))))  # P(N >= k)
    best = min(options, key=lambda o: o.gpu_hours_lost_week)
    break_even = max(o.standby for o in options if o.gpu_hours_lost_week <= baseline.gpu_hours_lost_week)
    return Projection(nodes, job_mttf, HOURS_PER_WEEK * 60.0 / job_mttf, baseline, best, break_even,
                      options[: spec.max_standby + 1])
