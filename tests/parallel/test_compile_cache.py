"""perf.compile keeps inductor's caches in the run directory: a restarted run (a new
process resuming the run) reads the graphs its predecessor compiled."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap

import pytest

from conftest import _env
from gpufleet.parallel import compile_cache
from gpufleet.parallel.compile_cache import keep_compile_cache

# One process of a compiled run: trains (or resumes) and prints inductor's cache counters.
CHILD = textwrap.dedent("""
    import json, sys
    import torch
    from torch._dynamo.utils import counters
    from torch.nn import functional as F
    import gpufleet, toyjob

    class Net(torch.nn.Module):  # (a plain nn.Sequential's compile traces no frame)
        def __init__(self):
            super().__init__()
            self.a, self.b = torch.nn.Linear(8, 16), torch.nn.Linear(16, 1)

        def forward(self, x):
            return self.b(torch.tanh(self.a(x)))
    run_dir, steps, resume = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "1"
    over = {"perf.compile": True, "run.dir": run_dir, "run.max_steps": steps,
            "checkpoint.every": 1, "log.progress": "off", "data.batch_size": 32,
            "data.num_workers": 0, "run.eval_every": 0, "monitor.diagnose": False}
    if resume:
        over["checkpoint.resume"] = "latest"
    torch.manual_seed(0)
    gpufleet.fit(Net(), toyjob.make_data(), loss_fn=F.mse_loss, overrides=over)
    print(json.dumps({"hit": counters["inductor"]["fxgraph_cache_hit"],
                      "miss": counters["inductor"]["fxgraph_cache_miss"]}))
""")


def _compiled_run(tmp_path, steps, resume):
    env = _env()
    env.pop("TORCHINDUCTOR_CACHE_DIR", None)
    out = subprocess.run([sys.executable, "-c", CHILD, str(tmp_path / "run"), str(steps),
                          "1" if resume else "0"], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.slow  # two compiles of a small model: 40-90 s on the 2-core machine
def test_a_restarted_run_reads_the_graphs_its_predecessor_compiled(tmp_path):
    first = _compiled_run(tmp_path, 2, resume=False)
    assert first["miss"] >= 1 and first["hit"] == 0, first  # compiled, and kept
    folder = tmp_path / "run" / "compile-cache" / socket.gethostname()
    assert any(folder.rglob("*")), "nothing kept in the run's compile cache"
    again = _compiled_run(tmp_path, 3, resume=True)
    assert again["hit"] >= first["miss"] and again["miss"] == 0, (first, again)


def test_the_cache_goes_to_the_run_dir_unless_you_chose_a_folder(tmp_path, monkeypatch):
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    monkeypatch.delenv("TRITON_CACHE_DIR", raising=False)
    monkeypatch.setattr(compile_cache, "_OURS", set())
    assert keep_compile_cache(tmp_path / "a", compile_on=False) is None
    assert "TORCHINDUCTOR_CACHE_DIR" not in os.environ
    folder = keep_compile_cache(tmp_path / "a", compile_on=True)
    assert folder == (tmp_path / "a" / "compile-cache" / socket.gethostname()).resolve()
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(folder) and folder.is_dir()
    assert os.environ["TRITON_CACHE_DIR"] == str(folder / "triton")
    # A second run in the same process moves to its own run directory.
    second = keep_compile_cache(tmp_path / "b", compile_on=True)
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(second) != str(folder)
    assert os.environ["TRITON_CACHE_DIR"] == str(second / "triton")
    # A folder of your own stays.
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "mine"))
    assert keep_compile_cache(tmp_path / "c", compile_on=True) is None
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "mine")
