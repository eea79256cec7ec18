"""tmrun_native/cmake/fetch_nccl_header.py against a loopback HTTP server (no outside network).

The script is what -DTMRUN_NCCL_HEADERS=FETCH runs at configure time; the real download is
exercised by every CI build (tests/nccl/test_nccl_build.py checks its result).
"""

from __future__ import annotations

import contextlib
import hashlib
import http.server
import io
import os
import re
import threading
import zipfile

import pytest

from tests.helpers import ROOT as _ROOT, load_script

ROOT = str(_ROOT)
SCRIPT = os.path.join(ROOT, "tmrun_native", "cmake", "fetch_nccl_header.py")


def _load():
    return load_script(SCRIPT, "tmrun_fetch_nccl_header")


HEADER = b"/* fake nccl.h */\n#define NCCL_VERSION_CODE 23203\n" + b"// padding\n" * 2000


def _wheel(fh) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as zf:
        zf.writestr(fh.MEMBER, HEADER)
        # A large incompressible member between the header and the directory, like libnccl.so.2.
        zf.writestr("nvidia/nccl/lib/libnccl.so.2", os.urandom(600_000), compress_type=zipfile.ZIP_STORED)
        zf.writestr(fh.LICENSE_MEMBER, b"license text\n")
    return buf.getvalue()


class _Server:
    def __init__(self, body: bytes, ranges: bool) -> None:
        self.body, self.ranges = body, ranges
        self.requests: list[str | None] = []
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def do_GET(self) -> None:
                spec = self.headers.get("Range")
                outer.requests.append(spec)
                data, size = outer.body, len(outer.body)
                m = re.fullmatch(r"bytes=(\d*)-(\d*)", spec or "")
                if outer.ranges and m:
                    a, b = m.groups()
                    if a == "":
                        start, end = max(0, size - int(b)), size - 1
                    else:
                        start, end = int(a), min(size - 1, int(b) if b else size - 1)
                    self.send_response(206)
                    self.send_header("Content-Range", f"bytes {start}-{end}/{size}")
                    data = data[start:end + 1]
                else:
                    self.send_response(200)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/nvidia_nccl_cu13-test.whl"
        self.thread = threading.Thread(target=self.httpd.serve_forever, args=(0.02,), daemon=True)  # prompt shutdown()
        self.thread.start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@contextlib.contextmanager
def _serving(body: bytes, ranges: bool):
    srv = _Server(body, ranges)
    try:
        yield srv
    finally:
        srv.close()


