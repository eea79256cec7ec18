"""The native module builds, imports and computes CRC-32C correctly."""

from __future__ import annotations

import zlib

import pytest

tmrun_native = pytest.importorskip("tmrun_native")


def test_crc32c_known_vector() -> None:
    # The standard CRC-32C check value of "123456789".
    assert tmrun_native.crc32c(b"123456789") == 0xE3069283


def test_crc32c_is_incremental_and_differs_from_crc32() -> None:
    data = bytes(range(256)) * 37 + b"tail"
    whole = tmrun_native.crc32c(data)
    for cut in (0, 1, 7, 8, 9, 1000, len(data)):
        assert tmrun_native.crc32c(data[cut:], tmrun_native.crc32c(data[:cut])) == whole
    assert whole != zlib.crc32(data)


def test_crc32c_accepts_buffers() -> None:
    import array

    values = array.array("f", range(1000))  # a typed, multi-byte-item buffer
    raw = values.tobytes()
    assert tmrun_native.crc32c(memoryview(values)) == tmrun_native.crc32c(raw)
    assert tmrun_native.crc32c(bytearray(raw)) == tmrun_native.crc32c(raw)
    assert tmrun_native.crc32c(b"") == 0


@pytest.mark.parametrize("length", [0, 1, 7, 8, 9, 8191, 24575, 24576, 24577, 3 * 24576 + 13, 200_003])
@pytest.mark.parametrize("offset", [0, 1, 5])
def test_crc32c_fast_path_matches_the_tables(length: int, offset: int) -> None:
    # crc32c() uses the CPU's instruction in three interleaved streams joined by polynomial
    # arithmetic (24 KiB rounds); crc32c_portable() is the table-only reference.
    import random

    data = random.Random(length * 7 + offset).randbytes(length + offset)[offset:]
    assert tmrun_native.crc32c(memoryview(data)) == tmrun_native.crc32c_portable(data)
    assert tmrun_native.crc32c(data, 0xDEADBEEF) == tmrun_native.crc32c_portable(data, 0xDEADBEEF)
