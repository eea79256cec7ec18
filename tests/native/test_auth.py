"""Authenticated links: SHA-256 / HMAC-SHA256 of the module against known vectors, and the job
token's challenge-response on every connection a communicator accepts or dials."""

from __future__ import annotations

import hashlib
import hmac
import os
import socket
import time

import pytest
import torch

from conftest import buf, close_all, dt, make_group, run_ranks, tn

# RFC 4231, test cases 1-4, 6, 7 (HMAC-SHA256; case 5 is a truncated output)
RFC4231 = [
    (b"\x0b" * 20, b"Hi There", "b0344c61d8db38535ca8afceaf0bf12b881dc200c9833da726e9376c2e32cff7"),
    (b"Jefe", b"what do ya want for nothing?", "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843"),
    (b"\xaa" * 20, b"\xdd" * 50, "773ea91e36800e46854db8ebd09181a72959098b3ef8c122d9635514ced565fe"),
    (bytes(range(1, 26)), b"\xcd" * 50, "82558a389a443c0ea4cc819899f2083a85f0faa3e578f8077a2e3ff46729665b"),
    (b"\xaa" * 131, b"Test Using Larger Than Block-Size Key - Hash Key First",
     "60e431591ee0b67f0d8a26aacbf5b77f8e0bc6213728c5140546040f0ee37f54"),
    (b"\xaa" * 131,
     b"This is a test using a larger than block-size key and a larger than block-size data. The key needs to be "
     b"hashed before being used by the HMAC algorithm.",
     "9b09ffa71b942fcb27635fbcd5b0e944bfdc63644f0713938a7f51535c3a35e2"),
]


@pytest.mark.parametrize("key,msg,expected", RFC4231)
def test_hmac_sha256_rfc4231(key, msg, expected):
    assert tn.hmac_sha256(key, msg).hex() == expected


def test_sha256_and_hmac_against_hashlib():
    assert tn.sha256(b"").hex() == "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"
    assert tn.sha256(b"abc").hex() == "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
    rng = __import__("random").Random(7)
    for n in [0, 1, 55, 56, 63, 64, 65, 119, 120, 127, 128, 1000, 4097]:
        data = bytes(rng.getrandbits(8) for _ in range(n))
        assert tn.sha256(data) == hashlib.sha256(data).digest(), n
        key = bytes(rng.getrandbits(8) for _ in range(n % 150))
        assert tn.hmac_sha256(key, data) == hmac.new(key, data, hashlib.sha256).digest(), n


def test_token_option_is_not_shown():
    o = tn.Options(token=b"sekrit-token")
    assert o.token == b"sekrit-token"
    assert "sekrit" not in repr(o)
    assert tn.Options(token="text").token == b"text"
    assert tn.Options().token == b""


def _sum_check(comms):
    xs = [torch.full((5000,), float(c.rank + 1), dtype=torch.float32) for c in comms]
    run_ranks(comms, lambda c: c.allreduce(buf(xs[c.rank]), dtype=dt(xs[c.rank])))
    n = len(comms)
    assert all((x == n * (n + 1) / 2).all() for x in xs)


def test_same_token_connects_and_runs_collectives():
    token = os.urandom(32)
    comms = make_group(3, job="auth-ok", token=token)
    try:
        _sum_check(comms)
        # a lazy point-to-point link (dialled inside an operation) is authenticated too
        a, b = torch.arange(100, dtype=torch.float32), torch.zeros(100, dtype=torch.float32)
        run_ranks(comms, lambda c: c.send(buf(a), 2) if c.rank == 0 else (c.recv(buf(b), 0) if c.rank == 2 else None))
        assert torch.equal(a, b)
        for c in comms:
            k = c.counters()
            assert k["auth_failures"] == 0 and k["rejected_connections"] == 0, k
    finally:
        close_all(comms)


def test_replacement_links_are_authenticated():
    from conftest import connect_all  # noqa: F401

    token = b"replace-token"
    comms = make_group(3, job="auth-rep", token=token)
    try:
        comms[1].close()
        joiner = tn.Communicator(1, 3, "auth-rep", 1, tn.Options(timeout=5.0, token=token))
        addrs = [comms[0].address, joiner.address, comms[2].address]
        survivors = [comms[0], comms[2]]
        for c in survivors:
            c.prepare([1], {1: joiner.address}, 1)
        run_ranks([joiner, *survivors], lambda c: c.connect(addrs) if c is joiner else c.commit())
        comms[1] = joiner
        _sum_check(comms)
        assert all(c.counters()["auth_failures"] == 0 for c in comms)
    finally:
        close_all(comms)


@pytest.mark.e2e  # over half a second: waits out a timeout (the unit subset stays within a minute)
def test_different_tokens_cannot_connect():
    a = tn.Communicator(0, 2, "auth-bad", 0, tn.Options(timeout=1.0, connect_timeout=1.5, token=b"token-A"))
    b = tn.Communicator(1, 2, "auth-bad", 0, tn.Options(timeout=1.0, connect_timeout=1.5, token=b"token-B"))
    try:
        addrs = [a.address, b.address]
        started = time.monotonic()
        _, errors = run_ranks([a, b], lambda c: c.connect(addrs), timeout=20, raise_errors=False)
        took = time.monotonic() - started
        assert took < 10, took
        # rank 0 dials rank 1 (the lower rank dials): refused at once, naming authentication
        assert isinstance(errors[0], tn.AuthenticationError), errors
        assert isinstance(errors[0], tn.CommError)
        assert "authentication" in str(errors[0])
        assert "token-A" not in str(errors[0]) and "token-B" not in str(errors[0])
        # rank 1 waited for rank 0's link in vain and says why
        assert isinstance(errors[1], tn.AuthenticationError), errors
        assert "failed authentication" in str(errors[1])
        kb = b.counters()
        assert kb["auth_failures"] >= 1 and kb["rejected_connections"] >= 1, kb
        assert "authentication failed" in kb["last_reject_reason"]
        assert a.counters()["auth_failures"] >= 1
    finally:
        close_all([a, b])


