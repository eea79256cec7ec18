"""Shared fixtures, and the ``e2e`` marker: every test under ``tests/e2e/`` starts whole jobs
(agents, workers, standbys) and is marked ``e2e``, so ``pytest -m "not e2e"`` is the fast
unit subset. Tests marked ``variant`` (more kill points, seeds or paths of a capability whose
other cases stay in the default run) are deselected unless ``--variants`` is given: the
default run is CI's (its time budget); ``pytest --variants`` is the whole suite."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import NoReturn

import pytest

_REAL_EXIT = os._exit
_PYTEST_PID = os.getpid()


def _exit_refused_in_pytest(status: int) -> NoReturn:
    """``os._exit`` in pytest's own process (tmrun's workers and launcher leave that way) would end
    the run with that code, the tests after it never run: with 0, a CI run that passes. Refused
    there; a forked child's exit is its own."""
    if os.getpid() == _PYTEST_PID:
        raise RuntimeError(f"os._exit({status}) called in pytest's own process: it would end the test run")
    _REAL_EXIT(status)


os._exit = _exit_refused_in_pytest

E2E_DIR = Path(__file__).resolve().parent / "e2e"


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--variants", action="store_true",
                     help="also run the tests marked 'variant' (more cases of a capability that a sibling test keeps "
                          "in the default run; deselected without this flag)")


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    """The unit subset (``-m "not e2e"``) does not import tests/e2e/ at all: every test there is
    ``e2e`` (below), and importing its modules only to deselect them is a few seconds."""
    if (config.getoption("markexpr") or "").split() == ["not", "e2e"] and collection_path.resolve() == E2E_DIR:
        return True
    return None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if E2E_DIR in Path(str(item.path)).resolve().parents:
            item.add_marker(pytest.mark.e2e)
    if config.getoption("--variants") or "variant" in (config.getoption("markexpr") or ""):
        return  # the whole suite, or a selection that names the marker (-m variant)
    named = [arg for arg in config.args if "::" in arg]  # node ids given on the command line run as asked
    kept, variants = [], []
    for item in items:
        deselect = item.get_closest_marker("variant") is not None and not any(
            _names(config, arg, item) for arg in named)
        (variants if deselect else kept).append(item)
    if variants:  # the default run (CI) keeps one case of each capability; --variants runs them all
        config.hook.pytest_deselected(items=variants)
        items[:] = kept


def _names(config: pytest.Config, arg: str, item: pytest.Item) -> bool:
    """Whether the command-line node id ``arg`` (``path::name``, relative to where pytest was
    started or absolute; a parametrized test's name with or without its ``[id]``) names ``item``."""
    path, _, name = arg.partition("::")
    _, _, item_name = item.nodeid.partition("::")
    return ((item_name == name or item_name.startswith(name + "["))
            and (config.invocation_params.dir / path).resolve() == Path(str(item.path)).resolve())


@pytest.fixture
def procs():  # type: ignore[no-untyped-def]
    """Child processes a test started; killed (by PID) and reaped at the end."""
    started: list[subprocess.Popen[bytes]] = []
    yield started
    for process in started:
        if process.poll() is None:
            process.kill()
        process.wait(timeout=10)


@pytest.fixture(scope="session")
def etcd_server(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    """One real etcd on loopback for the session (each test uses its own run id/namespace)."""
    from tests.etcd.server import start_etcd, why_no_etcd

    reason = why_no_etcd()
    if reason:
        pytest.skip(f"no etcd here: {reason}")
    server = start_etcd(tmp_path_factory.mktemp("etcd"))
    try:
        yield server
    finally:
        server.stop()
