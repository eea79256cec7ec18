"""Pipeline parallelism x data parallelism with torch's own APIs under the tmrun worker API: a
stack of linear layers cut into pipeline stages (``torch.distributed.pipelining`` over the "pp"
dimension of a 2-D device mesh), each stage replicated over "dp" (its gradients averaged over its
replicas), AdamW, all tracked. Schedules: GPipe and 1F1B (one stage per rank); Interleaved 1F1B,
Interleaved Zero Bubble (two stages per rank, looped: rank r holds stages r and r + pp), ZBV Zero
Bubble and DualPipeV (two stages per rank, in a V: rank r holds stages r and 2 pp - 1 - r).

    tmrun --standalone --nproc-per-node 4 --standby 1 examples/train_pp.py --final 'out/final-{rank}'
    torchrun --standalone --nproc-per-node 4 examples/train_pp.py --final 'out/final-{rank}'

A planned migration (rank 1 moved to the standby once it committed step 3, asked by the script
itself with ``tm.migrate()``; ``tmrun-ctl migrate 1`` does the same from outside):

    tmrun --standalone --nproc-per-node 4 --standby 1 examples/train_pp.py --migrate-at 3 --step-time 0.5

--final PATH writes the SHA-256 of this rank's stage (parameters and optimizer state); ``{rank}``
is replaced by the rank. Replicas of a stage (the same "pp" position) must agree, and runs under
tmrun and torchrun must give the same bits.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.pipelining import (PipelineStage, Schedule1F1B, ScheduleDualPipeV, ScheduleGPipe,
                                          ScheduleInterleaved1F1B, ScheduleInterleavedZeroBubble,
                                          ScheduleZBVZeroBubble)

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import tmrun  # noqa: E402
from train_inplace import digest  # noqa: E402


# --schedule: the schedule class, and how a rank's stages are laid out ("" one stage, "loop", "v")
SCHEDULES = {"gpipe": (ScheduleGPipe, ""), "1f1b": (Schedule1F1B, ""),
             "interleaved-1f1b": (ScheduleInterleaved1F1B, "loop"),
             "interleaved-zb": (ScheduleInterleavedZeroBubble, "loop"),
             "zbv": (ScheduleZBVZeroBubble, "v"), "dualpipev": (ScheduleDualPipeV, "v")}


def stage_indices(position: int, pp: int, style: str) -> list[int]:
    """The stages the rank at ``position`` of its pipeline holds."""
    if style == "loop":
        return [position, position + pp]
    if style == "v":
        return [position, 2 * pp - 1 - position]
    return [position]


def build_stage(stage: int, stages: int, width: int, depth: int) -> torch.nn.Module:
    """This stage's share of the layers (every rank builds the whole stack from one seed and keeps
    its own layers: the same weights whatever the cut)."""
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = []
    for _ in range(depth):
        layers += [torch.nn.Linear(width, width), torch.nn.Tanh()]
    per = len(layers) // stages
    mine = layers[stage * per: len(layers) if stage == stages - 1 else (stage + 1) * per]
    return torch.nn.Sequential(*mine)


def batch_for(step: int, replica: int, width: int, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1_000_003 * step + replica)
    x = torch.randn(batch, width, generator=generator)
    return x, x.roll(1, dims=1).sin()


def evaluate(tm: tmrun.Runtime, schedule, step: int, replica: int, first: bool, last: bool,
             args: argparse.Namespace) -> None:
    """A forward-only pass of the pipeline on a held-out batch (``schedule.eval``), its summed loss
    logged by the last stage: the step's first use of the schedule."""
    x, y = batch_for(-1 - step, replica, args.width, args.batch)
    losses: list[torch.Tensor] = []
    with torch.no_grad():
        schedule.eval(*((x,) if first else ()), target=y if last else None, losses=losses)
    if last and args.eval_log and not tm.is_shadow and not tm.void:
        with open(args.eval_log.replace("{rank}", str(tm.rank)), "a") as log:
            log.write(f"{step} {sum(loss.item() for loss in losses)!r}\n")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--stages", type=int, default=2, help='size of the "pp" dimension')
    parser.add_argument("--schedule", choices=tuple(SCHEDULES), default="1f1b")
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--final", default="")
    parser.add_argument("--step-log", default="", help="one line per completed step (step time pid); {rank}: the rank")
    parser.add_argument("--migrate-at", type=int, default=-1,
                        help="after this step, --migrate-rank asks to be moved to a warm standby (tm.migrate: a planned "
                             "migration, nothing recomputed; ignored without a standby, e.g. under torchrun)")
    parser.add_argument("--migrate-rank", type=int, default=1)
    parser.add_argument("--step-time", type=float, default=0.0, help="extra seconds per step (a slower job)")
    parser.add_argument("--eval-every", type=int, default=0,
                        help="evaluate (schedule.eval on a held-out batch) in every Nth step")
    parser.add_argument("--eval-from", type=int, default=0,
                        help="the first step that evaluates (then every --eval-every steps)")
    parser.add_argument("--eval-at", choices=("start", "end"), default="start",
                        help="before the step's training (raw loops: nanoGPT) or after it (torchtitan's validator)")
    parser.add_argument("--eval-log", default="",
                        help="the last stage's evaluation losses (step loss); {rank}: the rank")
    args = parser.parse_args()
    torch.set_num_threads(1)

    tm = tmrun.init()
    mesh = init_device_mesh("cpu", (tm.world_size // args.stages, args.stages), mesh_dim_names=("dp", "pp"))
    position, replica = mesh["pp"].get_local_rank(), mesh["dp"].get_local_rank()
    dp_group, pp_group = mesh["dp"].get_group(), mesh["pp"].get_group()
    schedule_class, style = SCHEDULES[args.schedule]
    indices = stage_indices(position, args.stages, style)
    total = args.stages * len(indices)
    modules = [build_stage(index, total, args.width, args.depth) for index in indices]
    module = modules[0] if len(modules) == 1 else torch.nn.ModuleList(modules)
    opt = torch.optim.AdamW(module.parameters(), lr=1e-3)
    tm.set_shard(position)  # replicas are the ranks of the same pipeline position (no DTensor says so)
    tm.track(model=module, optimizer=opt)
    stages = [PipelineStage(m, index, total, torch.device("cpu"), group=pp_group) for m, index in zip(modules, indices)]
    loss_fn = torch.nn.MSELoss(reduction="sum")
    schedule = schedule_class(stages[0] if not style else stages, n_microbatches=args.microbatches, loss_fn=loss_fn,
                              scale_grads=False)
    tm.track(schedule=schedule)  # a joiner runs its pipeline's start-up alone, from its rank's recording
    first, last = 0 in indices, total - 1 in indices
    for step in tm.steps(args.steps):
        evaluating = args.eval_every and step >= args.eval_from and (step - args.eval_from) % args.eval_every == 0
        if evaluating and args.eval_at == "start":
            evaluate(tm, schedule, step, replica, first, last, args)
        x, y = batch_for(step, replica, args.width, args.batch)
        if first and last:  # a V's first rank holds the first and the last stage
            schedule.step(x, target=y)
        elif first:
            schedule.step(x)
        elif last:
            schedule.step(target=y)
        else:
            schedule.step()
        for p in module.parameters():  # data parallel: each stage's gradients averaged over its replicas
            dist.all_reduce(p.grad, op=dist.ReduceOp.AVG, group=dp_group)
        opt.step()
        opt.zero_grad()
        if evaluating and args.eval_at == "end":
            evaluate(tm, schedule, step, replica, first, last, args)
        if args.step_time:
            time.sleep(args.step_time)
        if args.step_log and not tm.is_shadow and tm.committed_step == step:  # its update was applied
            with open(args.step_log.replace("{rank}", str(tm.rank)), "a") as log:
                log.write(f"{step} {time.time():.6f} {os.getpid()}\n")
        if step == args.migrate_at and tm.rank == args.migrate_rank and tm.in_place and not tm.is_shadow:
            tm.migrate(reason=f"--migrate-at {step}")
    if args.final:
        with open(args.final.replace("{rank}", str(tm.rank)), "w") as out:
            out.write(digest(module, opt) + "\n")


if __name__ == "__main__":
    main()
