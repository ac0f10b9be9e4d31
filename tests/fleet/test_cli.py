"""``gpufleet run``: the arguments reach the script; a missing script is named."""

from __future__ import annotations

import sys

from gpufleet.cli import main
from gpufleet.fleet.cli import run_script


def test_a_missing_script_is_named(capsys):
    assert main(["run", "--nproc", "1", "no/such/script.py"]) == 1
    assert "script 'no/such/script.py' does not exist" in capsys.readouterr().err


def test_each_rank_runs_the_script_as_main_with_its_arguments(tmp_path):
    out = tmp_path / "seen.txt"
    script = tmp_path / "job.py"
    script.write_text("import sys\n"
                      "if __name__ == '__main__':\n"
                      "    open(sys.argv[2], 'w').write(sys.argv[1])\n"
                      "    sys.exit(0)\n")
    argv = sys.argv
    try:
        run_script(str(script), ["--lr=0.1", str(out)])
    finally:
        sys.argv = argv
        sys.path.remove(str(tmp_path))
    assert out.read_text() == "--lr=0.1"


def _launched(monkeypatch, argv: list[str]) -> dict:
    seen: dict = {}

    def launch(entry, entry_args, **kwargs):
        seen.update(kwargs, script_args=list(entry_args[1:]))

    monkeypatch.setattr("gpufleet.launch.launch", launch)
    monkeypatch.setattr("gpufleet.fleet.cli._visible_gpus", lambda: 0)  # 1 rank by default
    assert main(["run", *argv]) == 0
    return seen


def test_the_options_after_the_script_as_the_docs_write_them(tmp_path, monkeypatch):
    """`gpufleet run SCRIPT --nproc N [--max-restarts K] [-- ARGS]` (docs/own-loop.md)
    starts N ranks; the options once reached the script and one rank ran."""
    script = tmp_path / "job.py"
    script.write_text("")
    seen = _launched(monkeypatch, [str(script), "--nproc", "2", "--max-restarts=1", "--",
                                   "--data", "x"])
    assert (seen["nproc"], seen["max_restarts"], seen["launcher"]) == (2, 1, "elastic")
    assert seen["script_args"] == ["--data", "x"]
    seen = _launched(monkeypatch, [str(script), "--nproc", "2"])
    assert seen["nproc"] == 2 and seen["script_args"] == []
    seen = _launched(monkeypatch, [str(script), "--nproc", "3", "--lr", "0.1"])
    assert seen["nproc"] == 3 and seen["script_args"] == ["--lr", "0.1"]
    # before SCRIPT, as torchrun has them: every argument after it is the script's
    seen = _launched(monkeypatch, ["--nproc", "2", str(script), "--nproc", "4"])
    assert seen["nproc"] == 2 and seen["script_args"] == ["--nproc", "4"]
    seen = _launched(monkeypatch, [str(script), "--lr", "0.1", "--nproc", "4"])
    assert seen["nproc"] == 1 and seen["script_args"] == ["--lr", "0.1", "--nproc", "4"]


def test_the_options_across_nodes_reach_the_agent(tmp_path, monkeypatch):
    """`gpufleet run --nnodes 1:2 --rdzv-endpoint HOST:PORT --rdzv-id ID SCRIPT` (on
    each node, docs/own-loop.md) gives torch's elastic agent gpufleet train's options
    across nodes, before or right after SCRIPT; those not given keep the launcher's."""
    script = tmp_path / "job.py"
    script.write_text("")
    across = ["--nnodes", "1:2", "--rdzv-endpoint", "10.0.0.1:29400", "--rdzv-id", "job"]
    for argv in ([*across, str(script), "--lr", "0.1"],
                 [str(script), *across, "--", "--lr", "0.1"]):
        seen = _launched(monkeypatch, argv)
        assert (seen["nnodes"], seen["rdzv_endpoint"], seen["rdzv_id"]) == \
            ("1:2", "10.0.0.1:29400", "job"), argv
        assert "node_rank" not in seen and "master_port" not in seen
        assert seen["script_args"] == ["--lr", "0.1"]
    seen = _launched(monkeypatch, ["--nnodes", "2", "--node-rank", "1", "--master-addr",
                                   "10.0.0.1", "--master-port", "29500", str(script)])
    assert (seen["nnodes"], seen["node_rank"], seen["master_addr"],
            seen["master_port"]) == ("2", 1, "10.0.0.1", 29500)
