"""nanoGPT in place: third-party training code (karpathy/nanoGPT at 3adf61e, MIT licence), its
``train.py``, ``model.py`` and ``configurator.py`` vendored verbatim in tests/thirdparty/nanogpt
(checked below against the upstream blob ids), and ``train_tmrun.py``, its port to the worker API
(``diff -u train.py train_tmrun.py``: docs/porting.md). The job: a 2-layer GPT on random tokens,
2 ranks under DDP with gradient accumulation (nanoGPT's own ``require_backward_grad_sync``
toggle), dropout 0.1, random batches drawn with the global torch RNG and prefetched, an
evaluation and a checkpoint by rank 0 every 10 iterations, its cosine LR schedule. A rank is
killed by a drill; the checkpoint rank 0 writes at the last iteration (model and AdamW state)
must be bitwise torchrun's, and every loss rank 0 printed must be one torchrun printed.

Found with it (2026-11-29): a rank lost in its optimizer step handed its joiner the random state
of the step before (the commit recorded the next step's data position, not its random state);
the joiner drew that step's batch again: exit 0, one in-place recovery, a checkpoint that
differed from torchrun's (tmrun.worker.rng_records)."""

from __future__ import annotations

import hashlib
import pickle
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.helpers import ROOT, run_job, tmrun_cmd, torchrun_cmd

NANOGPT = ROOT / "tests" / "thirdparty" / "nanogpt"
UPSTREAM_BLOBS = {  # git ls-tree 3adf61e154c3fe3fca428ad6bc3818b27a3b8291 (github.com/karpathy/nanoGPT)
    "train.py": "de5785051050d64bbda37a4964c2c079f0739b2b",
    "model.py": "c698f8b60129d793494de058b0dd4e318c0dcb5e",
    "configurator.py": "a8bba9599537cbb34b378399a077b525a87d497f",
    "LICENSE": "329db5e33310fd5d98343e2bca690bfb07317526",
}
CONFIG = ["--dataset=tiny", "--device=cpu", "--backend=gloo", "--dtype=float32", "--compile=False",
          "--n_layer=2", "--n_head=2", "--n_embd=48", "--block_size=64", "--batch_size=8",
          "--gradient_accumulation_steps=4", "--max_iters=40", "--eval_interval=10", "--eval_iters=2",
          "--warmup_iters=4", "--lr_decay_iters=40", "--learning_rate=1e-3", "--min_lr=1e-4", "--dropout=0.1",
          "--out_dir=out"]
JOB_TIMEOUT = 240
LINE = re.compile(r"^(step \d+: train loss \S+, val loss \S+|iter \d+: loss \S+),?", re.M)


def _workdir(work: Path) -> Path:
    """nanoGPT reads its configurator and data from the working directory: a copy, with a
    dataset of random tokens (its ``data/<dataset>/{train,val}.bin`` and ``meta.pkl``)."""
    import numpy as np

    work.mkdir()
    for name in ("train_tmrun.py", "model.py", "configurator.py"):
        shutil.copy(NANOGPT / name, work / name)
    data = work / "data" / "tiny"
    data.mkdir(parents=True)
    tokens = np.random.default_rng(0)
    for split, count in (("train", 20000), ("val", 4000)):
        tokens.integers(0, 64, count, dtype=np.uint16).tofile(data / f"{split}.bin")
    (data / "meta.pkl").write_bytes(pickle.dumps({"vocab_size": 64}))
    return work


def _checkpoint_digest(path: Path) -> tuple[int, str, float]:
    """(iteration, SHA-256 of the model and optimizer tensors, best loss) of nanoGPT's checkpoint."""
    import torch

    checkpoint = torch.load(path, weights_only=False)
    digest = hashlib.sha256()
    for name, tensor in sorted(checkpoint["model"].items()):
        digest.update(name.encode())
        digest.update(tensor.numpy().tobytes())
    for state in checkpoint["optimizer"]["state"].values():
        for name, value in sorted(state.items()):
            digest.update(value.numpy().tobytes())
    return checkpoint["iter_num"], digest.hexdigest(), float(checkpoint["best_val_loss"])


def _run(work: Path, launcher: str, *tmrun_args: str) -> tuple[int, str, tuple[int, str, float] | None, list[str]]:
    work = _workdir(work)
    if launcher == "torchrun":
        cmd = torchrun_cmd("--standalone", "--nproc-per-node", "2", "train_tmrun.py", *CONFIG)
    else:
        cmd = tmrun_cmd("--standalone", "--nproc-per-node", "2", "--standby", "1", "--console", "plain", *tmrun_args,
                        "train_tmrun.py", *CONFIG)
    code, log = run_job(cmd, work / "log", {"TMRUN_STATE_DIR": str(work / "state"), "OMP_NUM_THREADS": "1"},
                        JOB_TIMEOUT, cwd=work)
    checkpoint = work / "out" / "ckpt.pt"
    return code, log, _checkpoint_digest(checkpoint) if checkpoint.exists() else None, LINE.findall(log)


