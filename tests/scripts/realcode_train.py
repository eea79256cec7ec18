"""A raw-loop GPT trainer with the habits of real training code (issue 29), on the tmrun API.

What tmrun's own example scripts do not do, and third-party trainers do:

* a fused QKV projection whose ``state_dict`` hook exposes unfused q/k/v *copies* (torchtitan);
* an output head outside the DDP model whose gradient the script averages itself;
* a chunked cross-entropy that runs its own backward per chunk on a detached hidden state and
  asserts that state got its gradient, then back-propagates the body with it;
* gradient accumulation over micro-batches with ``no_sync``;
* an evaluation inside the loop under ``torch.no_grad()`` on rank 0, a "best" value kept from it,
  and a checkpoint written when it improves (skipped in an aborted step, as the porting guide
  says);
* a data loader whose position differs by rank (``tm.track_per_rank``), an LR schedule;
* ``@record`` on ``main`` (torch's elastic error handler, which swallows ``SystemExit(0)``);
* a function compiled with ``torch.compile`` that reads ``dist.get_rank()`` (``--compiled-rank``);
* resuming: ``--start`` runs steps ``start .. steps - 1`` as a script restarted from its
  checkpoint would.

Outputs: ``--final`` (per rank, ``{rank}``): a digest of the model and optimizer state;
``--eval-log``: rank 0's ``step value`` lines, one per evaluation run (an evaluation of a step that
is redone appears twice; every value must be the true one). ``--end-eval-log``: an evaluation
after each step's update on every rank, averaged by an all-reduce; a void one (a peer lost after
the commit) is redone at the next step's start (``tm.voided_step``): one true line per step.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import signal
import threading
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.elastic.multiprocessing.errors import record

import tmrun

VOCAB, WIDTH, HEADS, LAYERS, SEQ = 64, 32, 4, 2, 16
_RUNTIME: list[Any] = []  # this process's tmrun runtime, once made


class Attention(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.wqkv = torch.nn.Linear(WIDTH, 3 * WIDTH, bias=False)
        self.wo = torch.nn.Linear(WIDTH, WIDTH, bias=False)
        self._register_state_dict_hook(Attention._unfuse)
        self._register_load_state_dict_pre_hook(Attention._fuse)

    @staticmethod
    def _unfuse(module: "Attention", state: dict[str, Any], prefix: str, _local: Any) -> dict[str, Any]:
        fused = state.pop(f"{prefix}wqkv.weight")
        for name, part in zip("qkv", fused.chunk(3)):
            state[f"{prefix}w{name}.weight"] = part.clone()
        return state

    @staticmethod
    def _fuse(state: dict[str, Any], prefix: str, *_: Any) -> None:
        state[f"{prefix}wqkv.weight"] = torch.cat([state.pop(f"{prefix}w{n}.weight") for n in "qkv"])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = self.wqkv(x).view(b, t, 3, HEADS, WIDTH // HEADS).unbind(2)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(b, t, WIDTH))


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm1, self.norm2 = torch.nn.LayerNorm(WIDTH), torch.nn.LayerNorm(WIDTH)
        self.attn = Attention()
        self.mlp = torch.nn.Sequential(torch.nn.Linear(WIDTH, 4 * WIDTH), torch.nn.GELU(), torch.nn.Linear(4 * WIDTH, WIDTH))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class Body(torch.nn.Module):
    """Everything but the output head (the head is applied chunk by chunk in the loss)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, WIDTH)
        self.blocks = torch.nn.ModuleList(Block() for _ in range(LAYERS))
        self.norm = torch.nn.LayerNorm(WIDTH)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.norm(x)


