"""Adapters for the implementations a benchmark compares.

One adapter class per implementation, shared by every benchmark:

* the OSU harness (``bench.osu``) asks it to turn "a collective of ``count``
  elements of ``dtype``" into a prepared operation whose ``run()`` only moves
  data (allocation happens in ``prepare``, as in Gloo's algorithm classes),
  plus ``result()`` to read the output back as a numpy storage array (bf16
  as uint16 bits);
* the decode benchmark (``bench.decode``) calls ``allreduce(tensor)`` and
  ``allgather(tensor)`` on the torch tensors of its model, as a script would.

``make_impls`` creates the adapters (and sets harmpi up once),
``close_impls`` releases them.

``harmpi`` / ``harmpi:<algorithm>``
    ``harmpi.allreduce(t)`` / ``harmpi.allgather(t)`` on a torch tensor of the
    requested dtype (bf16 by default); ``:<algorithm>`` forces one of
    ``harmpi.ALGORITHMS``.
``mpi``
    mpi4py on the same ranks.  Allreduce: ``comm.Allreduce(MPI.IN_PLACE, buf,
    MPI.SUM)``; MPI has no bf16 (Open MPI) and no portable f16, so bf16 and
    f16 are compared against **float32 with the same bytes** (half as many
    elements; a 2-byte message sends one float32).  Allgather moves bytes, so
    it uses the requested dtype as is.  On tensors, bf16 and f16 are
    converted to float32 and back around ``MPI_Allreduce``.
``gloo`` (also ``torch:gloo``) / ``torch:harmpi``
    ``torch.distributed`` on the same ranks, called as an engine calls it:
    ``dist.all_reduce(t, group=g)`` and ``dist.all_gather_single(out, t,
    group=g)`` on a process group of backend gloo or harmpi (one adapter,
    ``TorchImpl``, with the backend word as its only difference).  One job
    may hold both: the first backend asked for gets the default group (rank
    0 starts a TCPStore on a free port and broadcasts it through MPI), the
    other a ``dist.new_group`` over all ranks (``TorchGroups``).  Tensors of
    the requested dtype.  Gloo takes milliseconds per call, so its
    iterations are capped (``--gloo-max-iters``).
``gloo:unbound``
    gloo again, on a group of its own whose threads were started with every
    CPU of the host allowed (the calling thread stays bound like every other
    implementation's).  Gloo works in threads of its own that, under
    mpirun's default binding, share the rank's one core with the caller;
    comparing the two says what the binding costs gloo.
``deepspeed``
    DeepSpeed's CPU shared-memory all-reduce, the closest rival:
    ``torch.ops.deepspeed.inference_all_reduce_(t)``; its adapter, and the
    build of DeepSpeed's op it needs, are ``bench.deepspeed_op``.
"""

from __future__ import annotations

import contextlib
import os
import socket
from typing import Callable, Sequence

import numpy as np

from bench.harness import DTYPES, DType

__all__ = [
    "Impl",
    "Prepared",
    "ImplUnavailable",
    "parse_impls",
    "make_impls",
    "close_impls",
    "HarmpiImpl",
    "MpiImpl",
    "TorchImpl",
    "TorchGroups",
    "harmpi_info_of",
    "torch_backend",
    "torch_from_storage",
    "storage_from_torch",
    "tensor_dtype",
    "IMPL_KINDS",
    "FuncolImpl",
    "TORCH_BACKENDS",
    "GLOO_UNBOUND",
]

IMPL_KINDS = ("harmpi", "mpi", "gloo", "torch", "funcol", "deepspeed")


class ImplUnavailable(Exception):
    """An implementation cannot run this collective here (raised by ``prepare``).

    The harness asks every rank, and skips the cell on all of them if any
    rank raised; the message goes into the table's notes.
    """


class Prepared:
    """One prepared collective: ``run()`` moves data, ``result()`` reads it back."""

    def __init__(self, run: Callable[[], object], result: Callable[[], np.ndarray]):
        self.run = run
        self.result = result