@pytest.fixture
def fh(monkeypatch: pytest.MonkeyPatch):
    mod = _load()
    monkeypatch.setattr(mod, "HEADER_SHA256", hashlib.sha256(HEADER).hexdigest())
    monkeypatch.setattr(mod.time, "sleep", lambda s: None)
    for var in ("http_proxy", "HTTP_PROXY", "https_proxy", "HTTPS_PROXY", "all_proxy", "ALL_PROXY"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("no_proxy", "127.0.0.1,localhost")
    return mod


def test_range_reads_fetch_only_the_header(fh, tmp_path, monkeypatch) -> None:
    body = _wheel(fh)
    with _serving(body, ranges=True) as srv:
        monkeypatch.setenv("TMRUN_NCCL_WHEEL_URL", srv.url)
        dest = tmp_path / "nccl" / "include"
        assert fh.fetch(str(dest)) == str(dest)
    assert (dest / "nccl.h").read_bytes() == HEADER
    assert (tmp_path / "nccl" / "License.txt").read_bytes() == b"license text\n"
    assert all(r and r.startswith("bytes=") for r in srv.requests)
    # The tail (directory + license) and the head (header); the 600 kB member is never read.
    assert len(srv.requests) == 2, srv.requests
    assert fh._stats["bytes"] <= 2 * fh.BLOCK < len(body) // 10


def test_cached_header_needs_no_network(fh, tmp_path, monkeypatch) -> None:
    dest = tmp_path / "include"
    dest.mkdir()
    (dest / "nccl.h").write_bytes(HEADER)
    monkeypatch.setenv("TMRUN_NCCL_WHEEL_URL", "http://127.0.0.1:9/unreachable.whl")
    assert fh.fetch(str(dest)) == str(dest)


def test_a_stale_cached_header_is_replaced(fh, tmp_path, monkeypatch) -> None:
    dest = tmp_path / "include"
    dest.mkdir()
    (dest / "nccl.h").write_bytes(b"old version\n")
    with _serving(_wheel(fh), ranges=True) as srv:
        monkeypatch.setenv("TMRUN_NCCL_WHEEL_URL", srv.url)
        fh.fetch(str(dest))
    assert (dest / "nccl.h").read_bytes() == HEADER


def test_server_without_ranges_falls_back_to_a_full_download(fh, tmp_path, monkeypatch) -> None:
    body = _wheel(fh)
    with _serving(body, ranges=False) as srv:
        monkeypatch.setenv("TMRUN_NCCL_WHEEL_URL", srv.url)
        dest = tmp_path / "include"
        fh.fetch(str(dest))
    assert (dest / "nccl.h").read_bytes() == HEADER
    assert srv.requests[-1] is None  # the plain GET
    assert sorted(os.listdir(dest)) == ["nccl.h"]  # the temporary wheel is gone


def test_local_wheel_path(fh, tmp_path, monkeypatch) -> None:
    whl = tmp_path / "w.whl"
    whl.write_bytes(_wheel(fh))
    monkeypatch.setenv("TMRUN_NCCL_WHEEL_URL", str(whl))
    fh.fetch(str(tmp_path / "include"))
    assert (tmp_path / "include" / "nccl.h").read_bytes() == HEADER


def test_wrong_header_is_rejected_with_one_line(fh, tmp_path, monkeypatch, capsys) -> None:
    monkeypatch.setattr(fh, "HEADER_SHA256", "0" * 64)
    with _serving(_wheel(fh), ranges=True) as srv:
        monkeypatch.setenv("TMRUN_NCCL_WHEEL_URL", srv.url)
        rc = fh.main(["--dest", str(tmp_path / "include")])
    err = capsys.readouterr().err
    assert rc == 1
    assert err.count("\n") == 1 and err.startswith("fetch_nccl_header: error:") and "sha256" in err
    assert not (tmp_path / "include" / "nccl.h").exists()


def test_unreachable_server_is_one_line_error(fh, tmp_path, monkeypatch, capsys) -> None:
    with _serving(b"", ranges=True) as srv:
        url = srv.url
    monkeypatch.setenv("TMRUN_NCCL_WHEEL_URL", url)  # the port is closed now
    rc = fh.main(["--dest", str(tmp_path / "include")])
    out = capsys.readouterr()
    assert rc == 1 and out.out == ""
    assert out.err.count("\n") == 1 and out.err.startswith("fetch_nccl_header: error: nccl.h")
    assert "127.0.0.1" in out.err


def test_unwritable_dest_uses_the_fallback(fh, tmp_path, monkeypatch, capsys) -> None:
    whl = tmp_path / "w.whl"
    whl.write_bytes(_wheel(fh))
    monkeypatch.setenv("TMRUN_NCCL_WHEEL_URL", str(whl))
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    rc = fh.main(["--dest", str(blocker / "include"), "--fallback-dest", str(tmp_path / "fb")])
    assert rc == 0
    assert capsys.readouterr().out.strip() == str(tmp_path / "fb")
    assert (tmp_path / "fb" / "nccl.h").read_bytes() == HEADER


def test_pins_are_consistent() -> None:
    mod = _load()
    assert re.fullmatch(r"\d+\.\d+\.\d+", mod.VERSION)
    assert re.fullmatch(r"[0-9a-f]{64}", mod.HEADER_SHA256)
    for url, sha in mod.WHEELS.values():
        assert f"nvidia_nccl_cu13-{mod.VERSION}-" in url and url.endswith(".whl")
        assert re.fullmatch(r"[0-9a-f]{64}", sha)
