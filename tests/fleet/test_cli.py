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
