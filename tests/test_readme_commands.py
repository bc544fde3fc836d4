"""The README's shell commands run as written (issue 22).

Every fenced block of README.md is one of:

- marked ``<!-- readme-test: skip: REASON -->`` on the line before it: not run
  here, for the reason given (hardware that is not here, another named test
  runs it, example output, a Python fragment);
- marked ``<!-- readme-test: file NAME -->``: a script the commands use, saved
  as NAME in the directory they run in;
- marked ``<!-- readme-test: prologue -->``: the exports every ``mpirun`` line
  assumes; each command runs after them, in the same shell;
- unmarked: a shell block, each command of which has an entry in
  :data:`COMMANDS`, the sign that it did its job (a line of its output) or,
  for a command of a block that is otherwise run, why it is not.

A block or command with neither fails :func:`test_every_block_is_run_or_marked`,
so a command added to the README cannot go untested unnoticed. Commands run
with ``bash -c`` exactly as the README spells them, with what a reader has
after ``make setup``: the venv's ``bin`` first on PATH, none of this process's
MPI, harmpi or torchrun variables, the numba cache warm (``make setup``
precompiles; so does :func:`scratch` here, so that a cold cache is not charged
to the first command's time limit).
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
from support import REPO  # noqa: E402 (the checkout, one definition)
from support.jobs import STARTUP_PER_RANK_S, STARTUP_S

README = REPO / "README.md"
SCRIPTS = Path(__file__).resolve().parent / "readme_scripts"  # files the README leaves to you
# run_shell's limit, scaled by the load, ends a command first; the precompile of
# :func:`scratch` (minutes on a cold cache) is inside the first test that uses it
pytestmark = pytest.mark.timeout(3600)
MARK = re.compile(r"<!-- readme-test: (skip: .+|file \S+|prologue) -->$")
FENCE = re.compile(r"^```(\w*)\s*$")


@dataclass(frozen=True)
class Block:
    line: int          # 1-based line of the opening fence
    lang: str
    text: str
    mark: str | None   # "skip: ...", "file NAME", "prologue" or None

    @property
    def first(self) -> str:
        return self.text.splitlines()[0] if self.text else ""


def readme_blocks(text: str) -> list[Block]:
    """The fenced blocks of a markdown text, each with the marker on the line before."""
    blocks, lines, i = [], text.splitlines(), 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        end = next((j for j in range(i + 1, len(lines)) if lines[j].rstrip() == "```"), None)
        assert end is not None, f"README.md:{i + 1}: a fence that is never closed"
        mark = MARK.match(lines[i - 1].strip()) if i else None
        blocks.append(Block(i + 1, m.group(1), "\n".join(lines[i + 1:end]),
                            mark.group(1) if mark else None))
        i = end + 1
    return blocks


def block_commands(block: Block) -> list[str]:
    """A shell block's commands: its lines (a trailing backslash joins the next),
    without blank and comment-only lines."""
    commands, pending = [], ""
    for line in block.text.splitlines():
        pending += line
        if pending.endswith("\\"):
            pending = pending[:-1] + " "
            continue
        if pending.strip() and not pending.lstrip().startswith("#"):
            commands.append(pending)
        pending = ""
    return commands


def command_key(command: str) -> str:
    """A command's words without its comment: how :data:`COMMANDS` names it."""
    return " ".join(shlex.split(command, comments=True))


# --------------------------------------------------------------------------
# What each command of a run block must show
# --------------------------------------------------------------------------


@dataclass(frozen=True)
class Run:
    """Run it in ``where`` ("scratch": a directory holding the README's scripts;
    "checkout": the repository, as the benchmarks need), exit 0, and print
    every regex of ``signs`` (multiline; stdout and stderr together): the first
    ``count`` times (once per rank), the others once. ``np``: the ranks it
    starts and ``work_s`` its seconds of work on a quiet 2-core machine, besides
    start-up: its time limit (:func:`time_limit_s`)."""
    signs: tuple[str, ...]
    where: str = "scratch"
    np: int = 2
    work_s: float = 10.0
    count: int = 1
    same: bool = False  # the first sign's group 1 is the same in every match (every rank's sum)


@dataclass(frozen=True)
class NotRun:
    reason: str


TAG = r"^(?:\[\d+,\d+\]<stdout>: ?)?"  # harmpi-launch tags each rank's lines by default
QUICK_START = TAG + r"{nodes} (\S+) torch\.Size\(\[{np}, 4096\]\)$"
TP_SCRIPT = TAG + r"my_tp_script: rank \d/2 .*: all_reduce sum 3, expected 3: ok$"


def _decode_rows(*comms: str) -> tuple[str, ...]:
    # a table row per backend: tok/s first, "yes" (every rank generated the same tokens) last
    return tuple(rf"^{re.escape(c)}\s+\d+\.\d+\s.*\syes$" for c in comms)


