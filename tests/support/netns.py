"""Real MPI "hosts" on one Linux machine, for multi-node tests.

``TwoHosts`` builds two network namespaces joined by a veth pair, gives each
its own host name, and launches ``mpirun`` so that Open MPI sees two separate
nodes: ``COMM_TYPE_SHARED`` splits 4 ranks 2 + 2, ranks on the same "host"
talk through shared memory (``sm`` BTL, ``MPI.Win.Allocate_shared``), and
ranks on different "hosts" talk TCP across the veth pair. ``Hosts(count)``
does the same for ``count`` (2 to 18) hosts joined through a Linux bridge
(see "N hosts" below); ``TwoHosts`` is ``Hosts(2, bridge=False)``. Everything
it made is deleted when the ``with`` block ends, also on failure, timeout or
KeyboardInterrupt. No pytest dependency: tests call
``can_make_namespaces()`` (``bridge=True`` for ``Hosts``) and
``pytest.skip(reason)`` themselves.

Usage::

    ok, reason = can_make_namespaces()
    with TwoHosts(ranks_per_host=2) as hosts:
        proc = hosts.mpirun([sys.executable, "script.py"], np=4,
                            timeout_s=60, env={"HARMPI_X": "1"})
        print(hosts.names, proc.returncode, proc.stdout)

    ok, reason = can_make_namespaces(bridge=True)
    with Hosts(4, ranks_per_host=1) as hosts:      # np defaults to 4 x 1
        proc = hosts.mpirun([sys.executable, "script.py"], timeout_s=60)

``mpirun`` returns a ``subprocess.CompletedProcess`` (text stdout/stderr
captured, never checked unless ``check=True``); on timeout every process of
the job is killed and ``subprocess.TimeoutExpired`` is raised (with the output
seen so far).

The recipe, and why each piece is needed
----------------------------------------
* Two namespaces ``hm<pid>n<seq>a`` / ``...b`` (unique per process and run,
  short because interface names are at most 15 characters), each with ``lo``
  up (Open MPI/PMIx talk to their local daemon over loopback) and one end of a
  veth pair ``v<name>`` created directly inside them (never visible in the
  root namespace). Addresses come from a private /24 (default 10.213.7.0/24)
  that exists only inside these two namespaces; no traffic ever leaves them.
* ``/etc/netns/<name>/hosts`` lists both hosts. ``ip netns exec`` bind-mounts
  every file of ``/etc/netns/<name>/`` over ``/etc/`` in the process's mount
  namespace, so inside either host both names resolve, without touching the
  machine's /etc/hosts.
* Every process runs as ``ip netns exec NAME unshare --uts sh -c 'echo NAME >
  /proc/sys/kernel/hostname; exec ...'``: a private UTS namespace gives each
  host its own host name. Open MPI decides "same node" by host name: that is
  what makes COMM_TYPE_SHARED split per namespace (``/dev/shm`` itself is
  shared by both, which is harmless: segment names contain the host name).
* ``mpirun`` itself runs inside host a (with host name a), with
  ``--host a:N,b:N``; host a is recognised as local (name matches), so its
  ranks are forked directly. For host b, PRRTE calls the rsh agent
  (``--mca plm_rsh_agent AGENT``) as ``AGENT b "<shell command starting
  prted>"``. The agent, a small script generated per run, refuses any host
  that is not one of the two, enters namespace b with host name b and runs
  the command with ``sh -c`` (ssh semantics: the arguments are joined by
  spaces). ``prted`` inherits mpirun's environment through the agent and PRRTE
  adds the install prefix (PRTE_PREFIX, LD_LIBRARY_PATH) itself, so the venv's
  wheel works on b without ``--prefix``; variables given in ``env=`` are also
  forwarded with ``-x``.
* N hosts (``Hosts(count)``, bridge=True): host namespaces ``...a``,
  ``...b``, ``...c``, ... (at most 18: a-r) and one more namespace, the
  "switch" ``...s``, holding a Linux bridge ``br0``. Each host gets a veth
  pair created directly between its namespace and the switch's: ``v<host>``
  in the host (address ``<subnet>.<i+1>``/24 for the i-th host), its peer
  ``p<host>`` enslaved to ``br0``. All hosts share the one /24 and reach each
  other through the bridge (no STP, so ports forward at once; the switch's
  empty netfilter tables pass bridged frames). No process ever runs in the
  switch namespace; it is deleted (and with it the bridge and every veth
  pair) with the hosts. ``mpirun`` runs in host a with ``--host
  a:R,b:R,c:R,...`` (R ranks per host); the rsh agent accepts every host
  and nothing else (not the switch).
* MCA settings: ``btl=tcp,self,sm`` (``vader`` is ``sm`` in Open MPI 5);
  ``btl_tcp_if_include`` and ``oob_tcp_if_include`` = the veth subnet (so TCP
  goes over the veth, not lo); ``pml=ob1`` and ``osc=^ucx`` for the pip wheel;
  ``mpi_yield_when_idle=1``; plus ``--bind-to none``. The last two matter for
  speed: each namespace sees the machine's full set of cores, so by default
  both hosts bind their first rank to core 0, and two busy-polling ranks then
  share one core in 4 ms scheduler slices (the "flat 4 ms per message" seen
  before). Unbound, and yielding when idle (4 ranks on 2 cores), a 1-byte
  cross-host round trip takes ~30-40 us instead of 8 ms (2 ranks, one per
  host: ~27 us); a 10 KB float32 MPI_Allreduce over 2 x 2 ranks ~75-110 us.
  Without mpi_yield_when_idle, 4 spinning ranks on 2 cores crawl (a 300-
  iteration ping-pong did not finish in 60 s). All of it swings 10-100x
  when other jobs load the 2 cores.
* ``OMPI_ALLOW_RUN_AS_ROOT(_CONFIRM)=1`` (root), ``SHELL=/bin/sh`` (PRRTE
  builds the remote command for the local shell's syntax) and ``TMPDIR`` = a
  per-run directory, so PRRTE/PMIx session directories (``ompi.<pid>``,
  ``prted.<pid>``) land there and are removed with it.
* Clean-up (``close()``, run by ``__exit__`` and at interpreter exit): kill
  every process whose network namespace is one of ours (found through
  ``/proc/*/ns/net``, so also prted/ranks orphaned by a killed mpirun),
  SIGTERM then SIGKILL; ``ip netns del`` every host and the switch (deleting
  a namespace destroys its veth ends and so the pairs, and the bridge);
  remove ``/etc/netns/<name>``, ``/dev/shm`` entries whose name contains one
  of our host names (``sm_segment.<host>.*`` left by killed ranks) and the
  per-run temp directory. ``leftovers()`` reports anything that survived;
  ``cleanup_stale()`` removes namespaces of this naming scheme (switch
  included) whose creating process is dead (after a SIGKILL).

Requirements: root, Linux with network namespaces, veth (and bridge, for
``Hosts``), ``ip`` (Debian package ``iproute2``), ``unshare``
(``util-linux``), ``sh``, and Open MPI's ``mpirun`` (next to
``sys.executable`` first, then on PATH).
"""
from __future__ import annotations

