"""transformers' tensor-parallel decode (tp_plan="auto") at 2 ranks on
Gloo and on harmpi: bench/tp_decode.py with a few tokens, run with the vLLM
venv's Python (.venv-vllm, `make vllm-venv`: transformers and accelerate).
Both jobs must run on a mesh of their own backend and generate the same
token ids.

`make test` builds that venv and sets HARMPI_VLLM_REQUIRED=1, so there a
missing venv or package fails; a bare pytest run without them skips,
saying why."""

import json
import os
import re
import subprocess

import pytest
from support import REPO
from support.vllm import VLLM_PY, need_vllm_venv, vllm_env

BENCH = os.path.join(REPO, "bench", "tp_decode.py")
TOKENS = 4
# 41 s at load 5 and 148 s at load 8 (nice 19) on the 2-core machine for 4
# tokens (the ranks' start-up, slowed by the load); the bounds leave room for worse
pytestmark = pytest.mark.timeout(660)


def test_tp_decode_gloo_and_harmpi_generate_the_same_tokens(tmp_path):
    need_vllm_venv(imports=("transformers", "accelerate", "click"))
    env = vllm_env()
    out = tmp_path / "jobs.json"
    proc = subprocess.run(
        [VLLM_PY, BENCH, "--tokens", str(TOKENS), "--prompt-len", "4", "--warmup", "0",
         "--runs", "1", "--timeout", "300", "--json", str(out)],
        env=env, cwd=str(tmp_path), capture_output=True, text=True, timeout=630)
    text = proc.stdout + proc.stderr
    assert proc.returncode == 0, text[-6000:]
    jobs = {j["backend"]: j for j in json.loads(out.read_text())}
    assert set(jobs) == {"gloo", "harmpi"}, list(jobs)
    for backend, job in jobs.items():
        # the group we made, not one transformers made for itself (it would be gloo)
        assert job["default_group"] == job["mesh_group"] == backend, job
        assert job["ranks_agree"], job
        assert job["new_tokens"] == TOKENS and len(job["tokens"][0]) == TOKENS, job
        calls = {call for call, *_ in job["counts"]}
        assert "dist.all_reduce" in calls, job["counts"]    # the rowwise layers' reductions
    assert jobs["harmpi"]["tokens"] == jobs["gloo"]["tokens"], jobs
    assert re.search(r"^  harmpi +harmpi +[\d.]+ \([\d.]+-[\d.]+\) +[\d.]+x  identical$",
                     text, re.M), text[-3000:]
