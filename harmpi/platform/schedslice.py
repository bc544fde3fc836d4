"""A short scheduler slice for the threads that run collectives (Linux
EEVDF, 6.12 and later; HARMPI_SCHED_SLICE_US).

Why: on a host whose cores also run other work, a rank that sleeps in a
wait gives its core to another task. When its peer's publish wakes it, the
fair scheduler lets the task that took the core run out its *slice* first
(1.4 ms by default on 6.18, longer on bigger machines: EEVDF's run to
parity) unless the woken task asked for a shorter slice than the running
one: then it preempts at once. Every collective on a busy host pays that
wake-up, and a tensor-parallel step waits for its slowest rank. A custom
slice (``sched_setattr`` with ``sched_runtime`` on a SCHED_OTHER thread) is
the kernel's way to ask for it. It needs no privilege and gives the thread
no more CPU time than its fair share (EEVDF keeps each task's lag); it only
moves the thread's turn earlier, in shorter pieces. The same request makes
a ``sched_yield`` push the thread back by the short slice instead of a long
one.

A context asks for it on the thread that sets it up (the thread that runs
its collectives) and gives it back when freed; several contexts on one
thread share one request, counted. Only a SCHED_OTHER thread on a kernel
that reports its slice (``sched_getattr`` gives ``sched_runtime``; 0 before
custom slices existed) gets it; another policy, an older kernel, no such
system call or a filter that refuses it leave the thread as it was, and
harmpi.info()["wait"] says so. A process the thread forks meanwhile
inherits the request, as it inherits the thread's nice value.
"""

from __future__ import annotations

import ctypes
import functools
import platform
import struct
import sys
import threading

__all__ = ["hold", "release", "held_us", "current", "SLICE_MIN_US", "SLICE_MAX_US", "DEFAULT_US"]

#: sched_getattr / sched_setattr by number through libc's syscall()
_NUMBERS = {"x86_64": (315, 314), "amd64": (315, 314), "aarch64": (275, 274),
            "arm64": (275, 274), "riscv64": (275, 274), "ppc64le": (356, 355),
            "ppc64": (356, 355), "s390x": (346, 345)}
_GET, _SET = _NUMBERS.get(platform.machine().lower(), (0, 0))
#: struct sched_attr, version 0: size, policy, flags, nice, priority,
#: runtime, deadline, period
_FMT = "=IIQiIQQQ"
_NBYTES = struct.calcsize(_FMT)
_SCHED_OTHER = 0
#: the kernel clamps a custom slice to [0.1, 100] ms
SLICE_MIN_US, SLICE_MAX_US = 100, 100_000
#: HARMPI_SCHED_SLICE_US=auto: the shortest slice the kernel takes
DEFAULT_US = SLICE_MIN_US

_lock = threading.Lock()
#: native thread id -> [contexts holding the slice, the thread's own nice and
#: slice (ns), the slice asked for (ns)]
_held: dict = {}


@functools.cache
def _libc_syscall():
    fn = ctypes.CDLL(None, use_errno=True).syscall
    fn.restype = ctypes.c_long
    return fn


def current(tid: int = 0):
    """(policy, nice, slice ns) of thread ``tid`` (0: the calling one), or
    None when the kernel does not say."""
    if not _GET or not sys.platform.startswith("linux"):
        return None
    buf = ctypes.create_string_buffer(_NBYTES)
    if _libc_syscall()(_GET, tid, buf, ctypes.c_uint(_NBYTES), ctypes.c_uint(0)) != 0:
        return None
    _, policy, _, nice, _, runtime, _, _ = struct.unpack_from(_FMT, buf.raw)
    return policy, nice, runtime


def _set(tid: int, nice: int, runtime_ns: int) -> bool:
    attr = ctypes.create_string_buffer(
        struct.pack(_FMT, _NBYTES, _SCHED_OTHER, 0, nice, 0, runtime_ns, 0, 0), _NBYTES)
    return _libc_syscall()(_SET, tid, attr, ctypes.c_uint(0)) == 0


def hold(slice_us: int):
    """Ask for a ``slice_us`` µs slice on the calling thread. Returns a
    token for release(), or a string saying why the thread keeps its own
    slice (see the module docstring)."""
    now = current()
    if now is None or not _SET:
        return "the kernel does not report scheduler slices (sched_getattr)"
    policy, nice, runtime = now
    tid = threading.get_native_id()
    short_ns = min(max(int(slice_us), SLICE_MIN_US), SLICE_MAX_US) * 1000
    with _lock:
        entry = _held.get(tid)
        # (an entry whose slice is not in force was left by an ended thread
        # whose id this one reuses: start afresh)
        if entry is not None and policy == _SCHED_OTHER and runtime == entry[3]:
            entry[0] += 1
            return tid
        if policy != _SCHED_OTHER:
            return f"the thread's policy is not SCHED_OTHER ({policy})"
        if runtime == 0:
            return "this kernel has no custom slices (Linux 6.12 and later have)"
        if runtime <= short_ns:
            return f"the thread's slice is already {runtime // 1000} us"
        if not _set(0, nice, short_ns):
            return f"sched_setattr refused it (errno {ctypes.get_errno()})"
        # the thread's own slice goes back as it was read (a default one then
        # stays at that value, should the sysctl change meanwhile)
        _held[tid] = [1, nice, runtime, short_ns]
        return tid


def held_us(token) -> int | None:
    """The slice (µs) in force for a hold() (the thread's first request
    stands for every later one), None for a string token or a released one."""
    with _lock:
        entry = _held.get(token) if isinstance(token, int) else None
        return None if entry is None else entry[3] // 1000


def release(token) -> None:
    """Give back a hold() (from any thread); the last one restores the
    thread's own slice. A string token (nothing held) is ignored."""
    if not isinstance(token, int):
        return
    with _lock:
        entry = _held.get(token)
        if entry is None:
            return
        entry[0] -= 1
        if entry[0] > 0:
            return
        del _held[token]
    # by thread id, the caller's own included; a thread that ended meanwhile
    # (ESRCH) has nothing to restore
    _set(token, entry[1], entry[2])
