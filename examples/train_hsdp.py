"""HSDP with torch's own APIs under the tmrun worker API: a tiny GPT-style model sharded with
FSDP2 (``fully_shard``) on a 2-D ("replicate", "shard") device mesh, AdamW, a warm-up + cosine
LR schedule and a stateful data loader, all tracked.

    tmrun --standalone --nproc-per-node 4 --standby 1 examples/train_hsdp.py --final 'out/final-{rank}'
    torchrun --standalone --nproc-per-node 4 examples/train_hsdp.py --final 'out/final-{rank}'
    torchrun --standalone --nproc-per-node 4 --max-restarts 3 examples/train_hsdp.py --checkpoint-dir ckpt

An injected failure and a planned migration in one run (rank 2 SIGKILLed in step 1's backward
and replaced in place, then rank 1 moved to the other standby once it committed step 1, which
it asks for itself with ``tm.migrate()``; ``tmrun-ctl migrate 1`` does the same from outside);
the final digests are those of the torchrun run above:

    tmrun --standalone --nproc-per-node 4 --standby 2 --inject-failure rank=2,step=1,at=backward \
        examples/train_hsdp.py --migrate-at 1 --migrate-rank 1 --step-time 1.5 --final 'out/final-{rank}'

Nothing of the model code knows about tmrun: after ``tm = tmrun.init()`` the default process
group is the resilient "tmrun" backend, and ``init_device_mesh`` / ``fully_shard`` build their
subgroups on it (each dimension's groups are "tmrun" groups too). On a standby the same code runs
in its sandbox (every collective of every group served locally) until it is promoted.

--final PATH writes the SHA-256 of this rank's local shards (parameters and optimizer state)
and of the scheduler's and loader's state; ``{rank}`` in PATH is replaced by the rank. Replicas
(the same position along "shard") must agree, and runs under tmrun and torchrun must give the
same bits. A rank lost during training is replaced in place by the standby, which waits in
``tmrun.init()`` and then builds its mesh and model as that rank (docs/mesh.md); a rank migrated
(planned) trains on until the switch step and hands its shards over to such a standby.

--eval-log PATH: an evaluation after each step's update, on every rank (FSDP's all-gathers and an
all-reduce). A rank lost after a step's update leaves that step committed and its evaluation
void on the survivors (``tm.void``); the next step redoes it first (``tm.voided_step``), so the
log has one line per step with torchrun's value.

--checkpoint-dir DIR --checkpoint-every N: torchrun's way to survive a failure, for plain runs
(``torchrun --max-restarts K``, no standby): every N completed steps the ranks save the sharded
model and optimizer state with torch.distributed.checkpoint (DCP, each rank its local shards)
into DIR/step-S, plus the scheduler's and loader's state, then rank 0 points DIR/latest at it
(after a barrier: a kill mid-save never leaves a torn checkpoint in use). A restarted worker
group loads the latest checkpoint and resumes at step S exactly (same bits as a run without the
failure); the steps since it are recomputed. bench/hsdp_failover.py measures both ways.
"""

from __future__ import annotations

import argparse
import hashlib
import math
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import tmrun  # noqa: E402
from tiny_gpt import GPT, GPTConfig, TokenLoader, digest, loss_of  # noqa: E402


def schedule(warmup: int, total: int):
    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, total - warmup)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))

    return factor


def save_checkpoint(root: str, done: int, model, opt, sched, loader) -> None:
    """DCP of the sharded model and optimizer (collective: every rank writes its shards) and the
    scheduler's and loader's state (the same on every rank) into ``root/step-<done>``; then,
    after every rank finished, ``root/latest`` names it (written atomically by rank 0)."""
    path = os.path.join(root, f"step-{done}")
    model_state, opt_state = get_state_dict(model, opt)
    extra = {"step": done, "scheduler": sched.state_dict(), "loader": loader.state_dict()}
    dcp.save({"model": model_state, "optim": opt_state}, checkpoint_id=path)
    if dist.get_rank() == 0:
        torch.save(extra, os.path.join(path, "extra.pt"))
    dist.barrier()
    if dist.get_rank() == 0:
        with open(os.path.join(root, "latest.tmp"), "w") as out:
            out.write(f"step-{done}\n")
        os.replace(os.path.join(root, "latest.tmp"), os.path.join(root, "latest"))
    dist.barrier()  # nobody can fail past a checkpoint that is not yet the latest