class RankLoader:
    """Token batches from a position that differs by rank (a sharded data set's reader)."""

    def __init__(self, rank: int, batch: int) -> None:
        self.position = 1000 * rank
        self.batch = batch

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(self.position)
        self.position += 1
        data = torch.randint(0, VOCAB, (self.batch, SEQ + 1), generator=g)
        return data[:, :-1], data[:, 1:]

    def state_dict(self) -> dict[str, int]:
        return {"position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.position = state["position"]


def chunked_loss(body_out: torch.Tensor, head: torch.nn.Linear, targets: torch.Tensor, chunks: int,
                 pause: float) -> torch.Tensor:
    """torchtitan's chunked cross-entropy's shape (see the module docstring)."""
    hidden = body_out.detach().requires_grad_(True)
    time.sleep(pause)  # the head's compute, where a peer's loss is often noticed
    total = torch.zeros(())
    for part, part_targets in zip(hidden.chunk(chunks), targets.chunk(chunks)):
        loss = F.cross_entropy(head(part).flatten(0, 1), part_targets.flatten()) / chunks
        loss.backward()
        total += loss.detach()
    assert hidden.grad is not None, "the hidden state got no gradient"
    body_out.backward(hidden.grad)
    return total


def _bytes(t: torch.Tensor) -> bytes:
    from tmrun.comm.native import as_buffer  # no numpy needed

    host = t.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
    return bytes(as_buffer(host)[0]) if host.numel() else b""


def digest(model: torch.nn.Module, opt: torch.optim.Optimizer) -> str:
    h = hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(_bytes(t))
    for state in opt.state_dict()["state"].values():
        for key in sorted(state):
            if isinstance(state[key], torch.Tensor):
                h.update(_bytes(state[key]))
    return h.hexdigest()


@record
def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--resume-step", type=int, default=0,
                        help="resume as from a checkpoint of step N - 1 (tm.steps(total, start=N))")
    parser.add_argument("--micro", type=int, default=2, help="micro-batches per step (no_sync)")
    parser.add_argument("--chunks", type=int, default=4)
    parser.add_argument("--pause", type=float, default=0.0, help="seconds before the chunked loss")
    parser.add_argument("--final", required=True)
    parser.add_argument("--eval-log", required=True)
    parser.add_argument("--end-eval-log", default="",
                        help="rank 0's 'step value how' per end-of-step evaluation (every rank evaluates, one "
                             "all-reduce; how: 'end', or 'redo' when redone in the next step after a void tail)")
    parser.add_argument("--kill-in-loss", type=int, default=-1, help="rank 1 SIGKILLs itself in this step's loss")
    parser.add_argument("--kill-at", default="", help="STEP:SECONDS: --kill-rank is SIGKILLed that long into STEP")
    parser.add_argument("--kill-rank", type=int, default=1)
    parser.add_argument("--step-log", default="", help="per rank ({rank}): 'step pid' per completed step")
    parser.add_argument("--aborted-log", default="", help="per rank ({rank}): 'step aborted committed void' per step run")
    parser.add_argument("--gloo-group", action="store_true",
                        help="a CPU side group (dist.new_group(backend='gloo')), as torchtitan's asynchronous "
                             "checkpoint makes one: a thread of each step all-reduces on it (a background save's "
                             "collectives), each outcome written to --side-log; every rank all-reduces on it at "
                             "the end")
    parser.add_argument("--mesh-group", action="store_true",
                        help="a tmrun subgroup of every rank (dist.new_group()) sums each step's loss: the job has "
                             "subgroups, so its standby rehearses and its joiner builds the DDP model after its "
                             "promotion")
    parser.add_argument("--side-log", default="",
                        help="with --gloo-group: 'step ok|cut|wrong' per background all-reduce")
    parser.add_argument("--compiled-rank", action="store_true",
                        help="each step checks dist.get_rank() read inside a compiled function (dynamo folds it in)")
    parser.add_argument("--corrupt-on-heal", action="store_true",
                        help="a tracked object's load_state_dict changes a weight (a buggy state hook)")
    args = parser.parse_args()
    try:  # a framework's catch-all around its training: a standby's exit must not stop here
        train(args)
    except BaseException as leaving:  # noqa: BLE001
        # (a rehearsal's end passes through here by design: re-raised, the script runs again)
        if _RUNTIME and _RUNTIME[0].is_standby and type(leaving).__name__ != "Rehearsed":
            with open(args.final + f".ran-on-{os.getpid()}", "w") as out:
                out.write("a standby's exit was swallowed and the script ran on\n")
        raise


