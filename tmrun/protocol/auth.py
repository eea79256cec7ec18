"""The job token: where an agent, a worker and ``tmrun-ctl`` find it, and the challenge-response
the leader's Python endpoints (operations, liveness) use with it. Standard library only.

A token is text (its UTF-8 bytes are the HMAC key); a generated one is 32 random bytes written
as 64 hex digits. It is read from the file ``TMRUN_JOB_TOKEN_FILE`` names (which must be
readable by its owner only and not empty), else from ``TMRUN_JOB_TOKEN``. It is never put on a
command line, in a log line, an event, a status reply or an exception message.

The handshake, line-based (the native links do the same in binary, docs/native.md):

    server -> client   b"TMRUN-AUTH1 " + hex(nonce_s) + b"\\n"
    client -> server   hex(nonce_c) + b" " + hex(HMAC(token, LABEL + b"dial" + nonce_s + nonce_c)) + b"\\n"
    server -> client   hex(HMAC(token, LABEL + b"acpt" + nonce_s + nonce_c)) + b"\\n"   (or it refuses and closes)

``LABEL`` is ``b"tmrun-auth-v1"``; proofs are compared with :func:`hmac.compare_digest`.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import socket
import stat
from typing import Mapping

from tmrun.protocol.environment import ENV_JOB_TOKEN, ENV_JOB_TOKEN_FILE

LABEL = b"tmrun-auth-v1"
CHALLENGE = b"TMRUN-AUTH1 "
NONCE_BYTES = 32
MAX_LINE = 256  # bytes of one handshake line, newline included


class TokenError(ValueError):
    """The job token cannot be used (one line for the user; never contains the token)."""


class AuthError(ConnectionError):
    """A peer failed the challenge-response (one line; never contains the token)."""


def new_token() -> str:
    return secrets.token_bytes(32).hex()


def read_token_file(path: str, what: str = ENV_JOB_TOKEN_FILE + "=") -> str:
    """The token in ``path``: refused when the file is readable or writable by group or others,
    or empty. ``what`` names the file in errors."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError as exc:
        raise TokenError(f"{what}{path}: cannot open it ({exc.strerror})") from None
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise TokenError(f"{what}{path} is not a regular file")
        if mode & 0o077:
            raise TokenError(f"{what}{path} is accessible to group or others "
                             f"(mode {stat.S_IMODE(mode):o}); chmod 600 it")
        data = os.read(fd, 1 << 16)
    finally:
        os.close(fd)
    try:
        token = data.decode().strip()
    except UnicodeDecodeError:
        raise TokenError(f"{what}{path} is not UTF-8 text") from None
    if not token:
        raise TokenError(f"{what}{path} is empty")
    return token


def token_from_environ(environ: Mapping[str, str] | None = None) -> str | None:
    """The token given to this process: the file ``TMRUN_JOB_TOKEN_FILE`` names, else
    ``TMRUN_JOB_TOKEN``; None when neither is set."""
    env = os.environ if environ is None else environ
    path = env.get(ENV_JOB_TOKEN_FILE, "")
    if path:
        return read_token_file(path)
    value = env.get(ENV_JOB_TOKEN, "").strip()
    return value or None


def write_token_file(path: str, token: str) -> None:
    """Write ``token`` to ``path``, readable by its owner only (created 0600, replaced atomically)."""
    tmp = f"{path}.{os.getpid()}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    try:
        os.write(fd, token.encode() + b"\n")
    finally:
        os.close(fd)
    os.replace(tmp, path)


def proof(token: str, role: bytes, nonce_server: bytes, nonce_client: bytes) -> bytes:
    return hmac.new(token.encode(), LABEL + role + nonce_server + nonce_client, hashlib.sha256).digest()


def fingerprint(token: str, run_id: str) -> str:
    """A value that tells whether two agents hold the same token without revealing it."""
    return hmac.new(token.encode(), LABEL + b"check" + run_id.encode(), hashlib.sha256).hexdigest()


# -- the line handshake ------------------------------------------------------------------------


def challenge() -> tuple[bytes, bytes]:
    """(nonce, the server's first line)."""
    nonce = secrets.token_bytes(NONCE_BYTES)
    return nonce, CHALLENGE + nonce.hex().encode() + b"\n"


def offer_challenge(sock: socket.socket) -> bytes | None:
    """Send the challenge on a freshly accepted socket: its nonce, or None (the socket failed and
    is closed). A few bytes into an empty socket buffer: never blocks."""
    nonce, line = challenge()
    try:
        sock.send(line)
    except OSError:
        sock.close()
        return None
    return nonce


def answer(token: str, challenge_line: bytes) -> tuple[bytes, bytes, bytes]:
    """The client's reply to the server's first line: (nonce_server, nonce_client, the line).
    Raises :class:`AuthError` when the line is not a challenge."""
    line = challenge_line.strip()
    if not line.startswith(CHALLENGE.strip()):
        raise AuthError("no authentication challenge (not a tmrun endpoint with a job token)")
    try:
        nonce_server = bytes.fromhex(line[len(CHALLENGE):].decode())
    except (ValueError, UnicodeDecodeError):
        raise AuthError("malformed authentication challenge") from None
    if len(nonce_server) != NONCE_BYTES:
        raise AuthError("malformed authentication challenge")
    nonce_client = secrets.token_bytes(NONCE_BYTES)
    mine = proof(token, b"dial", nonce_server, nonce_client)
    return nonce_server, nonce_client, nonce_client.hex().encode() + b" " + mine.hex().encode() + b"\n"


def check_answer(token: str, nonce_server: bytes, line: bytes) -> bytes | None:
    """The server's check of the client's line: the server's proof line to send back, or None
    (refuse and close)."""
    parts = line.strip().split(b" ")
    if len(parts) != 2:
        return None
    try:
        nonce_client, given = bytes.fromhex(parts[0].decode()), bytes.fromhex(parts[1].decode())
    except (ValueError, UnicodeDecodeError):
        return None
    if len(nonce_client) != NONCE_BYTES:
        return None
    if not hmac.compare_digest(given, proof(token, b"dial", nonce_server, nonce_client)):
        return None
    return proof(token, b"acpt", nonce_server, nonce_client).hex().encode() + b"\n"


def check_server(token: str, nonce_server: bytes, nonce_client: bytes, line: bytes) -> bool:
    """The client's check of the server's proof line."""
    try:
        given = bytes.fromhex(line.strip().decode())
    except (ValueError, UnicodeDecodeError):
        return False
    return hmac.compare_digest(given, proof(token, b"acpt", nonce_server, nonce_client))
