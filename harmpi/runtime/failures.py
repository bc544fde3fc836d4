"""A failed step's status, turned into the exception every rank raises.

A compiled step returns a status (harmpi.base.control: TIMEOUT, MISMATCH,
ABANDONED, ...) and leaves what it saw in the control block (peer, a, b).
:func:`fail` raises the exception that says, for this rank, what happened
and who was late or disagreed, and decides whether the context survives:
a failure that may have left peers mid-collective makes this rank give up
(``Context.give_up``: every peer then fails at once) and the context
unusable.
"""

from __future__ import annotations

from .. import node
from ..algorithms import ALGORITHM_IDS
from ..base import kind
from ..base.arena import W_META
from ..base.control import (
    ABANDONED,
    BUSY,
    INTERRUPTED,
    MISMATCH,
    POISONED,
    RAIL_FAILED,
    RAIL_LATE,
    RAIL_TIMEOUT,
    RAISED,
    TIMEOUT,
    WRONG_THREAD,
)
from ..errors import (
    HarmpiError,
    HarmpiMismatchError,
    HarmpiTimeoutError,
    HarmpiTransportError,
)
from . import owner

__all__ = ["fail", "raise_for_status", "mismatch_is_clean", "who"]


def fail(ctx, rc, call, state=None):
    """Raise the exception for a step's status ``rc``. ``state``: an
    earlier :meth:`Context.error_state`, when the algorithm went on (poisoned)
    after the failing step so its peers fail too.

    What the failure leaves behind decides what happens to the context:
    a timeout, a transport error, an interruption or a peer that gave up
    leave peers mid-collective, so this rank gives up on the node's
    flags too (node.abandon: every peer then fails at once) and the
    context is unusable. A disagreement is only survivable where every
    rank stops at the same flag round (see :func:`mismatch_is_clean`);
    anywhere else the step counters may now differ between ranks, so
    the context is unusable on every rank that raises."""
    try:
        raise_for_status(ctx, rc, call, state)
    except HarmpiMismatchError as exc:
        if rc == ABANDONED:  # a peer gave up after a disagreement (_abandoned_error)
            ctx.give_up(str(exc))
        elif not mismatch_is_clean(ctx, rc) or getattr(exc, "unclean", False):
            ctx.give_up(f"{exc} (after a disagreement across nodes or between "
                        "algorithms, the ranks' step counters may differ)",
                        node.CULPRIT_DISAGREED)
        raise
    except (HarmpiTimeoutError, HarmpiTransportError, KeyboardInterrupt) as exc:
        ctx.give_up(str(exc) or type(exc).__name__, getattr(exc, "culprit", -1))
        raise
    except HarmpiError as exc:
        if rc == ABANDONED:
            ctx.give_up(str(exc))
        raise


def mismatch_is_clean(ctx, rc):
    """After a disagreement: may this context go on? Yes if every rank
    of this node ran the same collective with the same algorithm in the
    failed step (sizes or dtypes differed): then every one of them took
    the same failure path through the same flag rounds, and the node's
    step counters still agree; likewise on one node for any mix of the
    steps that stop at their first round. Otherwise ranks that ran
    different algorithms or collectives may have left after different
    rounds: the counters may differ, and only an unusable context is safe. (A disagreement a
    Python algorithm raised itself, RAISED, comes from exchanges every
    rank finishes: the flat ring, or uneven nodes' allgather check.)"""
    if rc == RAISED:
        return True
    parity = (int(ctx.ctl[0]["steps"]) - 1) & 1
    kinds = {int(line[W_META + 2 * parity + 1]) for line in ctx.arena.flags()}
    # (the kind POISON is posted only by an allgather whose rail exchange
    # disagreed: its rank ran an allgather)
    runs = {(f["coll"], f["algo"]) if f else (kind.COLL_ALLGATHER, 0)
            for f in map(kind.decode, kinds)}
    if len(runs) == 1:
        return True
    # On one node, the compiled steps (an auto, shm or shm_rsag
    # all-reduce, an allgather, an all-to-all) all leave at the first flag round of a
    # disagreement: a mix of them still stops every rank in that round.
    return ctx.topo.node_count == 1 and runs <= _first_round_exits()


def _first_round_exits():
    ids = [ALGORITHM_IDS[n] for n in ("auto", "shm", "shm_rsag")]
    return ({(kind.COLL_ALLREDUCE, i) for i in ids}
            | {(kind.COLL_ALLGATHER, 0), (kind.COLL_ALLTOALL, 0)})


def who(ctx):
    """This rank, as the errors name it."""
    topo = ctx.topo
    return f"rank {topo.rank} (node {topo.node_index}, local rank {topo.local_rank})"