def train(args: argparse.Namespace) -> None:

    tm = tmrun.init()
    _RUNTIME.append(tm)
    torch.manual_seed(0)
    body = Body()
    head = torch.nn.Linear(WIDTH, VOCAB, bias=False)
    # the script's own "checkpoint": a resumed run starts from the state of `start` earlier steps
    # (here simply a deterministic state: every run with the same --start starts alike)
    mesh_group = dist.new_group() if args.mesh_group else None  # (before the model, as a mesh is made)
    model = tm.ddp(body)
    opt = torch.optim.AdamW([*model.parameters(), *head.parameters()], lr=3e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 4))
    loader = RankLoader(tm.rank, batch=4)
    best = Best()  # rank 0's alone: per rank (a tm.track value would come from a donor)
    tm.track(model=model, head=head, optimizer=opt, scheduler=sched)
    tm.track_per_rank(loader=loader, best=best)
    if args.corrupt_on_heal:
        tm.track(hook=CorruptingHook(head))
    if args.resume_step and not tm.is_standby:
        loader.position += args.resume_step * args.micro  # where the checkpoint's loader stood
        for _ in range(args.resume_step):
            sched.step()
    val_tokens, val_targets = RankLoader(99, batch=4).next()
    written: set[int] = set()
    side_group = dist.new_group(backend="gloo") if args.gloo_group else None

    def end_eval(step: int, how: str) -> None:
        """An evaluation after the step's update, averaged over the ranks (a collective): its
        value is written unless void (a peer lost: tm.void), and then redone in the next step."""
        end_tokens, end_targets = RankLoader(50 + tm.rank, batch=4).next()  # each rank its own held-out batch
        with torch.no_grad():  # (made here: a warm standby's set-up ran before it knew its rank)
            val = F.cross_entropy(head(model(end_tokens)).flatten(0, 1), end_targets.flatten()).reshape(1)
        dist.all_reduce(val)
        if tm.rank == 0 and not tm.is_shadow and not tm.void and step not in written:
            written.add(step)
            with open(args.end_eval_log, "a") as log:
                log.write(f"{step} {val.item() / tm.world_size:.6f} {how}\n")

    # compiled code reading the rank: a standby traces it in its sandbox, as another rank
    compiled_rank = torch.compile(lambda x: x + dist.get_rank(), backend="eager", fullgraph=True) \
        if args.compiled_rank else None
    kill_step, _, kill_after = args.kill_at.partition(":")
    side_thread: threading.Thread | None = None
    for step in tm.steps(args.steps, start=args.resume_step):
        if side_group is not None and not tm.is_shadow:  # the last step's "save" done, the next one begins
            if side_thread is not None:
                side_thread.join()
            side_thread = threading.Thread(target=side_work, args=(side_group, step, tm.world_size, args.side_log))
            side_thread.start()
        if args.end_eval_log and tm.voided_step is not None:  # the last step's tail was void: redo it first
            end_eval(tm.voided_step, "redo")
        if args.kill_at and step == int(kill_step) and tm.rank == args.kill_rank and not tm.is_shadow \
                and not os.path.exists(args.final + ".killed"):
            open(args.final + ".killed", "w").close()
            threading.Timer(float(kill_after), os.kill, (os.getpid(), signal.SIGKILL)).start()
        if tm.rank == 0 and not tm.is_shadow:
            with torch.no_grad():  # an evaluation inside the loop, at the step's start
                val = F.cross_entropy(head(model(val_tokens)).flatten(0, 1), val_targets.flatten()).item()
            with open(args.eval_log, "a") as log:
                log.write(f"{step} {val:.6f}\n")
            if val < best.val and not tm.aborted:
                best.val = val  # a checkpoint with the best value would be written here
        if compiled_rank is not None:
            seen = int(compiled_rank(torch.zeros(())).item())
            assert seen == dist.get_rank(), f"rank {dist.get_rank()}: compiled code computed with rank {seen}"
        step_loss = torch.zeros(())
        for micro in range(args.micro):
            tokens, targets = loader.next()
            last = micro == args.micro - 1
            context = model.no_sync() if not last else _nothing()
            with context:
                if step == args.kill_in_loss and tm.rank == 1 and last and not tm.is_shadow \
                        and not os.path.exists(args.final + ".killed"):
                    open(args.final + ".killed", "w").close()  # once: the joiner plays rank 1 on
                    os.kill(os.getpid(), signal.SIGKILL)
                step_loss += chunked_loss(model(tokens), head, targets, args.chunks, args.pause)
        for param in head.parameters():  # the head is not in the DDP model: the script averages it
            dist.all_reduce(param.grad)
            param.grad /= tm.world_size
        opt.step()
        sched.step()
        opt.zero_grad()
        dist.all_reduce(step_loss, group=mesh_group)  # a metrics all-reduce after the optimizer step
        if args.end_eval_log:
            end_eval(step, "end")
        if args.aborted_log and not tm.is_shadow:
            with open(args.aborted_log.format(rank=tm.rank), "a") as log:
                log.write(f"{step} {int(tm.aborted)} {int(tm.committed_step >= step)} {int(tm.void)}\n")
        if args.step_log and not tm.is_shadow and not tm.aborted:  # committed (void perhaps)
            with open(args.step_log.format(rank=tm.rank), "a") as log:
                log.write(f"{step} {os.getpid()}\n")
    if args.end_eval_log and not tm.is_standby and tm.voided_step is not None:  # the last step's tail was void
        end_eval(tm.voided_step, "redo")
    if side_thread is not None:
        side_thread.join()
    if side_group is not None and not tm.is_standby:
        done = torch.ones(1)
        dist.all_reduce(done, group=side_group)  # the CPU side group in use: every rank finished
        assert done.item() == tm.world_size
    if tm.rank == 0 and not tm.is_standby:
        with open(args.eval_log, "a") as log:
            log.write(f"-1 {best.val:.6f}\n")  # rank 0's best value, as its process ends
    if not tm.is_standby:
        with open(args.final.format(rank=tm.rank), "w") as out:
            out.write(digest(torch.nn.ModuleList([body, head]), opt) + "\n")


