#!/usr/bin/env bash
# Every GPU check of tmrun in one command, for a GPU machine with torch already installed and no
# network (the device machines lent to this project): builds the native module, then runs
# bench/gpu_nccl.py (the NCCL device plane), bench/gpu_p2p.py (which send/recv paths work, torch's
# own NCCL group beside tmrun's), bench/gpu_inplace.py (the host-staging path) and
# tests/nccl/gpu_check.py (the native NCCL transport; it needs NCCL >= 2.32 and skips with 77 on
# an older one). Writes its log, the JSON reports and the runs' logs (runs.tgz) to $OUT.
#
#     OUT=/tmp/gpu bash bench/gpu_all.sh [--quick]
#
# CHECKS: which to run (default "nccl p2p inplace native"). NCCL_PARTS: gpu_nccl.py's parts
# (default abcde). One call of the device tool has 10 minutes: on a 15-minute budget run
# CHECKS="nccl p2p" first.
# NCCL_INCLUDE_DIR: a folder with nccl.h for the native transport's build, where no nccl.h is
# installed (tmrun_native/cmake/fetch_nccl_header.py fetches the pinned one where a network is).
set -u
OUT=${OUT:-/tmp/tmrun-gpu}
QUICK=${1:-}
mkdir -p "$OUT"
exec > >(tee "$OUT/gpu_all.log") 2>&1
export PYTHONUNBUFFERED=1 CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-16}
PY=${PYTHON:-python3}
nvidia-smi -L
$PY -c "import torch, sys; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda, 'nccl', torch.cuda.nccl.version())"
$PY -m pip show nvidia-nccl-cu13 2>/dev/null | head -2
started=$(date +%s)
if ! $PY -m pip install -q --no-deps --no-build-isolation --no-cache-dir . ; then
  echo "build with the NCCL transport failed; again without it"
  $PY -m pip install -q --no-deps --no-build-isolation --no-cache-dir -C cmake.define.TMRUN_WITH_NCCL=OFF . || exit 1
fi
echo "built in $(( $(date +%s) - started )) s"
keep=$(mktemp -d)
status=0
CHECKS=${CHECKS:-nccl p2p inplace native}
if [[ " $CHECKS " == *" nccl "* ]]; then
timeout ${NCCL_TIMEOUT:-420} $PY bench/gpu_nccl.py $QUICK --parts "${NCCL_PARTS:-abcde}" --timeout 120 --json "$OUT/gpu_nccl.json" --keep "$keep/nccl"; rc=$?
echo "gpu_nccl.py exit $rc"; [ $rc -eq 0 ] || status=1
fi
if [[ " $CHECKS " == *" p2p "* ]]; then
timeout 240 $PY bench/gpu_p2p.py --timeout 25 --json "$OUT/gpu_p2p.json" --logs "$keep/p2p"; rc=$?
echo "gpu_p2p.py exit $rc"; [ $rc -eq 0 ] || status=1
fi
if [[ " $CHECKS " == *" inplace "* ]]; then
timeout 180 $PY bench/gpu_inplace.py --json "$OUT/gpu_inplace.json" --keep "$keep/inplace"; rc=$?
echo "gpu_inplace.py exit $rc"; [ $rc -eq 0 ] || status=1
fi
if [[ " $CHECKS " == *" native "* ]]; then
timeout 120 $PY tests/nccl/gpu_check.py --timeout 60 --json "$OUT/nccl_check.json"; rc=$?
echo "gpu_check.py exit $rc (77: skipped)"; [ $rc -eq 0 ] || [ $rc -eq 77 ] || status=1
fi
tar czf "$OUT/runs.tgz" -C "$keep" . 2>/dev/null
echo "gpu_all.sh exit $status"
exit $status
