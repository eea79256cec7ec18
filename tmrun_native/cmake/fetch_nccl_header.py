#!/usr/bin/env python3
"""Fetch nccl.h of a pinned nvidia-nccl-cu13 wheel into a cache directory (stdlib only).

Used by CMakeLists.txt with -DTMRUN_NCCL_HEADERS=FETCH; runnable by hand too:

    python tmrun_native/cmake/fetch_nccl_header.py [--dest DIR]

Prints the include directory (the one holding nccl.h) on stdout and exits 0; on failure
prints one line starting with "fetch_nccl_header: error:" on stderr and exits 1.

How: the wheel (~290 MiB, almost all libnccl.so.2) is a zip whose members can be read with
HTTP range requests: the central directory at the end, then the compressed nccl.h at the
start (~20 KiB in all, what pip's "lazy wheel" does). If the server ignores Range, the whole
wheel is streamed to a temporary file next to the cache, its sha256 checked, the header
extracted and the file removed. Either way the header's own sha256 is checked against the
pinned value before it is put in place (atomically), and a cached header that matches is
reused without any network access.

Environment: http(s)_proxy / no_proxy (urllib's usual handling), SSL_CERT_FILE or PIP_CERT
(CA bundle), TMRUN_NCCL_WHEEL_URL (a mirror URL or a local path of the same wheel, used
instead of the pinned URLs), TMRUN_CACHE_DIR (default $XDG_CACHE_HOME/tmrun, else
~/.cache/tmrun).
"""

from __future__ import annotations

import argparse
import hashlib
import io
import os
import platform
import shutil
import ssl
import sys
import tempfile
import time
import urllib.error
import urllib.request
import zipfile

VERSION = "2.32.3"
MEMBER = "nvidia/nccl/include/nccl.h"
LICENSE_MEMBER = f"nvidia_nccl_cu13-{VERSION}.dist-info/licenses/License.txt"
# sha256 of nccl.h inside both wheels below (the header is the same for every platform).
HEADER_SHA256 = "7d36e8a70b3c3a0a135f3ab7c8422d1a9b0180f09774bd604d58a39d73bdcb6b"
# (url, sha256 of the whole wheel, size), host architecture first when it matches.
WHEELS = {
    "x86_64": (
        "https://files.pythonhosted.org/packages/5b/29/6b277e63c92d91f9cb4d1a3a554e148983de39d54baa652bb52c798af78e/"
        f"nvidia_nccl_cu13-{VERSION}-py3-none-manylinux_2_27_x86_64.whl",
        "1459723080ac889d73a26edfa3e04383a7928ab31ac8f0ec43b3ea9548b04ff3",
    ),
    "aarch64": (
        "https://files.pythonhosted.org/packages/58/0a/c29c302036a06d27dd732588f3fd8ee89b1f7b0087e38c668ae7be8ff7b2/"
        f"nvidia_nccl_cu13-{VERSION}-py3-none-manylinux_2_27_aarch64.whl",
        "a5bee92b2f4af218c109f8d221c3c9adcc752b94ae0ffcb0ed5abf9341a7724c",
    ),
}

TIMEOUT_S = 30.0  # per connect / per read of one request
FULL_DOWNLOAD_DEADLINE_S = 900.0  # the whole-wheel fallback, end to end
RETRIES = 3
BLOCK = 16 * 1024  # smallest range request; the tail block holds the whole directory of this wheel

_stats = {"requests": 0, "bytes": 0}


class FetchError(Exception):
    pass


class DestUnwritable(FetchError):
    pass


class RangeUnsupported(Exception):
    pass


def _ssl_context() -> ssl.SSLContext:
    cafile = os.environ.get("SSL_CERT_FILE") or os.environ.get("PIP_CERT") or None
    if cafile and not os.path.isfile(cafile):
        cafile = None
    return ssl.create_default_context(cafile=cafile)


def _opener() -> urllib.request.OpenerDirector:
    # build_opener adds a ProxyHandler reading http_proxy/https_proxy/no_proxy.
    return urllib.request.build_opener(urllib.request.HTTPSHandler(context=_ssl_context()))


def _retrying(what: str, fn):
    delay = 1.0
    for attempt in range(1, RETRIES + 1):
        try:
            return fn()
        except (RangeUnsupported, FetchError):
            raise
        except urllib.error.HTTPError as exc:
            if exc.code < 500 or attempt == RETRIES:
                raise FetchError(f"{what}: HTTP {exc.code} {exc.reason}") from None
        except (urllib.error.URLError, OSError, TimeoutError) as exc:
            if attempt == RETRIES:
                reason = getattr(exc, "reason", exc)
                raise FetchError(f"{what}: {reason}") from None
        time.sleep(delay)
        delay *= 2
    raise AssertionError("unreachable")


