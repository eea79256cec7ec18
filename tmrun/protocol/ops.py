"""The operations endpoint's wire format: what ``tmrun-ctl`` and the leader say to each other.

One TCP connection per request: the client sends one JSON object on one line (at most
:data:`MAX_REQUEST` bytes, ``\\n``-terminated), the leader answers one JSON object on one line
and closes. Requests: ``{"op": "status"}``, ``{"op": "events", "since": N}``,
``{"op": "migrate", "rank": R | "node": G, "reason": TEXT}``, ``{"op": "ping"}``. Every reply has
``"ok"``; a refused request gets ``{"ok": false, "error": ONE LINE}``. Every reply also carries
``"run_id"`` so that a client can tell it reached the job it meant.

:func:`ask` is the client: every blocking call is bounded by its ``timeout``. This module imports
nothing but the standard library (``tmrun-ctl`` must start without torch).
"""

from __future__ import annotations

import json
import socket
import time
from typing import Any

from tmrun.protocol import auth

MAX_REQUEST = 4096  # bytes of one request line, newline included
MAX_REPLY = 64 << 20  # bytes of one reply (status of a large job, or many events)
OPS = ("ping", "status", "events", "migrate")


class OpsError(RuntimeError):
    """No usable answer from an operations endpoint (one line for the user)."""


class OpsRequestError(ValueError):
    """A request that the leader refuses (one line: sent back as the error)."""


def parse_address(text: str) -> tuple[str, int]:
    """"host:port" (``[v6]:port`` too) -> (host, port); raises :class:`OpsError` on bad input."""
    host, sep, port = text.strip().rpartition(":")
    host = host.strip("[]")
    # a host name or address: no brackets left, no spaces or control characters (" ", "[\x1f[")
    bad_host = not host.isprintable() or any(c.isspace() or c in "[]" for c in host)
    # isascii: str.isdigit() is true of digits int() refuses ("\u00b2")
    if not sep or not host or bad_host or not port.isascii() or not port.isdigit() or not 0 < int(port) < 65536:
        raise OpsError(f"malformed operations endpoint {text!r} (expected HOST:PORT)")
    return host, int(port)


def decode_request(line: bytes) -> dict[str, Any]:
    """Validate one request line; raises :class:`OpsRequestError` with a one-line reason."""
    if len(line) > MAX_REQUEST:
        raise OpsRequestError(f"request longer than {MAX_REQUEST} bytes")
    try:
        data = json.loads(line)
    except (ValueError, UnicodeDecodeError, RecursionError):  # RecursionError: nested too deeply
        raise OpsRequestError("request is not JSON") from None
    if not isinstance(data, dict):
        raise OpsRequestError("request must be a JSON object")
    op = data.get("op")
    if op not in OPS:
        raise OpsRequestError(f"unknown op {op!r} (expected one of {', '.join(OPS)})")
    if op == "events":
        since = data.get("since", 0)
        if not isinstance(since, int) or isinstance(since, bool) or since < 0:
            raise OpsRequestError("events: 'since' must be an integer >= 0")
    if op == "migrate":
        rank, node = data.get("rank", -1), data.get("node", -1)
        for name, value in (("rank", rank), ("node", node)):
            if not isinstance(value, int) or isinstance(value, bool) or value < -1:
                raise OpsRequestError(f"migrate: {name!r} must be an integer >= 0")
        if (rank >= 0) == (node >= 0):
            raise OpsRequestError("migrate: give exactly one of 'rank' and 'node'")
        if not isinstance(data.get("reason", ""), str):
            raise OpsRequestError("migrate: 'reason' must be a string")
    return data


TOKEN_HINT = ("tmrun-ctl reads the token of a job on this host from its run file, else from "
              "TMRUN_JOB_TOKEN_FILE or TMRUN_JOB_TOKEN")


def ask(address: tuple[str, int], request: dict[str, Any], timeout: float = 5.0,
        token: str | None = None) -> dict[str, Any]:
    """Send one request, return the reply's object (``ok`` false included); :class:`OpsError`
    when the endpoint cannot be reached, refuses ``token`` or answers something unreadable.
    With a token, the exchange starts with the job token's challenge-response (protocol.auth)."""
    deadline = time.monotonic() + timeout
    host, port = address
    where = f"{host}:{port}"
    nonces = (b"", b"")
    try:
        with socket.create_connection((host, port), timeout=timeout) as sock:
            line = json.dumps(request).encode() + b"\n"
            if token:
                challenge = _read_line(sock, deadline, where, timeout)
                try:
                    nonce_s, nonce_c, answer = auth.answer(token, challenge)
                except auth.AuthError as exc:
                    raise OpsError(f"{where}: {exc}") from None
                nonces = (nonce_s, nonce_c)
                line = answer + line
            sock.sendall(line)
            chunks: list[bytes] = []
            size = 0
            lines_wanted = 2 if token else 1
            while True:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise OpsError(f"no answer from the operations endpoint {host}:{port} within {timeout:g} s")
                sock.settimeout(left)
                chunk = sock.recv(1 << 16)
                if not chunk:
                    break
                chunks.append(chunk)
                size += len(chunk)
                if size > MAX_REPLY:
                    raise OpsError(f"the reply of {host}:{port} is larger than {MAX_REPLY} bytes")
                if chunk.endswith(b"\n") and b"".join(chunks).count(b"\n") >= lines_wanted:
                    break
    except TimeoutError:
        raise OpsError(f"no answer from the operations endpoint {host}:{port} within {timeout:g} s") from None
    except OSError as exc:
        raise OpsError(f"no tmrun job answers at {host}:{port} ({exc.strerror or exc})") from None
    data = b"".join(chunks)
    if data.startswith(auth.CHALLENGE):
        raise OpsError(f"the job at {where} requires its job token and none was found ({TOKEN_HINT})")
    if token:
        proof, _, data = data.partition(b"\n")
        if not auth.check_server(token, nonces[0], nonces[1], proof):
            if proof.startswith(b"{") and b"authentication failed" in proof:
                raise OpsError(f"authentication failed: the job at {where} refused this job token ({TOKEN_HINT})")
            raise OpsError(f"{where} did not prove the job token (not this job's operations endpoint?)")
    return decode_reply(data, where)


def decode_reply(raw: bytes, where: str) -> dict[str, Any]:
    """One reply of the endpoint at ``where``; raises :class:`OpsError` (one line) on anything
    that is not a reply object."""
    try:
        reply = json.loads(raw)
    except (ValueError, UnicodeDecodeError, RecursionError):
        raise OpsError(f"{where} is not a tmrun operations endpoint (unreadable reply)") from None
    if not isinstance(reply, dict) or "ok" not in reply:
        raise OpsError(f"{where} is not a tmrun operations endpoint")
    return reply


def _read_line(sock: socket.socket, deadline: float, where: str, timeout: float) -> bytes:
    data = b""
    while not data.endswith(b"\n"):
        left = deadline - time.monotonic()
        if left <= 0:
            raise OpsError(f"no authentication challenge from {where} within {timeout:g} s")
        sock.settimeout(left)
        chunk = sock.recv(1)  # a short line: nothing read past it
        if not chunk:
            raise OpsError(f"{where} closed the connection before authenticating")
        data += chunk
        if len(data) > auth.MAX_LINE:
            raise OpsError(f"{where} is not a tmrun operations endpoint (oversized handshake line)")
    return data