COMMANDS: dict[str, Run | NotRun] = {
    # Quick start: decode_step.py is the README's script (its "file" marker)
    "harmpi-launch -np 2 -- python decode_step.py":
        Run((QUICK_START.format(nodes=1, np=2),), count=2, same=True),
    "harmpi-launch -np 4 --virtual-nodes 2 --oversubscribe -- python decode_step.py":
        Run((QUICK_START.format(nodes=2, np=4),), np=4, count=4, same=True),
    "mpirun -np 2 --map-by numa python -m mpi4py decode_step.py":
        Run((QUICK_START.format(nodes=1, np=2),), count=2, same=True),
    # Launcher: my_tp_script.py is tests/readme_scripts/my_tp_script.py
    "harmpi-launch -np 2 -- python my_tp_script.py": Run((TP_SCRIPT,), count=2),
    "harmpi-launch --nproc-per-node 2 my_tp_script.py": Run((TP_SCRIPT,), count=2),
    "harmpi-launch --standalone --nnodes 1 --nproc_per_node 2 my_tp_script.py":
        Run((TP_SCRIPT,), count=2),
    "harmpi-launch info -np 4":
        Run((r"^Plan for -np 4$", r"^  4 ranks on this host; per host: 4 ranks, "),
            np=0, work_s=1),
    "harmpi-launch -np 4 --virtual-nodes 2 --oversubscribe --dry-run -- python bench.py":
        Run((r"^export HARMPI_RANKS_PER_NODE=2$",
             r"mpirun -np 4 .*python -m harmpi\.run bench\.py$"),
            np=0, work_s=1),
    # Benchmarks
    "mpirun -np 2 python -m mpi4py -m bench.osu_allreduce --impl "
    "harmpi,torch:harmpi,mpi,gloo,gloo:unbound --stat median -f -c":
        Run((r"^# Validation: all Pass$",
             *(rf"^# {re.escape(i)}\n# Size .*\n(?:\d+ .*\n)*10240 .* Pass$"
               for i in ("harmpi", "torch:harmpi", "mpi", "gloo", "gloo:unbound"))),
            where="checkout", work_s=30),
    "mpirun -np 4 --oversubscribe python -m mpi4py -m bench.osu_allgather --impl harmpi,mpi":
        Run((r"^#\s+harmpi\s+mpi\s+/harmpi$", r"^10240\s+\d+\.\d+\s+\d+\.\d+\s+\d+\.\d+$"),
            where="checkout", np=4, work_s=40),
    "mpirun -np 4 --oversubscribe python -m mpi4py -m bench.decode "
    "--comm harmpi,torch:harmpi,gloo,mpi --tokens 32 --rounds 2":
        Run(_decode_rows("harmpi", "torch:harmpi", "gloo", "mpi"),
            where="checkout", np=4, work_s=40),
    "mpirun -np 2 python -m mpi4py -m bench.decode --tp-api --comm torch:harmpi,gloo "
    "--tokens 32 --rounds 2":
        Run(_decode_rows("torch:harmpi", "gloo"), where="checkout", work_s=40),
    "python -m bench.demo":
        NotRun("what make demo runs (minutes); its parts: tests/test_demo_units.py, "
               "tests/test_output_width.py"),
    "mpirun -np 2 python -m mpi4py -m tests.stress.soak":
        NotRun("a soak: 10^6 calls by design; tests/test_soak.py::test_soak_under_mpirun "
               "runs tests.stress.soak under mpirun with 3000"),
}


def _blocks() -> list[Block]:
    return readme_blocks(README.read_text())


def _run_commands() -> list[tuple[Block, str]]:
    return [(b, c) for b in _blocks() if b.mark is None for c in block_commands(b)
            if isinstance(COMMANDS.get(command_key(c)), Run)]


def test_every_block_is_run_or_marked():
    blocks = _blocks()
    problems = []
    for b in blocks:
        if b.mark is None and b.lang not in ("", "sh", "bash", "shell"):
            problems.append(f"README.md:{b.line}: a {b.lang} block without a marker "
                            f"(<!-- readme-test: skip: REASON --> or file NAME): {b.first!r}")
        if b.mark is None and not block_commands(b):
            problems.append(f"README.md:{b.line}: an unmarked block with no command (output? "
                            f"mark it skip with the reason): {b.first!r}")
        if b.mark is None:
            problems += [f"README.md:{b.line}: command not in {__name__}.COMMANDS (add its "
                         f"sign, or mark the block skip with a reason): {c!r}"
                         for c in block_commands(b) if command_key(c) not in COMMANDS]
        if b.mark and b.mark.startswith("skip:") and len(b.mark) < len("skip: ") + 10:
            problems.append(f"README.md:{b.line}: skip without a reason: {b.mark!r}")
    listed = {command_key(c) for b in blocks if b.mark is None for c in block_commands(b)}
    problems += [f"COMMANDS names a command the README no longer has: {k!r}"
                 for k in COMMANDS if k not in listed]
    assert [b for b in blocks if b.mark == "prologue"], "no block marked prologue (the exports)"
    assert not problems, "\n".join(problems)


