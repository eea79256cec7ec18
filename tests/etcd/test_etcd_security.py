"""etcd reached the way a real cluster is configured: TLS (a CA, client certificates) and etcd's
own authentication (a user whose password comes from a file). Real etcd, certificates made with
openssl for the test."""

from __future__ import annotations

import shutil
import subprocess
import uuid
from pathlib import Path

import pytest

from tests.etcd.server import start_etcd, why_no_etcd
from tmrun.protocol.etcd import EtcdConfig, EtcdConfigError, EtcdError, EtcdStore

pytestmark = pytest.mark.e2e  # each test starts an etcd of its own: not in the quick unit subset


def _need_etcd() -> None:
    reason = why_no_etcd() or ("" if shutil.which("openssl") else "no openssl to make certificates")
    if reason:
        pytest.skip(f"no etcd here: {reason}")


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


def _certificates(directory: Path) -> Path:
    """A CA, a server certificate for 127.0.0.1 and a client certificate, all signed by the CA."""
    certs = directory / "certs"
    certs.mkdir()
    _openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes", "-keyout", "ca.key", "-out", "ca.crt", "-days", "2",
             "-subj", "/CN=tmrun-test-ca", cwd=certs)
    (certs / "san.cnf").write_text("subjectAltName=IP:127.0.0.1\nextendedKeyUsage=serverAuth,clientAuth\n")
    for name in ("server", "client"):
        _openssl("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes", "-keyout", f"{name}.key", "-out", f"{name}.csr",
                 "-subj", f"/CN={name}", cwd=certs)
        _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
                 "-out", f"{name}.crt", "-days", "2", "-extfile", "san.cnf", cwd=certs)
    return certs


def test_tls_with_client_certificates(tmp_path: Path) -> None:
    _need_etcd()
    certs = _certificates(tmp_path)
    server = start_etcd(tmp_path, scheme="https", extra=[
        "--cert-file", str(certs / "server.crt"), "--key-file", str(certs / "server.key"),
        "--client-cert-auth", "--trusted-ca-file", str(certs / "ca.crt")])
    try:
        options = {"etcd_cacert": str(certs / "ca.crt"), "etcd_cert": str(certs / "client.crt"),
                   "etcd_key": str(certs / "client.key")}
        store = EtcdStore.for_job(EtcdConfig.parse(server.endpoint, options), "tls", connect_timeout=5)
        store.set("k", "v")
        assert store.get("k") == b"v" and store.add("n", 2) == 2
        no_client_cert = EtcdConfig.parse(server.endpoint, {"etcd_cacert": str(certs / "ca.crt")})
        with pytest.raises(EtcdError):
            EtcdStore.for_job(no_client_cert, "tls", connect_timeout=1).set("k", "v")
    finally:
        server.stop()


def test_etcd_authentication_with_a_password_file(tmp_path: Path) -> None:
    _need_etcd()
    server = start_etcd(tmp_path)
    try:
        server.etcdctl("user", "add", "root:rootpw")
        server.etcdctl("user", "add", "trainer:s3cret")
        server.etcdctl("role", "add", "jobs")
        server.etcdctl("role", "grant-permission", "jobs", "--prefix=true", "readwrite", "/tmrun/")
        server.etcdctl("user", "grant-role", "trainer", "jobs")
        server.etcdctl("auth", "enable")
        password = tmp_path / "password"
        password.write_text("s3cret\n")
        password.chmod(0o600)
        config = EtcdConfig.parse(server.endpoint, {"etcd_user": "trainer", "etcd_password_file": str(password)})
        store = EtcdStore.for_job(config, f"auth-{uuid.uuid4().hex[:6]}", connect_timeout=5)
        store.set("k", "v")
        assert store.get("k") == b"v" and store.compare_set("k", "v", "w") == b"w"
        lease = store.grant_lease(5)
        assert store.create("lead", "me", lease)
        wrong = tmp_path / "wrong"
        wrong.write_text("nope")
        with pytest.raises(EtcdError, match="authentication failed|invalid"):
            EtcdStore.for_job(EtcdConfig.parse(server.endpoint, {"etcd_user": "trainer",
                                                                 "etcd_password_file": str(wrong)}), "x")
        with pytest.raises(EtcdConfigError, match="cannot read etcd_password_file"):
            EtcdStore.for_job(EtcdConfig.parse(server.endpoint, {"etcd_user": "trainer",
                                                                 "etcd_password_file": str(tmp_path / "none")}), "x")
        with pytest.raises(EtcdError):  # no credentials: refused
            EtcdStore.for_job(EtcdConfig.parse(server.endpoint), "x", connect_timeout=2).set("k", "v")
    finally:
        server.stop()


def test_an_expired_auth_token_is_renewed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """etcd forgets simple tokens after --auth-token-ttl: the store authenticates again."""
    _need_etcd()
    from tmrun.protocol import etcd

    refreshes: list[bool] = []
    authenticate = etcd._Client._authenticate
    monkeypatch.setattr(etcd._Client, "_authenticate",
                        lambda self, refresh=False: refreshes.append(refresh) or authenticate(self, refresh))
    server = start_etcd(tmp_path, extra=["--auth-token-ttl", "1"])
    try:
        server.etcdctl("user", "add", "root:rootpw")
        server.etcdctl("auth", "enable")
        password = tmp_path / "password"
        password.write_text("rootpw")
        store = EtcdStore.for_job(EtcdConfig.parse(server.endpoint, {"etcd_user": "root",
                                                                     "etcd_password_file": str(password)}), "ttl")
        store.set("k", "v")
        import time

        time.sleep(3)  # the token expired
        assert store.get("k") == b"v"
        assert refreshes == [False, True]  # authenticated, then once more after the expiry
    finally:
        server.stop()
