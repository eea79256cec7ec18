"""A plain torchrun training script: DDP + Adam, checkpoint/restart, no tmrun API.

It runs unchanged under torchrun and tmrun. For drills it can kill one of its own ranks once
(``--kill-rank R --kill-step S``; a marker file in the checkpoint folder makes it happen once).
Each rank appends ``<step> <unix time> <loss> <pid>`` to ``--step-log`` (a path containing
``{rank}``) after every completed step, which is what the benchmarks measure (the pid tells a
restarted worker's lines apart; bench/random_kill.py kills the rank by it).
"""

from __future__ import annotations

import argparse
import os
import signal
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--ckpt-dir", required=True)
    parser.add_argument("--ckpt-every", type=int, default=10)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--step-sleep", type=float, default=0.0, help="extra seconds per step (paces a tiny model)")
    parser.add_argument("--kill-rank", type=int, default=-1)
    parser.add_argument("--kill-step", type=int, default=-1)
    parser.add_argument("--step-log", default="")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args()


def build_model(width: int, layers: int) -> nn.Module:
    blocks: list[nn.Module] = []
    for _ in range(layers):
        blocks += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*blocks)


def save_checkpoint(path: str, step: int, model: nn.Module, opt: torch.optim.Optimizer) -> None:
    tmp = path + ".tmp"
    torch.save({"step": step, "model": model.state_dict(), "opt": opt.state_dict()}, tmp)
    os.replace(tmp, path)  # atomic: a kill mid-save never leaves a torn checkpoint


def main() -> None:
    args = parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(args.seed)
    model = build_model(args.width, args.layers)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    ckpt = os.path.join(args.ckpt_dir, "checkpoint.pt")
    start = 0
    if os.path.exists(ckpt):
        state = torch.load(ckpt, weights_only=True)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        start = state["step"]
        print(f"[rank {rank}] resumed from step {start}", flush=True)
    ddp = DistributedDataParallel(model)
    log = open(args.step_log.format(rank=rank), "a") if args.step_log else None
    kill_marker = os.path.join(args.ckpt_dir, "killed.marker")
    for step in range(start, args.steps):
        if rank == args.kill_rank and step == args.kill_step and not os.path.exists(kill_marker):
            with open(kill_marker, "w") as marker:
                marker.write(f"{time.time():.6f}")
            os.kill(os.getpid(), signal.SIGKILL)
        gen = torch.Generator().manual_seed(args.seed * 100_003 + step * 1009 + rank)
        x = torch.randn(args.batch, args.width, generator=gen)
        loss = ddp(x).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        if args.step_sleep:
            time.sleep(args.step_sleep)
        done = step + 1
        if rank == 0 and done % args.ckpt_every == 0:
            save_checkpoint(ckpt, done, model, opt)
        dist.barrier()  # everyone sees the checkpoint before anyone can fail past it
        if log:
            log.write(f"{done} {time.time():.6f} {loss.item():.6f} {os.getpid()}\n")
            log.flush()
    if rank == 0:
        print(f"finished {args.steps} steps, world size {world}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