class Impl:
    """Base adapter.  ``name`` is the column name in tables and JSON rows."""

    name = ""
    #: cap on timed iterations (None: the harness's count)
    max_iterations: int | None = None

    def wire_dtype(self, op: str, dtype: DType) -> DType:
        """The dtype this implementation actually reduces when asked for ``dtype``."""
        return dtype

    def describe(self, op: str, dtype: DType) -> str:
        """One header line saying what is timed."""
        raise NotImplementedError

    def prepare(self, op: str, values: np.ndarray, dtype: DType) -> Prepared:
        raise NotImplementedError

    def describe_tensors(self, dtype: DType) -> str:
        """One header line saying what ``allreduce`` / ``allgather`` call on tensors."""
        raise NotImplementedError

    def allreduce(self, tensor) -> None:
        """Sum a contiguous CPU torch tensor over the ranks, in place.

        Rank r holds x_r before; every rank holds x_0 + ... + x_{n-1} after.
        """
        raise NotImplementedError

    def allgather(self, tensor):
        """Every rank's tensor (same shape on all), concatenated along dim 0 in rank order.

        Rank r holds x_r of shape [m, ...]; every rank gets [x_0; ...; x_{n-1}]
        of shape [n m, ...].  The result may be a buffer that the next call
        with the same shape overwrites: consume it first.
        """
        raise NotImplementedError

    def info(self) -> dict | None:
        """harmpi.info() of the communicator this adapter runs on, None if not on harmpi."""
        return None

    def close(self) -> None:
        """Release resources; called once, in reverse order of creation."""


# --------------------------------------------------------------------------
# torch helpers (torch is imported lazily: the mpi adapter does not need it)
# --------------------------------------------------------------------------


def torch_from_storage(values: np.ndarray, dtype: DType):
    import torch

    storage = np.ascontiguousarray(values)
    if dtype.name == "bf16":
        return torch.from_numpy(storage.view(np.int16).copy()).view(torch.bfloat16)
    return torch.from_numpy(storage.copy())


def storage_from_torch(tensor, dtype: DType) -> np.ndarray:
    import torch

    flat = tensor.detach().reshape(-1)
    if dtype.name == "bf16":
        return flat.view(torch.int16).numpy().view(np.uint16).copy()
    return flat.numpy().copy()


_DTYPE_BY_TORCH_NAME = {f"torch.{dtype.torch_name}": dtype for dtype in DTYPES.values()}


def tensor_dtype(tensor) -> DType:
    """The benchmarks' DType of a torch tensor; ValueError for a dtype they do not know."""
    try:
        return _DTYPE_BY_TORCH_NAME[str(tensor.dtype)]
    except KeyError:
        raise ValueError(f"no benchmark dtype for {tensor.dtype} tensors") from None


def _gathered_shape(tensor, n_ranks: int) -> tuple[int, ...]:
    """Shape of n_ranks tensors like ``tensor`` concatenated along dim 0."""
    return (n_ranks * tensor.shape[0],) + tuple(tensor.shape[1:])


# --------------------------------------------------------------------------
# harmpi
# --------------------------------------------------------------------------


