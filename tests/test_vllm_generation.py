"""vLLM's CPU engine generating at TP=2 under harmpi-launch with harmpi's
plug-in (HARMPI_VLLM=1), eager and compiled: the sampled tokens must equal
those of vLLM's own communicator in the same mode, and vLLM's TP all-reduce
must really have gone through harmpi. Runs bench/vllm_demo.py (short
generations) with the vLLM venv's Python (.venv-vllm, `make vllm-venv`):
the arms (harmpi, vLLM's own, Gloo) take turns in one job: eager, in one
engine; compiled, one engine per arm in the same process.

`make test` builds that venv and sets HARMPI_VLLM_REQUIRED=1, so there a
missing venv fails; a bare pytest run without it skips, saying why."""

import os
import re
import subprocess

import pytest
from support import REPO
from support.vllm import VLLM_PY, need_vllm_venv, vllm_env

pytestmark = pytest.mark.timeout(1500)


def test_tp2_generation_through_harmpi_equals_vllms_own(tmp_path):
    need_vllm_venv()
    env = vllm_env()
    out = tmp_path / "jobs.json"
    proc = subprocess.run(
        [VLLM_PY, os.path.join(REPO, "bench", "vllm_demo.py"), "--layouts", "1x2",
         "--modes", "eager,compiled", "--runs", "3", "--warmup", "0", "--prompts", "2",
         "--max-tokens", "8", "--model", str(tmp_path / "model"), "--json", str(out),
         "--timeout", "600", "--serve", ""],  # (the serve rows: tests/test_vllm_serve.py)
        env=env, cwd=str(tmp_path), capture_output=True, text=True, timeout=1450)
    text = proc.stdout + proc.stderr
    assert proc.returncode == 0, text[-6000:]
    import json
    arms = json.loads(out.read_text())
    by = {(x["mode"], x["comm"]): x for x in arms}
    for mode in ("eager", "compiled"):
        h, v = by[(mode, "harmpi")], by[(mode, "vllm")]
        assert h["path"].startswith("harmpi"), h["path"]    # the plug-in carried it
        assert not v["path"].startswith("harmpi"), v["path"]
        assert h["output_tokens"] == 2 * 8
        assert h["stable"] and v["stable"], (h, v)          # the same tokens every run
        assert h["tokens"] == v["tokens"], (mode, h["tokens"], v["tokens"])
        assert len(v["ratios"]) == 3, v["ratios"]
        if (mode, "gloo") in by:                            # where vLLM's shm op exists
            assert v["path"] == "vllm shm op", v["path"]
            assert by[(mode, "gloo")]["path"] == "gloo"         # compiled: in its graph too
            assert h["tokens"] == by[(mode, "gloo")]["tokens"]
        # harmpi's profile of one generation: 9 all-reduces and a gather a
        # step; the microbenchmark went through every arm
        share = h["share"]
        assert share["calls_per_step"] == 10, share
        assert share["own_us_per_step"] > 0, share
        assert set(share["micro_us_per_step"]) == {x["comm"] for x in arms
                                                   if x["mode"] == mode}, share
        assert all(us > 0 for us in share["micro_us_per_step"].values()), share
        # torch.compile made one graph of the model and did not break it
        if mode == "compiled":
            assert h["compile"]["graph_breaks"] == 0, h["compile"]
    # the demo says what it is doing (one job per mode)
    assert text.count("job started") == 2 == text.count("job ended in"), text[-3000:]
    assert re.search(r"1x2 compiled +[\d.]+ us/step in 10\.00 collectives", text), text[-3000:]
    # the eager job counted the collectives: 9 all-reduces per step
    # (4 layers x 2, the vocabulary-parallel embedding) and one logits gather
    counts = by[("eager", "harmpi")]["counts"]
    reduces = sum(n for kind, _, n in counts if kind == "all_reduce")
    gathers = sum(n for kind, _, n in counts if kind == "all_gather")
    assert reduces == 9 * 8 and gathers == 8, counts
    assert "harmpi (plug-in)" in text, text[-3000:]