def test_unmarked_blocks_fail_the_check():
    """What the check above sees in a README with a new block (no marker) and a
    new command in a run block."""
    text = ("<!-- readme-test: skip: example output, not a command -->\n```\n# out\n```\n"
            "```\nmake test   # a comment\nmake frobnicate\n```\n```python\nx = 1\n```\n")
    blocks = readme_blocks(text)
    assert [(b.line, b.lang, b.mark) for b in blocks] == [
        (2, "", "skip: example output, not a command"), (5, "", None), (9, "python", None)]
    assert [command_key(c) for c in block_commands(blocks[1])] == ["make test", "make frobnicate"]
    assert "make frobnicate" not in COMMANDS
    joined = readme_blocks("```\na \\\n  b   # c\n```\n")[0]
    assert block_commands(joined) == ["a    b   # c"] and command_key("a    b   # c") == "a b"


# --------------------------------------------------------------------------
# Running them
# --------------------------------------------------------------------------


def reader_env() -> dict[str, str]:
    """What a README reader's shell has after ``make setup``: the venv's bin
    first on PATH, and none of the MPI/harmpi/torchrun variables of the test run."""
    drop = ("OMPI_", "PRTE_", "PMIX_", "HARMPI_", "MASTER_", "PYTHONPATH", "NUMBA_",
            "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")
    env = {k: v for k, v in os.environ.items() if not k.startswith(drop)}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    return env


def time_limit_s(run: Run) -> float:
    """Start-up of ``run.np`` ranks, then twice its work, times the runnable
    processes per CPU (tests/support/jobs.job_limit_s, without its cap: a 4-rank
    decode takes minutes when other jobs keep the 2 cores busy)."""
    busy = max(1.0, os.getloadavg()[0] / (os.cpu_count() or 1))
    return (STARTUP_S + STARTUP_PER_RANK_S * run.np + 2.0 * run.work_s) * busy


def run_shell(script: str, cwd: Path, limit_s: float) -> subprocess.CompletedProcess:
    """``bash -c script`` in its own session, killed with all it started after ``limit_s``."""
    proc = subprocess.Popen(["bash", "-c", script], cwd=cwd, env=reader_env(), text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True)
    t0 = time.monotonic()
    try:
        out, _ = proc.communicate(timeout=limit_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)   # mpirun and every rank
        out, _ = proc.communicate()
        pytest.fail(f"still running after {time.monotonic() - t0:.0f} s (limit {limit_s:.0f} s:"
                    f" start-up, twice the work, times the load per CPU):\n{out[-4000:]}")
    return subprocess.CompletedProcess(script, proc.returncode, out, "")


def prologue() -> str:
    (block,) = [b for b in _blocks() if b.mark == "prologue"]
    return block.text


@pytest.fixture(scope="module")
def scratch(tmp_path_factory) -> Path:
    """The directory the README's scripts run in: every "file" block saved
    under its name, and the scripts the README leaves to the reader; the
    numba cache compiled (make setup's step) before any command is timed."""
    where = tmp_path_factory.mktemp("readme")
    for b in _blocks():
        if b.mark and b.mark.startswith("file "):
            (where / b.mark.split()[1]).write_text(b.text + "\n")
    for script in SCRIPTS.glob("*.py"):
        shutil.copy(script, where / script.name)
    pre = subprocess.run([sys.executable, "-m", "harmpi.precompile"], cwd=where,
                         env=reader_env(), capture_output=True, text=True, timeout=1500)
    assert pre.returncode == 0, pre.stdout + pre.stderr
    return where


def test_prologue_sets_what_open_mpi_needs(scratch):
    proc = run_shell(prologue() + "\nenv", scratch, 30)
    assert proc.returncode == 0, proc.stdout
    env = dict(line.split("=", 1) for line in proc.stdout.splitlines() if "=" in line)
    assert env["OMPI_ALLOW_RUN_AS_ROOT"] == env["OMPI_ALLOW_RUN_AS_ROOT_CONFIRM"] == "1"
    assert env["OMPI_MCA_osc"] == "^ucx" and env["OMPI_MCA_pml"] == "ob1"


@pytest.mark.parametrize("block,command", _run_commands(),
                         ids=lambda x: f"L{x.line}" if isinstance(x, Block) else command_key(x))
def test_command_runs_as_written(block, command, scratch):
    run = COMMANDS[command_key(command)]
    cwd = REPO if run.where == "checkout" else scratch
    t0 = time.monotonic()
    proc = run_shell(f"{prologue()}\nset -o pipefail\n{command}", cwd, time_limit_s(run))
    took = f"README.md:{block.line}: {command!r} ({time.monotonic() - t0:.0f} s)"
    assert proc.returncode == 0, f"{took} exited {proc.returncode}:\n{proc.stdout[-4000:]}"
    for i, sign in enumerate(run.signs):
        found = re.findall(sign, proc.stdout, re.M)
        want = run.count if i == 0 else 1
        assert len(found) >= want, (f"{took}: {sign!r} found {len(found)} times, want "
                                    f"{want}:\n{proc.stdout[-4000:]}")
    if run.same:
        values = set(re.findall(run.signs[0], proc.stdout, re.M))
        assert len(values) == 1, f"{took}: ranks printed different results {values}"
