"""One MPI rank of torch's distributed test suite (run by tests/torch_suite/suite.py).

torch's ``DistributedTest._DistTestBase`` normally forks its own ranks per
method (``MultiProcessTestCase``) and meets them through a FileStore. Here
every mpirun rank is one test rank instead: it joins one process group for
the whole job (``init_process_group(backend, init_method="mpi://")`` under mpirun:
harmpi's MPI rendezvous, for gloo as for harmpi), then runs the listed methods in order,
the same method on every rank at the same time.

How the suite is adapted:

- ``BACKEND`` is "gloo" while the suite's module is imported, so its skip
  decorators (evaluated at import) judge harmpi as they judge gloo: harmpi is
  held to gloo's CPU feature set. The module's ``BACKEND`` is then set to the
  backend under test for what the methods read at run time.
- ``self._barrier()`` (the suite's file-lock barrier) is an MPI barrier on a
  communicator of this adapter's own, outside torch's process group.
- A method is called unwrapped, with ``self.rank`` set: neither setUp nor
  the multi-process join runs; what setUp does that the methods rely on is
  done here (every rank seeds torch's, Python's and numpy's generators
  with the suite's seed before each method, so ``torch.randn`` gives the
  same values on every rank, as in a freshly forked rank). A method the
  suite marks skipped (its ``__unittest_skip__``, which unittest's runner
  obeys) is reported skipped with the suite's reason, except
  :data:`RUN_DESPITE_MARK`.
- torch 2.13's ``skip_if_small_worldsize`` skips a method below 8 ranks,
  though the methods it guards need 3 (their groups are ranks [1, 2]): at 3
  ranks or more the guard is taken off (:func:`unguarded`), so the
  ``*_group`` methods run at 3 ranks and at 2x2 (their group then spans
  the two virtual nodes). At 2 ranks they skip with torch's reason.

After each method every rank writes one JSON line to ``RESULTS/rank<r>.jsonl``
(method, outcome pass/fail/skip, detail, seconds), then the ranks meet on the
adapter's communicator (with a deadline) and compare outcomes. Unless every
rank passed, skipped, or failed with the same error (a check that refused the
call before any data moved), or the method is one of :data:`NOTHING_LEFT_OPEN`,
rank 0 ends the job (MPI_Abort): a group left half-way through a collective
must not run the next method. The driver restarts the job after the last
method every rank reported (each start costs every rank ~15 s of imports).
"""

from __future__ import annotations

import json
import os
import re
import sys
import time
import unittest

#: what a method's outcome is called in the results
PASS, FAIL, SKIP = "pass", "fail", "skip"
#: methods run although the suite marks them skipped for gloo: it marks every
#: all_to_all "Only MPI supports ..." (written before gloo had them), and they
#: are the checks of uneven all_to_all splits
RUN_DESPITE_MARK = ("test_all_to_all",)
#: methods whose ranks disagree by design without leaving a collective or a
#: message half-way, so the job goes on after them (no restart), and why
NOTHING_LEFT_OPEN = {
    "test_monitored_barrier_gloo_subgroup":
        "rank 1 returns at once; every other rank is refused by torch's Python "
        "(dist.monitored_barrier: gloo groups only) before its group is called",
    "test_monitored_barrier_failure_order":
        "ranks 0 and 1 are refused by torch's Python before their group is called; the "
        "others call nothing",
    "test_monitored_barrier_wait_all_ranks":
        "rank 0 is refused by torch's Python before its group is called; the others call "
        "nothing",
}
#: exit status of the job when rank 0 ends it after a disagreement, and the
#: file it leaves in the results directory first (naming the method)
RESTART_STATUS = 3
RESTART_MARK = "restart"


def _args(argv):
    """backend, methods file, results directory, seconds a meeting may wait."""
    backend, methods_file, results_dir, meet_timeout_s = argv
    with open(methods_file) as fh:
        methods = [line.strip() for line in fh if line.strip()]
    return backend, methods, results_dir, float(meet_timeout_s)


def _suite_module(backend, size):
    """Import torch's suite with its decorators evaluated as for gloo."""
    os.environ["BACKEND"] = "gloo"
    os.environ["WORLD_SIZE"] = str(size)  # skip_if_small_worldsize reads it
    os.environ.setdefault("INIT_METHOD", "env://")
    from torch.testing._internal.distributed import distributed_test as dt  # noqa: PLC0415

    dt.BACKEND = backend
    os.environ["BACKEND"] = backend
    return dt


def _skip_reason(code, dt):
    """The reason behind one of the suite's TEST_SKIPS exit codes."""
    for skip in dt.TEST_SKIPS.values():
        if skip.exit_code == code:
            return skip.message
    return None


def _first_line(exc):
    text = f"{type(exc).__name__}: {exc}".strip()
    return text.splitlines()[0][:300]


def unguarded(method, size):
    """``method`` without torch's small-world-size guard (see the module
    docstring) when it is the method's outermost wrapper and ``size`` >= 3."""
    from torch.testing._internal.common_distributed import (  # noqa: PLC0415
        skip_if_small_worldsize,
    )

    guard = skip_if_small_worldsize(lambda: None).__code__  # every guarded method's wrapper
    if size >= 3 and getattr(method, "__code__", None) is guard:
        return method.__wrapped__
    return method