import atexit
import ctypes
import functools
import glob
import itertools
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from typing import Iterable, Mapping, Sequence

from launch.errors import MpiNotFoundError
from launch.mpienv import find_mpirun, job_defaults, mpi_env

__all__ = [
    "Hosts",
    "TwoHosts",
    "can_make_namespaces",
    "cleanup_stale",
    "find_tool",
    "leftovers",
]

_PREFIX = "hm"
# namespace suffixes: hosts a, b, c, ... (at most 18), "s" the switch of a
# bridged run, "t" the throwaway probe
_HOST_SUFFIXES = "abcdefghijklmnopqr"
_SWITCH_SUFFIX = "s"
_NAME_RE = re.compile(rf"^{_PREFIX}(\d+)n(\d+)([a-t])$")
_SBIN = ("/usr/local/sbin", "/usr/local/bin", "/usr/sbin", "/usr/bin", "/sbin", "/bin")
_SEQ = itertools.count()
_LIVE: "set[Hosts]" = set()
_LOCK = threading.Lock()
_SET_HOSTNAME = 'echo "$0" > /proc/sys/kernel/hostname && exec "$@"'
_CLONE_NEWNET = 0x40000000


@functools.lru_cache(maxsize=1)
def _libc():
    return ctypes.CDLL(None, use_errno=True)


