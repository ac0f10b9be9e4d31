"""`gpufleet serve` and `gpufleet export triton` as users run them."""

import os
import subprocess
import sys

import numpy as np
import tritonclient.http as httpclient
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2

from .conftest import cache_of


def test_export_command_writes_a_repository(run_cli, gpt_run, tmp_path):
    proc = run_cli("export", "triton", str(gpt_run), str(tmp_path / "repo"),
                   "--model-name", "tiny", "--max-batch-size", "4",
                   env={"GPUFLEET_CACHE": cache_of(gpt_run)})
    assert "tiny" in proc.stdout
    config = text_format.Parse((tmp_path / "repo" / "tiny" / "config.pbtxt").read_text(),
                               model_config_pb2.ModelConfig())
    assert config.max_batch_size == 4 and config.HasField("dynamic_batching")
    assert (tmp_path / "repo" / "tiny" / "1" / "model.pt").is_file()


def test_serve_command_answers_tritonclient(gpt_run, gpt_model, tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
           "GPUFLEET_CACHE": cache_of(gpt_run)}
    proc = subprocess.Popen([sys.executable, "-m", "gpufleet", "serve", str(gpt_run),
                             "--port", "0", "--model-name", "gpt", "--max-batch-size", "4"],
                            cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert "serving model 'gpt' at http://127.0.0.1:" in line, proc.stderr.read()
        address = line.split("http://")[1].split()[0]
        client = httpclient.InferenceServerClient(address)
        assert client.is_server_ready()
        x = np.array([[3, 1, 4, 1, 5]], dtype=np.int64)
        inp = httpclient.InferInput("INPUT__0", [1, 5], "INT64")
        inp.set_data_from_numpy(x)
        got = client.infer("gpt", [inp]).as_numpy("OUTPUT__0")
        client.close()
        from gpufleet.serve.export import outputs_of

        np.testing.assert_allclose(got, outputs_of(gpt_model, [x])[0], rtol=1e-5, atol=1e-6)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def test_serve_errors_name_the_fix(run_cli):
    proc = run_cli("serve", "no/such/run", expect=2)
    assert "neither a run directory" in proc.stderr and "Traceback" not in proc.stderr
    proc = run_cli("serve", "toyjob:make_model", expect=2)
    assert "--input NAME:DTYPE:DIMS" in proc.stderr
    proc = run_cli("serve", "toyjob:make_model", "--input", "x:FP32:8,x", expect=2)
    assert "must be positive integers or -1" in proc.stderr


def test_serve_a_factory_with_inputs(run_cli):
    proc = run_cli("serve", "toyjob:make_model", "--input", "x:FP32:9", expect=2)
    assert "failed on an example batch" in proc.stderr  # 9 features into Linear(8, ...)
