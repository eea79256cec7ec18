"""NCCL transport on a machine without a GPU: compile flag, graceful failure, loader, tables.

These run everywhere (CPU-only CI included). Whether the NCCL path was compiled in depends on
nccl.h being present at build time; tests that need it skip otherwise (CI builds with
TMRUN_NCCL_HEADERS=FETCH, so there they run: test_nccl_build.py fails a FETCH build without
the transport), and tests that need the nvidia-nccl wheel's libnccl.so.2 skip when it is not
installed.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

tmrun_native = pytest.importorskip("tmrun_native")
from tmrun.comm import nccl  # noqa: E402

COMPILED = bool(tmrun_native.nccl_compiled())
needs_compiled = pytest.mark.skipif(not COMPILED, reason="built without nccl.h")
WHEEL_LIB = nccl.wheel_lib_dir()
needs_wheel = pytest.mark.skipif(
    not (COMPILED and WHEEL_LIB), reason="needs the NCCL transport and the nvidia-nccl wheel"
)


def _has_gpu() -> bool:
    try:
        return tmrun_native.cuda_driver_info()["device_count"] > 0
    except tmrun_native.NcclError:
        return False


HAS_GPU = _has_gpu()
no_gpu_only = pytest.mark.skipif(HAS_GPU, reason="this machine has a usable GPU")


# ---- build flag ------------------------------------------------------------------------


def test_compiled_flag_is_consistent() -> None:
    assert isinstance(tmrun_native.nccl_compiled(), bool)
    assert nccl.nccl_compiled() is COMPILED
    assert (tmrun_native.nccl_header_version() > 0) is COMPILED
    if COMPILED:
        assert tmrun_native.nccl_header_version() >= 21800


def test_exception_hierarchy() -> None:
    assert issubclass(tmrun_native.NcclError, RuntimeError)
    assert issubclass(tmrun_native.NcclTimeoutError, tmrun_native.NcclError)
    assert issubclass(tmrun_native.NcclUnavailableError, tmrun_native.NcclError)
    assert nccl.NcclError is tmrun_native.NcclError


# ---- graceful failure without a GPU ----------------------------------------------------


@no_gpu_only
def test_nccl_available_is_false_with_a_reason() -> None:
    ok, reason = nccl.nccl_available()
    assert ok is False
    assert reason
    if not COMPILED:
        assert "built without" in reason
    elif WHEEL_LIB:
        # Library loads; the CUDA driver does not.
        assert "no usable GPU" in reason and "libcuda.so.1" in reason


@no_gpu_only
def test_cuda_driver_missing_is_a_clear_error() -> None:
    with pytest.raises(tmrun_native.NcclUnavailableError, match="libcuda"):
        tmrun_native.cuda_driver_info()


def test_cuda_driver_override_rejects_a_non_driver_library(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TMRUN_CUDA_DRIVER_LIBRARY", "libm.so.6")
    if HAS_GPU:
        pytest.skip("driver already loaded and cached in this process")
    with pytest.raises(tmrun_native.NcclUnavailableError, match="lacks symbols: cuInit"):
        tmrun_native.cuda_driver_info()


@no_gpu_only
def test_constructing_a_communicator_without_gpu_raises() -> None:
    with pytest.raises(tmrun_native.NcclUnavailableError) as info:
        tmrun_native.NcclCommunicator(bytes(128), 2, 0, 0)
    msg = str(info.value)
    assert "libcuda" in msg or "libnccl" in msg or "built without" in msg
    assert info.value.code == -1


@no_gpu_only
def test_wrapper_construction_without_gpu_raises() -> None:
    torch_dist = pytest.importorskip("torch.distributed")
    store = torch_dist.HashStore()
    with pytest.raises(nccl.NcclUnavailableError):
        nccl.NcclComm(store, 0, 1, 0, epoch=1, timeout=2.0)


@needs_compiled
def test_bad_unique_id_is_a_value_error() -> None:
    if not WHEEL_LIB:
        pytest.skip("library must load before the id is checked")
    with pytest.raises(ValueError, match="128 bytes"):
        tmrun_native.NcclCommunicator(b"short", 2, 0, 0)


# ---- dlopen loader ---------------------------------------------------------------------


@needs_compiled
def test_loader_rejects_missing_file() -> None:
    with pytest.raises(tmrun_native.NcclUnavailableError, match="could not be loaded"):
        tmrun_native.nccl_open_library("/nonexistent/dir/libnccl.so.2")


@needs_compiled
def test_loader_rejects_a_library_that_is_not_nccl() -> None:
    with pytest.raises(tmrun_native.NcclUnavailableError, match="not a usable NCCL library.*ncclGetVersion"):
        tmrun_native.nccl_open_library("libm.so.6")


def test_env_override_with_bogus_path_is_reported() -> None:
    # A fresh process: the loaded library is cached per process.
    code = (
        "import tmrun_native as t\n"
        "try:\n"
        "    t.nccl_load()\n"
        "    print('LOADED')\n"
        "except t.NcclUnavailableError as e:\n"
        "    print('ERR', e)\n"
    )
    env = dict(os.environ, TMRUN_NCCL_LIBRARY="/nonexistent/libnccl.so.2")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    if COMPILED:
        assert "TMRUN_NCCL_LIBRARY is set but unusable" in out.stdout
        assert "/nonexistent/libnccl.so.2" in out.stdout
    else:
        assert "built without" in out.stdout


@needs_compiled
def test_missing_library_lists_attempts() -> None:
    code = (
        "import tmrun_native as t\n"
        "try:\n"
        "    t.nccl_load('', ['/nonexistent/a', '/nonexistent/b'])\n"
        "    print('LOADED')\n"
        "except t.NcclUnavailableError as e:\n"
        "    print('ERR', e)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TMRUN_NCCL_LIBRARY"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    if out.stdout.startswith("LOADED"):
        pytest.skip("libnccl.so.2 is on the default loader path here")
    assert "/nonexistent/a/libnccl.so.2" in out.stdout and "/nonexistent/b/libnccl.so.2" in out.stdout


@needs_wheel
def test_get_version_through_dlopen_table() -> None:
    from importlib import metadata

    info = nccl.load_library()
    dist = next(
        (d for d in ("nvidia-nccl-cu13", "nvidia-nccl-cu12") if _installed(metadata, d)), None
    )
    assert info["path"].endswith("libnccl.so.2")
    if dist:
        major, minor, patch = (int(x) for x in metadata.version(dist).split(".")[:3])
        assert info["version"] == major * 10000 + minor * 100 + patch
    if info["version"] >= 22900:
        assert info["revoke"] and info["shrink"] and info["grow"]
    assert tmrun_native.nccl_library_info()["path"] == info["path"]


def _installed(metadata, name: str) -> bool:
    try:
        metadata.version(name)
        return True
    except metadata.PackageNotFoundError:
        return False


@needs_wheel
def test_get_unique_id_without_gpu() -> None:
    a = nccl.get_unique_id()
    b = nccl.get_unique_id()
    assert isinstance(a, bytes) and len(a) == tmrun_native.NCCL_UNIQUE_ID_BYTES == 128
    assert a != b


@needs_wheel
def test_unique_id_exchange_through_store_is_epoch_prefixed() -> None:
    torch_dist = pytest.importorskip("torch.distributed")
    store = torch_dist.HashStore()
    root = nccl.exchange_unique_id(store, is_root=True, epoch=5, group="g")
    other = nccl.exchange_unique_id(store, is_root=False, epoch=5, group="g", timeout=5)
    assert root == other and len(root) == 128
    assert store.get("epoch/5/nccl/g/init") == root
    # A member of another epoch does not see it.
    with pytest.raises(Exception):
        nccl.exchange_unique_id(store, is_root=False, epoch=6, group="g", timeout=0.2)


def test_store_key_layout() -> None:
    assert nccl.store_key(3, "default", "init") == "epoch/3/nccl/default/init"
    with pytest.raises(ValueError):
        nccl.store_key(-1, "g", "init")


def test_exchange_rejects_a_malformed_id() -> None:
    torch_dist = pytest.importorskip("torch.distributed")
    store = torch_dist.HashStore()
    store.set(nccl.store_key(1, "g", "init"), b"x" * 7)
    with pytest.raises(nccl.NcclError, match="not an NCCL unique id"):
        nccl.exchange_unique_id(store, is_root=False, epoch=1, group="g", timeout=1)


# ---- tables ----------------------------------------------------------------------------


def test_dtype_table_is_complete() -> None:
    table = tmrun_native.nccl_dtypes()
    # ncclDataType_t of NCCL 2.32: ncclInt8 (0) .. ncclFloat8e5m2 (11), ncclNumTypes == 12.
    assert sorted(v for v, _ in table.values()) == list(range(12))
    sizes = {name: size for name, (_, size) in table.items()}
    assert sizes == {
        "int8": 1, "uint8": 1, "int32": 4, "uint32": 4, "int64": 8, "uint64": 8,
        "float16": 2, "float32": 4, "float64": 8, "bfloat16": 2, "float8_e4m3fn": 1, "float8_e5m2": 1,
    }


def test_every_torch_dtype_nccl_supports_maps() -> None:
    torch = pytest.importorskip("torch")
    for dt in (torch.int8, torch.uint8, torch.int32, torch.int64, torch.float16, torch.float32,
               torch.float64, torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2):
        name, _, size = tmrun_native.nccl_dtype(str(dt))
        assert size == torch.empty((), dtype=dt).element_size(), dt
        assert name == str(dt).replace("torch.", "")
    for bad in ("torch.bool", "complex64", ""):
        with pytest.raises(ValueError, match="unsupported NCCL dtype"):
            tmrun_native.nccl_dtype(bad)


def test_dtype_aliases() -> None:
    for alias, canonical in (("float", "float32"), ("half", "float16"), ("double", "float64"),
                             ("int", "int32"), ("long", "int64"), ("bf16", "bfloat16")):
        assert tmrun_native.nccl_dtype(alias)[0] == canonical


def test_op_table_is_complete() -> None:
    ops = tmrun_native.nccl_ops()
    assert ops == {"sum": 0, "prod": 1, "max": 2, "min": 3, "avg": 4}
    for alias, canonical in (("product", "prod"), ("SUM", "sum"), ("ReduceOp.AVG", "avg"),
                             ("RedOpType.PRODUCT", "prod"), ("mean", "avg"), ("maximum", "max")):
        assert tmrun_native.nccl_op(alias)[0] == canonical
    with pytest.raises(ValueError, match="unsupported NCCL reduction op"):
        tmrun_native.nccl_op("band")


def test_torch_reduce_ops_map() -> None:
    dist = pytest.importorskip("torch.distributed")
    for op, name in ((dist.ReduceOp.SUM, "sum"), (dist.ReduceOp.AVG, "avg"), (dist.ReduceOp.MIN, "min"),
                     (dist.ReduceOp.MAX, "max"), (dist.ReduceOp.PRODUCT, "prod")):
        assert tmrun_native.nccl_op(nccl._op_name(op))[0] == name


def test_result_names() -> None:
    names = [tmrun_native.nccl_result_name(i) for i in range(9)]
    assert names == ["ncclSuccess", "ncclUnhandledCudaError", "ncclSystemError", "ncclInternalError",
                     "ncclInvalidArgument", "ncclInvalidUsage", "ncclRemoteError", "ncclInProgress",
                     "ncclTimeout"]


# ---- logical <-> NCCL rank map ---------------------------------------------------------


def test_shrink_then_grow_keeps_logical_ranks() -> None:
    # 4 ranks, logical 1 fails: NCCL renumbers survivors 0,2,3 -> 0,1,2; the joiner is NCCL 3.
    shrunk, excluded = tmrun_native.nccl_shrink_rank_map([0, 1, 2, 3], [1])
    assert shrunk == [0, 2, 3] and excluded == [1]
    grown = tmrun_native.nccl_grow_rank_map(shrunk, [1])
    assert grown == [0, 2, 3, 1]
    # Data layout by logical position: the joiner's chunk goes to slot 1.
    assert tmrun_native.nccl_rank_positions(grown) == [0, 2, 3, 1]
    # A second replacement on the already-mapped communicator.
    shrunk2, excluded2 = tmrun_native.nccl_shrink_rank_map(grown, [3])
    assert shrunk2 == [0, 2, 1] and excluded2 == [2]
    assert tmrun_native.nccl_grow_rank_map(shrunk2, [3]) == [0, 2, 1, 3]


def test_shrink_several_and_positions_with_holes() -> None:
    shrunk, excluded = tmrun_native.nccl_shrink_rank_map([0, 1, 2, 3, 4, 5, 6, 7], [5, 4])
    assert shrunk == [0, 1, 2, 3, 6, 7] and excluded == [4, 5]
    assert tmrun_native.nccl_rank_positions(shrunk) == [0, 1, 2, 3, 4, 5]
    assert tmrun_native.nccl_grow_rank_map(shrunk, [4, 5]) == [0, 1, 2, 3, 6, 7, 4, 5]


def test_rank_map_errors() -> None:
    with pytest.raises(ValueError, match="not a member"):
        tmrun_native.nccl_shrink_rank_map([0, 1, 2], [7])
    with pytest.raises(ValueError, match="twice"):
        tmrun_native.nccl_grow_rank_map([0, 1, 2], [1])
    with pytest.raises(ValueError, match="every rank"):
        tmrun_native.nccl_shrink_rank_map([0, 1], [0, 1])
    with pytest.raises(ValueError, match="twice"):
        tmrun_native.nccl_rank_positions([0, 0])
