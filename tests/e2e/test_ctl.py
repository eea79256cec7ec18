"""tmrun-ctl against a whole job: status and events through the operations endpoint, the
JSON-lines event log, and the recovery totals at the end of the job (one node, one failure)."""

from __future__ import annotations

import json
import re
import threading
from functools import partial
from pathlib import Path

from tests.helpers import EXAMPLES, ctl_when_logged, kill_tree, leftovers, start, tmrun_cmd


def test_status_events_log_and_totals(tmp_path: Path) -> None:
    state, logs = tmp_path / "state", tmp_path / "logs"
    cmd = tmrun_cmd(
        "--standalone", "--nproc-per-node", "2", "--standby", "1", "--log-dir", str(logs),
        "--inject-failure", "rank=1,step=8",
        str(EXAMPLES / "train_inplace.py"), "--steps", "14", "--width", "48", "--batch", "16", "--step-time", "0.15",
    )  # fmt: skip
    seen: list[str] = []
    asked = threading.Thread(target=partial(ctl_when_logged, tmp_path / "agent.log", ["standby 0 warm"],
                                            ["status", "--json"], state, seen), daemon=True)
    asked.start()
    agent = start(cmd, log=tmp_path / "agent.log", env={"TMRUN_STATE_DIR": str(state)})
    try:
        code = agent.wait(timeout=240)
    finally:
        kill_tree(agent)
        assert leftovers(agent) == []
    asked.join(timeout=5)
    log = (tmp_path / "agent.log").read_text()
    assert code == 0, log
    assert len(re.findall(r"operations endpoint at 127\.0\.0\.1:\d+", log)) == 1
    status = json.loads(seen[0])
    assert status["membership"]["phase"] == "running" and status["totals"]["ettr"] <= 1.0
    assert len(status["nodes"][0]["workers"]) == 2
    # the event log: one JSON object per line, in --log-dir
    files = list(logs.glob("*.events.jsonl"))
    assert len(files) == 1, list(logs.iterdir())
    rows = [json.loads(line) for line in files[0].read_text().splitlines()]
    kinds = [r["kind"] for r in rows]
    assert [r["seq"] for r in rows] == list(range(len(rows)))
    assert "replace" in kinds and "recovered" in kinds and kinds[-1] == "closed", kinds
    recovered = rows[kinds.index("recovered")]
    assert recovered["gen"] == 1 and recovered["seconds"] > 0 and recovered["phases"]["total"] == recovered["seconds"]
    phases = recovered["phases"]
    assert phases["recover"] is not None and phases["plan"] is not None
    # the downtime counts from the earliest evidence (a survivor's collective losing its peer
    # may come before the controller saw the exit): detect + plan + recover, to the rounding
    assert phases["detect"] is not None, phases
    assert abs(phases["detect"] + phases["plan"] + phases["recover"] - recovered["seconds"]) < 0.01, phases
    # the workers' phases reached the event (their RecoveryTiming records): every phase measured,
    # none negative, on one timeline in order, the first step after the recovery included
    names = ["detect", "plan", "connect", "transfer", "first_step"]
    assert all(isinstance(phases[n], float) and phases[n] >= 0 for n in names), phases
    marks = recovered["marks"]
    instants = [marks[n] for n in ["failed", "seen", "published", "connected", "healed", "first_step"]]
    assert all(isinstance(m, float) for m in instants) and instants == sorted(instants), marks
    assert abs(sum(phases[n] for n in names) - (marks["first_step"] - marks["failed"])) < 0.001
    assert phases["first_step"] >= 0.1, phases  # the example's step takes --step-time 0.15 s
    replaced = rows[kinds.index("replace")]
    assert marks["seen"] <= replaced["time"] <= recovered["time"] and marks["first_step"] <= recovered["time"]
    assert rows[kinds.index("replace")]["ranks"] == [1]
    # the totals at the end of the job
    totals = re.search(r"recovery totals: downtime ([\d.]+)s over ([\d.]+)s, ETTR ([\d.]+)%, 1 in-place recoveries "
                       r"\(0 planned\), [01] steps recomputed", log)  # 0: rank 0 learned of it before its step 8
    assert totals, log[-3000:]
    assert abs(float(totals.group(1)) - recovered["seconds"]) < 0.0011
