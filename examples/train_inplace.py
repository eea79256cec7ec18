"""A training script that uses the tmrun worker API (the loop of the product brief, verbatim).

    tmrun --nproc-per-node 2 --standby 1 --inject-failure rank=1,step=8 examples/train_inplace.py

Under tmrun with a standby, a rank that dies is replaced in place: survivors keep their
processes, the standby (already warm) takes the rank, and at most the step in flight is redone.
Under plain torchrun the same script trains normally (no replacement).

--step-log PATH writes one line per completed step (``step time pid``); ``{rank}`` in PATH is
replaced by the rank. --final PATH writes the SHA-256 of the final parameters and optimizer
state (rank 0; every rank when PATH contains ``{rank}``), so runs with and without failures can
be compared bit for bit, and replicas with each other. --checkpoint PATH (with --checkpoint-every
K) makes rank 0 save the model and optimizer every K steps, and every rank resume from PATH at
start: a group restart then recomputes only the steps since (tmrun counts them).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import time

import torch

import tmrun


def build_model(width: int, depth: int, batchnorm: bool = False) -> torch.nn.Module:
    layers: list[torch.nn.Module] = []
    for _ in range(depth):
        layers += [torch.nn.Linear(width, width), *([torch.nn.BatchNorm1d(width)] if batchnorm else []),
                   torch.nn.ReLU()]
    layers.append(torch.nn.Linear(width, 1))
    return torch.nn.Sequential(*layers)


def batch_for(step: int, rank: int, world_size: int, width: int, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1_000_003 * step + rank)
    x = torch.randn(batch, width, generator=generator)
    return x, x.sum(dim=1, keepdim=True).sin()


def _update(sha: "hashlib._Hash", tensor: torch.Tensor) -> None:
    from tmrun.comm.native import as_buffer

    host = tensor.detach().cpu().contiguous()  # a copy for CUDA tensors: it must outlive the buffer
    sha.update(as_buffer(host.view(-1).view(torch.uint8))[0])


def digest(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> str:
    sha = hashlib.sha256()
    for tensor in model.state_dict().values():
        _update(sha, tensor)
    for state in optimizer.state.values():
        for key in sorted(state):
            if isinstance(state[key], torch.Tensor):
                _update(sha, state[key])
    return sha.hexdigest()


def report(done: list[tuple[int, float]], recoveries: list[dict[str, float | int]]) -> None:
    """What the failures cost this rank: downtime (largest gap between two completed steps minus
    a steady step) and steps recomputed."""
    gaps = sorted(b - a for (_, a), (_, b) in zip(done, done[1:]))
    steady = gaps[len(gaps) // 2]
    recomputed = len(done) - len({step for step, _ in done})
    print(
        f"[rank 0] {len(done)} steps, steady step {steady * 1000:.1f} ms; recoveries: {len(recoveries)}; "
        f"downtime {max(0.0, gaps[-1] - steady):.3f} s (largest gap minus a steady step); "
        f"steps recomputed: {recomputed}",
        flush=True,
    )


def resume(path: str, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Load the checkpoint at ``path`` if there is one; the step to start at."""
    if not path or not os.path.exists(path):
        return 0
    state = torch.load(path)
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    return int(state["step"]) + 1


