"""harmpi's vLLM plug-in: vLLM's CPU tensor-parallel all-reduce and logits
all_gather through harmpi.

vLLM loads every ``vllm.general_plugins`` entry point in each of its
processes; harmpi's (``harmpi = harmpi_vllm:register``, pyproject.toml) is
:func:`register`. It reads one switch, ``HARMPI_VLLM``:

- unset or ``0``: it returns at once; vLLM is untouched and harmpi is not
  imported (nor MPI, numba or llvmlite);
- ``1``: vLLM's CPU platform makes its device communicators from
  :class:`harmpi_vllm.communicator.HarmpiCpuCommunicator`. That class is
  vLLM's ``CpuCommunicator`` except in a tensor-parallel group, where
  ``all_reduce`` is the operator ``torch.ops.harmpi.all_reduce_inplace``
  (in place, as vLLM's own; vLLM's torch.compile keeps it in its graph) and ``all_gather`` (the
  logits) is ``harmpi.allgather``, over an MPI communicator of the group's
  ranks. harmpi is imported only there, when vLLM makes the group's
  communicator (importing it any earlier, before vLLM's
  ``register_triton_kernel_overrides``, breaks vLLM's scan of
  ``sys.modules`` on an llvmlite object). Where harmpi's torch extension
  (``harmpi._C``, the operator's home) is absent, vLLM's own collectives
  carry the group and one log line says why.

vLLM's ranks must be MPI ranks: one process per rank started by an MPI
launcher, and vLLM told not to start its own workers::

    HARMPI_VLLM=1 harmpi-launch -np 2 -- python generate.py
    # generate.py: LLM(model, tensor_parallel_size=2,
    #                  distributed_executor_backend="external_launcher")

Under vLLM's default multiprocessing executor the workers are not MPI ranks
and making the group's communicator raises :class:`VllmLaunchError`, which
says the above.

This package is a top-level name of its own, not ``harmpi.vllm``: importing
any ``harmpi.*`` module runs harmpi/__init__.py (MPI, numba), which the
switched-off plug-in must not do.
"""

from __future__ import annotations

import os

__all__ = ["register", "enabled", "VllmLaunchError", "ENV", "COMMUNICATOR"]

#: the switch
ENV = "HARMPI_VLLM"
#: the device communicator class vLLM's CPU platform makes when switched on
COMMUNICATOR = "harmpi_vllm.communicator.HarmpiCpuCommunicator"


class VllmLaunchError(RuntimeError):
    """The plug-in cannot serve this vLLM set-up (vLLM's ranks are not MPI
    ranks, or the platform is not vLLM's CPU one). Not a ``HarmpiError``:
    it is raised before harmpi is imported, since importing harmpi
    initialises MPI, which a process that is not an MPI rank must not do."""


def enabled(environ=None) -> bool:
    """Whether ``HARMPI_VLLM`` switches the plug-in on (a value other than
    unset, "", 0 or 1 raises ValueError: a typo must not leave it off)."""
    value = (os.environ if environ is None else environ).get(ENV, "").strip()
    if value in ("", "0"):
        return False
    if value == "1":
        return True
    raise ValueError(f"{ENV}={value!r}: 1 switches harmpi's vLLM plug-in on; 0 or unset "
                     "leaves vLLM untouched")


def _communicator_cls(cls) -> str:
    return COMMUNICATOR


def register() -> None:
    """vLLM's entry point (every vLLM process calls it once, early): with
    ``HARMPI_VLLM=1``, make vLLM's CPU platform build its device
    communicators from :data:`COMMUNICATOR`; otherwise do nothing."""
    if not enabled():
        return
    from vllm.platforms import current_platform  # noqa: PLC0415 - vLLM is loading us

    if not current_platform.is_cpu():
        raise VllmLaunchError(
            f"{ENV}=1: harmpi's vLLM plug-in serves vLLM's CPU backend; this process's vLLM "
            f"platform is {type(current_platform).__name__} (unset {ENV})")
    # the platform names the class by its qualified name and vLLM imports it
    # when it makes a group's communicator: that is when harmpi is imported
    type(current_platform).get_device_communicator_cls = classmethod(_communicator_cls)
