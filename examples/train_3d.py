"""Data x pipeline x tensor parallelism (3-D) with torch's own APIs under the tmrun worker API:
a stack of MLP blocks cut into pipeline stages (``torch.distributed.pipelining``, 1F1B or GPipe
over "pp"), each block's two linear layers split over "tp" (``ColwiseParallel`` /
``RowwiseParallel``), every stage replicated over "dp" (its gradients averaged over its
replicas), AdamW, all tracked. 8 ranks: a (2, 2, 2) ("dp", "pp", "tp") device mesh.

``--inner fsdp``: the third dimension shards instead (torchtitan's PP x HSDP shape): a
("pp", "dp", "shard") mesh, each stage's blocks and the stage itself ``fully_shard``-ed on its
("dp", "shard") submesh (HSDP: sharded over "shard", replicated over "dp", FSDP averaging the
gradients over both), kept gathered between a step's microbatches (``reshard_after_forward=False``)
as torchtitan does with a pipeline. A lost rank is healed from the rank of the other "dp"
replica at the same stage and "shard" position.

    tmrun --standalone --nproc-per-node 8 --standby 1 --inject-failure rank=5,step=4 \\
        examples/train_3d.py --final 'out/final-{rank}'
    torchrun --standalone --nproc-per-node 8 examples/train_3d.py --final 'out/final-{rank}'

A lost rank is healed from the rank of the other replica at the same stage and "tp" position:
``tm.set_shard(stage)`` names the stage (DTensor's placements name the "tp" shard). The standby
waits in ``tmrun.init()`` and builds its mesh and stage as that rank (docs/mesh.md); the
pipelines that share a link with it (its own and those of its "tp" peers) run torch's pipeline
start-up again with it.

--final PATH writes the SHA-256 of this rank's local shards (parameters and optimizer state);
``{rank}`` is replaced by the rank. Runs under tmrun and torchrun must give the same bits.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import tmrun  # noqa: E402
from tiny_gpt import digest, local  # noqa: E402
from train_pp import batch_for  # noqa: E402


class Block(torch.nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.up = torch.nn.Linear(width, 4 * width)
        self.down = torch.nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.tanh(self.up(x)))


def build_stage(stage: int, stages: int, width: int, depth: int) -> torch.nn.Sequential:
    """This stage's share of the blocks (every rank builds the whole stack from one seed and keeps
    its own blocks: the same weights whatever the cut)."""
    torch.manual_seed(0)
    blocks = [Block(width) for _ in range(depth)]
    per = depth // stages
    return torch.nn.Sequential(*blocks[stage * per: depth if stage == stages - 1 else (stage + 1) * per])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--dp", type=int, default=2, help='size of the "dp" dimension')
    parser.add_argument("--stages", type=int, default=2, help='size of the "pp" dimension')
    parser.add_argument("--schedule", choices=("gpipe", "1f1b"), default="1f1b")
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--width", type=int, default=32)
    parser.add_argument("--depth", type=int, default=4, help="MLP blocks in all")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--step-time", type=float, default=0.0, help="extra seconds per step (a slower job)")
    parser.add_argument("--inner", choices=("tp", "fsdp"), default="tp",
                        help='the third dimension: tensor parallel ("tp") or FSDP ("shard", HSDP with "dp")')
    parser.add_argument("--final", default="")
    parser.add_argument("--step-log", default="", help="one line per completed step (step time pid); {rank}: the rank")
    args = parser.parse_args()
    torch.set_num_threads(1)

    tm = tmrun.init()
    inner = tm.world_size // (args.dp * args.stages)
    if args.inner == "tp":
        mesh = init_device_mesh("cpu", (args.dp, args.stages, inner), mesh_dim_names=("dp", "pp", "tp"))
    else:
        mesh = init_device_mesh("cpu", (args.stages, args.dp, inner), mesh_dim_names=("pp", "dp", "shard"))
    stage_index, replica = mesh["pp"].get_local_rank(), mesh["dp"].get_local_rank()
    if args.inner == "fsdp":  # every ("dp", "shard") position is data parallel: a batch of its own
        replica = replica * inner + mesh["shard"].get_local_rank()
    dp_group, pp_group = mesh["dp"].get_group(), mesh["pp"].get_group()
    module = build_stage(stage_index, args.stages, args.width, args.depth)
    if args.inner == "tp":
        # src_data_rank=None: every rank shards its own copy (the same seed everywhere), no scatter
        # that a joiner building its stage alone could not match (docs/mesh.md)
        parallelize_module(module, mesh["tp"], {
            **{f"{i}.up": ColwiseParallel() for i in range(len(module))},
            **{f"{i}.down": RowwiseParallel() for i in range(len(module))},
        }, src_data_rank=None)
    else:
        hsdp = mesh["dp", "shard"]
        for block in module:
            fully_shard(block, mesh=hsdp, reshard_after_forward=False)
        fully_shard(module, mesh=hsdp, reshard_after_forward=False)
    opt = torch.optim.AdamW(module.parameters(), lr=1e-3)
    tm.set_shard(stage_index)  # a stage's replicas; DTensor's placements tell the inner shards apart
    tm.track(model=module, optimizer=opt)
    stage = PipelineStage(module, stage_index, args.stages, torch.device("cpu"), group=pp_group)
    schedule_class = ScheduleGPipe if args.schedule == "gpipe" else Schedule1F1B
    schedule = schedule_class(stage, n_microbatches=args.microbatches, loss_fn=torch.nn.MSELoss(reduction="sum"),
                              scale_grads=False)
    tm.track(schedule=schedule)
    last = stage_index == args.stages - 1
    for step in tm.steps(args.steps):
        x, y = batch_for(step, replica, args.width, args.batch)
        if stage_index == 0:
            schedule.step(x)
        elif last:
            schedule.step(target=y)
        else:
            schedule.step()
        if args.inner == "tp":  # data parallel: each stage's (local) gradients averaged over "dp" (FSDP does it itself)
            for p in module.parameters():
                dist.all_reduce(local(p.grad), op=dist.ReduceOp.AVG, group=dp_group)
        opt.step()
        opt.zero_grad()
        if args.step_time:
            time.sleep(args.step_time)
        if args.step_log and not tm.is_shadow and tm.committed_step == step:  # its update was applied
            with open(args.step_log.replace("{rank}", str(tm.rank)), "a") as log:
                log.write(f"{step} {time.time():.6f} {os.getpid()}\n")
    if args.final:
        with open(args.final.replace("{rank}", str(tm.rank)), "w") as out:
            out.write(digest(module, opt) + "\n")


if __name__ == "__main__":
    main()