def find_tool(name: str) -> str | None:
    """Absolute path of a system tool: PATH first, then the sbin/bin dirs
    (pytest environments often lack /usr/sbin on PATH)."""
    found = shutil.which(name)
    if found:
        return found
    for d in _SBIN:
        p = os.path.join(d, name)
        if os.path.isfile(p) and os.access(p, os.X_OK):
            return p
    return None


def _mpirun() -> str | None:
    """launch's mpirun (next to ``sys.executable``, else on PATH), or None."""
    try:
        return find_mpirun()
    except MpiNotFoundError:
        return None


def _run(argv: Sequence[str], check: bool = True,
         timeout: float = 30) -> subprocess.CompletedProcess:
    proc = subprocess.run(list(argv), stdin=subprocess.DEVNULL, capture_output=True,
                          text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise RuntimeError(f"{shlex.join(argv)} failed ({proc.returncode}): {proc.stderr.strip()}")
    return proc


def _new_base() -> str:
    # hm<pid>n<seq>: at most 2+7+1+3 = 13 chars, +1 for the suffix (a, b, ..., s),
    # +1 for the "v"/"p" prefix of a veth end: 15, the interface name limit
    return f"{_PREFIX}{os.getpid()}n{next(_SEQ) % 1000}"


def _missing_prerequisite(need_mpirun: bool) -> str | None:
    """Why this process cannot make namespaces before trying (None: nothing missing)."""
    if not sys.platform.startswith("linux"):
        return f"network namespaces need Linux, not {sys.platform}"
    if os.geteuid() != 0:
        return "network namespaces need root (euid is %d)" % os.geteuid()
    if find_tool("ip") is None:
        return "`ip` not found (Debian package iproute2)"
    if find_tool("unshare") is None:
        return "`unshare` not found (Debian package util-linux)"
    if find_tool("sh") is None:
        return "`sh` not found"
    if need_mpirun and _mpirun() is None:
        return "mpirun not found next to sys.executable nor on PATH"
    return None


def _try_namespace(ip: str, unshare: str, bridge: bool = False) -> tuple[bool, str]:
    """Make a throwaway namespace with a veth pair and a private host name
    (and a bridge with one veth end enslaved, if ``bridge``), then delete it."""
    name = _new_base() + "t"
    try:
        proc = _run([ip, "netns", "add", name], check=False)
        if proc.returncode != 0:
            return False, f"`ip netns add` failed: {proc.stderr.strip()}"
        steps = [
            [ip, "-n", name, "link", "set", "lo", "up"],
            [ip, "-n", name, "link", "add", "tva", "type", "veth", "peer", "name", "tvb"],
            [ip, "netns", "exec", name, unshare, "--uts", "sh", "-c",
             'echo "$0" > /proc/sys/kernel/hostname'
             ' && test "$(cat /proc/sys/kernel/hostname)" = "$0"',
             name],
        ]
        if bridge:
            steps += [
                [ip, "-n", name, "link", "add", "tbr", "type", "bridge"],
                [ip, "-n", name, "link", "set", "tvb", "master", "tbr"],
                [ip, "-n", name, "link", "set", "tbr", "up"],
            ]
        for argv in steps:
            proc = _run(argv, check=False)
            if proc.returncode != 0:
                return False, f"`{shlex.join(argv[:6])} ...` failed: {proc.stderr.strip()}"
    except (OSError, subprocess.TimeoutExpired) as exc:
        return False, f"namespace probe failed: {exc}"
    finally:
        subprocess.run([ip, "netns", "del", name], capture_output=True)
    return True, "ok"


@functools.lru_cache(maxsize=None)
def _probe(need_mpirun: bool, bridge: bool = False) -> tuple[bool, str]:
    missing = _missing_prerequisite(need_mpirun)
    if missing is not None:
        return False, missing
    return _try_namespace(find_tool("ip"), find_tool("unshare"), bridge)


def can_make_namespaces(need_mpirun: bool = True, bridge: bool = False) -> tuple[bool, str]:
    """(True, "ok") if this process can build TwoHosts: Linux, root, ``ip``,
    ``unshare``, (``mpirun``), and a throwaway namespace with a veth pair and
    a private host name really works; with ``bridge``, also a Linux bridge
    (what ``Hosts`` needs). Otherwise (False, reason) for
    ``pytest.skip(reason)``. Cached."""
    return _probe(need_mpirun, bridge)


def _netns_inode(name: str) -> int | None:
    try:
        return os.stat(f"/run/netns/{name}").st_ino
    except OSError:
        return None


def _pids_in(inodes: Iterable[int]) -> list[int]:
    """Pids of live processes whose network namespace inode is in inodes."""
    want = {f"net:[{i}]" for i in inodes if i}
    if not want:
        return []
    me = os.getpid()
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == me:
            continue
        try:
            if os.readlink(f"/proc/{entry}/ns/net") in want:
                pids.append(int(entry))
        except OSError:
            continue  # gone, zombie, or not ours to read
    return pids


def _kill_all(inodes: Iterable[int], grace_s: float = 2.0) -> list[int]:
    """SIGTERM, then SIGKILL, every process in these namespaces. Returns the
    pids still alive afterwards (should be [])."""
    inodes = list(inodes)
    for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
        pids = _pids_in(inodes)
        if not pids:
            return []
        for pid in pids:
            try:
                os.kill(pid, sig)
            except OSError:
                pass
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            if not _pids_in(inodes):
                return []
            time.sleep(0.05)
    return _pids_in(inodes)


def _shm_entries(names: Iterable[str]) -> list[str]:
    pats = [re.compile(rf"(?<![A-Za-z0-9]){re.escape(n)}(?![A-Za-z0-9])") for n in names]
    try:
        entries = os.listdir("/dev/shm")
    except OSError:
        return []
    return [os.path.join("/dev/shm", e) for e in entries if any(p.search(e) for p in pats)]


def _netns_list(ip: str) -> list[str]:
    proc = subprocess.run([ip, "netns", "list"], capture_output=True, text=True)
    return [line.split()[0] for line in proc.stdout.splitlines() if line.strip()]


def leftovers(names: Sequence[str], inodes: Sequence[int] = (), tmpdir: str | None = None) -> dict:
    """What is left of a TwoHosts/Hosts run (empty dict = clean): namespaces
    still listed, /etc/netns dirs, processes in its namespaces, links named
    like its veth ends (``v<name>``, ``p<name>``) in the root namespace,
    /dev/shm entries, its temp dir. ``names``: every namespace of the run,
    the switch included."""
    ip = find_tool("ip") or "ip"
    left: dict = {}
    ns = [n for n in _netns_list(ip) if n in names]
    if ns:
        left["namespaces"] = ns
    etc = [f"/etc/netns/{n}" for n in names if os.path.exists(f"/etc/netns/{n}")]
    if etc:
        left["etc_netns"] = etc
    pids = _pids_in(inodes)
    if pids:
        left["pids"] = pids
    links = [f"{v}{n}" for n in names for v in "vp" if os.path.exists(f"/sys/class/net/{v}{n}")]
    if links:
        left["links"] = links
    shm = _shm_entries(names)
    if shm:
        left["dev_shm"] = shm
    if tmpdir and os.path.exists(tmpdir):
        left["tmpdir"] = tmpdir
    return left


def cleanup_stale() -> list[str]:
    """Delete what runs of this module left behind when their process died
    without cleaning up (e.g. SIGKILL): namespaces named ``hm<pid>n<seq>[a-t]``
    (hosts a-r, switch s, probe t) whose <pid> no longer exists, with their
    processes, /etc/netns dirs, /dev/shm entries and temp dirs. Returns the names removed."""
    ip = find_tool("ip")
    if ip is None or os.geteuid() != 0:
        return []
    names = set(_netns_list(ip))
    try:
        names |= set(os.listdir("/etc/netns"))
    except OSError:
        pass
    tmp = tempfile.gettempdir()
    tmpdirs: dict[str, list[str]] = {}
    for d in glob.glob(os.path.join(tmp, f"netns-{_PREFIX}*-*")):
        base = os.path.basename(d).split("-")[1]
        tmpdirs.setdefault(base, []).append(d)
        names |= {base + "a", base + "b"}
    stale = []
    for name in sorted(names):
        m = _NAME_RE.match(name)
        if not m or int(m.group(1)) == os.getpid():
            continue
        try:
            os.kill(int(m.group(1)), 0)
            continue  # creator alive: not ours to touch
        except ProcessLookupError:
            pass
        except PermissionError:
            continue
        _kill_all([_netns_inode(name)], grace_s=0.5)
        subprocess.run([ip, "netns", "del", name], capture_output=True)
        shutil.rmtree(f"/etc/netns/{name}", ignore_errors=True)
        for p in _shm_entries([name]):
            _rm(p)
        for d in tmpdirs.pop(name[:-1], []):
            shutil.rmtree(d, ignore_errors=True)
        stale.append(name)
    return stale


def _rm(path: str) -> None:
    try:
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path, ignore_errors=True)
        else:
            os.unlink(path)
    except OSError:
        pass


