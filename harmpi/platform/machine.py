"""Which physical machine this process runs on: the kernel's boot id.

Containers and network namespaces of one machine share its kernel, so
ranks that compare boot ids count together what shares cores and memory
(hostnames differ between containers; the boot id does not).
"""

from __future__ import annotations

__all__ = ["boot_id"]

BOOT_ID_PATH = "/proc/sys/kernel/random/boot_id"


def boot_id() -> str | None:
    """The running kernel's boot id, or None where there is none (not Linux)."""
    try:
        with open(BOOT_ID_PATH) as f:
            return f.read().strip()
    except OSError:
        return None
