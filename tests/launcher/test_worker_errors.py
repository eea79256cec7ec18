"""A failed worker's own error in one line (launcher.worker_errors)."""

from __future__ import annotations

import json
from pathlib import Path

from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

from tmrun.launcher.worker_errors import MAX_CHARS, error_line


def _failure(tmp_path: Path, exitcode: int, error_file_message: str | None = None) -> ProcessFailure:
    error_file = tmp_path / "error.json"
    if error_file_message is not None:
        error_file.write_text(json.dumps({"message": {"message": error_file_message,
                                                      "extraInfo": {"timestamp": "1"}}}))
    return ProcessFailure(local_rank=0, pid=5, exitcode=exitcode, error_file=str(error_file))


def test_the_error_file_of_a_recorded_script_comes_first(tmp_path: Path) -> None:
    stderr = tmp_path / "stderr.log"
    stderr.write_text("something else\n")
    failure = _failure(tmp_path, 1, "Traceback (most recent call last):\n  ...\nValueError: bad batch size")
    assert error_line(failure, str(stderr)) == "ValueError: bad batch size"


def test_the_last_line_of_a_redirected_stderr(tmp_path: Path) -> None:
    stderr = tmp_path / "stderr.log"
    stderr.write_text("usage: train.py [-h] --lr LR\n[rank0]: train.py: error: the following arguments are "
                      "required: --lr\n\n")
    assert error_line(_failure(tmp_path, 2), str(stderr)) == "train.py: error: the following arguments are required: --lr"
    stderr.write_text("x" * 10_000 + "\n" + "E" * 500 + "\n")
    line = error_line(_failure(tmp_path, 2), str(stderr))
    assert len(line) == MAX_CHARS and line.endswith("...")


def test_nothing_readable_gives_nothing(tmp_path: Path) -> None:
    assert error_line(_failure(tmp_path, 1), None) == ""  # stderr on the terminal: printed there
    assert error_line(_failure(tmp_path, 1), str(tmp_path / "missing.log")) == ""
    (tmp_path / "empty.log").write_text("")
    assert error_line(_failure(tmp_path, 1), str(tmp_path / "empty.log")) == ""
    assert error_line(_failure(tmp_path, -9, "ignored"), None) == ""  # a signal: no error of its own
