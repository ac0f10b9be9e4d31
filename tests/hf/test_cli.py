"""`gpufleet tokens add` as users type it, on the real MiniLM folder; and the install
hint when Transformers is missing."""

from __future__ import annotations

import subprocess
import sys

import torch

from conftest import _env

from .conftest import SENTENCE


def test_tokens_add_prints_sizes_and_tokenization_and_saves_both(run_cli, minilm,
                                                                  minilm_dir, tmp_path):
    from transformers import AutoModel, AutoTokenizer

    proc = run_cli("tokens", "add", str(minilm_dir), "out", "--special",
                   "--token", "[ENT_START]", "--init", "mean:start of an entity",
                   "--token", "[ENT_END]", "--init", "copy:[SEP]",
                   "--token", "[SEP]", "--init", "zeros", "--sample", SENTENCE)
    out = proc.stdout
    assert "skipped '[SEP]': already in the vocabulary (id 102)" in out
    assert "'[ENT_START]' id 30522, init mean:start of an entity" in out
    assert "vocabulary size: 30522 -> 30524" in out
    assert "embedding rows: 30522 -> 30524" in out
    assert "before (33 tokens): two [ en ##t _ start ] cars [ en ##t _ end ]" in out
    assert ("after  (13 tokens): two [ENT_START] cars [ENT_END] collided in a [ENT_START] "
            "tunnel [ENT_END] this morning .") in out

    # The folder loads back with the new vocabulary and the rows the strategies set.
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "out")
    model = AutoModel.from_pretrained(tmp_path / "out")
    assert len(tokenizer) == 30524 and tokenizer.tokenize("[ENT_END]") == ["[ENT_END]"]
    old, new = minilm[0].get_input_embeddings().weight, model.get_input_embeddings().weight
    assert new.shape == (30524, 384) and torch.equal(new[:30522], old)
    desc = minilm[1]("start of an entity", add_special_tokens=False)["input_ids"]
    torch.testing.assert_close(new[30522], old[desc].mean(0))
    assert torch.equal(new[30523], old[minilm[1].sep_token_id])


def test_tokens_add_errors_name_the_problem(run_cli, minilm_dir):
    bad = run_cli("tokens", "add", str(minilm_dir), "out", "--token", "[E]",
                  "--init", "mean-al", expect=2)
    assert "gpufleet: error: init strategy 'mean-al' is not known. Did you mean 'mean-all'?" \
        in bad.stderr
    assert "Traceback" not in bad.stderr
    unknown = run_cli("tokens", "add", str(minilm_dir), "out", "--token", "[E]",
                      "--init", "copy:[NOPE]", expect=2)
    assert "'[NOPE]' is not a token of this tokenizer" in unknown.stderr
    missing = run_cli("tokens", "add", "no/such/dir", "out", "--token", "[E]", expect=2)
    assert "model folder 'no/such/dir' does not exist" in missing.stderr


def test_without_transformers_the_command_says_how_to_install_it(tmp_path):
    # Blocks `import transformers` the way an environment without it fails.
    code = ("import sys; sys.modules['transformers'] = None; from gpufleet.cli import main; "
            "sys.exit(main(sys.argv[1:]))")

    def gpufleet(*args):
        return subprocess.run([sys.executable, "-c", code, *args], cwd=tmp_path, env=_env(),
                              capture_output=True, text=True, timeout=120)

    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    proc = gpufleet("tokens", "add", "model", "out", "--token", "[E]")
    assert proc.returncode == 2, proc.stderr
    assert "gpufleet tokens needs Hugging Face Transformers" in proc.stderr
    assert "pip install 'gpufleet[hf]'" in proc.stderr and "Traceback" not in proc.stderr
    helped = gpufleet("--help")  # the rest of the CLI is unaffected
    assert helped.returncode == 0 and "tokens" in helped.stdout
