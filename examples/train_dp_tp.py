"""Tensor parallelism with torch's own APIs under the tmrun worker API: a tiny GPT-style model
whose MLPs are split over "tp" (``ColwiseParallel`` / ``RowwiseParallel``) on a 2-D ("dp", "tp")
device mesh, gradients averaged over "dp" by hand, AdamW, a stateful data loader per "dp" rank,
all tracked.

    tmrun --standalone --nproc-per-node 4 --standby 1 examples/train_dp_tp.py --final 'out/final-{rank}'
    torchrun --standalone --nproc-per-node 4 examples/train_dp_tp.py --final 'out/final-{rank}'

The ranks with the same "tp" coordinate hold the same shards (replicas along "dp"): a lost rank's
standby, which waits in ``tmrun.init()`` and builds the mesh and model as that rank, is healed
from its replica (docs/mesh.md). --final PATH and --step-log PATH as in train_hsdp.py.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
import time

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import tmrun  # noqa: E402
from tiny_gpt import GPT, GPTConfig, TokenLoader, digest, local, loss_of  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--dp", type=int, default=2, help='size of the "dp" dimension')
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--dim", type=int, default=32, help="model width (even: 2 attention heads)")
    parser.add_argument("--step-time", type=float, default=0.0, help="extra seconds per step (a slower job)")
    parser.add_argument("--final", default="")
    parser.add_argument("--step-log", default="", help="one line per completed step (step time pid); {rank}: the rank")
    args = parser.parse_args()
    torch.set_num_threads(1)

    tm = tmrun.init()
    mesh = init_device_mesh("cpu", (args.dp, tm.world_size // args.dp), mesh_dim_names=("dp", "tp"))
    cfg = GPTConfig(dim=args.dim, layers=args.layers)
    torch.manual_seed(0)
    model = GPT(cfg)
    # src_data_rank=None: every rank shards its own copy (the same seed everywhere); the default
    # (0) scatters rank 0's weights over "tp", a collective that a standby promoted later, which
    # builds its model alone while the others train, could never match (docs/mesh.md)
    parallelize_module(model, mesh["tp"], {
        **{f"blocks.{i}.mlp.up": ColwiseParallel() for i in range(cfg.layers)},
        **{f"blocks.{i}.mlp.down": RowwiseParallel() for i in range(cfg.layers)},
    }, src_data_rank=None)
    dp, dp_rank = mesh.get_group("dp"), mesh.get_local_rank("dp")
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    loader = TokenLoader(cfg, dp_rank=dp_rank, dp_size=args.dp)
    tm.track(model=model, optimizer=opt, loader=loader)  # local shards; opt.step() goes through tmrun's guard

    for step in tm.steps(args.steps):
        idx, target = loader.next()
        loss = loss_of(model, idx, target)
        loss.backward()
        for p in model.parameters():  # data parallel over "dp": average the (local) gradients
            grad = local(p.grad)
            dist.all_reduce(grad, group=dp)
            grad.div_(args.dp)
        opt.step()  # skipped in a step a failure aborted
        opt.zero_grad()
        if args.step_time:
            time.sleep(args.step_time)
        if args.step_log and not tm.is_shadow and tm.committed_step == step:  # its update was applied
            with open(args.step_log.replace("{rank}", str(tm.rank)), "a") as log:
                log.write(f"{step} {time.time():.6f} {os.getpid()}\n")
        if tm.rank == 0 and not tm.is_shadow and not tm.void:
            print(f"step {step} loss {loss.item():.4f}", flush=True)

    if args.final:
        sha = hashlib.sha256(digest(model, opt).encode())
        sha.update(repr(loader.state_dict()).encode())
        with open(args.final.replace("{rank}", str(tm.rank)), "w") as out:
            out.write(sha.hexdigest() + "\n")


if __name__ == "__main__":
    main()