def load_checkpoint(root: str, model, opt, sched, loader) -> int:
    """The step to resume at: 0 without a checkpoint, else what ``save_checkpoint`` saved."""
    try:
        with open(os.path.join(root, "latest")) as f:
            path = os.path.join(root, f.read().strip())
    except FileNotFoundError:
        return 0
    model_state, opt_state = get_state_dict(model, opt)
    state = {"model": model_state, "optim": opt_state}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    extra = torch.load(os.path.join(path, "extra.pt"), weights_only=True)
    sched.load_state_dict(extra["scheduler"])
    loader.load_state_dict(extra["loader"])
    return int(extra["step"])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--replicas", type=int, default=2, help='size of the "replicate" dimension')
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--dim", type=int, default=32)
    parser.add_argument("--final", default="")
    parser.add_argument("--step-log", default="", help="one line per completed step (step time pid); {rank}: the rank")
    parser.add_argument("--step-time", type=float, default=0.0, help="extra seconds per step (a slower job)")
    parser.add_argument("--checkpoint-dir", default="", help="plain runs: save (and resume from) DCP checkpoints here")
    parser.add_argument("--checkpoint-every", type=int, default=10, help="with --checkpoint-dir: every N steps")
    parser.add_argument("--migrate-at", type=int, default=-1,
                        help="after this step, --migrate-rank asks to be moved to a warm standby (tm.migrate: a planned "
                             "migration, nothing recomputed; ignored without a standby, e.g. under torchrun)")
    parser.add_argument("--migrate-rank", type=int, default=1)
    parser.add_argument("--eval-log", default="",
                        help="after each step's update every rank evaluates a held-out batch (FSDP's all-gathers, "
                             "then an all-reduce of the loss); rank 0 appends 'step loss how' (how: 'end', or "
                             "'redo' when a lost peer voided it and the next step redid it: tm.voided_step)")
    args = parser.parse_args()
    if args.checkpoint_every < 1:
        parser.error("--checkpoint-every must be at least 1")
    asked = False
    torch.set_num_threads(1)

    tm = tmrun.init()  # the default group is "tmrun"; on a standby: the sandbox until promoted
    world = tm.world_size
    mesh = init_device_mesh("cpu", (args.replicas, world // args.replicas), mesh_dim_names=("replicate", "shard"))

    cfg = GPTConfig(dim=args.dim, layers=args.layers)
    torch.manual_seed(0)
    model = GPT(cfg)
    for block in model.blocks:
        fully_shard(block, mesh=mesh)  # HSDP: shard over "shard", replicate over "replicate"
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    tm.track(model=model, optimizer=opt)  # local shards; opt.step() now goes through tmrun's guard
    # the scheduler after tm.track: it wraps the guarded step (made before, it warns each step
    # that optimizer.step() was overridden after it)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule(warmup=2, total=args.steps))
    loader = TokenLoader(cfg, dp_rank=tm.rank, dp_size=world)  # every rank is data-parallel in HSDP
    tm.track(scheduler=sched, loader=loader)
    start = 0
    if args.checkpoint_dir:
        os.makedirs(args.checkpoint_dir, exist_ok=True)
        start = load_checkpoint(args.checkpoint_dir, model, opt, sched, loader)
        if start and tm.rank == 0:
            print(f"resumed from the checkpoint of step {start}", flush=True)

    held_out = TokenLoader(cfg, dp_rank=0, dp_size=1, seed=1)
    evaluated: set[int] = set()

    def evaluate(step: int, how: str) -> None:
        """The model after ``step``'s update on a held-out batch, averaged over the ranks. Its
        collectives are void when a peer is lost (tm.void): then nothing is written, and the
        next step redoes it (tm.voided_step), the model as ``step`` left it."""
        idx, target = held_out.tokens[:4, :-1], held_out.tokens[:4, 1:]
        with torch.no_grad():
            val = loss_of(model, idx, target).reshape(1)
        dist.all_reduce(val)
        if tm.rank == 0 and not tm.is_shadow and not tm.void and step not in evaluated:
            evaluated.add(step)
            with open(args.eval_log, "a") as out:
                out.write(f"{step} {val.item() / tm.world_size:.6f} {how}\n")

    for step in tm.steps(args.steps):
        if step < start:  # done before the checkpoint this run resumed from
            continue
        if args.eval_log and tm.voided_step is not None:  # the last step's evaluation was void: redo it
            evaluate(tm.voided_step, "redo")
        idx, target = loader.next()
        loss = loss_of(model, idx, target)
        loss.backward()
        opt.step()  # skipped in a step a failure aborted (tm.track guards it)
        sched.step()
        opt.zero_grad()
        if args.step_time:
            time.sleep(args.step_time)
        if args.checkpoint_dir and (step + 1) % args.checkpoint_every == 0 and not tm.void:
            save_checkpoint(args.checkpoint_dir, step + 1, model, opt, sched, loader)
        if step == args.migrate_at and tm.rank == args.migrate_rank and tm.in_place and not tm.void and not asked:
            tm.migrate(reason=f"--migrate-at {step}")  # the switch: a later step boundary
            asked = True
        if args.step_log and not tm.is_shadow and tm.committed_step == step:  # its update was applied
            with open(args.step_log.replace("{rank}", str(tm.rank)), "a") as log:
                log.write(f"{step} {time.time():.6f} {os.getpid()}\n")
        if tm.rank == 0 and not tm.is_shadow and not tm.void:
            print(f"step {step} loss {loss.item():.4f} lr {sched.get_last_lr()[0]:.2e}", flush=True)
        if args.eval_log:
            evaluate(step, "end")
    if args.eval_log and tm.voided_step is not None:  # the last step's
        evaluate(tm.voided_step, "redo")

    if args.final:
        sha = hashlib.sha256(digest(model, opt).encode())
        sha.update(repr((sched.state_dict()["last_epoch"], loader.state_dict())).encode())
        with open(args.final.replace("{rank}", str(tm.rank)), "w") as out:
            out.write(sha.hexdigest() + "\n")


if __name__ == "__main__":
    main()