_AGENT = """#!/bin/sh
# rsh agent for Open MPI (--mca plm_rsh_agent), generated by tests/support/netns.py.
# Called by PRRTE as: agent [options] HOST COMMAND...; runs COMMAND (joined by
# spaces, like ssh) with sh inside network namespace HOST, host name HOST.
while [ $# -gt 0 ]; do case "$1" in -*) shift ;; *) break ;; esac; done
host="$1"; shift
case "$host" in
  {hosts}) ;;
  *) echo "netns rsh agent: refusing host '$host' (not one of: {hosts})" >&2; exit 255 ;;
esac
exec {ip} netns exec "$host" {unshare} --uts /bin/sh -c \\
  'echo "$0" > /proc/sys/kernel/hostname && {own_shm}exec /bin/sh -c "$1"' "$host" "$*"
"""
# a /dev/shm of its own for every host but a (where mpirun runs), as on separate
# machines (TwoHosts(own_shm=True): host b's): a fresh tmpfs in the mount namespace
# `ip netns exec` made for this command, seen by it and its children only
_OWN_SHM = ('case "$0" in {others}) '
            'mount -t tmpfs -o mode=1777,size=1g harmpi-netns /dev/shm ;; esac && ')



class Hosts:
    """``count`` network-namespace "hosts" on this machine; see the module docstring.

    ``bridge=True`` (the default): the hosts hang off a Linux bridge in a
    separate "switch" namespace (``switch``); ``bridge=False`` (``count`` must
    be 2): one veth pair joins the two hosts directly (``TwoHosts``).

    Attributes (valid inside the ``with`` block): ``names`` (host a, b, ...;
    also the namespace names), ``addresses`` (same order), ``switch`` (the
    switch namespace's name, None without a bridge), ``count``, ``cidr``,
    ``tmpdir``, ``agent`` (the rsh agent path), ``mpirun_path``.
    """

    def __init__(self, count: int, ranks_per_host: int = 1, *, subnet: str = "10.213.7",
                 mpirun: str | None = None, own_shm: bool = False,
                 bridge: bool = True) -> None:
        if not 2 <= count <= len(_HOST_SUFFIXES):
            raise ValueError(f"count must be 2 to {len(_HOST_SUFFIXES)}, not {count}")
        if not bridge and count != 2:
            raise ValueError("without a bridge only 2 hosts (one veth pair) can be joined")
        if ranks_per_host < 1:
            raise ValueError("ranks_per_host must be >= 1")
        if not re.fullmatch(r"10\.\d{1,3}\.\d{1,3}", subnet):
            raise ValueError("subnet must be the first three octets of a private 10.x.y.0/24")
        self.count = count
        self.bridge = bridge
        self.ranks_per_host = ranks_per_host
        self.own_shm = own_shm
        self.subnet = subnet
        self.cidr = f"{subnet}.0/24"
        self.addresses: tuple[str, ...] = tuple(f"{subnet}.{i + 1}" for i in range(count))
        self.mpirun_path = mpirun or _mpirun()
        self.names: tuple[str, ...] = ("",) * count
        self.switch: str | None = None
        self.tmpdir: str | None = None
        self.agent: str | None = None
        self._inodes: list[int] = []
        self._ip = find_tool("ip")
        self._unshare = find_tool("unshare")
        self._open = False
        self._last_cleanup: dict = {}

    # ---- lifecycle -------------------------------------------------------
    def __enter__(self) -> "Hosts":
        self.open()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _namespaces(self) -> list[str]:
        """Every namespace of this run: the hosts, then the switch (if any)."""
        return [n for n in (*self.names, self.switch) if n]

    def open(self) -> "Hosts":
        ok, reason = can_make_namespaces(need_mpirun=False, bridge=self.bridge)
        if not ok:
            raise RuntimeError(f"cannot make network namespaces: {reason}")
        cleanup_stale()
        base = _new_base()
        self.names = tuple(base + s for s in _HOST_SUFFIXES[:self.count])
        self.switch = base + _SWITCH_SUFFIX if self.bridge else None
        with _LOCK:
            _LIVE.add(self)
        self._open = True
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def _build(self) -> None:
        ip = self._ip
        a = self.names[0]
        self.tmpdir = tempfile.mkdtemp(prefix=f"netns-{a[:-1]}-")
        os.mkdir(os.path.join(self.tmpdir, "tmp"))
        for n in self._namespaces():
            _run([ip, "netns", "add", n])
            self._inodes.append(_netns_inode(n))
        if self.switch is None:
            b = self.names[1]
            _run([ip, "link", "add", f"v{a}", "netns", a, "type", "veth",
                  "peer", "name", f"v{b}", "netns", b])
        else:
            sw = self.switch
            _run([ip, "-n", sw, "link", "add", "br0", "type", "bridge"])
            _run([ip, "-n", sw, "link", "set", "br0", "up"])
            for n in self.names:
                # both ends made directly in their namespaces: never in the root one
                _run([ip, "link", "add", f"v{n}", "netns", n, "type", "veth",
                      "peer", "name", f"p{n}", "netns", sw])
                _run([ip, "-n", sw, "link", "set", f"p{n}", "master", "br0"])
                _run([ip, "-n", sw, "link", "set", f"p{n}", "up"])
        for n, addr in zip(self.names, self.addresses):
            _run([ip, "-n", n, "link", "set", "lo", "up"])
            _run([ip, "-n", n, "addr", "add", f"{addr}/24", "dev", f"v{n}"])
            _run([ip, "-n", n, "link", "set", f"v{n}", "up"])
        hosts = ("127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost ip6-loopback\n"
                 + "".join(f"{addr}\t{n}\n" for n, addr in zip(self.names, self.addresses)))
        for n in self.names:
            d = f"/etc/netns/{n}"
            for attempt in range(5):  # another run may rmdir /etc/netns meanwhile
                try:
                    os.makedirs(d, exist_ok=True)
                    with open(f"{d}/hosts", "w") as f:
                        f.write(hosts)
                    break
                except FileNotFoundError:
                    if attempt == 4:
                        raise
                    time.sleep(0.05)
        self.agent = os.path.join(self.tmpdir, "rsh_agent.sh")
        with open(self.agent, "w") as f:
            own_shm = (_OWN_SHM.format(others="|".join(self.names[1:]))
                       if self.own_shm else "")
            f.write(_AGENT.format(hosts="|".join(self.names), ip=shlex.quote(ip),
                                  unshare=shlex.quote(self._unshare), own_shm=own_shm))
        os.chmod(self.agent, 0o755)

    def close(self) -> dict:
        """Delete everything (idempotent). Returns ``leftovers()`` (should be
        {}), also kept in ``last_cleanup``."""
        if not self._open:
            return self._last_cleanup
        ip = self._ip
        try:
            _kill_all(self._inodes)
        finally:
            # the hosts, then the switch (deleting it drops the bridge and
            # whatever veth ends are left on it)
            for n in self._namespaces():
                subprocess.run([ip, "netns", "del", n], capture_output=True)
            for n in self._namespaces():
                # only if creation failed half-way in the root namespace
                for v in "vp":
                    if os.path.exists(f"/sys/class/net/{v}{n}"):
                        subprocess.run([ip, "link", "del", f"{v}{n}"], capture_output=True)
                shutil.rmtree(f"/etc/netns/{n}", ignore_errors=True)
            try:
                os.rmdir("/etc/netns")  # only if empty; other runs may use it
            except OSError:
                pass
            for p in _shm_entries(self._namespaces()):
                _rm(p)
            if self.tmpdir:
                shutil.rmtree(self.tmpdir, ignore_errors=True)
            self._open = False
            with _LOCK:
                _LIVE.discard(self)
            self._last_cleanup = self.leftovers()
        return self._last_cleanup

    @property
    def last_cleanup(self) -> dict:
        return self._last_cleanup

    def leftovers(self) -> dict:
        return leftovers(self._namespaces(), self._inodes, self.tmpdir)

    # ---- running things --------------------------------------------------
    def pids(self) -> list[int]:
        """Pids of all processes currently inside any host (or the switch)."""
        return _pids_in(self._inodes)

    def veth_bytes(self) -> dict[str, tuple[int, int]]:
        """{host: (rx_bytes, tx_bytes)} of each host's veth end (towards the
        other host, or the bridge): proof that traffic really crossed between
        the hosts."""
        out = {}
        for n in self.names:
            stats = f"/sys/class/net/v{n}/statistics"
            proc = _run([self._ip, "netns", "exec", n, "cat", f"{stats}/rx_bytes",
                         f"{stats}/tx_bytes"])
            rx, tx = (int(x) for x in proc.stdout.split())
            out[n] = (rx, tx)
        return out

    def host_argv(self, host: str, argv: Sequence[str]) -> list[str]:
        """argv that runs ``argv`` inside ``host`` with its host name set."""
        if host not in self.names:
            raise ValueError(f"unknown host {host!r}; hosts are {self.names}")
        return [self._ip, "netns", "exec", host, self._unshare, "--uts",
                "/bin/sh", "-c", _SET_HOSTNAME, host, *argv]

    def call_in(self, host: str, fn, *args, **kwargs):
        """``fn(*args, **kwargs)`` in a thread that entered ``host``'s network
        namespace (setns: a thread's own sockets then belong to that host; the
        rest of this process stays where it is). Returns or raises what fn does."""
        if host not in self.names:
            raise ValueError(f"unknown host {host!r}; hosts are {self.names}")
        out: dict = {}

        def body() -> None:
            try:
                fd = os.open(f"/run/netns/{host}", os.O_RDONLY)
                try:
                    if _libc().setns(fd, _CLONE_NEWNET) != 0:
                        err = ctypes.get_errno()
                        raise OSError(err, f"setns into {host}: {os.strerror(err)}")
                finally:
                    os.close(fd)
                out["value"] = fn(*args, **kwargs)
            except BaseException as exc:  # handed to the caller's thread
                out["error"] = exc

        t = threading.Thread(target=body, name=f"in-{host}", daemon=True)
        t.start()
        t.join()
        if "error" in out:
            raise out["error"]
        return out["value"]

    def run(self, host: str, argv: Sequence[str], timeout_s: float = 30,
            env: Mapping[str, str] | None = None) -> subprocess.CompletedProcess:
        """Run a plain command inside one host (no MPI)."""
        return self._spawn(self.host_argv(host, argv), timeout_s, self.env(env), None)

    def default_mca(self) -> dict[str, str]:
        mca = {
            "plm_rsh_agent": self.agent,
            "btl": "tcp,self,sm",
            "btl_tcp_if_include": self.cidr,
            "oob_tcp_if_include": self.cidr,
        }
        # pml ob1, osc ^ucx, mpi_yield_when_idle 1: the launcher's job settings
        prefix = "OMPI_MCA_"
        mca.update((name[len(prefix):], value) for name, value in job_defaults().items()
                   if name.startswith(prefix))
        return mca

    def mpirun_argv(self, argv: Sequence[str], np: int | None = None, *,
                    mca: Mapping[str, str | None] | None = None,
                    extra_args: Sequence[str] = (), env_keys: Iterable[str] = (),
                    bind_to: str | None = "none") -> list[str]:
        """The full command line (``ip netns exec A unshare ... mpirun ...``).
        ``mca`` entries override the defaults; a None value drops one."""
        if not self._open:
            raise RuntimeError(f"{type(self).__name__} is not open")
        if self.mpirun_path is None:
            raise RuntimeError("mpirun not found next to sys.executable nor on PATH")
        rph = self.ranks_per_host
        np = self.count * rph if np is None else np
        settings = self.default_mca()
        settings.update(mca or {})
        cmd = [self.mpirun_path, "--host", ",".join(f"{n}:{rph}" for n in self.names),
               "-np", str(np)]
        for k, v in settings.items():
            if v is not None:
                cmd += ["--mca", k, str(v)]
        if bind_to is not None:
            cmd += ["--bind-to", bind_to]
        for k in env_keys:
            cmd += ["-x", k]
        cmd += list(extra_args)
        cmd += list(argv)
        return self.host_argv(self.names[0], cmd)

    def mpirun(self, argv: Sequence[str], np: int | None = None, *, timeout_s: float = 120,
               env: Mapping[str, str] | None = None, mca: Mapping[str, str | None] | None = None,
               extra_args: Sequence[str] = (), bind_to: str | None = "none",
               cwd: str | None = None, check: bool = False) -> subprocess.CompletedProcess:
        """Run ``argv`` (e.g. ``[sys.executable, "script.py"]``) as an MPI job
        of ``np`` ranks (default count x ranks_per_host) over the hosts.

        ``env`` is added to this process's environment and forwarded to every
        rank (``-x``). Leftover processes of the job are killed afterwards. On
        timeout all are killed and subprocess.TimeoutExpired is raised."""
        full = self.mpirun_argv(argv, np, mca=mca, extra_args=extra_args,
                                env_keys=list(env or {}), bind_to=bind_to)
        proc = self._spawn(full, timeout_s, self.env(env), cwd)
        if check:
            proc.check_returncode()
        return proc

    def env(self, extra: Mapping[str, str] | None = None) -> dict[str, str]:
        """The environment a process started in a host gets (Open MPI's
        settings, root allowed, the per-run TMPDIR, mpirun's directory first on
        PATH), updated by ``extra``."""
        # root allowed (and the MCA settings of default_mca(), which win)
        env = mpi_env(extra={"SHELL": "/bin/sh", "TMPDIR": os.path.join(self.tmpdir, "tmp")})
        # mpirun must come from the wheel / PATH we chose, and prted on the
        # other hosts from the same prefix: keep the venv's bin first on PATH.
        if self.mpirun_path:
            bindir = os.path.dirname(self.mpirun_path)
            env["PATH"] = bindir + os.pathsep + env.get("PATH", "")
        # an inherited exclude list would clash with our *_if_include
        for key in ("OMPI_MCA_btl_tcp_if_exclude", "OMPI_MCA_oob_tcp_if_exclude",
                    "PRTE_MCA_oob_tcp_if_exclude"):
            env.pop(key, None)
        env.update(extra or {})
        return env

    def _spawn(self, argv: list[str], timeout_s: float, env: dict, cwd: str | None
               ) -> subprocess.CompletedProcess:
        p = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, env=env, cwd=cwd,
                             start_new_session=True)
        try:
            out, err = p.communicate(timeout=timeout_s)
        except BaseException as exc:  # timeout, KeyboardInterrupt, ...
            _kill_all(self._inodes, grace_s=1.0)
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except OSError:
                pass
            out, err = p.communicate()
            if isinstance(exc, subprocess.TimeoutExpired):
                raise subprocess.TimeoutExpired(argv, timeout_s, out, err) from None
            raise
        # a clean mpirun leaves nothing; a failed one may leave prted/ranks
        _kill_all(self._inodes, grace_s=1.0)
        return subprocess.CompletedProcess(argv, p.returncode, out, err)


class TwoHosts(Hosts):
    """Two network-namespace "hosts" joined directly by one veth pair (no
    bridge, no switch namespace); see the module docstring.

    Attributes (valid inside the ``with`` block): ``names`` (host a, host b;
    also the namespace names), ``addresses``, ``cidr``, ``tmpdir``,
    ``agent`` (the rsh agent path), ``mpirun_path``.
    """

    def __init__(self, ranks_per_host: int = 2, *, subnet: str = "10.213.7",
                 mpirun: str | None = None, own_shm: bool = False) -> None:
        super().__init__(2, ranks_per_host, subnet=subnet, mpirun=mpirun,
                         own_shm=own_shm, bridge=False)


@atexit.register
def _close_all() -> None:
    with _LOCK:
        live = list(_LIVE)
    for h in live:
        try:
            h.close()
        except Exception:
            pass
