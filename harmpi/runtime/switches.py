"""auto's two size switches for one context: the user's, else the cost model's.

Steps, when a context is made (after its topology is known):
  1. if HARMPI_SMALL_MAX_BYTES or HARMPI_HAR_LATENCY_MAX_BYTES is unset
     (Config field None), rank 0 of the communicator loads the cost model
     (harmpi.algorithms.model_file: its file, else the built-in constants)
     and one polled allgather hands its constants to every rank;
  2. every rank computes model.thresholds(constants, L, N), L the largest
     node's ranks, N the node count: the same numbers on every rank (with
     the built-in constants, across nodes of several ranks, not below the
     measured 256 KiB: BUILT_IN_HAR_LATENCY_FLOOR);
  3. a switch the user set stays as set (an override).

Invariant: every rank of a communicator switches at the same sizes, which
pairs the same steps (Config.must_match makes the set ones agree; step 1
the model's), whatever model file each host holds. A bad file on rank 0 is
a warning there and the built-in constants, never a failed set-up.
"""

from __future__ import annotations

import logging
from typing import NamedTuple

from ..algorithms import model, model_file
from ..base.topology import allgather_polled

__all__ = ["Switches", "resolve", "describe", "modelled", "BUILT_IN_HAR_LATENCY_FLOOR"]

log = logging.getLogger("harmpi")

#: Across nodes of several ranks the built-in constants hold no measured
#: pair of har_latency and har_bandwidth at one size, and their
#: extrapolated switch was wrong where it was checked: 2 virtual nodes x 2
#: on the 2-core machine (tcp rail, 2026-12-05), model ~42 KiB, but
#: har_bandwidth took 137-157 us at 64 KiB against 70-103 for har_latency,
#: and 202-210 against 131-159 at 128 KiB (two runs each). So with the
#: built-in constants that switch stays at least where it was measured
#: (256 KiB) until a host's own tuned file (python -m harmpi.tune, which
#: measures such layouts where the host's cores allow) says otherwise.
BUILT_IN_HAR_LATENCY_FLOOR = 256 << 10


def modelled(loaded: model_file.LoadedModel, L: int, N: int) -> model.Thresholds:
    """The model's switches for L ranks per node on N nodes, with the
    built-in constants' floor across nodes of several ranks (above)."""
    t = model.thresholds(loaded.constants, L, N)
    if loaded.source == model_file.BUILT_IN and L > 1 and N > 1:
        t = t._replace(har_latency_max_nbytes=max(t.har_latency_max_nbytes,
                                                  BUILT_IN_HAR_LATENCY_FLOOR))
    return t


class Switches(NamedTuple):
    """A context's switches, the model behind them and who set each."""

    thresholds: model.Thresholds
    loaded: model_file.LoadedModel
    ranks_per_node: int
    nodes: int
    #: per switch: "cost model" or the setting that overrode it
    set_by: dict


def resolve(comm, topo, config, timeout_s) -> Switches:
    """The :class:`Switches` of a context on ``comm`` (collective when a
    switch is unset and ``comm`` has several ranks)."""
    given = {"small_max_nbytes": config.small_max_nbytes,
             "har_latency_max_nbytes": config.har_latency_max_nbytes}
    if any(v is None for v in given.values()):
        mine = model_file.load(config.model_file) if topo.rank == 0 else None
        loaded = allgather_polled(comm, mine, timeout_s,
                                  "setting up harmpi (rank 0's cost model)")[0]
        if loaded.problem and topo.rank == 0:
            log.warning("harmpi cost model: %s", loaded.problem)
    else:  # both set: the model is only shown (harmpi.info), this rank's own
        loaded = model_file.load(config.model_file)
    L, N = max(topo.node_sizes), topo.node_count
    from_model = modelled(loaded, L, N)._asdict()
    names = {"small_max_nbytes": "HARMPI_SMALL_MAX_BYTES",
             "har_latency_max_nbytes": "HARMPI_HAR_LATENCY_MAX_BYTES"}
    values, set_by = {}, {}
    for key, value in given.items():
        values[key] = from_model[key] if value is None else value
        set_by[key] = "cost model" if value is None else f"{names[key]} (Config.{key})"
    if topo.rank == 0:
        log.debug("harmpi: auto's switches on %d x %d: %s (%s; constants: %s)", N, L, values,
                  set_by, loaded.source)
    return Switches(model.Thresholds(**values), loaded, L, N, set_by)


def describe(sw: Switches) -> dict:
    """info()["model"]: the constants, their source, and auto's choice per size."""
    return {"source": sw.loaded.source,
            "problem": sw.loaded.problem,
            "constants": sw.loaded.constants.as_dict(),
            "layout": f"{sw.nodes} x {sw.ranks_per_node}",
            "switches_set_by": dict(sw.set_by),
            "model_thresholds": modelled(sw.loaded, sw.ranks_per_node, sw.nodes)._asdict(),
            "choices": model.choices(sw.loaded.constants, sw.ranks_per_node, sw.nodes,
                                     sw.thresholds)}
