"""Fuzz the per-rank progress record (tmrun/protocol/progress.py): whatever bytes the file of
a rank holds (a torn write, another writer, a truncated or longer file), ``progress.read``
returns a ProgressRecord or None and never raises; a record read back packs and unpacks to
itself.

    python tests/fuzz/fuzz_progress.py -atheris_runs=50000
    python tests/fuzz/fuzz_progress.py -max_total_time=150
"""

from __future__ import annotations

import os
import struct
import sys
import tempfile

from _harness import atheris, main

with atheris.instrument_imports(include=["tmrun"]):
    from tmrun.protocol import progress

PATH = os.path.join(tempfile.mkdtemp(prefix="tmrun-fuzz-progress-"), "rank-0")


def test_one_input(data: bytes) -> None:
    with open(PATH, "wb") as f:
        f.write(data)
    record = progress.read(PATH)
    assert record is None or isinstance(record, progress.ProgressRecord), record
    if len(data) >= progress.SIZE:
        seq, direct = progress.ProgressRecord.unpack(data[: progress.SIZE])
        packed = direct.pack(seq)
        again = progress.ProgressRecord.unpack(packed)[1]
        assert again.pack(seq) == packed, (direct, again)
        assert record is None if (seq == 0 or seq % 2) else record.pack(seq) == packed
    else:
        assert record is None


def seeds() -> list[bytes]:
    record = progress.ProgressRecord(step=3, step_end=1.5, step_seconds=0.1, busy_seconds=0.05, pid=7, gen=1,
                                     role="active")
    return [record.pack(2), record.pack(3), record.pack(2)[:30], record.pack(4) + b"tail",
            struct.pack("<Q", 2) + bytes(progress.SIZE - 8)]


if __name__ == "__main__":
    main(test_one_input, seeds())
    sys.exit(0)