def run_method(case, name, dt):
    """(outcome, detail) of one method on this rank."""
    method = getattr(type(case), name)
    if getattr(method, "__unittest_skip__", False) and not name.startswith(RUN_DESPITE_MARK):
        return SKIP, method.__unittest_skip_why__  # the mark unittest's runner obeys
    from torch.testing._internal.common_utils import set_rng_seed  # noqa: PLC0415

    set_rng_seed()  # what the suite's setUp does: the same random values on every rank
    debug = os.environ.get("TORCH_DISTRIBUTED_DEBUG")
    try:
        return _call(unguarded(method, int(os.environ["WORLD_SIZE"])), case, dt)
    finally:
        # with_dist_debug_levels leaves its last level set (each method of the
        # suite normally has a process of its own): back to this job's level
        if debug is None:
            os.environ.pop("TORCH_DISTRIBUTED_DEBUG", None)
        else:
            os.environ["TORCH_DISTRIBUTED_DEBUG"] = debug
        dt.dist.set_debug_level_from_env()


def _call(method, case, dt):
    try:
        method(case)
    except unittest.SkipTest as exc:
        return SKIP, str(exc)[:300]
    except SystemExit as exc:  # the suite's skip decorators exit with a code
        reason = _skip_reason(exc.code, dt)
        if reason is not None:
            return SKIP, reason
        return FAIL, f"sys.exit({exc.code!r})"
    except BaseException as exc:  # noqa: BLE001 - every failure is a result
        return FAIL, _first_line(exc)
    return PASS, ""


def same_failure(details):
    """Whether failures on several ranks are one error (rank numbers aside)."""
    return len({re.sub(r"\d+", "#", d) for d in details}) == 1


def uniform(outcomes):
    """Whether the job may go on after a method: every rank saw the same outcome
    (for a failure: the same error)."""
    kinds = {o for o, _ in outcomes}
    if kinds == {FAIL}:
        return same_failure([d for _, d in outcomes])
    return len(kinds) == 1


class _Meeting:
    """An MPI communicator of the adapter's own, met with a deadline."""

    def __init__(self, timeout_s):
        from mpi4py import MPI  # noqa: PLC0415

        self.comm = MPI.COMM_WORLD.Dup()
        self.timeout_s = timeout_s

    def barrier(self, *args, timeout=None, **kwargs):
        deadline = time.monotonic() + (timeout or self.timeout_s)
        req = self.comm.Ibarrier()
        while not req.Test():
            if time.monotonic() > deadline:
                raise TimeoutError(f"rank {self.comm.rank}: the adapter's barrier timed out")
            time.sleep(0.001)

    def outcomes(self, mine):
        self.barrier()
        return self.comm.allgather(mine)


def _case_class(dt, meeting):
    class Case(dt.TestDistBackend, dt.DistributedTest._DistTestBase):
        def _barrier(self, *args, **kwargs):
            meeting.barrier(*args, **kwargs)

    return Case


def _record(fh, name, outcome, detail, seconds):
    fh.write(json.dumps({"method": name, "outcome": outcome, "detail": detail,
                         "s": round(seconds, 3)}) + "\n")
    fh.flush()
    os.fsync(fh.fileno())


def main(argv):
    backend, methods, results_dir, meet_timeout_s = _args(argv)
    from mpi4py import MPI  # noqa: PLC0415

    rank, size = MPI.COMM_WORLD.rank, MPI.COMM_WORLD.size
    dt = _suite_module(backend, size)
    import datetime  # noqa: PLC0415

    import torch.distributed as dist  # noqa: PLC0415

    import harmpi.distributed  # noqa: F401, PLC0415 - backend "harmpi" and mpi://

    meeting = _Meeting(meet_timeout_s)
    # the world's deadline, for gloo as for harmpi (harmpi honours a group's timeout=)
    deadline = datetime.timedelta(seconds=float(os.environ.get("HARMPI_TIMEOUT_S", "10")))
    dist.init_process_group(backend, init_method="mpi://", timeout=deadline)
    Case = _case_class(dt, meeting)
    with open(os.path.join(results_dir, f"rank{rank}.jsonl"), "a") as fh:
        for name in methods:
            case = Case(name)
            case.rank = rank
            case.file_name = os.path.join(results_dir, f"store.{name}")
            t0 = time.monotonic()
            outcome, detail = run_method(case, name, dt)
            _record(fh, name, outcome, detail, time.monotonic() - t0)
            if not uniform(meeting.outcomes((outcome, detail))) and \
                    name not in NOTHING_LEFT_OPEN:
                if rank == 0:
                    with open(os.path.join(results_dir, RESTART_MARK), "w") as mark:
                        mark.write(name)
                    MPI.COMM_WORLD.Abort(RESTART_STATUS)
                meeting.barrier(timeout=3600)  # rank 0 ends the job
    meeting.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
