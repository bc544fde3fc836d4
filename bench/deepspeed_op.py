"""DeepSpeed's CPU shared-memory all-reduce as a benchmark adapter (``--impl deepspeed``).

The closest rival: ``torch.ops.deepspeed.inference_all_reduce_(t)`` from the
op DeepSpeed builds on the machine (``ShareMemCommBuilder().load()``: a JIT
build, ~1 min the first time, then cached in ~/.cache/torch_extensions;
rank 0 builds, the others load its build).  Optional (``pip install
'harmpi[deepspeed]'``): without it, or where the op cannot run, every cell
is skipped with the reason.  Its bf16/f16 kernels need avx512bw (elsewhere
the op dies with SIGILL), so on such CPUs bf16 is compared as float32 of
the same bytes, and the header says so.  One host only: a job over several
hosts or virtual nodes is refused.  It spins without yielding, so with more
ranks than CPUs its iterations are capped like gloo's.  No all-gather of
its own: ``allgather(tensor)`` is MPI_Allgather.

Here: the pure decisions (``cpu_flags``, ``deepspeed_wire``,
``deepspeed_refusal``), building and loading the op (``load_deepspeed_op``,
``deepspeed_status``) and the adapter (``DeepSpeedImpl``); ``bench.impls``
creates it by name like the other adapters.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import sys

import numpy as np

from bench.harness import DTYPES, DType
from bench.impl_base import (
    Impl,
    ImplUnavailable,
    Prepared,
    storage_from_torch,
    tensor_dtype,
    torch_from_storage,
)
from bench.impl_mpi import MpiImpl
from bench.job import topology

__all__ = [
    "DeepSpeedImpl",
    "cpu_flags",
    "deepspeed_wire",
    "deepspeed_refusal",
    "load_deepspeed_op",
    "deepspeed_status",
    "DEEPSPEED_KERNEL_FLAGS",
]

logger = logging.getLogger(__name__)

#: the CPU flag each dtype's reduce kernel in DeepSpeed's shm op is compiled
#: for (bf16/f16: 512-bit conversions; f32: 256-bit AVX); without it the op
#: dies with SIGILL and its peers spin on the shm flags for ever
DEEPSPEED_KERNEL_FLAGS = {"bf16": "avx512bw", "f16": "avx512bw", "f32": "avx2"}

#: one rank's workspace segment in /dev/shm, as DeepSpeed's shm.cpp names it
DEEPSPEED_SEGMENT = "deepspeed_allreduce_buffer_{uid}_{addr}_{port}_{rank}"

#: the MASTER_ADDR word in the segment names (no TCP rendezvous happens)
DEEPSPEED_ADDR = "harmpi-bench"


def cpu_flags(cpuinfo_path: str = "/proc/cpuinfo") -> frozenset[str]:
    """The CPU flags of the first processor in /proc/cpuinfo; empty when there is none."""
    try:
        with open(cpuinfo_path) as fh:
            for line in fh:
                if line.startswith("flags"):
                    return frozenset(line.partition(":")[2].split())
    except OSError as exc:
        logger.info("cannot read %s (%s): no CPU flags known", cpuinfo_path, exc)
    return frozenset()


def deepspeed_wire(dtype: DType, flags) -> tuple[DType | None, str]:
    """(the dtype DeepSpeed's shm op reduces when asked for ``dtype`` on a CPU
    with ``flags``, why it differs); (None, why) when it cannot reduce it.

    bf16 needs avx512bw; without it the comparison is float32 of the same
    bytes, as for MPI.  The op returns a float64 tensor unreduced: refused.
    """
    need = DEEPSPEED_KERNEL_FLAGS.get(dtype.name)
    if need is None:
        return None, (f"DeepSpeed's shm op does not reduce {dtype.name} "
                      "(it returns the tensor unreduced)")
    if need in flags:
        return dtype, ""
    if dtype.name != "f32" and DEEPSPEED_KERNEL_FLAGS["f32"] in flags:
        return DTYPES["f32"], (f"float32, same bytes: this CPU has no {need}, without which "
                               f"DeepSpeed's {dtype.name} kernel dies with SIGILL")
    return None, f"this CPU has no {need}, which DeepSpeed's {dtype.name} kernel needs"


def deepspeed_refusal(topo: dict) -> str | None:
    """Why DeepSpeed's shm op cannot run on the job ``topo`` describes
    (``bench.osu.topology``), None when it can: it sums over one host's
    shared memory, so several hosts, or virtual nodes on one, are refused
    rather than timed as something they are not."""
    if topo["hosts"] > 1:
        return (f"DeepSpeed's shm op works within one host; these {topo['ranks']} ranks "
                f"span {topo['hosts']} hosts")
    if topo["virtual"]:
        return ("DeepSpeed's shm op has no notion of nodes: under virtual nodes "
                f"(HARMPI_RANKS_PER_NODE={os.environ.get('HARMPI_RANKS_PER_NODE', '?')}) "
                "it would sum over the whole host, not time a multi-node job")
    return None


@contextlib.contextmanager
def _environ(changes: dict):
    """os.environ with ``changes`` inside, restored on leaving (C getenv sees them)."""
    saved = {key: os.environ.get(key) for key in changes}
    os.environ.update(changes)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _build_environment() -> dict:
    """DS_ACCELERATOR=cpu (no accelerator probing) and, when pip's ninja is
    installed beside this Python, its directory first on PATH: torch's JIT
    build runs the first ``ninja`` on PATH, and two ninja versions read each
    other's build log as stale, so alternating them rebuilds the op (~1 min)."""
    changes = {"DS_ACCELERATOR": os.environ.get("DS_ACCELERATOR") or "cpu"}
    bin_dir = os.path.dirname(sys.executable)
    if os.path.exists(os.path.join(bin_dir, "ninja")):
        changes["PATH"] = bin_dir + os.pathsep + os.environ.get("PATH", "")
    return changes


