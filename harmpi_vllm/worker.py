"""One vLLM worker as one MPI rank of :class:`harmpi_vllm.executor.MpiExecutor`'s job.

The executor starts ``python -m harmpi_vllm.worker`` on every rank through
harmpi's launcher (under its rankenv shim, which sets RANK, WORLD_SIZE,
LOCAL_RANK, MASTER_ADDR/PORT from MPI's own, and harmpi's runner, which
ends the whole job if a rank fails). Each rank then:

1. connects back to the engine (harmpi_vllm.channel: authenticated) and
   says who and where it is;
2. receives the engine's VLLM_* settings, then the worker's arguments (the
   vLLM config and the scheduler queue's handle);
3. runs vLLM's own ``WorkerProc``: the worker (here the CPU worker, whose TP
   all-reduce is harmpi's with HARMPI_VLLM=1), the model, the KV cache,
   torch.distributed over MASTER_ADDR/PORT; its response queue is shared
   memory where the rank shares the engine's /dev/shm, else a TCP socket;
4. reports ready and serves vLLM's ``worker_busy_loop`` until the engine
   closes the connection (shutdown) or a signal comes.

A rank that leaves on purpose says :class:`~harmpi_vllm.channel.Bye`
first; one that dies says nothing, and the executor names it.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import sys
import threading
import traceback

from . import channel

log = logging.getLogger("vllm.harmpi.worker")

__all__ = ["main"]


def _hello(environ) -> channel.Hello:
    return channel.Hello(rank=int(environ["RANK"]), world_size=int(environ["WORLD_SIZE"]),
                         local_rank=int(environ.get("LOCAL_RANK", "0")), pid=os.getpid(),
                         host=socket.gethostname(), probe=channel.read_probe(environ))


def _worker_proc_class():
    """vLLM's WorkerProc with the queues of a rank started elsewhere (as
    vLLM's RayWorkerProc has them): the scheduler queue from the engine's
    handle, the response queue local (shm) or remote (TCP) to the engine."""
    from vllm.distributed.device_communicators.shm_broadcast import MessageQueue  # noqa: PLC0415
    from vllm.v1.executor.multiproc_executor import WorkerProc  # noqa: PLC0415

    class MpiWorkerProc(WorkerProc):
        engine_shares_shm = True
        reply_ip: str | None = None  # this host's address facing the engine (TCP replies)

        def _init_message_queues(self, input_shm_handle, vllm_config) -> None:
            self.rpc_broadcast_mq = MessageQueue.create_from_handle(input_shm_handle,
                                                                    self.worker.rank)
            local = self.engine_shares_shm
            self.worker_response_mq = MessageQueue(1, 1 if local else 0,
                                                   connect_ip=None if local else self.reply_ip)
            self.peer_response_handles = []

    return MpiWorkerProc


class _Stop:
    """Why this rank is leaving (set once): the engine closed the channel, or a signal."""

    def __init__(self, conn):
        self.conn, self.reason, self.queues = conn, None, []
        self._lock = threading.Lock()

    def request(self, reason: str) -> bool:
        """Record ``reason``, say Bye and wake the queues; False if already stopping."""
        with self._lock:
            if self.reason is not None:
                return False
            self.reason = reason
        try:
            self.conn.send(channel.Bye(reason))
        except OSError:  # the engine is gone: nobody to tell
            pass
        for mq in self.queues:
            mq.shutdown()
        return True

    def watch(self) -> None:
        """Wait for the end of the channel (the engine sends nothing more)."""
        try:
            self.conn.recv()
        except (EOFError, OSError):
            pass
        self.request("the engine closed the channel")


def _serve(conn, kwargs) -> None:
    """Run vLLM's worker until the engine stops it."""
    stop = _Stop(conn)

    def on_signal(signum, _frame):
        if stop.request(f"signal {signal.Signals(signum).name}"):
            raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    threading.Thread(target=stop.watch, daemon=True, name="HarmpiEngineChannel").start()

    from vllm.logger import configure_logging  # noqa: PLC0415

    if logging_config := getattr(kwargs["vllm_config"], "logging_config", None):
        configure_logging(logging_config)
    proc_class = _worker_proc_class()
    proc_class.engine_shares_shm = kwargs.pop("engine_shares_shm")
    proc_class.reply_ip = channel.local_ip(conn)
    proc = None
    try:
        try:
            proc = proc_class(**kwargs)
        except Exception:
            conn.send(channel.Failed(traceback.format_exc()))
            raise
        stop.queues += [proc.rpc_broadcast_mq, proc.worker_response_mq]
        if stop.reason is not None:  # stopped while the model loaded
            return
        conn.send(channel.Ready(proc.worker_response_mq.export_handle()))
        proc.rpc_broadcast_mq.wait_until_ready()
        proc.worker_response_mq.wait_until_ready()
        try:
            proc.worker_busy_loop()
        except Exception:
            if stop.reason is None:
                raise
    finally:
        if proc is not None:
            proc.shutdown()
    log.debug("harmpi worker rank %s stopped: %s", kwargs["rank"], stop.reason)


def main(environ=None) -> int:
    environ = os.environ if environ is None else environ
    conn = channel.connect(environ)
    conn.send(_hello(environ))
    env = conn.recv()
    for name, value in env.variables.items():
        os.environ.setdefault(name, value)
    kwargs = conn.recv()  # unpickling imports vLLM (its settings are in place now)
    _serve(conn, kwargs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
