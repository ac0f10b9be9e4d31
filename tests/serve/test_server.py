"""The official tritonclient talks to the server: health, metadata, inference."""

import numpy as np
import pytest
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from gpufleet.serve.export import outputs_of

from .conftest import ECHO_TYPES


@pytest.fixture
def client(server):
    c = httpclient.InferenceServerClient(server.address)
    yield c
    c.close()


def _tokens(rows: int, length: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (rows, length), dtype=np.int64)


def test_health_and_metadata(client):
    assert client.is_server_live()
    assert client.is_server_ready()
    assert client.is_model_ready("gpt")
    assert client.is_model_ready("gpt", "1")
    assert not client.is_model_ready("gpt", "7")
    assert "binary_tensor_data" in client.get_server_metadata()["extensions"]
    meta = client.get_model_metadata("gpt")
    assert meta["inputs"] == [{"name": "INPUT__0", "datatype": "INT64", "shape": [-1, -1]}]
    assert meta["outputs"] == [{"name": "OUTPUT__0", "datatype": "FP32",
                                "shape": [-1, -1, 256]}]
    assert client.get_model_metadata("gpt", "1") == meta
    config = client.get_model_config("gpt")
    assert config["max_batch_size"] == 8 and config["input"][0]["data_type"] == "TYPE_INT64"
    with pytest.raises(InferenceServerException, match="Did you mean 'gpt'"):
        client.get_model_metadata("gtp")


@pytest.mark.parametrize("binary", [True, False])
def test_inference_equals_the_direct_model_call(client, gpt_model, binary):
    x = _tokens(3, 11, seed=1)
    inp = httpclient.InferInput("INPUT__0", list(x.shape), "INT64")
    inp.set_data_from_numpy(x, binary_data=binary)
    out = httpclient.InferRequestedOutput("OUTPUT__0", binary_data=binary)
    result = client.infer("gpt", [inp], outputs=[out], request_id="r1")
    (want,) = outputs_of(gpt_model, [x])
    got = result.as_numpy("OUTPUT__0")
    assert got.dtype == np.float32 and got.shape == (3, 11, 256)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    assert result.get_response()["id"] == "r1"


def test_all_outputs_binary_when_none_are_named(client, gpt_model):
    x = _tokens(1, 5, seed=2)
    inp = httpclient.InferInput("INPUT__0", [1, 5], "INT64")
    inp.set_data_from_numpy(x)
    got = client.infer("gpt", [inp], model_version="1").as_numpy("OUTPUT__0")
    np.testing.assert_allclose(got, outputs_of(gpt_model, [x])[0], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("binary", [True, False])
def test_bytes_tensors(client, binary):
    text = np.array([[b"hello", b"v2 protocol"]], dtype=object)
    inp = httpclient.InferInput("TEXT", [1, 2], "BYTES")
    inp.set_data_from_numpy(text, binary_data=binary)
    out = httpclient.InferRequestedOutput("OUTPUT__0", binary_data=binary)
    got = client.infer("upper", [inp], outputs=[out]).as_numpy("OUTPUT__0")
    assert [v if isinstance(v, bytes) else v.encode() for v in got.reshape(-1)] == [
        b"HELLO", b"V2 PROTOCOL"]


@pytest.mark.parametrize("binary", [True, False])
def test_every_datatype_round_trips(client, binary):
    from tritonclient.utils import triton_to_np_dtype

    rng = np.random.default_rng(0)
    inputs, outputs, sent = [], [], {}
    for i, t in enumerate(ECHO_TYPES):
        if t == "BYTES":
            value = np.array([[b"a", b"bc"]], dtype=object)
        else:
            value = (rng.random((1, 2)) * 100).astype(triton_to_np_dtype(t))
        # BF16 goes as binary data either way (JSON has no BF16 in tritonclient), which
        # also mixes JSON and binary tensors in one request.
        as_binary = binary or t == "BF16"
        inputs.append(httpclient.InferInput(f"IN_{t}", [1, 2], t)
                      .set_data_from_numpy(value, binary_data=as_binary))
        outputs.append(httpclient.InferRequestedOutput(f"OUTPUT__{i}", binary_data=as_binary))
        sent[t] = value
    result = client.infer("echo", inputs, outputs=outputs)
    for i, t in enumerate(ECHO_TYPES):
        got = result.as_numpy(f"OUTPUT__{i}")
        assert result.get_output(f"OUTPUT__{i}")["datatype"] == t
        if t == "BYTES":
            got = np.array([v if isinstance(v, bytes) else v.encode()
                            for v in got.reshape(-1)], dtype=object).reshape(1, 2)
        np.testing.assert_array_equal(np.asarray(got, dtype=sent[t].dtype), sent[t])


def test_mistakes_come_back_as_client_errors(client):
    x = _tokens(1, 4, seed=3)
    inp = httpclient.InferInput("INPUT__0", [1, 4], "INT64")
    inp.set_data_from_numpy(x)
    with pytest.raises(InferenceServerException, match="OUTPUT__0") as e:
        client.infer("gpt", [inp], outputs=[httpclient.InferRequestedOutput("LOGITS")])
    assert e.value.status() == "400"
    wrong = httpclient.InferInput("INPUT__0", [1, 4], "FP32")
    wrong.set_data_from_numpy(x.astype(np.float32))
    with pytest.raises(InferenceServerException, match=r"datatype FP32.*takes INT64"):
        client.infer("gpt", [wrong])
    big = httpclient.InferInput("INPUT__0", [9, 4], "INT64")
    big.set_data_from_numpy(_tokens(9, 4, seed=4))
    with pytest.raises(InferenceServerException, match=r"batch size 9 is outside 1\.\.8"):
        client.infer("gpt", [big])
    assert client.is_server_live()
