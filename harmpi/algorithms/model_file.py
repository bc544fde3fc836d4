"""A host's measured cost-model constants, kept in a file, and reading them back.

``python -m harmpi.tune`` measures the host and writes the file; a context
reads it when it is made (rank 0 only: the other ranks take rank 0's
constants, so every rank switches at the same sizes). Where it lives:

1. ``HARMPI_MODEL_FILE`` (``Config.model_file``), if set;
2. else ``$XDG_CACHE_HOME/harmpi/cost-model-<hostname>.json`` (``~/.cache``
   when XDG_CACHE_HOME is unset): per user and per host, so a home
   directory shared by several hosts keeps each host's own.

Reading never raises (:func:`load`): a missing default file means the
built-in constants; a file that is missing although named, unreadable, not
JSON, of another format or version, or holding a constant that is not a
finite number >= 0 also means the built-in constants, with the reason in
``LoadedModel.problem``, which the context logs (a warning, once, on rank
0) and ``harmpi.info()["model"]`` shows. A bad file costs speed, never a
failed call: it only moves auto's switches between correct algorithms.

The format (JSON, an object)::

    {"format": "harmpi-cost-model", "version": 1,
     "constants": {"call_us": 1.2, ...},          # every CostConstants field
     "host": {"hostname": ..., "cpus": ...},       # where it was measured
     "measured_utc": "2026-12-05T13:00:00Z",
     "rows": [["shm", 2, 1, "compiled", 4096, 2.3], ...]}   # what it was fitted to
"""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path
from typing import NamedTuple

from .model import DEFAULT, CostConstants, Row

__all__ = ["FORMAT", "VERSION", "LoadedModel", "ModelFileError", "default_path", "model_path",
           "read", "load", "write", "BUILT_IN"]

FORMAT = "harmpi-cost-model"
VERSION = 1
#: LoadedModel.source of the constants built into harmpi (model.DEFAULT)
BUILT_IN = "built-in defaults"


class LoadedModel(NamedTuple):
    """The constants a context uses, where they came from (a file's path or
    BUILT_IN), and why a file was not used (None: no problem)."""

    constants: CostConstants
    source: str
    problem: str | None = None


class ModelFileError(ValueError):
    """A model file that cannot be used (the message says which and why)."""


def default_path(env=None) -> Path:
    """The per-user, per-host file (see the module docstring)."""
    env = os.environ if env is None else env
    cache = env.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    host = socket.gethostname().split(".")[0] or "host"
    return Path(cache) / "harmpi" / f"cost-model-{host}.json"


def model_path(model_file: str | None, env=None) -> tuple[Path, bool]:
    """(the file to read, whether it was named explicitly)."""
    if model_file:
        return Path(model_file).expanduser(), True
    return default_path(env), False


def read(path) -> tuple[CostConstants, list[Row], dict]:
    """(constants, rows, host) of a model file; ModelFileError says what is wrong."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except OSError as exc:
        raise ModelFileError(f"cannot read it: {exc.strerror or exc}") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise ModelFileError(f"not JSON: {exc}") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise ModelFileError(f"not a harmpi cost-model file (no \"format\": \"{FORMAT}\")")
    if data.get("version") != VERSION:
        raise ModelFileError(f"version {data.get('version')!r}, this harmpi reads version "
                             f"{VERSION}: run python -m harmpi.tune again")
    raw = data.get("constants")
    names = CostConstants.names()
    if not isinstance(raw, dict) or set(raw) != set(names):
        got = sorted(raw) if isinstance(raw, dict) else type(raw).__name__
        raise ModelFileError(f"its constants are {got}, expected {list(names)}")
    try:
        constants = CostConstants(**raw)
    except ValueError as exc:
        raise ModelFileError(str(exc)) from None
    try:
        rows = [Row(*r) for r in data.get("rows", [])]
    except TypeError as exc:
        raise ModelFileError(f"its rows are not (algorithm, L, N, entry, bytes, us): {exc}") \
            from None
    host = data.get("host") if isinstance(data.get("host"), dict) else {}
    return constants, rows, host


def load(model_file: str | None = None, env=None) -> LoadedModel:
    """The constants to use: the file's, else the built-in ones (never raises)."""
    path, explicit = model_path(model_file, env)
    if not explicit and not os.path.exists(path):
        return LoadedModel(DEFAULT, BUILT_IN)
    try:
        constants, _rows, _host = read(path)
    except ModelFileError as exc:
        named = "HARMPI_MODEL_FILE " if explicit else ""
        return LoadedModel(DEFAULT, BUILT_IN, f"{named}{path}: {exc}; using the built-in "
                                              "constants")
    return LoadedModel(constants, str(path))


def write(path, constants: CostConstants, rows, host: dict, measured_utc: str) -> Path:
    """Write a model file (atomically: a reader sees the old file or the new one)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    data = {"format": FORMAT, "version": VERSION, "constants": constants.as_dict(),
            "host": host, "measured_utc": measured_utc, "rows": [list(Row(*r)) for r in rows]}
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=1)
        f.write("\n")
    os.replace(tmp, path)
    return path