def side_work(group: Any, step: int, world_size: int, side_log: str) -> None:
    """A background thread's collectives on the side group, spread over the step (a save's plans
    and results): each all-reduce of ones gives the world size, or fails when a change cut it
    off (tmrun's BackgroundInterrupted), never another value."""
    from tmrun.comm.backend import BackgroundInterrupted

    outcomes = []
    for _ in range(8):
        time.sleep(0.025)
        value = torch.ones(1)
        try:
            dist.all_reduce(value, group=group)
        except BackgroundInterrupted:
            outcomes.append("cut")
            continue
        outcomes.append("ok" if value.item() == world_size else f"wrong:{value.item()}")
    if side_log:
        with open(side_log.format(rank=dist.get_rank()), "a") as log:
            log.writelines(f"{step} {outcome}\n" for outcome in outcomes)


class Best:
    def __init__(self) -> None:
        self.val = float("inf")

    def state_dict(self) -> dict[str, float]:
        return {"val": self.val}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.val = state["val"]


class CorruptingHook:
    """A tracked object whose load_state_dict changes a weight: what a buggy state hook does on
    the joiner (the replica check must stop the job)."""

    def __init__(self, head: torch.nn.Module) -> None:
        self.head = head

    def state_dict(self) -> dict[str, int]:
        return {}

    def load_state_dict(self, _state: dict[str, int]) -> None:
        with torch.no_grad():
            self.head.weight[0, 0] += 1.0


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *_: Any) -> None:
        return None


if __name__ == "__main__":
    main()
