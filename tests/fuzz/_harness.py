"""What every harness of tests/fuzz shares: the property checks and the atheris entry point.

A harness is a script: ``python tests/fuzz/fuzz_X.py -atheris_runs=N`` (or
``-max_total_time=S``; any libFuzzer flag). It writes its seed corpus (valid messages, encoded)
into a fresh temporary directory that libFuzzer starts from and adds to, unless a corpus
directory is given on the command line. Defaults: ``-timeout=5`` (an input that takes longer is
a hang, a finding) and ``-rss_limit_mb=2048``. A finding makes the script exit non-zero and
leaves ``crash-*``/``timeout-*`` files (``-artifact_prefix=DIR/`` chooses where).

The property every decoder keeps: an input either decodes to a valid value or raises the
module's documented error type with a one-line message; never another exception, never a hang.
"""

from __future__ import annotations

import sys
import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
# An editable install imports tmrun through a custom loader, which atheris cannot instrument:
# import the sources from the checkout with the ordinary path finder instead.
sys.meta_path[:] = [f for f in sys.meta_path if not type(f).__module__.startswith("_editable_")]

import atheris  # noqa: E402


def expect_error(exc: BaseException, allowed: type[BaseException] | tuple[type[BaseException], ...]) -> None:
    """Re-raise ``exc`` unless it is of the documented type with a one-line, non-empty message."""
    if not isinstance(exc, allowed):
        raise exc
    text = str(exc)
    if not text or "\n" in text or "Traceback" in text:
        raise AssertionError(f"{type(exc).__name__} without a one-line message: {text!r}") from exc


def main(test_one_input: Callable[[bytes], None], seeds: Iterable[bytes], argv: list[str] | None = None) -> None:
    args = list(sys.argv if argv is None else argv)
    flags = [a for a in args[1:] if a.startswith("-")]
    if not any(a.startswith("-timeout=") for a in flags):
        args.append("-timeout=5")
    if not any(a.startswith("-rss_limit_mb=") for a in flags):
        args.append("-rss_limit_mb=2048")
    if not any(not a.startswith("-") for a in args[1:]):  # no corpus given: the seeds
        corpus = tempfile.mkdtemp(prefix="tmrun-fuzz-corpus-")
        for index, seed in enumerate(seeds):
            Path(corpus, f"seed-{index:04d}").write_bytes(seed)
        args.append(corpus)
    atheris.Setup(args, test_one_input)
    atheris.Fuzz()


def json_value(fdp: atheris.FuzzedDataProvider, depth: int = 0) -> object:
    """A JSON value of any type (the type confusions a hand-written test forgets): integers
    small, negative and huge, floats (NaN and infinities too), booleans, null, strings (any
    Unicode), lists and objects."""
    kind = fdp.ConsumeIntInRange(0, 9 if depth < 3 else 6)
    if kind == 0:
        return fdp.ConsumeIntInRange(-3, 70)
    if kind == 1:
        return fdp.ConsumeInt(fdp.ConsumeIntInRange(1, 80))
    if kind == 2:
        return fdp.PickValueInList([0.0, -0.0, 1.5, -2.0, 1e308, float("nan"), float("inf"), float("-inf")])
    if kind == 3:
        return fdp.ConsumeBool()
    if kind == 4:
        return None
    if kind == 5:
        return fdp.ConsumeUnicodeNoSurrogates(fdp.ConsumeIntInRange(0, 12))
    if kind == 6:
        return fdp.PickValueInList(["", "0", "1", "-1", "1e9", "nan", "\u00b2", "\u0661", "running", "memory"])
    if kind == 7:
        return [json_value(fdp, depth + 1) for _ in range(fdp.ConsumeIntInRange(0, 4))]
    if kind == 8:
        return {fdp.ConsumeUnicodeNoSurrogates(4): json_value(fdp, depth + 1) for _ in range(fdp.ConsumeIntInRange(0, 3))}
    return {str(fdp.ConsumeIntInRange(-2, 9)): json_value(fdp, depth + 1) for _ in range(fdp.ConsumeIntInRange(0, 3))}


def json_object(fdp: atheris.FuzzedDataProvider, names: list[str]) -> dict[str, object]:
    """An object over the message's own field names (each present or not, any type)."""
    data: dict[str, object] = {}
    for name in names:
        if fdp.ConsumeIntInRange(0, 4):
            data[name] = json_value(fdp)
    if fdp.ConsumeIntInRange(0, 5) == 0:
        data[fdp.ConsumeUnicodeNoSurrogates(6)] = json_value(fdp)
    return data