def _content_range_total(value: str | None) -> int:
    # "bytes 100-199/305100071"
    if not value or "/" not in value:
        raise RangeUnsupported("no Content-Range")
    total = value.rsplit("/", 1)[1].strip()
    if not total.isdigit():
        raise RangeUnsupported(f"Content-Range without a length: {value!r}")
    return int(total)


class HttpRangeFile(io.RawIOBase):
    """A read-only, seekable file over HTTP Range GETs, keeping the blocks already fetched."""

    def __init__(self, url: str, opener: urllib.request.OpenerDirector) -> None:
        super().__init__()
        self.url = url
        self.opener = opener
        self.pos = 0
        # One suffix request gives the size and the tail (end of central directory + directory).
        start, data, total = self._get(f"bytes=-{BLOCK}")
        self.size = total
        self.blocks = [(start, data)]  # the few blocks read so far (tail, member, ...)

    def _get(self, spec: str) -> tuple[int, bytes, int]:
        def once():
            req = urllib.request.Request(self.url, headers={"Range": spec, "Accept-Encoding": "identity"})
            with self.opener.open(req, timeout=TIMEOUT_S) as resp:
                if resp.status != 206:
                    raise RangeUnsupported(f"server answered {resp.status} to a range request")
                total = _content_range_total(resp.headers.get("Content-Range"))
                first = int(resp.headers["Content-Range"].split()[1].split("-")[0])
                data = resp.read()
            _stats["requests"] += 1
            _stats["bytes"] += len(data)
            return first, data, total

        return _retrying(f"range request to {self.url}", once)

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self.pos, io.SEEK_END: self.size}[whence]
        self.pos = max(0, base + offset)
        return self.pos

    def readinto(self, buf) -> int:
        want = min(len(buf), self.size - self.pos)
        if want <= 0:
            return 0
        end = self.pos + want
        for start, data in self.blocks:
            if start <= self.pos and end <= start + len(data):
                break
        else:
            last = min(self.size, self.pos + max(want, BLOCK)) - 1
            start, data, _ = self._get(f"bytes={self.pos}-{last}")
            if start != self.pos or len(data) < want:
                raise FetchError(f"range request to {self.url}: short or misplaced answer")
            self.blocks = [(start, data)] + self.blocks[:3]
        off = self.pos - start
        buf[:want] = data[off:off + want]
        self.pos = end
        return want


def _read_members(zf: zipfile.ZipFile) -> tuple[bytes, bytes | None]:
    try:
        header = zf.read(MEMBER)  # checks the member's CRC-32
    except KeyError:
        raise FetchError(f"{MEMBER} is not in the wheel") from None
    try:
        lic = zf.read(LICENSE_MEMBER)
    except KeyError:
        lic = None
    return header, lic


def _via_ranges(url: str, opener) -> tuple[bytes, bytes | None]:
    f = HttpRangeFile(url, opener)
    with zipfile.ZipFile(f) as zf:
        return _read_members(zf)


def _via_full_download(url: str, wheel_sha256: str | None, tmp_dir: str, opener) -> tuple[bytes, bytes | None]:
    deadline = time.monotonic() + FULL_DOWNLOAD_DEADLINE_S
    fd, tmp = tempfile.mkstemp(prefix=".nccl-wheel-", suffix=".whl", dir=tmp_dir)
    os.close(fd)
    try:
        def once():
            digest = hashlib.sha256()
            req = urllib.request.Request(url, headers={"Accept-Encoding": "identity"})
            with open(tmp, "wb") as out, opener.open(req, timeout=TIMEOUT_S) as resp:
                while True:
                    if time.monotonic() > deadline:
                        raise FetchError(f"download of {url} took longer than {FULL_DOWNLOAD_DEADLINE_S:.0f} s")
                    chunk = resp.read(1 << 20)
                    if not chunk:
                        break
                    out.write(chunk)
                    digest.update(chunk)
                    _stats["bytes"] += len(chunk)
            _stats["requests"] += 1
            return digest.hexdigest()

        got = _retrying(f"download of {url}", once)
        if wheel_sha256 and got != wheel_sha256:
            raise FetchError(f"{url}: sha256 {got} != pinned {wheel_sha256}")
        with zipfile.ZipFile(tmp) as zf:
            return _read_members(zf)
    finally:
        os.unlink(tmp)


