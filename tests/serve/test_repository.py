"""The model_repository extension, through tritonclient: index, load, unload, reload."""

import gc
import os
import subprocess
import sys
import weakref

import numpy as np
import pytest
import torch
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from gpufleet.serve.app import ServeOptions, create_app
from gpufleet.serve.export import export_triton
from gpufleet.serve.model import TensorSpec, from_module
from gpufleet.serve.repository import ModelRepository, is_repository
from gpufleet.serve.runner import BackgroundServer


class Scale(torch.nn.Module):
    def __init__(self, k: float) -> None:
        super().__init__()
        self.k = torch.nn.Parameter(torch.tensor(k))

    def forward(self, x):
        return x * self.k


def _export(root, name, k):
    model = from_module(name, Scale(k), [TensorSpec("INPUT__0", "FP32", (3,))], "cpu")
    return export_triton(model, root)


@pytest.fixture
def repo_dir(tmp_path):
    _export(tmp_path, "double", 2.0)
    _export(tmp_path, "triple", 3.0)
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "config.pbtxt").write_text("name: 'broken' input [")
    (tmp_path / "notes").mkdir()  # not a model folder: not listed
    return tmp_path


@pytest.fixture
def served(repo_dir):
    repository = ModelRepository(repo_dir, device="cpu")
    models, unavailable = repository.load_all()
    app = create_app(models, ServeOptions(max_batch_size=4), repository, unavailable)
    del models  # the server holds the only references (the unload test checks them)
    with BackgroundServer(app) as srv:
        client = httpclient.InferenceServerClient(srv.address)
        yield srv, client, app.state.server
        client.close()


def _infer(client, name, x):
    inp = httpclient.InferInput("INPUT__0", list(x.shape), "FP32").set_data_from_numpy(x)
    return client.infer(name, [inp]).as_numpy("OUTPUT__0")


def _index(client):
    return {e["name"]: (e["state"], e.get("reason", "")) for e in
            client.get_model_repository_index()}


X = np.array([[1.0, 2.0, 3.0]], np.float32)


def test_index_lists_the_folders_with_their_state(served):
    _, client, _ = served
    assert "model_repository" in client.get_server_metadata()["extensions"]
    index = _index(client)
    assert set(index) == {"broken", "double", "triple"}
    assert index["double"] == ("READY", "") and index["triple"][0] == "READY"
    assert index["broken"][0] == "UNAVAILABLE" and "load failed" in index["broken"][1]
    assert not client.is_model_ready("broken")
    np.testing.assert_array_equal(_infer(client, "triple", X), X * 3)


def test_unload_frees_the_model_and_load_brings_it_back(served):
    _, client, server = served
    module = weakref.ref(server.models["double"].module)
    client.unload_model("double")
    gc.collect()
    assert module() is None, "the unloaded model is still referenced"
    assert not client.is_model_ready("double")
    assert _index(client)["double"] == ("UNAVAILABLE", "unloaded")
    with pytest.raises(InferenceServerException, match=r"not loaded.*load") as e:
        _infer(client, "double", X)
    assert e.value.status() == "400"
    with pytest.raises(InferenceServerException, match="not loaded"):
        client.get_model_metadata("double")
    assert client.is_server_ready()  # the models still loaded are all ready
    client.load_model("double")
    assert client.is_model_ready("double") and client.is_model_ready("double", "1")
    assert client.get_model_metadata("double")["inputs"] == [
        {"name": "INPUT__0", "datatype": "FP32", "shape": [-1, 3]}]
    np.testing.assert_array_equal(_infer(client, "double", X), X * 2)


def test_load_reads_the_folder_again(served, repo_dir):
    _, client, _ = served
    _export(repo_dir, "double", 5.0)  # the files change on disk: a reload picks them up
    _export(repo_dir, "added", 7.0)  # a folder added after the start
    assert _index(client)["added"] == ("UNAVAILABLE", "not loaded")
    client.load_model("double")
    client.load_model("added")
    np.testing.assert_array_equal(_infer(client, "double", X), X * 5)
    np.testing.assert_array_equal(_infer(client, "added", X), X * 7)
    assert {n for n, (state, _) in _index(client).items() if state == "READY"} == {
        "added", "double", "triple"}


def test_load_mistakes_are_client_errors(served):
    _, client, _ = served
    with pytest.raises(InferenceServerException, match="Did you mean 'double'") as e:
        client.load_model("doubel")
    assert e.value.status() == "404"
    with pytest.raises(InferenceServerException, match="failed to load") as e:
        client.load_model("broken")
    assert e.value.status() == "400"
    with pytest.raises(InferenceServerException, match="only as its folder"):
        client.load_model("double", config='{"max_batch_size": 2}')
    assert client.is_model_ready("double")  # a failed request leaves the model serving


def test_a_fixed_server_does_not_advertise_the_extension(server):
    client = httpclient.InferenceServerClient(server.address)
    try:
        assert "model_repository" not in client.get_server_metadata()["extensions"]
        with pytest.raises(InferenceServerException, match="not a model repository"):
            client.load_model("gpt")
        assert client.is_model_ready("gpt")
    finally:
        client.close()


def test_serve_command_serves_a_repository(repo_dir):
    assert is_repository(repo_dir) and not is_repository(repo_dir / "double")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "gpufleet", "serve", str(repo_dir),
                             "--port", "0", "--device", "cpu"], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert "2 loaded: double, triple" in line, proc.stderr.read()
        client = httpclient.InferenceServerClient(line.split("http://")[1].split()[0])
        client.unload_model("triple")
        assert not client.is_model_ready("triple")
        client.load_model("triple")
        np.testing.assert_array_equal(_infer(client, "triple", X), X * 3)
        client.close()
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
