"""The torch.distributed adapters: ``TorchImpl`` (gloo, torch:harmpi: the
calls an engine makes on a process group), ``FuncolImpl`` (functional
collectives) and ``TorchGroups`` (one process group per backend in a job)."""

from __future__ import annotations

import contextlib
import os
import socket

import numpy as np

from bench.harness import DType
from bench.impl_base import (
    Impl,
    Prepared,
    gathered_shape,
    import_harmpi,
    storage_from_torch,
    torch_from_storage,
)

__all__ = ["TORCH_BACKENDS", "GLOO_UNBOUND", "TorchGroups", "TorchImpl", "FuncolImpl"]

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
            import_harmpi()
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
        self._send_counts = torch.zeros(self._n_ranks, dtype=torch.int64)  # alltoall's
        self._recv_counts = torch.zeros(self._n_ranks, dtype=torch.int64)

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
        call = {"allreduce": "all_reduce", "alltoall": "all_to_all_single"}.get(
            op, self._gather.__name__)
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
        if op == "alltoall":
            return self.prepare_alltoall(values, dtype)
        raise ValueError(op)

    def allreduce(self, tensor) -> None:
        self._dist.all_reduce(tensor, group=self.group)

    def describe_alltoall(self, uneven: bool) -> str:
        if uneven:
            return (f"{self.name}: dist.all_to_all_single of the counts, then of the rows with "
                    f"split sizes (back: the counts known), on {self.group_description()}")
        return f"{self.name}: dist.all_to_all_single on {self.group_description()}"

    def alltoall(self, tensor, send_counts=None, recv_counts=None, out=None):
        torch, dist = self._torch, self._dist
        if send_counts is None:
            out = tensor.new_empty(tensor.shape) if out is None else out
            dist.all_to_all_single(out, tensor, group=self.group)
            return out, None
        if recv_counts is None:  # the counts first (int64, one per rank)
            self._send_counts.copy_(torch.tensor(send_counts, dtype=torch.int64))
            dist.all_to_all_single(self._recv_counts, self._send_counts, group=self.group)
            recv_counts = self._recv_counts.tolist()
        out = tensor.new_empty((int(sum(recv_counts)),) + tuple(tensor.shape[1:]))
        dist.all_to_all_single(out, tensor, output_split_sizes=list(recv_counts),
                               input_split_sizes=list(send_counts), group=self.group)
        return out, recv_counts

    def allgather(self, tensor):
        key = (tuple(tensor.shape), tensor.dtype)
        out = self._gather_outs.get(key)
        if out is None:
            out = self._gather_outs[key] = tensor.new_empty(gathered_shape(tensor, self._n_ranks))
        self._gather(out, tensor, group=self.group)
        return out  # reused by the next call of this shape

    def info(self) -> dict | None:
        if self.backend != "harmpi":
            return None
        comm = None if self._groups.is_default(self._key) else self.group.comm
        return dict(import_harmpi().info(comm=comm))

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
