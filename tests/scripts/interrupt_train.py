"""A training script with long steps and everything a loop carries, for the interruption tests.

Each of the model's --layers blocks is a Linear followed by a slow layer that sleeps --slow
seconds in its forward and in its backward and counts how often it ran, so a step takes
seconds and its progress is countable. The loop carries a data loader position, an LR
schedule and a gradient scaler (all tracked), and runs its body inside a context manager and a
``try/finally``. Every attempt of a step appends one line to --log (rank in the name):
``step pid aborted slow_forwards slow_backwards finally_runs exits lr scale position``.
--final writes a SHA-256 of everything that must survive a failure bit for bit.

--wrap picks the model's wrapper: tm.ddp, the script's own DistributedDataParallel, or FSDP2
(HSDP with one shard per replica). --die-in-backward RANK,STEP,N: that rank SIGKILLs itself in
the N-th slow layer of that step's backward (the failure drills' "backward" point of a sharded
module comes only at the end of its backward).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import hashlib
import os
import signal
import time
from typing import Any, Iterator

import torch

import tmrun

COUNTS = {"forward": 0, "backward": 0, "finally": 0, "exits": 0}
DIE_AT = -1  # this process SIGKILLs itself at this count of slow backwards (--die-in-backward)
DIE_AT_HOOK: Any = None


class _SlowGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, seconds: float) -> torch.Tensor:
        ctx.seconds = seconds
        return x.clone()  # not a view: FSDP2 warns about blocks that return one

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        COUNTS["backward"] += 1
        if DIE_AT == COUNTS["backward"]:
            DIE_AT_HOOK()
        time.sleep(ctx.seconds)
        return grad, None


class Slow(torch.nn.Module):
    def __init__(self, seconds: float) -> None:
        super().__init__()
        self.seconds = seconds

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        COUNTS["forward"] += 1
        time.sleep(self.seconds)
        return _SlowGrad.apply(x, self.seconds)


class Positions:
    """A data loader's position, tracked like torchdata's StatefulDataLoader."""

    def __init__(self) -> None:
        self.position = 0

    def next(self) -> int:
        self.position += 1
        return self.position

    def state_dict(self) -> dict[str, int]:
        return {"position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.position = int(state["position"])


@contextlib.contextmanager
def counted() -> Iterator[None]:
    try:
        yield
    finally:
        COUNTS["exits"] += 1


def _raw_bytes(tensor: torch.Tensor) -> bytes:
    """A tensor's bytes without numpy (torch's CPU wheel does not need it, and CI may not have it)."""
    dense = tensor.detach().contiguous()
    return ctypes.string_at(dense.data_ptr(), dense.numel() * dense.element_size())


def digest(*tensors_of: Any) -> str:
    sha = hashlib.sha256()
    for value in tensors_of:
        sha.update(repr(value).encode() if not isinstance(value, torch.Tensor) else _raw_bytes(value))
    return sha.hexdigest()


def sharded(blocks: list[torch.nn.Module], world: int) -> torch.nn.Module:
    """HSDP with one shard per replica: every rank holds all of the state (a lost rank's shard
    has a live replica), and FSDP2 runs its whole machinery (unshard, reshard, reduce-scatter,
    the replicas' allreduce) on the tmrun backend."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world, 1), mesh_dim_names=("replicate", "shard"))
    model = torch.nn.Sequential(*[torch.nn.Sequential(*blocks[i:i + 2]) for i in range(0, len(blocks), 2)])
    for block in model:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--layers", type=int, default=20)
    parser.add_argument("--slow", type=float, default=0.05)
    parser.add_argument("--log", required=True)
    parser.add_argument("--final", required=True)
    parser.add_argument("--wrap", choices=("tm", "torch", "hsdp"), default="tm",
                        help="tm: tm.ddp; torch: the script's own DistributedDataParallel, given to tm.track; "
                             "hsdp: FSDP2's fully_shard per block on a (world, 1) ('replicate', 'shard') mesh")
    parser.add_argument("--die-in-backward", default="",
                        help="RANK,STEP,N: that rank SIGKILLs itself in the N-th slow layer of that step's backward "
                             "(once: a file beside --final says it did)")
    args = parser.parse_args()

    tm = tmrun.init()
    torch.manual_seed(0)
    blocks: list[torch.nn.Module] = []
    for _ in range(args.layers):
        blocks += [torch.nn.Linear(16, 16), Slow(args.slow)]
    if args.wrap == "tm":
        model = tm.ddp(torch.nn.Sequential(*blocks))
    elif args.wrap == "torch":
        model = torch.nn.parallel.DistributedDataParallel(torch.nn.Sequential(*blocks))
    else:
        model = sharded(blocks, tm.world_size)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8, growth_interval=1)
    loader = Positions()
    tm.track(model=model, optimizer=opt, scheduler=sched, scaler=scaler, loader=loader)
    die_rank, die_step, die_at = (int(v) for v in args.die_in_backward.split(",")) if args.die_in_backward else (-1,) * 3
    died = args.final.replace("{rank}", str(die_rank)) + ".died"

    def die() -> None:
        with open(died, "w"):
            pass
        os.kill(os.getpid(), signal.SIGKILL)

    global DIE_AT, DIE_AT_HOOK
    DIE_AT_HOOK = die
    for step in tm.steps(args.steps):
        before = dict(COUNTS)
        armed = not tm.is_shadow and (tm.rank, step) == (die_rank, die_step) and not os.path.exists(died)
        DIE_AT = before["backward"] + die_at if armed else -1
        try:
            with counted():
                position = loader.next()
                generator = torch.Generator().manual_seed(1000 * position + tm.rank)
                x = torch.randn(8, 16, generator=generator)
                loss = torch.nn.functional.mse_loss(model(x), x.sin())
                scaler.scale(loss).backward()
                scaler.step(opt)
                scaler.update()
                sched.step()
                opt.zero_grad()
        finally:
            COUNTS["finally"] += 1
            if not tm.is_shadow:
                with open(args.log.replace("{rank}", str(tm.rank)), "a") as out:
                    out.write(f"{step} {os.getpid()} {int(tm.aborted)} {COUNTS['forward'] - before['forward']} "
                              f"{COUNTS['backward'] - before['backward']} {COUNTS['finally'] - before['finally']} "
                              f"{COUNTS['exits'] - before['exits']} {sched.get_last_lr()[0]!r} {scaler.get_scale()!r} "
                              f"{loader.position}\n")
    state = [t for t in getattr(model, "module", model).state_dict().values()]
    state += [v for s in opt.state.values() for _, v in sorted(s.items()) if isinstance(v, torch.Tensor)]
    state = [getattr(t, "to_local", lambda t=t: t)() for t in state]  # a DTensor: this rank's shard
    final = digest(*state, sched.state_dict(), scaler.state_dict(), loader.state_dict())
    with open(args.final.replace("{rank}", str(tm.rank)), "w") as out:
        out.write(final + "\n")


if __name__ == "__main__":
    main()
