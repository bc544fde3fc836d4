"""harmpi_vllm.keeper's clean-up of /dev/shm once the engine is gone, without
vLLM: an "engine" process maps two /dev/shm files, the keeper runs a
stand-in for mpirun that ends by itself, then the engine is SIGKILLed (as
vLLM's API server kills it on Ctrl-C) and its pipe to the keeper closes.
The engine's file that nothing maps any more is removed (a resource
tracker that died with the engine would leave it); the one another live
process still maps is kept. (The whole path, under vllm serve:
tests/test_vllm_serve.py.)"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid

import pytest
from support import REPO

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux") or
                                not os.path.isdir("/dev/shm"), reason="Linux /dev/shm")

#: maps each file named on its command line, says so, then sleeps
MAPPER = """
import mmap, os, sys, time
maps = []
for path in sys.argv[1:]:
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    os.ftruncate(fd, 4096)
    maps.append(mmap.mmap(fd, 4096))
print("mapped", flush=True)
time.sleep(120)
"""


def _mapper(*paths):
    proc = subprocess.Popen([sys.executable, "-c", MAPPER, *paths], stdout=subprocess.PIPE,
                            text=True)
    assert proc.stdout.readline().strip() == "mapped"
    return proc


class Events:
    """The keeper's event lines (one pipe, read on as each is awaited)."""

    def __init__(self, fd):
        self.fd, self.buffered, self.lines = fd, b"", []

    def until(self, prefix, limit_s=60.0):
        """Every line so far, once one that starts with ``prefix`` has come."""
        end = time.monotonic() + limit_s
        while not any(line.startswith(prefix) for line in self.lines):
            if time.monotonic() > end:
                raise AssertionError(f"no {prefix!r} from the keeper: {self.lines}")
            chunk = os.read(self.fd, 4096)
            if not chunk:
                raise AssertionError(f"the keeper ended before {prefix!r}: {self.lines}")
            self.buffered += chunk
            *done, self.buffered = self.buffered.split(b"\n")
            self.lines += [line.decode() for line in done]
        return self.lines


def test_the_dead_engines_files_that_nothing_maps_are_removed():
    tag = uuid.uuid4().hex[:8]
    own, shared = f"/dev/shm/harmpi-test-engine-{tag}", f"/dev/shm/harmpi-test-shared-{tag}"
    engine = _mapper(own, shared)
    other = _mapper(shared)          # a live process outside the job still maps this one
    read_fd, write_fd = os.pipe()
    env = dict(os.environ, PYTHONPATH=str(REPO))
    keeper = subprocess.Popen(
        [sys.executable, "-m", "harmpi_vllm.keeper", str(engine.pid), str(write_fd), "--",
         sys.executable, "-c", "import time; time.sleep(0.5)"],  # mpirun's stand-in
        stdin=subprocess.PIPE, pass_fds=(write_fd,), env=env)
    os.close(write_fd)
    try:
        keeper.wait(30)               # its parent returns at once: the keeper forked away
        events = Events(read_fd)
        events.until("exit ")         # mpirun's stand-in ended: the engine's files were seen
        engine.send_signal(signal.SIGKILL)
        engine.wait(30)
        keeper.stdin.close()          # the engine's end of the pipe: gone with it
        said = events.until("stopped")
        assert not os.path.exists(own), said
        assert os.path.exists(shared), said
        assert f"forced removed {own}" in said, said
    finally:
        os.close(read_fd)
        for proc in (engine, other):
            proc.kill()
            proc.wait()
        for path in (own, shared):
            if os.path.exists(path):
                os.unlink(path)
