"""The device communicator vLLM's CPU platform makes with ``HARMPI_VLLM=1``.

It is vLLM's ``CpuCommunicator`` (set up exactly as vLLM sets it up, so
every other collective, gather and the pipeline-parallel tensor dicts stay
vLLM's), except in a tensor-parallel group ("tp:N"), where ``all_reduce``
and ``all_gather`` go through harmpi (:class:`harmpi_vllm.group.HarmpiGroup`).
vLLM imports this module by name (harmpi_vllm.COMMUNICATOR) when it makes a
group of more than one rank; harmpi itself is imported only for a TP group.
"""

from __future__ import annotations

import os
import socket

import torch.distributed as dist
from vllm.distributed.device_communicators.cpu_communicator import CpuCommunicator

from .group import HarmpiGroup, rank_view

__all__ = ["HarmpiCpuCommunicator", "node_of"]

#: each MPI's local rank variable (harmpi's virtual nodes split a host by it)
_LOCAL_RANK = ("OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "LOCAL_RANK")


def node_of(environ) -> tuple:
    """(host, virtual node) of this process: ranks that share memory for
    harmpi share both (HARMPI_RANKS_PER_NODE=K: every K local ranks a node)."""
    per_node = int(environ.get("HARMPI_RANKS_PER_NODE") or 0)
    local = next((int(environ[v]) for v in _LOCAL_RANK if environ.get(v, "").isdigit()), 0)
    return socket.gethostname(), local // per_node if per_node > 0 else 0


class HarmpiCpuCommunicator(CpuCommunicator):
    """vLLM's CPU communicator; a TP group's all-reduce and all_gather by harmpi."""

    def __init__(self, cpu_group, device=None, device_group=None, unique_name: str = "",
                 use_all2all: bool = False):
        super().__init__(cpu_group, device, device_group, unique_name, use_all2all=use_all2all)
        self.harmpi = None
        if unique_name.split(":")[0] == "tp":
            views = [None] * self.world_size
            dist.all_gather_object(
                views, rank_view(self.global_rank, self.global_world_size, os.environ),
                group=self.cpu_group)
            self.harmpi = HarmpiGroup.make(unique_name, self.ranks, views)

    def _all_group_ranks_share_shm_group_name(self) -> bool:
        """vLLM builds its shared-memory op for a group only where this is
        true: never for one that spans hosts or harmpi's virtual nodes."""
        if not super()._all_group_ranks_share_shm_group_name():
            return False
        nodes = [None] * self.world_size
        dist.all_gather_object(nodes, node_of(os.environ), group=self.device_group)
        return len(set(nodes)) == 1

    def all_reduce(self, input_):
        """In place, returning ``input_``, in every group (as vLLM's own)."""
        if self.harmpi is None:
            return super().all_reduce(input_)
        return self.harmpi.all_reduce(input_)

    def all_gather(self, input_, dim: int = -1):
        if self.harmpi is None:
            return super().all_gather(input_, dim)
        return self.harmpi.all_gather(input_, dim)