def raise_for_status(ctx, rc, call, state=None):
    """Raise the exception of status ``rc`` of ``call`` (``state``: the
    (peer, a, b) the step left, else the control block's), nothing else."""
    if rc == RAISED:
        exc, ctx.pending_error = ctx.pending_error, None
        raise exc
    if rc in (RAIL_TIMEOUT, RAIL_FAILED, RAIL_LATE) and ctx.har2() is not None:
        ctx.har2().raise_rail(rc, call)
    if rc == BUSY and ctx.split_pending is not None:
        raise HarmpiError(
            f"{who(ctx)}: {call}: an async torch.distributed collective on this "
            "communicator was started and not yet waited for; call its work's wait() "
            "first (collectives on one communicator complete in order)")
    if rc == BUSY:
        raise HarmpiError(
            f"{who(ctx)}: {call}: another thread is inside a collective on this "
            "communicator; call harmpi's collectives on one communicator from one thread "
            "at a time (or give each thread its own communicator)")
    if rc == WRONG_THREAD:
        ended = ctx.ctl[0]["owner"] == owner.ENDED
        raise HarmpiError(f"{who(ctx)}: {call}: {owner.refusal(ctx.owner_name, ended)}")
    if rc == INTERRUPTED:
        raise KeyboardInterrupt(f"{who(ctx)}: {call}: interrupted while waiting; this "
                                "context is unusable now")
    peer, a, b = state or ctx.error_state()
    if rc == ABANDONED:
        raise _abandoned_error(ctx, call, peer, a, b)
    if rc == TIMEOUT:
        raise HarmpiTimeoutError(
            f"{who(ctx)}: {call}: local rank {peer} (rank {_rank_of(ctx, peer)}) did not "
            f"publish step {a} within {ctx.config.timeout_s:g} s; its flag shows {b}. It "
            "crashed, hangs, or never called this collective (HARMPI_TIMEOUT_S sets the "
            "deadline); this context is unusable now.")
    if rc in (MISMATCH, POISONED):
        raise _mismatch_error(ctx, call, rc, peer, a, b)
    raise HarmpiError(f"{who(ctx)}: {call}: unexpected step status {rc}")


def _rank_of(ctx, local_rank):
    return ctx.topo.node_ranks[ctx.topo.node_index][local_rank]


def _abandoned_error(ctx, call, peer, epoch, culprit):
    if ctx.broken is not None:  # refused at the entry: an earlier failure
        return HarmpiError(f"harmpi context is unusable: {ctx.broken}")
    gave_up = f"local rank {peer} (rank {_rank_of(ctx, peer)})"
    if culprit == node.CULPRIT_INTERRUPTED:
        why = ("this rank was interrupted (SIGINT) while it waited" if peer ==
               ctx.topo.local_rank else f"{gave_up} was interrupted (SIGINT) while it waited")
    elif culprit in (node.CULPRIT_REFUSED, node.CULPRIT_DISAGREED):
        # not a late rank: the ranks disagreed, and that rank said so at once
        why = (f"{gave_up} refused its own arguments to this call (its HarmpiArgumentError "
               "says why) while a peer made it for real"
               if culprit == node.CULPRIT_REFUSED else
               f"{gave_up} saw the ranks disagree (another size, dtype, op, collective or "
               "algorithm) and gave up")
        return HarmpiMismatchError(
            f"{who(ctx)}: {call}: step {epoch}: {why}. No rank completes this "
            "collective; this context is unusable now (the ranks' step counters may "
            "differ). Every rank must make the same calls, with the same sizes and dtypes, "
            "in the same order.")
    elif culprit == ctx.topo.rank:
        why = f"{gave_up} gave up waiting for this rank: it arrived after the deadline"
    elif culprit == _rank_of(ctx, peer):
        why = f"{gave_up} did not arrive in time, and a peer gave up on it"
    elif culprit >= 0:
        why = f"{gave_up} gave up waiting for rank {culprit}"
    else:
        why = f"{gave_up} gave up (its transport failed, it timed out or was interrupted)"
    return HarmpiTimeoutError(f"{who(ctx)}: {call}: step {epoch}: {why}. No rank "
                              "completes this collective (HARMPI_TIMEOUT_S sets the "
                              "deadline); this context is unusable now.")


def _mismatch_error(ctx, call, rc, peer, a, b):
    refused = None if rc == POISONED else kind.refused_coll(b)
    if refused is not None:
        return HarmpiMismatchError(
            f"{who(ctx)}: {call}: local rank {peer} (rank {_rank_of(ctx, peer)}) refused "
            f"its own arguments to {refused} in this call (its HarmpiArgumentError says "
            "why), so no rank completes it. Every rank must make the same calls with "
            "arguments that pass the checks, in the same order.")
    if rc == POISONED or b == kind.POISON:
        detail = ("the cross-node exchange saw a peer node pass a different size, dtype, "
                  "op or algorithm, or refuse its own arguments")
    else:
        detail = (f"this rank passes {call.nbytes} bytes (kind {call.describe_code()}), "
                  f"local rank {peer} (rank {_rank_of(ctx, peer)}) passes {a} bytes "
                  f"(kind {call.describe_code(b)})")
    return HarmpiMismatchError(
        f"{who(ctx)}: {call}: ranks disagree: {detail}. Every rank must pass a tensor "
        "of the same size and dtype, with the same op and algorithm, in the same order.")
