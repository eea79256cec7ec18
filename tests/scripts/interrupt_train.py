"""A training script with long steps and everything a loop carries, for the interruption tests.

Each of the model's --layers blocks is a Linear followed by a slow layer that sleeps --slow
seconds in its forward and in its backward and counts how often it ran, so a step takes
seconds and its progress is countable. The loop carries a data loader position, an LR
schedule and a gradient scaler (all tracked), and runs its body inside a context manager and a
``try/finally``. Every attempt of a step appends one line to --log (rank in the name):
``step pid aborted slow_forwards slow_backwards finally_runs exits lr scale position``.
--final writes a SHA-256 of everything that must survive a failure bit for bit.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import hashlib
import os
import time
from typing import Any, Iterator

import torch

import tmrun

COUNTS = {"forward": 0, "backward": 0, "finally": 0, "exits": 0}


class _SlowGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, seconds: float) -> torch.Tensor:
        ctx.seconds = seconds
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        COUNTS["backward"] += 1
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


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--layers", type=int, default=20)
    parser.add_argument("--slow", type=float, default=0.05)
    parser.add_argument("--log", required=True)
    parser.add_argument("--final", required=True)
    parser.add_argument("--wrap", choices=("tm", "torch"), default="tm",
                        help="tm: tm.ddp; torch: the script's own DistributedDataParallel, given to tm.track")
    args = parser.parse_args()

    tm = tmrun.init()
    torch.manual_seed(0)
    blocks: list[torch.nn.Module] = []
    for _ in range(args.layers):
        blocks += [torch.nn.Linear(16, 16), Slow(args.slow)]
    if args.wrap == "tm":
        model = tm.ddp(torch.nn.Sequential(*blocks))
    else:
        model = torch.nn.parallel.DistributedDataParallel(torch.nn.Sequential(*blocks))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8, growth_interval=1)
    loader = Positions()
    tm.track(model=model, optimizer=opt, scheduler=sched, scaler=scaler, loader=loader)
    for step in tm.steps(args.steps):
        before = dict(COUNTS)
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
    state = [t for t in model.module.state_dict().values()]
    state += [v for s in opt.state.values() for _, v in sorted(s.items()) if isinstance(v, torch.Tensor)]
    final = digest(*state, sched.state_dict(), scaler.state_dict(), loader.state_dict())
    with open(args.final.replace("{rank}", str(tm.rank)), "w") as out:
        out.write(final + "\n")


if __name__ == "__main__":
    main()