class HarmpiImpl(Impl):
    """harmpi on torch tensors; ``algorithm`` None means the library's choice."""

    def __init__(self, comm, algorithm: str | None):
        harmpi = _import_harmpi()
        self._harmpi = harmpi
        self._comm = comm
        self.algorithm = algorithm
        self.name = "harmpi" if algorithm is None else f"harmpi:{algorithm}"
        if algorithm is not None and algorithm not in harmpi.ALGORITHMS:
            raise SystemExit(
                f"unknown harmpi algorithm {algorithm!r}; "
                f"choose from {', '.join(harmpi.ALGORITHMS)}"
            )
        #: keyword arguments of every harmpi.allreduce call
        self._kwargs = {} if algorithm is None else {"algorithm": algorithm}

    def _algorithm_note(self) -> str:
        forced = os.environ.get("HARMPI_ALGORITHM")
        if self.algorithm is not None:
            return f"algorithm {self.algorithm} (forced per call)"
        if forced:
            return f"algorithm {forced} (HARMPI_ALGORITHM)"
        return "algorithm auto"

    def describe(self, op: str, dtype: DType) -> str:
        into = " into a preallocated tensor (out=)" if op == "allgather" else ""
        return (
            f"{self.name}: harmpi.{op} on a torch {dtype.torch_name} tensor{into}, "
            f"{self._algorithm_note()}"
        )

    def describe_tensors(self, dtype: DType) -> str:
        return (
            f"{self.name}: harmpi.allreduce / harmpi.allgather on {dtype.name} tensors, "
            f"{self._algorithm_note()}"
        )

    def prepare(self, op: str, values: np.ndarray, dtype: DType) -> Prepared:
        tensor = torch_from_storage(values, dtype)
        if op == "allreduce":
            return self._prepare_allreduce(tensor, values, dtype)
        if op == "allgather":
            return self._prepare_allgather(tensor, dtype)
        raise ValueError(op)

    def _prepare_allreduce(self, tensor, values: np.ndarray, dtype: DType) -> Prepared:
        harmpi, comm, kwargs = self._harmpi, self._comm, self._kwargs
        # Argument and topology checks happen before any data moves, so a
        # mismatch (e.g. "shm" across nodes) raises on every rank alike.
        try:
            harmpi.allreduce(tensor, comm=comm, **kwargs)
        except harmpi.HarmpiArgumentError as exc:
            raise ImplUnavailable(str(exc)) from exc
        tensor.copy_(torch_from_storage(values, dtype))  # undo the probe call

        from mpi4py import MPI

        if comm is MPI.COMM_WORLD and not kwargs:
            # the call a research script makes: harmpi.allreduce(t)
            def run(tensor=tensor, allreduce=harmpi.allreduce):
                allreduce(tensor)
        else:
            def run(tensor=tensor, allreduce=harmpi.allreduce, comm=comm, kwargs=kwargs):
                allreduce(tensor, comm=comm, **kwargs)

        return Prepared(run, lambda: storage_from_torch(tensor, dtype))

    def _prepare_allgather(self, tensor, dtype: DType) -> Prepared:
        comm = self._comm
        # into a preallocated tensor (out=), as the mpi and gloo impls do
        out = tensor.new_empty(tensor.numel() * comm.Get_size())

        def run(tensor=tensor, out=out, allgather=self._harmpi.allgather, comm=comm):
            allgather(tensor, comm=comm, out=out)

        return Prepared(run, lambda: storage_from_torch(out, dtype))

    def allreduce(self, tensor) -> None:
        self._harmpi.allreduce(tensor, comm=self._comm, **self._kwargs)

    def allgather(self, tensor):
        return self._harmpi.allgather(tensor, comm=self._comm)  # a new tensor per call

    def info(self) -> dict | None:
        return dict(self._harmpi.info(comm=self._comm))


# --------------------------------------------------------------------------
# MPI
# --------------------------------------------------------------------------


