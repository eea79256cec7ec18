"""torchtitan (0.3.0, the ``torchtitan`` extra) through :mod:`tmrun.integrations.torchtitan`: its
llama3 debug model on CPU (the test-only shim and config in tests/titan/), trained under plain
torchrun without a failure and under ``tmrun --standby 1`` with a rank SIGKILLed in the middle
of a step's forward, in four layouts (DDP-like on 2 processes, HSDP 2 x 2, TP x DP and PP x DP on 4):
every rank ends bitwise equal to torchrun's (model shards, buffers, optimizer state, learning
rates), survivors keep their processes, at most one step is redone.
Also: the integration's result is bitwise that of torchtitan's own trainer."""

from __future__ import annotations

import importlib.util
import os
import re
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.helpers import ROOT, run_job, tmrun_cmd, torchrun_cmd

pytestmark = pytest.mark.skipif(importlib.util.find_spec("torchtitan") is None,
                                reason="torchtitan is not installed (pip install -e '.[torchtitan]')")

STEPS = 8  # tests/titan/config.py: STEPS
KILL_STEP = 4  # torchtitan's 1-based step in whose forward the rank kills itself
JOB_TIMEOUT = 300
# layout name -> (processes, torchtitan's parallelism flags)
LAYOUTS = {
    # with gradient accumulation (a global batch of 8 is 2 microbatches of 2 per rank and step) and
    # torchtitan's DCP checkpoint every 2 steps (compared with torchrun's by content)
    "ddp": (2, ["--parallelism.data_parallel_replicate_degree", "2", "--training.global_batch_size", "8",
                "--checkpoint.enable", "--checkpoint.interval", "2", "--checkpoint.folder", "ckpt"]),
    # the same with torchtitan's asynchronous checkpoint (its saves on a thread of their own, through
    # dist.new_group(backend="gloo"): a tmrun background group under tmrun)
    "ddp_async": (2, ["--parallelism.data_parallel_replicate_degree", "2", "--training.global_batch_size", "8",
                      "--checkpoint.enable", "--checkpoint.interval", "2", "--checkpoint.folder", "ckpt",
                      "--checkpoint.async_mode", "async"]),
    # the DDP-like layout saving every step: the reference for a save taken out of the interval
    "ddp_each_step": (2, ["--parallelism.data_parallel_replicate_degree", "2", "--training.global_batch_size", "8",
                          "--checkpoint.enable", "--checkpoint.interval", "1", "--checkpoint.folder", "ckpt"]),
    # compiled as torchtitan compiles (each transformer block whole, fullgraph; inductor on the CPU)
    "hsdp": (4, ["--parallelism.data_parallel_replicate_degree", "2", "--parallelism.data_parallel_shard_degree", "2",
                 "--compile.enable"]),
    # compiled too: the loss's vocabulary-parallel cross-entropy reads its TP rank, which dynamo folds
    # into the graph (a joiner that kept its rehearsal's graph trained on with wrong values)
    "tp_dp": (4, ["--parallelism.data_parallel_replicate_degree", "2", "--parallelism.data_parallel_shard_degree", "1",
                  "--parallelism.tensor_parallel_degree", "2", "--compile.enable"]),
    # DeepSeek-V3's debug model (mixture of experts: routed experts sharded over "ep", their tokens
    # exchanged by all-to-all with data-dependent splits) on HSDP 2 x 2, experts parallel 2, compiled
    "moe_ep": (4, ["--parallelism.data_parallel_replicate_degree", "2", "--parallelism.data_parallel_shard_degree", "2",
                   "--parallelism.expert_parallel_degree", "2", "--compile.enable"]),
    # pipeline parallel 2 x dp_replicate 2 (torchtitan's mesh puts "pp" outermost: ranks 0, 1 hold stage 0)
    "pp_dp": (4, ["--parallelism.data_parallel_replicate_degree", "2", "--parallelism.pipeline_parallel_degree", "2"]),
    # the same with two stages per rank (Interleaved 1F1B: rank r holds stages r // 2 and r // 2 + 2)
    "pp_dp_interleaved": (4, ["--parallelism.data_parallel_replicate_degree", "2",
                              "--parallelism.pipeline_parallel_degree", "2",
                              "--parallelism.pipeline_parallel_schedule", "Interleaved1F1B"]),
    # zero bubble in a V (ZBV: rank r holds stages r // 2 and 3 - r // 2, the first rank pair the
    # first and the last stage), its backward split into input and weight parts; without
    # activation checkpointing, which torchtitan's split backward refuses under torchrun too
    # ("Trying to backward an extra time ... selective activation checkpoint")
    "pp_dp_zbv": (4, ["--parallelism.data_parallel_replicate_degree", "2",
                      "--parallelism.pipeline_parallel_degree", "2",
                      "--parallelism.pipeline_parallel_schedule", "ZBVZeroBubble", "activation-checkpoint:none"]),
    # pipeline parallel 2 x dp_replicate 2 with torchtitan's validator after every second step
    # (--config titan_debug_cpu_validate: pp_schedule.eval() after the step's training)
    "pp_dp_validate": (4, ["--parallelism.data_parallel_replicate_degree", "2",
                           "--parallelism.pipeline_parallel_degree", "2"]),
    # pure FSDP (one holder per shard), torchtitan's DCP checkpoint every 2 steps
    "fsdp": (2, ["--parallelism.data_parallel_shard_degree", "2", "--checkpoint.enable", "--checkpoint.interval", "2",
                 "--checkpoint.folder", "ckpt"]),
}


