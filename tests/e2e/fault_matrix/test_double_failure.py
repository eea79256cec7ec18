"""Two ranks lost at once while only one standby is warm (issue 16, bug 1).

Three workers, ``--standby 2``, both standbys still warming up at different speeds (a test knob
delays their ready marks, as a loaded machine would: the first turns warm seconds after the kills,
the second two seconds after the first). Ranks 1 and 2 are SIGKILLed at the start of the same
step. The controller folds both into ONE generation once both standbys are warm (before the fix:
rank 1 went to the first standby in generation 1 as soon as it was warm, rank 2 to the second in
generation 2 while generation 1 still recovered; generation 1's joiner waited 60 s for rank 2's
address and the job fell back to a group restart).

No standby is warm when the ranks die, so both failures are known before any plan can be
published, whatever the moments of the two exits. (With a standby already warm, two exits some
milliseconds apart give two generations, the second superseding the first: that path is
``test_lost_during_recovery.py``'s.)"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.e2e.fault_matrix.conftest import STEPS
from tests.e2e.test_inplace_one_node import _check, _run

pytestmark = pytest.mark.e2e


def test_two_ranks_killed_together_are_replaced_in_one_generation(tmp_path: Path, reference3: str) -> None:
    code, log, final, steps = _run(
        tmp_path, "double", "--inject-failure", "rank=1,step=4", "--inject-failure", "rank=2,step=4",
        "--standby-wait", "40", nproc=3, standby=2, step_time=0.1, env={"TMRUN_TEST_STANDBY_DELAY": "0:4,1:6"},
    )
    _check(code, log, final, steps, reference3, survivors=[0])
    assert "falling back" not in log and "fallback" not in log, log
    assert re.search(r"failed; waiting up to \d+s for \d more warm standby", log), log  # no plan before both are warm
    replacements = re.findall(r"in-place replacement, generation (\d+): (.*)", log)
    assert len(replacements) == 1, log
    gen, detail = replacements[0]
    assert gen == "1" and "rank 1 " in detail and "rank 2 " in detail, log
    assert "generation 1: all 3 ranks recovered" in log, log
    for rank in (1, 2):  # each lost rank played by two processes, every step done
        assert len({pid for _, pid in steps[rank]}) == 2, (rank, steps[rank])
        assert sorted({s for s, _ in steps[rank]}) == list(range(STEPS)), (rank, steps[rank])