class MpiImpl(Impl):
    """mpi4py buffer collectives on the benchmark's communicator."""

    name = "mpi"

    def __init__(self, comm):
        from mpi4py import MPI

        self._MPI = MPI
        self._comm = comm
        self._float_types = {"f32": MPI.FLOAT, "f64": MPI.DOUBLE}
        self._f32_staging: dict[int, object] = {}  # element count -> float32 tensor
        self._torch = None  # imported at the first tensor call (OSU runs need no torch)

    def wire_dtype(self, op: str, dtype: DType) -> DType:
        if op == "allreduce" and dtype.name in ("bf16", "f16"):
            return DTYPES["f32"]
        return dtype

    def describe(self, op: str, dtype: DType) -> str:
        MPI = self._MPI
        wire = self.wire_dtype(op, dtype)
        if op == "allreduce":
            what = "MPI_Allreduce(MPI_IN_PLACE, SUM)"
            if wire is not dtype:
                what += (
                    f" float32, same bytes ({dtype.name} has no MPI type; half the elements,"
                    " a 2 B message sends 4 B)"
                )
            else:
                what += f" {wire.name}"
        else:
            what = f"MPI_Allgather, {dtype.name} moved as bytes"
        levels = {
            MPI.THREAD_SINGLE: "single",
            MPI.THREAD_FUNNELED: "funneled",
            MPI.THREAD_SERIALIZED: "serialized",
            MPI.THREAD_MULTIPLE: "multiple",
        }
        level = MPI.Query_thread()
        return f"mpi: {what}; thread level {levels.get(level, level)}"

    def describe_tensors(self, dtype: DType) -> str:
        wire = self.wire_dtype("allreduce", dtype)
        if wire is dtype:
            reduce = f"MPI_Allreduce on {dtype.torch_name}"
        else:
            reduce = f"MPI_Allreduce on {wire.torch_name} ({dtype.name} converted in and out)"
        return f"mpi: {reduce}, MPI_Allgather of {dtype.name} bytes"

    def prepare(self, op: str, values: np.ndarray, dtype: DType) -> Prepared:
        MPI = self._MPI
        comm = self._comm
        buf = np.ascontiguousarray(values).copy()
        if op == "allreduce":
            if buf.dtype not in (np.float32, np.float64):
                raise ImplUnavailable(f"mpi allreduce of {buf.dtype} is not supported here")
            target = [buf, MPI.FLOAT if buf.dtype == np.float32 else MPI.DOUBLE]

            def run(comm=comm, target=target, in_place=MPI.IN_PLACE, op=MPI.SUM):
                comm.Allreduce(in_place, target, op)

            return Prepared(run, lambda: buf.copy())
        if op == "allgather":
            out = np.empty(len(buf) * comm.Get_size(), dtype=buf.dtype)
            send = [buf.view(np.uint8), MPI.BYTE]
            recv = [out.view(np.uint8), MPI.BYTE]

            def run(comm=comm, send=send, recv=recv):
                comm.Allgather(send, recv)

            return Prepared(run, lambda: out.copy())
        raise ValueError(op)

    def _torch_module(self):
        if self._torch is None:
            import torch

            self._torch = torch
        return self._torch

    def allreduce(self, tensor) -> None:
        MPI = self._MPI
        dtype = tensor_dtype(tensor)
        wire = self.wire_dtype("allreduce", dtype)
        flat = tensor.view(-1)  # a view: a non-contiguous tensor raises instead of losing the sum
        if wire is dtype:
            target = [flat.numpy(), self._float_types[wire.name]]
            self._comm.Allreduce(MPI.IN_PLACE, target, MPI.SUM)
            return
        # MPI has no bf16 (and no portable f16): sum float32 copies
        staging = self._f32_staging.get(flat.numel())
        if staging is None:
            torch = self._torch_module()
            staging = torch.empty(flat.numel(), dtype=torch.float32)
            self._f32_staging[flat.numel()] = staging
        staging.copy_(flat)
        self._comm.Allreduce(MPI.IN_PLACE, [staging.numpy(), MPI.FLOAT], MPI.SUM)
        flat.copy_(staging)

    def allgather(self, tensor):
        MPI, torch = self._MPI, self._torch_module()
        out = tensor.new_empty(_gathered_shape(tensor, self._comm.Get_size()))
        send = tensor.contiguous().view(torch.uint8).numpy()
        self._comm.Allgather([send, MPI.BYTE], [out.view(torch.uint8).numpy(), MPI.BYTE])
        return out  # a new tensor per call


# --------------------------------------------------------------------------
# torch.distributed: gloo and harmpi process groups, one adapter
# --------------------------------------------------------------------------

#: torch.distributed backends the benchmarks can put a process group on
TORCH_BACKENDS = ("harmpi", "gloo")


def _store_address(comm) -> str:
    """127.0.0.1 when every rank is on one host, else rank 0's address."""
    override = os.environ.get("HARMPI_BENCH_GLOO_ADDR")
    if override:
        return override
    hosts = comm.allgather(socket.gethostname())
    if len(set(hosts)) == 1:
        return "127.0.0.1"
    address = socket.gethostbyname(hosts[0]) if comm.Get_rank() == 0 else None
    return comm.bcast(address, root=0)


def _init_default_group(comm, backend: str) -> tuple[str, int]:
    """Start torch.distributed's default process group of ``backend`` on the ranks of ``comm``.

    Rank 0 binds a TCPStore to port 0 itself (no pick-then-rebind race) and
    broadcasts the port through MPI, so no MASTER_ADDR is needed and the
    same rendezvous serves every backend (harmpi's own MPI rendezvous is
    not relied on: a gloo-only run needs no harmpi).  Returns (address, port).
    """
    import torch.distributed as dist

    rank, size = comm.Get_rank(), comm.Get_size()
    address = _store_address(comm)
    store = None
    if rank == 0:
        store = dist.TCPStore(address, 0, size, is_master=True, wait_for_workers=False)
    port = comm.bcast(store.port if rank == 0 else None, root=0)
    if rank != 0:
        store = dist.TCPStore(address, port, size, is_master=False)
    dist.init_process_group(backend, store=store, rank=rank, world_size=size)
    return address, port


