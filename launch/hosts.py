"""Host lists: ``--hosts a,b:4`` and hostfiles in Open MPI or MPICH syntax.

A host without a slot count is assumed to look like the launching host (as
many slots as this host has cores); the plan writes that count out explicitly
wherever the MPI's syntax allows, so mpirun and the launcher agree.
"""

from __future__ import annotations

import re
import socket
from dataclasses import dataclass
from typing import Callable, Iterable

from .errors import LaunchError

__all__ = ["Host", "parse_hostfile", "parse_hosts", "unresolvable"]

_NAME = re.compile(r"^[A-Za-z0-9_.\-\[\]]+$")


@dataclass(frozen=True)
class Host:
    """One host and its slot count (None: as many as this host has cores)."""

    name: str
    slots: int | None = None


def _slots(text: str, where: str) -> int:
    try:
        n = int(text)
    except ValueError:
        raise LaunchError(f"{where}: slot count {text!r} is not a whole number") from None
    if n < 1:
        raise LaunchError(f"{where}: slot count must be at least 1, got {n}")
    return n


def _check_unique(hosts: list[Host], where: str) -> tuple[Host, ...]:
    seen: set[str] = set()
    for h in hosts:
        if h.name in seen:
            raise LaunchError(
                f"{where}: host {h.name!r} is listed twice; write {h.name}:N to give it N slots"
            )
        seen.add(h.name)
    if not hosts:
        raise LaunchError(f"{where}: no hosts given")
    return tuple(hosts)


def parse_hosts(text: str) -> tuple[Host, ...]:
    """Parse ``"h1,h2:4"`` (``--hosts``) into hosts."""
    hosts = []
    for item in text.split(","):
        item = item.strip()
        if not item:
            continue
        name, _, count = item.partition(":")
        if not _NAME.match(name):
            raise LaunchError(f"--hosts: {name!r} is not a host name")
        hosts.append(Host(name, _slots(count, "--hosts") if count else None))
    return _check_unique(hosts, "--hosts")


def parse_hostfile(text: str, where: str = "hostfile") -> tuple[Host, ...]:
    """Parse a hostfile: ``host slots=N`` (Open MPI) or ``host:N`` (MPICH), ``#`` comments."""
    hosts = []
    for lineno, line in enumerate(text.splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        first, *rest = line.split()
        name, _, count = first.partition(":")
        if not _NAME.match(name):
            raise LaunchError(f"{where} line {lineno}: {name!r} is not a host name")
        slots = _slots(count, f"{where} line {lineno}") if count else None
        for token in rest:
            key, _, value = token.partition("=")
            if key == "slots":
                slots = _slots(value, f"{where} line {lineno}")
        hosts.append(Host(name, slots))
    return _check_unique(hosts, where)


def _resolves(name: str) -> bool:
    try:
        socket.getaddrinfo(name.strip("[]"), None)  # "[::1]": an IPv6 address
    except (OSError, UnicodeError):
        return False
    return True


def unresolvable(hosts: Iterable[Host],
                 resolves: Callable[[str], bool] = _resolves) -> list[str]:
    """Names among ``hosts`` that do not resolve to an address (in order)."""
    return [h.name for h in hosts if not resolves(h.name)]