def load_deepspeed_op():
    """DeepSpeed's shm op, built on first use and cached; registers
    ``torch.ops.deepspeed.inference_all_reduce_``.  Returns the extension
    module (``initialize``, ``vector_kernel_level``).  ImplUnavailable, with
    the reason, when deepspeed is not installed or the build fails.

    ``make setup`` calls it once so that test ranks find the build done.
    """
    with _environ(_build_environment()):
        try:
            from deepspeed.ops.op_builder.cpu import ShareMemCommBuilder
        except ImportError as exc:
            raise ImplUnavailable(f"deepspeed is not installed ({exc}); "
                                  "pip install 'harmpi[deepspeed]'") from exc
        try:
            return ShareMemCommBuilder().load(verbose=False)
        except Exception as exc:  # compiler or ninja missing or failing: the reason goes out
            lines = str(exc).strip().splitlines() or [type(exc).__name__]
            raise ImplUnavailable(f"DeepSpeed's shm op did not build: {lines[-1]}") from exc


def deepspeed_status() -> str:
    """One line: the op is built and loads, or why not (``make setup`` prints it)."""
    try:
        load_deepspeed_op()
    except ImplUnavailable as exc:
        return f"unavailable: {exc}"
    return f"built (DeepSpeed {_deepspeed_version()})"


def _deepspeed_version() -> str:
    from importlib import metadata

    try:
        return metadata.version("deepspeed")
    except metadata.PackageNotFoundError:
        return "?"


def _first_reason(comm, reason: str | None) -> str | None:
    """The first rank's reason when any rank has one (the same on every rank)."""
    reasons = comm.allgather(reason)
    return next((r for r in reasons if r), None)