def _import_harmpi():
    try:
        import harmpi
    except ImportError as exc:  # the library is optional while benchmarking rivals
        raise SystemExit(
            f"harmpi is not importable ({exc}); leave harmpi out of the implementations "
            "to compare (--impl, or --comm for the decode benchmark)"
        ) from exc
    return harmpi


#: the variant of gloo whose threads may run on every CPU of the host
GLOO_UNBOUND = "gloo:unbound"


@contextlib.contextmanager
def _every_cpu_allowed():
    """Threads started inside inherit every CPU of the host (the calling
    thread's binding is restored on leaving)."""
    bound = os.sched_getaffinity(0)
    try:
        os.sched_setaffinity(0, range(os.cpu_count() or 1))
    except OSError:  # a cgroup or a launcher forbids it: say so in the description
        bound = None
    try:
        yield
    finally:
        if bound is not None:
            os.sched_setaffinity(0, bound)


class TorchGroups:
    """The torch.distributed process groups of one job, one per backend.

    The first backend asked for gets the default group (started here, over
    the ranks of ``comm``, unless the caller started one); every other
    backend gets ``dist.new_group(backend=...)`` over all ranks, so gloo and
    harmpi groups coexist in one job.  The default group is destroyed when
    the last adapter using a group releases it, if it was started here.
    Collective: every rank asks for the same backends in the same order.
    """

    def __init__(self, comm):
        self._comm = comm
        self._groups: dict[str, object] = {}
        self._owner = False
        self._users = 0
        self.address: str | None = None
        self.port: int | None = None

    def acquire(self, backend: str, unbound: bool = False):
        """The process group of ``backend`` (made on first use); pair with ``release``.
        ``unbound``: a group of its own whose threads start with every CPU allowed."""

        if backend not in TORCH_BACKENDS:
            raise ValueError(f"no torch.distributed backend {backend!r} here; "
                             f"choose from {', '.join(TORCH_BACKENDS)}")
        if backend == "harmpi":
            _import_harmpi()
            import harmpi.distributed  # noqa: F401 - registers the backend
        key = f"{backend}:unbound" if unbound else backend
        group = self._groups.get(key)
        if group is None:
            with _every_cpu_allowed() if unbound else contextlib.nullcontext():
                group = self._new_group(backend)
            self._groups[key] = group
        self._users += 1
        return group

    def _new_group(self, backend: str):
        import torch.distributed as dist

        if not dist.is_initialized():
            self.address, self.port = _init_default_group(self._comm, backend)
            self._owner = True
        world_taken = any(group is dist.group.WORLD for group in self._groups.values())
        if dist.get_backend() == backend and not world_taken:
            return dist.group.WORLD
        return dist.new_group(backend=backend)

    def is_default(self, key: str) -> bool:
        import torch.distributed as dist

        return self._groups.get(key) is dist.group.WORLD

    def rendezvous(self) -> str:
        if self.address is None:
            return "the caller's rendezvous"
        return f"TCPStore tcp://{self.address}:{self.port}"

    def release(self) -> None:
        import torch.distributed as dist

        self._users -= 1
        if self._users == 0 and self._owner and dist.is_initialized():
            dist.destroy_process_group()
            self._groups.clear()
            self._owner = False


