"""A process whose torch is held to an instruction set (--kernels, or ATEN_CPU_CAPABILITY by hand) compiles into an
inductor cache of its own: the one shared by the user's processes serves a graph vectorized for another set, whose
kernels then compute wrong values (NaN here). Each process below is a fresh one, with its own temp dir."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent

PROBE = """
import json, os, sys
from app.flags import hold_torch_to
hold_torch_to(sys.argv[1] or None)  # before torch loads, as infer.py and bench.py do
import torch
from tests.helpers import tiny_model
from utils.runner import CachedModel
lm = CachedModel(tiny_model(seed=1, layers=1, hidden=64, dtype=torch.float32))
prompt = list(range(1, 12))
def last_logits():
    lm.reset()
    with torch.inference_mode():
        lm.forward(prompt[:-2])
        lm.forward(prompt[-2:-1])
        return lm.forward(prompt[-1:])[-1]
eager = last_logits()
lm.compile_step()
print(json.dumps({"difference": float((eager - last_logits()).abs().max()),
                  "cache": os.environ.get("TORCHINDUCTOR_CACHE_DIR"),
                  "capability": torch.backends.cpu.get_cpu_capability()}))
"""

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(torch.backends.cpu.get_cpu_capability() in ("AVX2", "DEFAULT", "NO AVX"),
                       reason="needs torch running more than AVX2 here"),
]


def probe(tmp_path: Path, kernel_set: str) -> dict:
    env = {k: v for k, v in os.environ.items()
           if k not in ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "TORCHINDUCTOR_CACHE_DIR")}
    env.update(TMPDIR=str(tmp_path), PYTHONPATH=str(ROOT))  # inductor's default cache lies in the temp dir
    done = subprocess.run([sys.executable, "-c", PROBE, kernel_set], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_process_held_to_avx2_does_not_read_the_graphs_compiled_for_this_cpu(tmp_path):
    shared = probe(tmp_path, "")  # this CPU's own instruction set fills the shared cache
    assert shared["difference"] < 1e-4
    held = probe(tmp_path, "avx2")
    assert held["capability"] == "AVX2" and held["cache"] != shared["cache"]
    assert held["difference"] < 1e-4  # NaN where it read the shared cache's graph
