#!/usr/bin/env bash
# make bench-host in one go on a lent host with no network (the 16-core host of
# ../shared/HOST16.md), from the checkout's root:
#
#   OUT=/results/folder bash bench/host16.sh [bench.host options]
#
# 1. installs the mpi4py and Open MPI wheels carried in .whl/ into that host's python
#    (fetch them here first: HOST16.md step 1; without .whl/ the python's own MPI is used);
# 2. compiles harmpi's kernels into a fresh NUMBA_CACHE_DIR (100-160 s there) and, beside
#    that, harmpi's native part (HOST16_NATIVE=0 skips it: it builds in the checkout);
# 3. runs make bench-host with that python (python -m bench.host when make is missing),
#    with --deadline so that every job ends inside the host's 15 minutes.
#
# $OUT gets at most 7 files (the results folder brings back 8): host.txt, native.txt,
# precompile.txt, bench-host.txt (the table), bench-host.json (every cell), jobs.tgz (each
# job's log and JSON) and steps.txt. Try it here first, e.g. at 2 ranks:
#   PYTHON=.venv/bin/python HOST16_NATIVE=0 NUMBA_CACHE_DIR=harmpi/runtime/__pycache__ \
#     OUT=/tmp/h16 bash bench/host16.sh --quick --layouts 1x2 --sizes 2K,10K
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-$(mktemp -d)}; mkdir -p "$OUT"
PY=${PYTHON:-python3}
DEADLINE=${DEADLINE:-420}   # seconds of bench.host --deadline, after the compile
T0=$(date +%s)
log() { echo "## t=$(( $(date +%s) - T0 ))s $*" | tee -a "$OUT/steps.txt"; }

{ lscpu | grep -E 'Model name|^CPU\(s\)|Core|Thread|NUMA node\(s\)'
  lscpu | grep -o -E 'avx512[a-z_0-9]*|amx[a-z_0-9]*' | sort -u | tr '\n' ' '; echo
  "$PY" -c 'import sys, numpy, numba; print(sys.version.split()[0], numpy.__version__, numba.__version__)'
  "$PY" -c 'import torch; print("torch", torch.__version__)'; } > "$OUT/host.txt" 2>&1

if ls .whl/*.whl >/dev/null 2>&1; then
  log "installing $(ls .whl/*.whl | tr '\n' ' ')"
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade .whl/*.whl \
    2>&1 | tail -3 | tee -a "$OUT/steps.txt"
else
  log "no .whl/: using the MPI this python already has"
fi
# mpirun lands beside the python the wheels went into
PATH=$(dirname "$("$PY" -c 'import sys; print(sys.executable)')"):$PATH
export PATH NUMBA_CACHE_DIR=${NUMBA_CACHE_DIR:-$(mktemp -d)}
for s in $("$PY" -m launch.mpienv --exports); do export "$s"; done

if [ "${HOST16_NATIVE:-1}" = 1 ]; then
  log "native part: building beside the kernel compile"
  ( timeout 200 "$PY" setup.py build_ext --inplace > "$OUT/native.txt" 2>&1
    echo "rc=$?" >> "$OUT/native.txt" ) &
fi
log "precompile (NUMBA_CACHE_DIR=$NUMBA_CACHE_DIR)"
timeout -k 5 300 "$PY" -m harmpi.precompile > "$OUT/precompile.txt" 2>&1
log "precompile rc=$?"
wait
[ -f "$OUT/native.txt" ] && grep -a -m5 -E ' error|rc=' "$OUT/native.txt" | cut -c1-250 | tee -a "$OUT/steps.txt"

JOBS=$(mktemp -d)  # a log and a JSON per job: too many files for $OUT, so packed below
ARGS="--no-precompile --deadline $DEADLINE --out $JOBS --json $OUT/bench-host.json $*"
log "bench.host $ARGS"
if command -v make >/dev/null 2>&1; then
  timeout -k 10 $(( DEADLINE + 120 )) make --no-print-directory bench-host \
    BENCH_HOST_PYTHON="$PY" BENCH_HOST_ARGS="$ARGS" > "$OUT/bench-host.txt" 2>&1
else
  # shellcheck disable=SC2086  # ARGS is a list of words without spaces
  timeout -k 10 $(( DEADLINE + 120 )) "$PY" -m bench.host $ARGS > "$OUT/bench-host.txt" 2>&1
fi
log "bench.host rc=$?"
tar -C "$JOBS" -czf "$OUT/jobs.tgz" . && rm -rf "$JOBS"
sed -n '/^# harmpi bench.host/,$p' "$OUT/bench-host.txt"
log "done; results in $OUT (each job's log and JSON: $OUT/jobs.tgz)"