def _allgather_function():
    """torch.distributed's gather-into-one-tensor call (all_gather_single in torch >= 2.13)."""
    import torch.distributed as dist

    return getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class TorchImpl(Impl):
    """torch.distributed collectives on a process group of ``backend``, called as an
    engine calls them: ``dist.all_reduce(t, group=g)`` and
    ``dist.all_gather_single(out, t, group=g)``.  gloo and torch:harmpi are
    this one class with a different backend word."""

    def __init__(self, name: str, backend: str, groups: TorchGroups,
                 max_iterations: int | None = None, unbound: bool = False):
        import torch
        import torch.distributed as dist

        self._dist = dist
        self._torch = torch
        self.name = name
        self.backend = backend
        self.max_iterations = max_iterations
        self._groups = groups
        self.unbound = unbound
        self._key = f"{backend}:unbound" if unbound else backend
        #: the process group every call names (group=)
        self.group = groups.acquire(backend, unbound)
        self._gather = _allgather_function()
        self._n_ranks = dist.get_world_size(self.group)
        self._gather_outs: dict[tuple, object] = {}  # (shape, dtype) -> allgather output

    def group_description(self) -> str:
        """'a harmpi process group (the default group, TCPStore tcp://...)'."""
        which = "the default group" if self._groups.is_default(self._key) else (
            "a new_group over all ranks")
        text = f"a {self.backend} process group ({which}, {self._groups.rendezvous()})"
        if self.backend == "gloo":
            text += ("; its threads started with every host CPU allowed, the caller bound"
                     if self.unbound else "; its threads bound as the rank is")
        return text

    def describe(self, op: str, dtype: DType) -> str:
        call = "all_reduce" if op == "allreduce" else self._gather.__name__
        cap = ""
        if self.max_iterations is not None:
            cap = f", at most {self.max_iterations} timed iterations per size"
        return (
            f"{self.name}: torch.distributed.{call} ({dtype.torch_name}) on "
            f"{self.group_description()}, torch {self._torch.__version__}{cap}"
        )

    def describe_tensors(self, dtype: DType) -> str:
        return (
            f"{self.name}: torch.distributed.all_reduce / {self._gather.__name__} on "
            f"{dtype.name} tensors, {self.group_description()}"
        )

    def prepare(self, op: str, values: np.ndarray, dtype: DType) -> Prepared:
        tensor = torch_from_storage(values, dtype)
        group = self.group
        if op == "allreduce":

            def run(tensor=tensor, all_reduce=self._dist.all_reduce, group=group):
                all_reduce(tensor, group=group)

            return Prepared(run, lambda: storage_from_torch(tensor, dtype))
        if op == "allgather":
            out = self._torch.empty(tensor.numel() * self._n_ranks, dtype=tensor.dtype)

            def run(tensor=tensor, out=out, gather=self._gather, group=group):
                gather(out, tensor, group=group)

            return Prepared(run, lambda: storage_from_torch(out, dtype))
        raise ValueError(op)

    def allreduce(self, tensor) -> None:
        self._dist.all_reduce(tensor, group=self.group)

    def allgather(self, tensor):
        key = (tuple(tensor.shape), tensor.dtype)
        out = self._gather_outs.get(key)
        if out is None:
            out = self._gather_outs[key] = tensor.new_empty(_gathered_shape(tensor, self._n_ranks))
        self._gather(out, tensor, group=self.group)
        return out  # reused by the next call of this shape

    def info(self) -> dict | None:
        if self.backend != "harmpi":
            return None
        comm = None if self._groups.is_default(self._key) else self.group.comm
        return dict(_import_harmpi().info(comm=comm))

    def close(self) -> None:
        self._groups.release()


class FuncolImpl(TorchImpl):
    """torch's functional collectives on a process group of ``backend``, as
    DTensor and compiled graphs call them: ``y = funcol.all_reduce(t, "sum",
    g)`` (out of place) then ``funcol.wait_tensor(y)``.  All-reduce only."""

    def __init__(self, name: str, backend: str, groups: TorchGroups):
        super().__init__(name, backend, groups)
        import torch.distributed._functional_collectives as funcol

        self._funcol = funcol

    def describe(self, op: str, dtype: DType) -> str:
        return (f"{self.name}: torch.distributed._functional_collectives.all_reduce "
                f"({dtype.torch_name}, 'sum', out of place) + wait_tensor on "
                f"{self.group_description()}, torch {self._torch.__version__}")

    def describe_tensors(self, dtype: DType) -> str:
        return (f"{self.name}: functional all_reduce + wait_tensor on {dtype.name} tensors, "
                f"{self.group_description()}")

    def prepare(self, op: str, values: np.ndarray, dtype: DType) -> Prepared:
        if op != "allreduce":
            raise ValueError(f"{self.name} times all-reduce only, not {op}")
        tensor = torch_from_storage(values, dtype)
        last = [tensor]

        def run(tensor=tensor, all_reduce=self._funcol.all_reduce,
                wait=self._funcol.wait_tensor, group=self.group):
            last[0] = wait(all_reduce(tensor, "sum", group))

        # the result is a new tensor: the check reads the last call's
        return Prepared(run, lambda: storage_from_torch(last[0], dtype))

    def allreduce(self, tensor) -> None:
        tensor.copy_(self._funcol.wait_tensor(self._funcol.all_reduce(tensor, "sum", self.group)))

    def allgather(self, tensor):
        raise ValueError(f"{self.name} times all-reduce only")


