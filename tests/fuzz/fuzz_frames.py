"""Fuzz the native wire-frame parser (tmrun_native/src/frame.cpp through ``tn.parse_frame``):
any byte string either parses into a self-consistent header or raises ``tn.FrameError`` (a
ValueError) with a one-line reason; never another exception, never a crash.

    python tests/fuzz/fuzz_frames.py -atheris_runs=100000
    python tests/fuzz/fuzz_frames.py -max_total_time=150

Input: byte 0 picks the mode.
* raw: the rest, as bytes, as a bytearray and as a memoryview (with and without a job id);
* valid: a frame built by ``tn.encode_frame`` from the rest's fields; it parses back to those
  fields (or is refused for a reason the wire format states: a control frame with a payload, a
  hello of the wrong size), and split at every position its prefix parses the same: shorter
  than the header "truncated", else the same header, ``complete`` only once whole;
* flip: one bit of a valid frame's header flipped: always refused (CRC-32C catches every
  single-bit error).

The C++ is not instrumented for coverage (that would take a libFuzzer build of the module):
libFuzzer mutates the seeds guided only by the harness's own Python branches.
"""

from __future__ import annotations

import sys

from _harness import atheris, expect_error, main

import tmrun_native as tn

HS = tn.FRAME_HEADER_SIZE
FIELDS = ("type_id", "flags", "tag", "job_hash", "epoch", "seq", "length", "payload_crc")
JOBS = ["", "job", "run-1/0", "x" * 300, "\u00e9t\u00e9"]


def _parse(data: object, job: str | None) -> dict | None:
    try:
        return tn.parse_frame(data, job)
    except tn.FrameError as exc:
        expect_error(exc, tn.FrameError)
        return None


def _check_accepted(d: dict, data: bytes, job: str | None) -> None:
    assert d["version"] == tn.WIRE_VERSION, d
    assert 1 <= d["type_id"] <= 7 and d["length"] <= 1 << 30, d
    assert d["complete"] == (len(data) - HS >= d["length"]), d
    if job is not None:
        assert d["job_hash"] == tn.job_hash(job), d


@atheris.instrument_func
def _raw(body: bytes, job: str | None) -> None:
    results = []
    for view in (body, bytearray(body), memoryview(body)):
        d = _parse(view, job)
        if d is not None:
            _check_accepted(d, body, job)
        results.append(d)
    assert results[0] == results[1] == results[2], results
    if len(body) > 1:  # a strided view is refused outright, never read past
        try:
            tn.parse_frame(memoryview(body)[::-1], job)
            raise AssertionError("a strided view was parsed")
        except TypeError:
            pass


@atheris.instrument_func
def _valid(fdp: atheris.FuzzedDataProvider) -> None:
    kind = fdp.ConsumeIntInRange(1, 7)
    size = fdp.PickValueInList([0, 12, fdp.ConsumeIntInRange(0, 200)])
    payload = fdp.ConsumeBytes(size)
    job = fdp.PickValueInList(JOBS)
    epoch, seq, tag = fdp.ConsumeIntInRange(0, 2**64 - 1), fdp.ConsumeIntInRange(0, 2**64 - 1), fdp.ConsumeIntInRange(0, 2**32 - 1)
    checksum = fdp.ConsumeBool()
    frame = tn.encode_frame(kind, payload, job_id=job, epoch=epoch, seq=seq, tag=tag, checksum=checksum)
    whole = _parse(frame, job)
    control = kind in (4, 5, 6) and payload
    hello = kind in (2, 3) and len(payload) != 12
    reject = kind == 7 and len(payload) > 4096
    if control or hello or reject:
        assert whole is None, (kind, len(payload), whole)
        return
    assert whole is not None, (kind, len(payload))
    assert (whole["type_id"], whole["epoch"], whole["seq"], whole["tag"], whole["length"]) == (
        kind, epoch, seq, tag, len(payload)), whole
    assert whole["complete"] and whole["job_hash"] == tn.job_hash(job)
    assert _parse(frame, job + "-other") is None  # foreign job
    for cut in range(len(frame) + 1):
        part = _parse(frame[:cut], job)
        if cut < HS:
            assert part is None, cut
            continue
        assert part is not None, cut
        assert {k: part[k] for k in FIELDS} == {k: whole[k] for k in FIELDS}, (cut, part, whole)
        assert part["complete"] == (cut == len(frame)), (cut, part)
    if payload and checksum:  # a damaged payload is caught once the frame is complete
        damaged = bytearray(frame)
        damaged[HS + fdp.ConsumeIntInRange(0, len(payload) - 1)] ^= 1 << fdp.ConsumeIntInRange(0, 7)
        assert _parse(bytes(damaged), job) is None


def _flip(fdp: atheris.FuzzedDataProvider) -> None:
    frame = bytearray(tn.encode_frame(fdp.ConsumeIntInRange(1, 7), b"", job_id="job",
                                      epoch=fdp.ConsumeIntInRange(0, 9), seq=fdp.ConsumeIntInRange(0, 9)))
    frame[fdp.ConsumeIntInRange(0, HS - 1)] ^= 1 << fdp.ConsumeIntInRange(0, 7)
    assert _parse(bytes(frame), None) is None


def test_one_input(data: bytes) -> None:
    if not data:
        return
    mode = data[0] % 4
    if mode in (0, 1):
        _raw(data[1:], "job" if mode == 1 else None)
    elif mode == 2:
        _valid(atheris.FuzzedDataProvider(data[1:]))
    else:
        _flip(atheris.FuzzedDataProvider(data[1:]))


def seeds() -> list[bytes]:
    out = []
    for kind in range(1, 8):
        payload = b"" if kind in (4, 5, 6) else (b"\x00" * 12 if kind in (2, 3) else b"payload")
        for mode in (0, 1):
            out.append(bytes([mode]) + tn.encode_frame(kind, payload, job_id="job", epoch=kind, seq=kind))
    out += [bytes([2]) + bytes(range(40)), bytes([3]) + bytes(8), bytes([0]) + b"TMRN"]
    return out


if __name__ == "__main__":
    main(test_one_input, seeds())
    sys.exit(0)