@pytest.fixture(scope="module")
def torchrun_reference(tmp_path_factory: pytest.TempPathFactory) -> tuple[tuple[int, str, float], list[str]]:
    code, log, checkpoint, lines = _run(tmp_path_factory.mktemp("nanogpt") / "torchrun", "torchrun")
    assert code == 0, log
    assert checkpoint is not None and checkpoint[0] == 40, log
    assert len(lines) == 41 + 5, log  # an "iter" line per iteration, an evaluation every 10
    return checkpoint, lines


def test_the_vendored_files_are_upstreams_verbatim() -> None:
    for name, blob in UPSTREAM_BLOBS.items():
        got = subprocess.run(["git", "hash-object", str(NANOGPT / name)], capture_output=True, text=True,
                             check=True).stdout.strip()
        assert got == blob, f"{name} is not nanoGPT's own (only train_tmrun.py is ours)"


@pytest.mark.parametrize("failure, recomputed", [
    # after the commit: the group resumes at step 14 (the random state bug); rank 0 redoes nothing,
    # or the part of step 14 it began before it learned of the loss
    ("rank=1,step=13,at=optimizer", "[01]"),
    ("rank=0,step=20,at=backward", "1"),  # rank 0 (evaluation, checkpoint, best loss) in an evaluation step, redone
])
def test_a_lost_rank_is_replaced_in_place_bitwise_equal_to_torchrun(
        tmp_path: Path, torchrun_reference: tuple[tuple[int, str, float], list[str]], failure: str,
        recomputed: str) -> None:
    reference_checkpoint, reference_lines = torchrun_reference
    code, log, checkpoint, lines = _run(tmp_path / "tmrun", "tmrun", "--inject-failure", failure)
    assert code == 0, log
    assert "in-place replacement, generation 1" in log and "replicas agree" in log, log
    assert "group restart" not in log.split("recovery totals")[0], log
    assert re.search(rf"1 in-place recoveries \(0 planned\), {recomputed} steps recomputed", log), log
    assert checkpoint == reference_checkpoint, "rank 0's last checkpoint differs from torchrun's\n" + log
    # every loss printed is torchrun's (a redone step prints twice; a killed rank 0 may lose its
    # step's line); the last evaluation is there
    assert set(lines) <= set(reference_lines), sorted(set(lines) - set(reference_lines))
    assert reference_lines[-2] in lines and len(set(reference_lines) - set(lines)) <= 1, log
    assert "Traceback" not in log, log


def _worker_pid(work: Path, rank: int, standby: int) -> int | None:
    """The process that runs ``rank`` of the job started in ``work`` (not its standby)."""
    import psutil

    for proc in psutil.process_iter(["pid", "cmdline"]):
        try:
            cmdline = " ".join(proc.info["cmdline"] or [])
            if proc.pid != standby and "train_tmrun.py" in cmdline and "tmrun.cli.main" not in cmdline \
                    and proc.cwd() == str(work) and proc.environ().get("RANK") == str(rank):
                return proc.pid
        except psutil.Error:
            continue
    return None


@pytest.mark.variant  # by hand: 34 such kills on 2026-11-29 (docs/status.md); the drills above run by default
@pytest.mark.parametrize("seed", range(1, 7))
def test_a_rank_killed_at_a_random_moment_is_replaced_in_place(
        tmp_path: Path, torchrun_reference: tuple[tuple[int, str, float], list[str]], seed: int) -> None:
    """Rank 0 or 1 SIGKILLed from outside at a random moment after a random iteration: never at a
    drill's fixed point (its prefetch, its evaluation, between its commit vote and its optimizer
    step, its logging after the step can all be hit)."""
    import os
    import random
    import signal
    import threading
    import time

    from tests.helpers import wait_until

    reference_checkpoint, _ = torchrun_reference
    pick = random.Random(seed)
    rank, after, delay = pick.choice([0, 1]), pick.randint(3, 30), pick.uniform(0.0, 0.3)
    work = tmp_path / "tmrun"
    killed: list[int] = []

    def kill() -> None:
        log = work / "log"

        def ready() -> bool:
            text = log.read_text(errors="replace") if log.exists() else ""
            return re.search(rf"^iter {after}:", text, re.M) is not None and "standby worker 0 started" in text

        if wait_until(ready, JOB_TIMEOUT):
            time.sleep(delay)
            started = re.search(r"standby worker 0 started \(pid (\d+)\)", log.read_text())
            standby = int(started.group(1))  # type: ignore[union-attr]
            pid = _worker_pid(work, rank, standby)
            if pid is not None:
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)

    killer = threading.Thread(target=kill, daemon=True)
    killer.start()
    code, log, checkpoint, _ = _run(work, "tmrun")
    killer.join(timeout=10)
    assert killed, log
    assert code == 0 and "1 in-place recoveries" in log and "group restart" not in log, log
    assert checkpoint == reference_checkpoint, "rank 0's last checkpoint differs from torchrun's\n" + log