# --------------------------------------------------------------------------
# Construction
# --------------------------------------------------------------------------


def torch_backend(name: str) -> str | None:
    """'gloo' and 'torch:gloo' -> 'gloo', 'torch:harmpi' -> 'harmpi'; None for the others."""
    kind, _, rest = name.partition(":")
    if kind == "gloo" and rest in ("", "unbound"):
        return "gloo"
    return rest if kind == "torch" else None


def parse_impls(spec: str) -> list[str]:
    """'harmpi,harmpi:shm,mpi,gloo,torch:harmpi' -> names, checked for kind and duplicates.

    ``gloo`` is short for ``torch:gloo`` (the two are one implementation)."""
    names = [part.strip() for part in spec.split(",") if part.strip()]
    if not names:
        raise ValueError("--impl needs at least one implementation")
    for name in names:
        kind, _, algorithm = name.partition(":")
        if kind not in IMPL_KINDS:
            raise ValueError(
                f"unknown implementation {name!r}; choose from harmpi, harmpi:<algorithm>, "
                f"mpi, gloo, {', '.join(f'torch:{b}' for b in TORCH_BACKENDS)}, "
                f"{', '.join(f'funcol:{b}' for b in TORCH_BACKENDS)}, deepspeed"
            )
        if kind in ("torch", "funcol") and algorithm not in TORCH_BACKENDS:
            raise ValueError(f"{kind} takes a backend, one of {', '.join(TORCH_BACKENDS)}, "
                             f"not {name!r}")
        if kind == "gloo" and algorithm not in ("", "unbound"):
            raise ValueError(f"gloo takes no option but unbound, not {name!r}")
        if algorithm and kind not in ("harmpi", "torch", "funcol", "gloo"):
            raise ValueError(f"only harmpi takes an algorithm, not {name!r}")
        if kind in ("mpi", "deepspeed") and ":" in name:
            raise ValueError(f"{kind} takes no option, not {name!r}")
        if kind == "harmpi" and ":" in name and not algorithm:
            raise ValueError(f"empty algorithm in {name!r}")
    keys = [("torch", torch_backend(n), n == GLOO_UNBOUND) if torch_backend(n) else n
            for n in names]
    if len(set(keys)) != len(keys):
        raise ValueError(f"duplicate implementation in {spec!r}")
    return names


def make_impls(names: Sequence[str], comm, *, gloo_max_iterations: int | None = 50) -> list[Impl]:
    """Create the adapters (collectively: every rank must call this with the same names)."""
    impls: list[Impl] = []
    harmpi_module = None
    groups = None
    for name in names:
        kind, _, algorithm = name.partition(":")
        backend = torch_backend(name)
        if kind == "funcol":
            groups = groups or TorchGroups(comm)
            impls.append(FuncolImpl(name, algorithm, groups))
        elif backend is not None:
            groups = groups or TorchGroups(comm)
            cap = gloo_max_iterations if backend == "gloo" else None
            impls.append(TorchImpl(name, backend, groups, cap, unbound=name == GLOO_UNBOUND))
        elif kind == "harmpi":
            impl = HarmpiImpl(comm, algorithm or None)
            if harmpi_module is None:
                harmpi_module = impl._harmpi
                harmpi_module.init(comm=comm)
            impls.append(impl)
        elif kind == "mpi":
            impls.append(MpiImpl(comm))
        elif kind == "deepspeed":
            from bench.deepspeed_op import DeepSpeedImpl  # it builds on this module's base

            # gloo's cap: an oversubscribed DeepSpeed takes milliseconds per call too
            impls.append(DeepSpeedImpl(comm, max_iterations=gloo_max_iterations))
    return impls


def harmpi_info_of(impls: Sequence[Impl]) -> dict | None:
    """harmpi.info() of the first adapter that runs on harmpi (for the header), else None."""
    for impl in impls:
        info = impl.info()
        if info is not None:
            return info
    return None


def close_impls(impls: Sequence[Impl]) -> None:
    """Close in reverse order, then finalize harmpi once if it was used."""
    harmpi_module = None
    for impl in reversed(impls):
        impl.close()
        if isinstance(impl, HarmpiImpl):
            harmpi_module = impl._harmpi
    if harmpi_module is not None:
        harmpi_module.finalize()