@pytest.mark.e2e  # slow: waits out a protocol timeout (over a second), not in the unit subset
def test_token_on_one_side_only_cannot_connect():
    a = tn.Communicator(0, 2, "auth-half", 0, tn.Options(timeout=1.0, connect_timeout=1.5))
    b = tn.Communicator(1, 2, "auth-half", 0, tn.Options(timeout=1.0, connect_timeout=1.5, token=b"t"))
    try:
        addrs = [a.address, b.address]
        _, errors = run_ranks([a, b], lambda c: c.connect(addrs), timeout=20, raise_errors=False)
        assert isinstance(errors[0], tn.AuthenticationError), errors
        assert "no job token" in str(errors[0])
        assert errors[1] is not None
        assert b.counters()["auth_failures"] >= 1
    finally:
        close_all([a, b])
    # and the other way round: the dialer has a token, the acceptor none
    a = tn.Communicator(0, 2, "auth-half2", 0, tn.Options(timeout=1.0, connect_timeout=1.5, token=b"t"))
    b = tn.Communicator(1, 2, "auth-half2", 0, tn.Options(timeout=1.0, connect_timeout=1.5))
    try:
        addrs = [a.address, b.address]
        started = time.monotonic()
        _, errors = run_ranks([a, b], lambda c: c.connect(addrs), timeout=20, raise_errors=False)
        assert time.monotonic() - started < 10
        assert isinstance(errors[0], tn.CommError) and "authentication challenge" in str(errors[0]), errors
        assert errors[1] is not None
    finally:
        close_all([a, b])


def _wait_counter(comm, name, value, timeout=10.0):
    deadline = time.monotonic() + timeout
    while comm.counters()[name] < value:
        assert time.monotonic() < deadline, comm.counters()
        time.sleep(0.02)


@pytest.mark.e2e  # slow: waits out a protocol timeout (over a second), not in the unit subset
def test_stray_clients_are_dropped_and_counted_while_the_group_works():
    token = os.urandom(32)
    comms = make_group(3, job="auth-stray", timeout=1.0, token=token)
    try:
        ids = [{l["peer"]: l["id"] for l in c.links()} for c in comms]
        target = comms[1]
        socks = []
        # garbage in place of the reply; a valid hello frame without authentication; a truncated reply
        hello = tn.encode_frame(2, b"\x00" * 12, job_id="auth-stray", epoch=0, seq=0)
        for payload in [b"GET / HTTP/1.1\r\nHost: x\r\n\r\n" + b"x" * 64, hello, b"\x01" * 10]:
            s = socket.create_connection(("127.0.0.1", target.port))
            challenge = s.recv(40)
            assert challenge[:8] == b"TMRAUTH1"
            s.sendall(payload)
            socks.append(s)
        # a wrong proof of the right length, after reading the challenge
        s = socket.create_connection(("127.0.0.1", target.port))
        s.recv(40)
        s.sendall(os.urandom(64))
        assert s.recv(1) == b"\x01"  # refused
        socks.append(s)
        silent = socket.create_connection(("127.0.0.1", target.port))  # says nothing at all
        # a collective runs meanwhile and is correct
        _sum_check(comms)
        _wait_counter(target, "auth_failures", 3)  # the garbage, the bare hello, the wrong proof: at once
        socks[2].close()  # the truncated one hangs up
        _wait_counter(target, "auth_failures", 4)
        _wait_counter(target, "auth_failures", 5)  # the silent one, after max(2 s, timeout)
        assert "authentication failed" in target.counters()["last_reject_reason"]
        for s in socks:
            s.close()
        silent.close()
        _sum_check(comms)
        assert [{l["peer"]: l["id"] for l in c.links()} for c in comms] == ids
        assert all(c.failure() == "" for c in comms)
    finally:
        close_all(comms)


def test_a_client_that_knows_the_token_gets_the_acceptors_proof():
    """The handshake as documented (docs/native.md), done by hand: mutual proofs."""
    token = b"hand-made"
    comms = make_group(2, job="auth-hand", token=token)
    try:
        s = socket.create_connection(("127.0.0.1", comms[1].port))
        ch = s.recv(40)
        while len(ch) < 40:
            ch += s.recv(40 - len(ch))
        nonce_a, nonce_d = ch[8:], os.urandom(32)
        label = b"tmrun-auth-v1"
        proof_d = hmac.new(token, label + b"dial" + nonce_a + nonce_d, hashlib.sha256).digest()
        s.sendall(nonce_d + proof_d)
        verdict = b""
        while len(verdict) < 33:
            verdict += s.recv(33 - len(verdict))
        assert verdict[0] == 0
        assert hmac.compare_digest(verdict[1:], hmac.new(token, label + b"acpt" + nonce_a + nonce_d,
                                                         hashlib.sha256).digest())
        s.close()
        assert comms[1].counters()["auth_failures"] == 0
        _sum_check(comms)
    finally:
        close_all(comms)