@pytest.fixture(scope="module")
def assets(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.titan.assets import make_assets

    directory = tmp_path_factory.mktemp("titan-assets")
    make_assets(directory)
    return directory


# layout -> its --config, where not titan_debug_cpu
CONFIGS = {"pp_dp_validate": "titan_debug_cpu_validate", "moe_ep": "titan_moe_cpu"}


def _run(work: Path, assets: Path, launcher: str, layout: str, config: str = "",
         kill: str | None = None) -> tuple[int, str, dict]:
    """Train the layout; returns (exit code, log, {"finals": {rank: digest}, "steps": {rank: [(step, pid)]},
    "checkpoints": {step folder: content digest}})."""
    work.mkdir()
    config = config or CONFIGS.get(layout, "titan_debug_cpu")
    nproc, flags = LAYOUTS[layout]
    args = ["--standalone", "--nproc-per-node", str(nproc)]
    titan = ["-m", "torchtitan.train", "--module", "tests.titan.config", "--config", config, *flags]
    if launcher == "torchrun":
        cmd = torchrun_cmd(*args, *titan)
    else:
        cmd = tmrun_cmd(*args, "--standby", "1", "--console", "plain", *titan)
    env = {"TITAN_TEST_ASSETS": str(assets), "TITAN_TEST_OUT": str(work), "TMRUN_STATE_DIR": str(work / "state"),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
           "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    if kill:
        env["TITAN_TEST_KILL"] = kill
    code, log = run_job(cmd, work / "log", env, JOB_TIMEOUT)
    finals = {r: (work / f"final-{r}").read_text().strip() for r in range(nproc) if (work / f"final-{r}").exists()}
    steps = {r: [tuple(map(int, line.split())) for line in (work / f"steps-{r}").read_text().splitlines()]
             for r in range(nproc) if (work / f"steps-{r}").exists()}
    # torchtitan's checkpoints (the DDP-like layout's), by content: the files' bytes vary between runs
    checkpoints = _checkpoint_digests(work / "ckpt") if layout.startswith("ddp") else {}
    return code, log, {"finals": finals, "steps": steps, "checkpoints": checkpoints}


def _checkpoint_digests(folder: Path) -> dict[str, str]:
    """step folder -> SHA-256 of everything torchtitan's DCP checkpoint there holds (read back in
    this process: model, optimizer, LR schedulers, data loader and train state, in key order).
    A folder without DCP's ``.metadata`` (a save not finished: torchtitan never loads it) is left out."""
    import hashlib
    import tempfile

    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    def leaves(value: object, path: str = "") -> list[tuple[str, object]]:
        if isinstance(value, dict):
            return [leaf for key in sorted(value, key=str) for leaf in leaves(value[key], f"{path}.{key}")]
        if isinstance(value, (list, tuple)):
            return [leaf for i, item in enumerate(value) for leaf in leaves(item, f"{path}[{i}]")]
        return [(path, value)]

    digests: dict[str, str] = {}
    for step in sorted(p for p in folder.glob("step-*") if (p / ".metadata").is_file()) if folder.is_dir() else []:
        with tempfile.TemporaryDirectory() as scratch:
            dcp_to_torch_save(step, Path(scratch) / "state.pt")
            state = torch.load(Path(scratch) / "state.pt", weights_only=False)
        digest = hashlib.sha256()
        for path, value in leaves(state):
            digest.update(path.encode())
            if isinstance(value, torch.Tensor):
                digest.update(f"{tuple(value.shape)} {value.dtype}".encode())
                digest.update(value.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
            else:
                digest.update(repr(value).encode())
        digests[step.name] = digest.hexdigest()
    return digests


@pytest.fixture(scope="module")
def references(tmp_path_factory: pytest.TempPathFactory, assets: Path) -> Callable[[str], dict]:
    """The layout under plain torchrun, no failure (run once per layout): every step ran once,
    the replicas of each shard end equal."""
    done: dict[str, dict] = {}

    def reference(layout: str) -> dict:
        if layout not in done:
            code, log, got = _run(tmp_path_factory.mktemp(f"titan-{layout}") / "torchrun", assets, "torchrun", layout)
            assert code == 0, log
            nproc = LAYOUTS[layout][0]
            assert len(got["finals"]) == nproc, got
            assert all([s for s, _ in got["steps"][r]] == list(range(1, STEPS + 1)) for r in range(nproc)), got["steps"]
            done[layout] = {**got, "log": log}
        return done[layout]

    return reference


@pytest.fixture(scope="module")
def ddp_reference(references: Callable[[str], dict]) -> dict:
    got = references("ddp")
    assert len(set(got["finals"].values())) == 1, got  # every parameter is replicated
    assert sorted(got["checkpoints"]) == ["step-2", "step-4", "step-6", "step-8"], got["checkpoints"]
    return got


def test_the_integration_trains_as_torchtitans_own_trainer(tmp_path: Path, assets: Path, ddp_reference: dict) -> None:
    """torchtitan's own Trainer (no tmrun: gloo, the shim's SUM reductions) under torchrun ends
    with the integration's bits: tmrun.init(), the tracking and tm.steps change no number."""
    code, log, got = _run(tmp_path / "plain", assets, "torchrun", "ddp", config="titan_debug_cpu_plain")
    assert code == 0, log
    assert got["finals"] == ddp_reference["finals"], log
    assert got["checkpoints"] == ddp_reference["checkpoints"], log


def _check_in_place(code: int, log: str, got: dict, reference: dict, killed: int) -> None:
    assert code == 0, log
    assert got["finals"] == reference["finals"], "a rank's final state differs from torchrun's\n" + log
    assert got["checkpoints"] == reference["checkpoints"], "a checkpoint differs from torchrun's\n" + log
    assert "in-place replacement" in log and "replicas agree" in log, log
    # (not "group restart" anywhere: a script drawing random numbers after opt.step() is told in
    # one line that a rank lost after its optimizer step would take the group restart)
    assert "falling back to restarting the worker group" not in log and "restarted: epoch" not in log, log
    assert "Traceback" not in log, log
    for rank, steps in got["steps"].items():
        assert sorted({s for s, _ in steps}) == list(range(1, STEPS + 1)), (rank, steps)
        assert len(steps) - len({s for s, _ in steps}) <= 1, f"rank {rank} redid more than one step: {steps}"
        if rank != killed:
            assert len({pid for _, pid in steps}) == 1, f"survivor rank {rank} changed process: {steps}"
    assert len({pid for _, pid in got["steps"][killed]}) == 2, f"rank {killed} should have been played by two processes"


@pytest.mark.parametrize("killed, step", [(1, KILL_STEP), pytest.param(0, 6, marks=pytest.mark.variant)],
                         ids=["rank1-step4", "rank0-step6"])
def test_ddp_layout_rank_killed_mid_step_is_replaced_in_place(tmp_path: Path, assets: Path, ddp_reference: dict,
                                                              killed: int, step: int) -> None:
    """``dp_replicate`` 2 (FSDP2 over a 2 x 1 mesh, every parameter replicated) with torchtitan's
    gradient accumulation (2 microbatches a step): a rank SIGKILLed in the forward of the middle
    layer of a step's second microbatch, its first one's gradients accumulated (rank 1 in step 4;
    rank 0, which logs the metrics, in step 6); the standby takes its place and is healed from
    the other rank's memory; the result is torchrun's, bit for bit."""
    code, log, got = _run(tmp_path / "tmrun", assets, "tmrun", "ddp", kill=f"{killed}:{step}:forward=2")
    _check_in_place(code, log, got, ddp_reference, killed=killed)
    assert (tmp_path / "tmrun" / "killed").read_text().split()[1:] == [str(step)], log  # in that step, not a later one


def test_a_rank_lost_in_a_checkpoint_save_has_it_redone(tmp_path: Path, assets: Path, ddp_reference: dict) -> None:
    """Rank 1 SIGKILLed as step 4's DCP checkpoint save begins (after the step's update): DCP
    gathers and broadcasts its save plans, and the survivor decoded what the collectives served
    locally after the loss (``EOFError: Ran out of input``; rank 0 of HSDP: "Failed to validate
    global plan") and died: the group restart from the checkpoint of step 2. Now a failed save
    is void (one line), step 4 is not redone, every rank saves step 4 again before step 5
    (``tm.voided_step``), and every checkpoint holds torchrun's values, as does every rank at the end."""
    code, log, got = _run(tmp_path / "tmrun", assets, "tmrun", "ddp", kill="1:4:save")
    _check_in_place(code, log, got, ddp_reference, killed=1)
    # (rank 0's save fails, in one line, when DCP decodes what a collective served after the loss
    # gave: "step 4's checkpoint save failed in a void step (EOFError ...)"; in some runs what it
    # decoded was whole and the void save ended without an error; either way it is done again)
    assert "rank 0: step 3 committed and then lost a peer" in log, log
    assert "step 4's checkpoint and validation were void" in log, log
    assert re.search(r"1 in-place recoveries \(0 planned\), 0 steps recomputed", log), log


def test_an_asynchronous_save_cut_off_by_a_failure_is_said_and_taken_again_at_the_next_step(
        tmp_path: Path, assets: Path, ddp_reference: dict, references: Callable[[str], dict]) -> None:
    """``--checkpoint.async_mode async``: torchtitan saves on a thread of its own through
    ``dist.new_group(backend="gloo")``. A gloo group cannot follow a replacement, so every failure
    took the group restart (75 s of waiting before the ninth session, at once since). Now it is a
    tmrun background group. Rank 1 SIGKILLed in step 4's background save as it writes its files:
    rank 0's save thread waits for it in DCP's gather of the results. Its operations fail rather
    than being served locally: step 4's save is not finished (no ``.metadata``, so torchtitan
    never loads it; a save finished with plans no peer made would be loaded), said in one line.
    The job is replaced in place and, since the thirteenth session, the ranks agree at the first
    step after the recovery that a save was cut and save that step's state at once, out of the interval
    (before, the job's newest checkpoint stayed step 2's until step 6). Every checkpoint written
    is torchrun's for its step (a torchrun run saving every step), as is every rank's final state."""
    code, log, got = _run(tmp_path / "tmrun", assets, "tmrun", "ddp_async", kill="1:4:background")
    each_step = references("ddp_each_step")["checkpoints"]
    said = re.search(r"tmrun: saving step (\d+)'s checkpoint now, out of the interval", log)
    assert said, log
    taken = f"step-{said.group(1)}"
    assert sorted(got["checkpoints"]) == sorted({"step-2", "step-6", "step-8", taken}), (got["checkpoints"], log)
    assert taken in ("step-5", "step-6"), log  # the first step whose tail follows the change
    expected = {name: each_step[name] for name in got["checkpoints"]}
    _check_in_place(code, log, got, {**ddp_reference, "checkpoints": expected}, killed=1)
    assert "rank 0: the script made a gloo group (dist.new_group(backend='gloo')" in log, log
    assert "the asynchronous checkpoint save of step 4 was cut off by a change" in log, log
    assert not (tmp_path / "tmrun" / "ckpt" / "step-4" / ".metadata").exists()
    assert (tmp_path / "tmrun" / "killed").read_text().split()[1:] == ["4"], log


# ddp-21 and hsdp-22 are variants (CI time): those layouts are replaced in place by default in
# test_ddp_layout_rank_killed_mid_step_is_replaced_in_place[rank1-step4] and
# test_hsdp_layout_rank_killed_mid_step_is_replaced_in_place (HSDP at random moments by default:
# tests/e2e/test_mesh.py)
@pytest.mark.parametrize("layout, seed", [pytest.param("ddp", 21, marks=pytest.mark.variant),
                                          pytest.param("hsdp", 22, marks=pytest.mark.variant), ("tp_dp", 23),
                                          pytest.param("moe_ep", 24, marks=pytest.mark.variant),
                                          pytest.param("ddp_async", 25, marks=pytest.mark.variant)])
def test_rank_killed_at_a_random_moment_is_replaced_in_place(tmp_path: Path, assets: Path,
                                                             references: Callable[[str], dict], layout: str,
                                                             seed: int) -> None:
    """Rank 1 SIGKILLed from outside at a random moment of a step (after its third step): not at a
    fixed point of torchtitan's step (forward, the chunked loss's backward, the optimizer step,
    its metrics all-reduce after the optimizer step can all be hit), in the DDP-like, HSDP 2 x 2
    and TP x DP layouts, and (under ``--variants``) DeepSeek-V3's mixture of experts with experts
    parallel over HSDP, where the kill can land in an all-to-all, and the DDP-like layout with
    torchtitan's asynchronous checkpoint (a background save the kill cuts off is not finished,
    said in one line; every other checkpoint torchrun's). HSDP's blocks are compiled
    (``--compile.enable``: torchtitan compiles each block whole, fullgraph): a survivor doomed
    inside one used to die of dynamo's ``Unsupported: Observed exception`` (tmrun's check, traced
    into the block, raised there)."""
    import random
    import signal
    import threading
    import time

    from tests.helpers import wait_until

    delay = random.Random(seed).uniform(0.0, 1.0)
    work = tmp_path / "tmrun"
    killed: list[int] = []

    def kill_rank_1() -> None:
        path = work / "steps-1"
        if wait_until(lambda: path.exists() and len(path.read_text().splitlines()) >= 3, JOB_TIMEOUT):
            time.sleep(delay)
            pid = int(path.read_text().split()[1])
            try:
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
            except ProcessLookupError:
                pass

    reference = references(layout)  # first: the killer's wait counts from the job's start
    killer = threading.Thread(target=kill_rank_1, daemon=True)
    killer.start()
    code, log, got = _run(work, assets, "tmrun", layout)
    killer.join(timeout=10)
    assert killed, log
    if layout == "ddp_async":  # a background save the kill cut off is not finished (said), the next step saved
        missing = set(reference["checkpoints"]) - set(got["checkpoints"])
        assert len(missing) <= 1 and (not missing or "was cut off by a change" in log), (missing, log)
        assert not missing or "out of the interval" in log, log
        each_step = references("ddp_each_step")["checkpoints"]
        reference = {**reference, "checkpoints": {step: each_step[step] for step in got["checkpoints"]}}
    _check_in_place(code, log, got, reference, killed=1)


def test_hsdp_layout_rank_killed_mid_step_is_replaced_in_place(tmp_path: Path, assets: Path,
                                                               references: Callable[[str], dict]) -> None:
    """HSDP 2 x 2 (``dp_replicate`` 2, ``dp_shard`` 2: ranks 0, 1 and 2, 3 shard the model, 0 and 2,
    1 and 3 replicate the shards), each block compiled: rank 1 SIGKILLed in step 4's forward (at
    the token embedding, before the compiled blocks); its standby is healed
    from rank 3's shards; the result is torchrun's, bit for bit. (torchtitan's chunked loss
    switches lm_head's FSDP2 unit to reshard after forward after its first step: the integration
    sets that from the start, or the joiner's first step would all-gather once less than the
    survivors' redone one.) The survivors' forwards run into the compiled blocks doomed: each of
    them died of dynamo's ``Unsupported: Observed exception`` before (tmrun's check, traced into
    the block, raised there), and the job restarted from step 0."""
    reference = references("hsdp")
    assert reference["finals"][0] == reference["finals"][2] and reference["finals"][1] == reference["finals"][3]
    code, log, got = _run(tmp_path / "tmrun", assets, "tmrun", "hsdp", kill=f"1:{KILL_STEP}")
    _check_in_place(code, log, got, reference, killed=1)


@pytest.mark.variant  # the default run kills TP x DP's rank 1 at a random moment instead (above)
def test_tp_dp_layout_rank_killed_mid_step_is_replaced_in_place(tmp_path: Path, assets: Path,
                                                                references: Callable[[str], dict]) -> None:
    """Tensor parallel 2 x ``dp_replicate`` 2 (ranks 0, 1 and 2, 3 are TP pairs; 0 and 2, 1 and 3
    replicate): rank 1 SIGKILLed mid-forward in step 4; rank 2, which shares no group with rank 1,
    may be inside an FSDP all-reduce with rank 0 when rank 0 starts its recovery (it shares four
    groups with rank 0: the recovery commits them at once, or rank 0 waited in one for rank 2
    stuck in another); the result is torchrun's, bit for bit."""
    reference = references("tp_dp")
    assert reference["finals"][0] == reference["finals"][2] and reference["finals"][1] == reference["finals"][3]
    code, log, got = _run(tmp_path / "tmrun", assets, "tmrun", "tp_dp", kill=f"1:{KILL_STEP}")
    _check_in_place(code, log, got, reference, killed=1)


@pytest.mark.variant  # CI time: the planned join runs the same reset as the unplanned one (tmrun.worker.standby)
def test_a_planned_migration_of_a_compiled_tp_rank_is_torchruns_bits(tmp_path: Path, assets: Path,
                                                                      references: Callable[[str], dict]) -> None:
    """``tmrun-ctl migrate 1`` once the standby is warm, TP x DP compiled: the joiner, whose
    rehearsal traced the compiled loss as TP rank 0 (dynamo folds the rank in), drops those
    graphs when it takes rank 1 and builds before the switch; no step is redone and every rank
    ends with torchrun's bits."""
    import threading

    from tests.helpers import ctl_when_logged

    reference = references("tp_dp")
    work = tmp_path / "tmrun"
    requested: list[str] = []
    request = threading.Thread(target=ctl_when_logged, daemon=True,
                               args=(work / "log", ["warm after"], ["migrate", "1", "--reason", "drill"],
                                     work / "state", requested, JOB_TIMEOUT))
    request.start()
    code, log, got = _run(work, assets, "tmrun", "tp_dp")
    request.join(timeout=10)
    assert requested and "migration of rank 1 requested" in requested[0], (requested, log)
    assert code == 0 and got["finals"] == reference["finals"], log
    assert "planned migration, generation 1: rank 1" in log and "(1 planned), 0 steps recomputed" in log, log
    assert re.search(r"rank 1: \d+ graph\(s\) compiled before this process had its rank dropped", log), log
    assert "Traceback" not in log, log


@pytest.mark.parametrize("layout, killed", [pytest.param("pp_dp", 3, marks=pytest.mark.variant),
                                            ("pp_dp_interleaved", 1),
                                            pytest.param("pp_dp_zbv", 0, marks=pytest.mark.variant)])
def test_pp_layout_rank_killed_mid_step_is_replaced_in_place(tmp_path: Path, assets: Path,
                                                             references: Callable[[str], dict],
                                                             layout: str, killed: int) -> None:
    """Pipeline parallel 2 x ``dp_replicate`` 2 (ranks 0, 1 hold the first stage(s), 2, 3 the
    others, each pair replicas), torchtitan's 1F1B (rank 3, the last stage, killed) and
    Interleaved 1F1B (two stages per rank; rank 1 killed): SIGKILLed mid-forward in step 4; the
    integration names each rank's stages (``tm.set_shard``) and tracks torchtitan's schedule, so
    the joiner is healed from its stages' replica and runs its pipelines' start-up alone, from
    the messages the lost rank received in its own (no survivor runs it again); the result is
    torchrun's, bit for bit."""
    reference = references(layout)
    assert reference["finals"][0] == reference["finals"][1] and reference["finals"][2] == reference["finals"][3]
    code, log, got = _run(tmp_path / "tmrun", assets, "tmrun", layout, kill=f"{killed}:{KILL_STEP}")
    _check_in_place(code, log, got, reference, killed=killed)
    assert f"rank {killed}: recovered" in log and "from 1 donor" in log, log
    assert f"rank {killed}: the pipeline start-up of schedule 0 ran on this joiner alone" in log, log
    assert "runs torch's start-up again" not in log, log


def _validations(log: str) -> list[tuple[int, str]]:
    """The (step, loss) pairs torchtitan's validator logged (every rank logs its own)."""
    plain = re.sub(r"\x1b\[[0-9;]*m", "", log)
    return sorted((int(step), loss) for step, loss in re.findall(r"validate step:\s+(\d+)\s+loss:\s+(\S+)", plain))


def test_pp_layout_with_validation_is_replaced_in_place(tmp_path: Path, assets: Path,
                                                       references: Callable[[str], dict]) -> None:
    """torchtitan's validator every second step (``pp_schedule.eval()`` after the step's
    training; torch 2.14 starts the stages again at each switch to and from evaluation), rank 3
    (the last stage) SIGKILLed mid-forward in step 5, the step after a validation. Before: its
    neighbour's switch back to training, in the doomed step, read a metadata size from a receive
    the loss cut off (torch.empty's bytes: it asked for 94 TB and died) and the job restarted
    from step 0. Now: in place, every rank's final digest and every validation loss torchrun's."""
    reference = references("pp_dp_validate")
    code, log, got = _run(tmp_path / "tmrun", assets, "tmrun", "pp_dp_validate", kill=f"3:{KILL_STEP + 1}")
    _check_in_place(code, log, got, reference, killed=3)
    reference_log = reference["log"]
    assert _validations(log) == _validations(reference_log), (_validations(log), _validations(reference_log))
    assert [step for step, _ in _validations(log)][::4] == [1, 2, 4, 6, 8], _validations(log)


# CI time: both under --variants; by default the void tail's redo runs end to end with a checkpoint
# save (test_a_rank_lost_in_a_checkpoint_save_has_it_redone), the validation's in
# tests/titan/test_integration.py, and a validation in a doomed step in the PP layout's test above
@pytest.mark.parametrize("killed", [pytest.param(3, marks=pytest.mark.variant),
                                    pytest.param(0, marks=pytest.mark.variant)])
def test_a_rank_lost_in_a_validation_after_its_update_has_it_redone(tmp_path: Path, assets: Path,
                                                                   references: Callable[[str], dict],
                                                                   killed: int) -> None:
    """A rank SIGKILLed inside torchtitan's validation of step 4, after the step's update was
    applied everywhere: the step stays committed (not redone); the survivors' validation lost
    the peer (tm.void) and logs nothing; before step 5 trains, every rank, the joiner too, runs
    step 4's validation again (tm.voided_step) with the state step 4 left. Before: the validator's
    ``log_validation`` was not guarded and ranks logged made-up losses (3.8123 for torchrun's
    7.5994; -0.0020 for -0.0039), and the validation's data loader drew a random number after
    ``opt.step()``, so the lost rank's random state was unknown and the job fell back to its group
    restart. Every rank's final digest and every validation loss are torchrun's."""
    reference = references("pp_dp_validate")
    code, log, got = _run(tmp_path / "tmrun", assets, "tmrun", "pp_dp_validate", kill=f"{killed}:4:validate")
    _check_in_place(code, log, got, reference, killed=killed)
    assert "step 4's checkpoint and validation were void" in log, log[-6000:]
    for rank in (r for r in range(4) if r != killed):  # step 4 committed, not redone
        assert [s for s, _ in got["steps"][rank]] == list(range(1, STEPS + 1)), got["steps"]
    assert _validations(log) == _validations(reference["log"]), (_validations(log), _validations(reference["log"]))


def test_pure_fsdp_falls_back_to_torchtitans_own_checkpoint(tmp_path: Path, assets: Path,
                                                            references: Callable[[str], dict]) -> None:
    """Pure FSDP (``dp_shard`` 2: each shard has one holder) with torchtitan's DCP checkpoint every 2
    steps: rank 1 SIGKILLed mid-forward in step 4 leaves a shard no live replica holds. Every
    member says so in one line (docs/mesh.md), the job falls back to its group restart at once, the restarted
    trainer resumes from torchtitan's own checkpoint (the standby never loads it) and ends with
    torchrun's bits."""
    reference = references("fsdp")
    code, log, got = _run(tmp_path / "tmrun", assets, "tmrun", "fsdp", kill=f"1:{KILL_STEP}")
    assert code == 0, log
    # a 1-D mesh makes no subgroups: the standby built its shard in its sandbox as rank 0's, and
    # every member refuses it in one line (had it waited for its rank, no replica would hold it)
    assert re.search(r"rank 0: rank 1 (joined with sharded state built in a standby's sandbox|"
                     r"no live replica holds the shard of rank 1).*falling back to the group restart", log), log
    assert "falling back to restarting the worker group" in log, log
    assert got["finals"] == reference["finals"], "the resumed job's final state differs from torchrun's\n" + log
    resumed = [s for s, _ in got["steps"][0]]
    assert resumed.count(KILL_STEP - 1) <= 2 and max(resumed) == STEPS, resumed  # resumed after step 2, not from 0
    assert resumed.count(1) == 1, f"the restart began again from step 1: {resumed}"