def _from_local(path: str) -> tuple[bytes, bytes | None]:
    try:
        with zipfile.ZipFile(path) as zf:
            return _read_members(zf)
    except (OSError, zipfile.BadZipFile) as exc:
        raise FetchError(f"{path}: {exc}") from None


def _candidates() -> list[tuple[str, str | None]]:
    override = os.environ.get("TMRUN_NCCL_WHEEL_URL")
    if override:
        return [(override, None)]
    arch = platform.machine().lower()
    order = sorted(WHEELS, key=lambda a: a != arch)
    return [WHEELS[a] for a in order]


def fetch(dest_include: str, *, log=lambda msg: None) -> str:
    """Make dest_include/nccl.h the pinned header; return dest_include."""
    target = os.path.join(dest_include, "nccl.h")
    if os.path.isfile(target) and _sha256_file(target) == HEADER_SHA256:
        log(f"cached: {target}")
        return dest_include
    try:
        os.makedirs(dest_include, exist_ok=True)
    except OSError as exc:
        raise DestUnwritable(f"cannot create {dest_include}: {exc.strerror}") from None
    if not os.access(dest_include, os.W_OK | os.X_OK):
        raise DestUnwritable(f"cannot write to {dest_include}")

    errors = []
    opener = _opener()
    for url, wheel_sha in _candidates():
        try:
            if "://" not in url:
                header, lic = _from_local(url)
            elif url.startswith("file://"):
                header, lic = _from_local(urllib.request.url2pathname(url[len("file://"):]))
            else:
                try:
                    header, lic = _via_ranges(url, opener)
                except (RangeUnsupported, zipfile.BadZipFile) as exc:
                    log(f"range reads failed ({exc}); downloading the whole wheel")
                    header, lic = _via_full_download(url, wheel_sha, dest_include, opener)
        except (FetchError, zipfile.BadZipFile) as exc:
            errors.append(str(exc))
            continue
        got = hashlib.sha256(header).hexdigest()
        if got != HEADER_SHA256:
            errors.append(f"{url}: nccl.h sha256 {got} != pinned {HEADER_SHA256}")
            continue
        _write_atomic(target, header)
        if lic is not None:
            _write_atomic(os.path.join(os.path.dirname(dest_include), "License.txt"), lic)
        log(f"fetched nccl.h {VERSION} from {url}: {_stats['bytes']} bytes in {_stats['requests']} requests")
        return dest_include
    raise FetchError("; ".join(errors) or "no wheel to fetch from")


def _write_atomic(path: str, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=os.path.dirname(path))
    try:
        with os.fdopen(fd, "wb") as out:
            out.write(data)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o644 & ~umask)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def _sha256_file(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def default_cache_root() -> str:
    root = os.environ.get("TMRUN_CACHE_DIR")
    if root:
        return root
    xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(xdg, "tmrun")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dest", help="include dir to put nccl.h in "
                    f"(default: <cache>/nccl-{VERSION}/include, <cache> = TMRUN_CACHE_DIR or ~/.cache/tmrun)")
    ap.add_argument("--fallback-dest", help="include dir to use when --dest cannot be written")
    ap.add_argument("--verbose", "-v", action="store_true", help="report what was done on stderr")
    args = ap.parse_args(argv)

    def log(msg: str) -> None:
        if args.verbose:
            print(f"fetch_nccl_header: {msg}", file=sys.stderr)

    dests = [args.dest or os.path.join(default_cache_root(), f"nccl-{VERSION}", "include")]
    if args.fallback_dest:
        dests.append(args.fallback_dest)
    for i, dest in enumerate(dests):
        try:
            print(fetch(os.path.abspath(dest), log=log))
            return 0
        except FetchError as exc:
            # Only an unwritable destination moves on to the fallback; a network failure is final.
            if i + 1 < len(dests) and isinstance(exc, DestUnwritable):
                log(f"{exc}; trying {dests[i + 1]}")
                continue
            print(f"fetch_nccl_header: error: nccl.h {VERSION} not obtained: {exc}", file=sys.stderr)
            return 1
        except OSError as exc:
            print(f"fetch_nccl_header: error: nccl.h {VERSION} not obtained: {exc}", file=sys.stderr)
            return 1
    return 1


if __name__ == "__main__":
    sys.exit(main())
