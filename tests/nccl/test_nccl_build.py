"""The build that CI (and the README's test command) makes must have the NCCL transport in it.

`-C cmake.define.TMRUN_NCCL_HEADERS=FETCH` makes CMake fetch the pinned nccl.h; the module
records the mode, so a FETCH build without the transport fails here instead of letting the
NCCL tests skip.
"""

from __future__ import annotations

import os
import re

import pytest

from tests.helpers import load_script

tmrun_native = pytest.importorskip("tmrun_native")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FETCH_FLAG = "-C cmake.define.TMRUN_NCCL_HEADERS=FETCH"


def _pinned_version_code() -> int:
    path = os.path.join(ROOT, "tmrun_native", "cmake", "fetch_nccl_header.py")
    mod = load_script(path, "tmrun_fetch_nccl_header_pin")
    major, minor, patch = (int(x) for x in mod.VERSION.split("."))
    return major * 10000 + minor * 100 + patch


def test_headers_mode_is_recorded() -> None:
    assert tmrun_native.nccl_headers_mode() in ("AUTO", "FETCH")


def test_fetch_build_has_the_transport() -> None:
    if tmrun_native.nccl_headers_mode() != "FETCH":
        pytest.skip("module not built with TMRUN_NCCL_HEADERS=FETCH")
    assert tmrun_native.nccl_compiled(), "TMRUN_NCCL_HEADERS=FETCH but the NCCL transport was not compiled"
    assert tmrun_native.nccl_header_version() == _pinned_version_code()


def test_ci_builds_with_fetch() -> None:
    # CI runs .ci/run with CI=true; a build without FETCH there would skip the NCCL tests.
    if os.environ.get("CI", "").lower() not in ("true", "1", "yes"):
        pytest.skip("not CI")
    assert tmrun_native.nccl_headers_mode() == "FETCH", (
        "CI must build with the README's test command (" + FETCH_FLAG + ")"
    )


def test_ci_script_and_readme_run_the_same_fetch_command() -> None:
    ci = os.path.join(ROOT, ".ci", "run")
    readme = os.path.join(ROOT, "README.md")
    if not (os.path.isfile(ci) and os.path.isfile(readme)):
        pytest.skip("not a source checkout")
    with open(ci) as f:
        steps = [ln.strip() for ln in f if re.match(r"\s*(pip|python) ", ln)]
    with open(readme) as f:
        text = f.read()
    m = re.search(r"Run the tests:\n\n {4}(.+)\n", text)
    assert m, "README has no 'Run the tests:' command"
    assert m.group(1).strip() == " && ".join(steps)
    assert FETCH_FLAG in steps[0]
