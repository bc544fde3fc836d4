"""harmpi's SIGINT handler (registry.SigintWatch, issue 35 #4) in one
process: while harmpi reads its signal wakeup pipe, SIGINT's Python-level
handler empties the pipe and then runs the handler it stands in front of,
so a Ctrl-C the program handles itself leaves no byte for a later wait to
take as an interrupt. finalize, MPI_Finalize and fork give the program its
own handler and the wakeup fd back. (Between ranks:
tests/mpi/test_handled_sigint.py.)"""

import signal
import subprocess
import sys
import textwrap

import pytest
from support.jobs import shm_env

pytestmark = pytest.mark.timeout(240)

CODE = """
    import os, signal, time, harmpi
    from mpi4py import MPI
    from harmpi.runtime.registry import STATE, DrainFirst

    def ctrl_c():
        try:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(5)
        except KeyboardInterrupt:
            return "raised"
        return "returned"

    def pipe():
        try:
            return f"{len(os.read(STATE.sigint.fd, 64))} bytes left"
        except BlockingIOError:
            return "empty"

    def front_of(handler):
        h = signal.getsignal(signal.SIGINT)
        return isinstance(h, DrainFirst) and h.handler is handler

    harmpi.init()
    print("default:", front_of(signal.default_int_handler), ctrl_c(), pipe())
    harmpi.finalize()
    print("finalized:", signal.getsignal(signal.SIGINT) is signal.default_int_handler,
          signal.set_wakeup_fd(-1))
    harmpi.init()                      # a new set-up watches again
    print("again:", front_of(signal.default_int_handler), ctrl_c(), pipe())
    seen = []
    def own(signum, frame):
        seen.append(signum)
    signal.signal(signal.SIGINT, own)  # the program's own, after harmpi's
    os.kill(os.getpid(), signal.SIGINT)
    print("own, unseen:", seen == [signal.SIGINT], pipe())
    comm = MPI.COMM_WORLD.Dup()
    harmpi.init(comm)                  # the next set-up stands in front of it
    os.kill(os.getpid(), signal.SIGINT)
    print("own, in front:", front_of(own), len(seen), pipe())
    pid = os.fork()
    if pid == 0:                       # a child's signals are not its parent's
        os._exit(0 if signal.getsignal(signal.SIGINT) is own
                 and signal.set_wakeup_fd(-1) == -1 else 1)
    print("child:", os.waitpid(pid, 0)[1])
    MPI.Finalize()
    print("finalized MPI:", signal.getsignal(signal.SIGINT) is own, signal.set_wakeup_fd(-1))
"""


def test_harmpis_sigint_handler_drains_the_pipe_and_steps_aside(tmp_path):
    env, _ = shm_env(tmp_path)
    # a program whose Ctrl-C is live: a shell's background job (make test
    # under `nohup ... &`) inherits SIGINT ignored, which Python keeps and
    # harmpi leaves alone (and then this test failed: "default: False")
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(CODE)], env=env,
                          capture_output=True, text=True, timeout=180,
                          preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    assert proc.returncode == 0, (proc.stdout, proc.stderr[-2000:])
    assert proc.stdout.splitlines() == [
        "default: True raised empty",
        "finalized: True -1",
        "again: True raised empty",
        "own, unseen: True 1 bytes left",   # documented: a handler put after harmpi's
        "own, in front: True 2 empty",
        "child: 0",
        "finalized MPI: True -1",
    ], proc.stdout + proc.stderr[-2000:]