def save(path: str, model: torch.nn.Module, optimizer: torch.optim.Optimizer, step: int) -> None:
    """The state after ``step``, written whole or not at all."""
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step}, path + ".tmp")
    os.replace(path + ".tmp", path)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--depth", type=int, default=2)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--step-time", type=float, default=0.0, help="extra seconds per step (a slower job)")
    parser.add_argument("--step-log", default="")
    parser.add_argument("--final", default="")
    parser.add_argument("--migrate-at", type=int, default=-1,
                        help="after this step, ask for a planned migration of --migrate-rank (tm.migrate)")
    parser.add_argument("--migrate-rank", type=int, default=1)
    parser.add_argument("--deterministic", action="store_true",
                        help="torch.use_deterministic_algorithms(True) (on CUDA also set CUBLAS_WORKSPACE_CONFIG)")
    parser.add_argument("--device", default="cpu", help="cpu, or cuda (every process on cuda:LOCAL_RANK %% GPUs)")
    parser.add_argument("--checkpoint", default="", help="resume from PATH at start; rank 0 saves there")
    parser.add_argument("--checkpoint-every", type=int, default=0, metavar="K", help="save every K steps (0: never)")
    parser.add_argument("--batchnorm", action="store_true",
                        help="a BatchNorm1d after each hidden layer (running statistics: buffers a forward changes)")
    parser.add_argument("--no-broadcast-buffers", action="store_true",
                        help="DDP's broadcast_buffers=False: each rank keeps its own buffers (per-rank state)")
    parser.add_argument("--grad-scaler", choices=("none", "tracked", "untracked"), default="none",
                        help="a torch.amp.GradScaler (its scale doubling every 2 steps), given to tm.track or not "
                             "(then tmrun tracks it for the script)")
    parser.add_argument("--lr-schedule", choices=("none", "tracked", "untracked"), default="none",
                        help="an LR scheduler (StepLR, x0.9 every step), given to tm.track or not "
                             "(then tmrun tracks it for the script)")
    parser.add_argument("--subgroup", action="store_true",
                        help="also make a group of every rank (dist.new_group), as a job with a device mesh does: "
                             "its standby rehearses and builds its DDP model once promoted (docs/user-guide.md)")
    args = parser.parse_args()

    tm = tmrun.init()  # on a standby: runs in the sandbox until promoted
    if args.subgroup:
        torch.distributed.new_group()
    if args.deterministic:
        torch.use_deterministic_algorithms(True)
    device = torch.device("cpu")
    if args.device == "cuda":
        device = torch.device("cuda", tm.local_rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    torch.manual_seed(0)
    model = build_model(args.width, args.depth, args.batchnorm).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    start = resume(args.checkpoint, model, opt)
    model = tm.ddp(model, **({"broadcast_buffers": False} if args.no_broadcast_buffers else {}))  # DDP over tmrun's group
    tm.track(model=model, optimizer=opt)  # what a joiner receives; step and RNG state included
    scaler = torch.amp.GradScaler(device.type, growth_interval=2, enabled=args.grad_scaler != "none")
    if args.grad_scaler == "tracked":
        tm.track(scaler=scaler)  # its scale goes to a joiner, and back where a failure aborted a step
    schedule = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.9) if args.lr_schedule != "none" else None
    if args.lr_schedule == "tracked":
        tm.track(lr_schedule=schedule)  # its epoch goes to a joiner, and back where a failure aborted a step
    loss_fn = torch.nn.MSELoss()
    done: list[tuple[int, float]] = []  # (step, completion time) on this process
    for step in tm.steps(args.steps, start=start):  # re-yields a step that a failure aborted
        x, y = batch_for(step, tm.rank, tm.world_size, args.width, args.batch)
        loss = loss_fn(model(x.to(device)), y.to(device))
        scaler.scale(loss).backward()  # without --grad-scaler: loss.backward()
        scaler.step(opt)  # opt.step(): applied only when every rank finished the step
        scaler.update()
        opt.zero_grad()
        if schedule is not None:
            schedule.step()
        if args.step_time:
            time.sleep(args.step_time)
        if not tm.is_shadow:
            done.append((step, time.monotonic()))
            if step == args.migrate_at and tm.rank == args.migrate_rank and not tm.void:
                tm.migrate(reason=f"--migrate-at {step}")
        if args.checkpoint_every and (step + 1) % args.checkpoint_every == 0 and tm.rank == 0 \
                and not tm.is_shadow and not tm.void:
            save(args.checkpoint, model.module, opt, step)
        if args.step_log and not tm.is_shadow:
            with open(args.step_log.replace("{rank}", str(tm.rank)), "a") as log:
                log.write(f"{step} {time.time():.6f} {os.getpid()}\n")
    if tm.rank == 0 and len(done) > 2:
        report(done, tm.recoveries)
    if args.final and (tm.rank == 0 or "{rank}" in args.final):  # "{rank}" in PATH: every rank writes
        with open(args.final.replace("{rank}", str(tm.rank)), "w") as out:
            scale = f" scale {scaler.get_scale():g}" if scaler.is_enabled() else ""
            lr = f" lr {opt.param_groups[0]['lr']:.9g}" if schedule is not None else ""
            out.write(digest(model.module, opt) + scale + lr + "\n")


if __name__ == "__main__":
    main()