class DeepSpeedImpl(Impl):
    """DeepSpeed's CPU shared-memory all-reduce on the ranks of ``comm``:
    ``torch.ops.deepspeed.inference_all_reduce_(t)``, the op its
    ``deepspeed.comm.inference_all_reduce`` calls on CPU.

    The constructor is collective and does everything that can fail: the
    topology check, the build (rank 0 first, the others after it), and
    DeepSpeed's shm world.  When any of it fails, ``unavailable`` says why
    and every ``prepare`` raises ImplUnavailable with it.
    """

    name = "deepspeed"

    def __init__(self, comm, max_iterations: int | None = None, flags=None):
        self._comm = comm
        self._flags = cpu_flags() if flags is None else frozenset(flags)
        self._mpi = MpiImpl(comm)  # allgather: DeepSpeed's shm op has none
        self._f32_staging: dict[int, object] = {}  # element count -> float32 tensor
        self._reduce = None
        self.version = _deepspeed_version()
        topo = topology(comm)
        #: ranks outnumber the host's CPUs: DeepSpeed spins, each call takes milliseconds
        self.oversubscribed = topo["max_ranks_per_host"] > (os.cpu_count() or 1)
        self.max_iterations = max_iterations if self.oversubscribed else None
        #: why the op cannot run on this job (same on every rank), None when it can
        self.unavailable = _first_reason(comm, deepspeed_refusal(topo))
        if self.unavailable is None:
            self.unavailable = self._start()

    def _start(self) -> str | None:
        """Build or load the op (rank 0 first: two ranks building one torch
        extension at once can clash), then start its shm world."""
        comm = self._comm
        module, reason = None, None
        for turn in (0, 1):
            if (comm.Get_rank() == 0) == (turn == 0):
                try:
                    module = load_deepspeed_op()
                except ImplUnavailable as exc:
                    reason = str(exc)
            reason = _first_reason(comm, reason)
            if reason:
                return reason
        reason = _first_reason(comm, self._join(module))
        if reason is None:
            import torch

            self._reduce = torch.ops.deepspeed.inference_all_reduce_
        return reason

    def _join(self, module) -> str | None:
        """DeepSpeed's shm world over the ranks of ``comm`` (collective).

        DeepSpeed keeps one world per process; a second adapter over the
        same processes reuses it, one over other processes is refused.
        """
        comm = self._comm
        rank, size = comm.Get_rank(), comm.Get_size()
        members = tuple(comm.allgather(os.getpid()))
        started = getattr(module, "harmpi_bench_members", None)
        if started is not None:
            return None if started == members else (
                "DeepSpeed's shm op keeps one world per process, already started over "
                f"{len(started)} other ranks")
        # segment names carry MASTER_ADDR/MASTER_PORT: a word unique to this
        # job keeps concurrent jobs of one user apart
        port = comm.bcast(f"{os.getpid()}-{secrets.token_hex(4)}" if rank == 0 else None, root=0)
        env = {"LOCAL_SIZE": str(size), "MASTER_ADDR": DEEPSPEED_ADDR, "MASTER_PORT": port}
        with _environ(env):
            # creates this rank's workspace, then waits until it has mapped every other rank's
            module.initialize(size, rank)
        module.harmpi_bench_members = members
        comm.Barrier()  # every rank has mapped every workspace
        # DeepSpeed never unlinks its segments (66 MiB a rank); the mappings outlive the names
        segment = DEEPSPEED_SEGMENT.format(uid=os.getuid(), addr=DEEPSPEED_ADDR, port=port,
                                           rank=rank)
        try:
            os.unlink(os.path.join("/dev/shm", segment))
        except OSError as exc:
            logger.warning("could not unlink DeepSpeed's segment %s: %s", segment, exc)
        return None

    def wire_dtype(self, op: str, dtype: DType) -> DType:
        wire, _ = deepspeed_wire(dtype, self._flags)
        return wire or dtype

    def _not_run(self, op: str, dtype: DType) -> str | None:
        """Why this adapter cannot run ``op`` on ``dtype``, None when it can."""
        if self.unavailable:
            return self.unavailable
        if op != "allreduce":
            return f"DeepSpeed's shm op has no {op}"
        wire, why = deepspeed_wire(dtype, self._flags)
        return why if wire is None else None

    def _notes(self) -> str:
        import torch

        notes = (f"{torch.get_num_threads()} OpenMP thread(s) per rank (torch's); "
                 "it spins without yielding")
        if self.max_iterations is not None:
            notes += (f"; ranks outnumber CPUs, at most {self.max_iterations} timed "
                      "iterations per size")
        return notes

    def describe(self, op: str, dtype: DType) -> str:
        why = self._not_run(op, dtype)
        if why:
            return f"{self.name}: not run: {why}"
        wire, change = deepspeed_wire(dtype, self._flags)
        return (f"{self.name}: torch.ops.deepspeed.inference_all_reduce_ (DeepSpeed "
                f"{self.version} shm op, built here) on a torch {wire.torch_name} tensor"
                + (f" ({change})" if change else "") + f"; {self._notes()}")

    def describe_tensors(self, dtype: DType) -> str:
        why = self._not_run("allreduce", dtype)
        if why:
            return f"{self.name}: not run on {dtype.name} tensors: {why}"
        _, change = deepspeed_wire(dtype, self._flags)
        return (f"{self.name}: torch.ops.deepspeed.inference_all_reduce_ on {dtype.name} "
                "tensors" + (f" ({change})" if change else "")
                + f"; allgather: MPI_Allgather (DeepSpeed's shm op has none); {self._notes()}")

    def prepare(self, op: str, values: np.ndarray, dtype: DType) -> Prepared:
        why = self._not_run(op, dtype)
        if why:
            raise ImplUnavailable(why)
        if self.wire_dtype(op, dtype) is not dtype:
            raise ImplUnavailable(f"asked for {dtype.name}, which this CPU reduces as "
                                  f"{self.wire_dtype(op, dtype).name} (call wire_dtype first)")
        tensor = torch_from_storage(values, dtype)

        def run(tensor=tensor, reduce=self._reduce):
            reduce(tensor)

        return Prepared(run, lambda: storage_from_torch(tensor, dtype))

    def allreduce(self, tensor) -> None:
        dtype = tensor_dtype(tensor)
        why = self._not_run("allreduce", dtype)
        if why:
            raise ImplUnavailable(why)
        if not tensor.is_contiguous():
            # the op would reduce a contiguous copy and leave the tensor itself unreduced
            raise ValueError("DeepSpeed's shm op needs a contiguous tensor")
        wire = self.wire_dtype("allreduce", dtype)
        if wire is dtype:
            self._reduce(tensor)
            return
        flat = tensor.view(-1)
        staging = self._f32_staging.get(flat.numel())
        if staging is None:
            import torch

            staging = self._f32_staging[flat.numel()] = torch.empty(flat.numel(),
                                                                    dtype=torch.float32)
        staging.copy_(flat)
        self._reduce(staging)
        flat.copy_(staging)

    def allgather(self, tensor):
        return self._mpi.allgather(tensor)
