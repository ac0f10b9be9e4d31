"""The Triton repository: config.pbtxt parses against Triton's schema, model.pt matches."""

import numpy as np
import pytest
import torch
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2

from gpufleet.errors import ConfigError
from gpufleet.serve.export import export_triton, outputs_of, to_pbtxt
from gpufleet.serve.model import TensorSpec, from_module, load_model


@pytest.fixture(scope="module")
def repo(gpt_model, tmp_path_factory):
    out = tmp_path_factory.mktemp("repo")
    export_triton(gpt_model, out, max_batch_size=16, max_queue_delay_us=250)
    return out


def test_config_parses_against_tritons_model_config(repo):
    config = text_format.Parse((repo / "gpt" / "config.pbtxt").read_text(),
                               model_config_pb2.ModelConfig())
    assert config.name == "gpt" and config.platform == "pytorch_libtorch"
    assert config.max_batch_size == 16
    assert config.dynamic_batching.max_queue_delay_microseconds == 250
    # The GPT's trace holds no device constant, so Triton may place it on any instance.
    assert not config.instance_group
    (inp,) = config.input
    (out,) = config.output
    assert (inp.name, inp.data_type, list(inp.dims)) == (
        "INPUT__0", model_config_pb2.TYPE_INT64, [-1])
    assert (out.name, out.data_type, list(out.dims)) == (
        "OUTPUT__0", model_config_pb2.TYPE_FP32, [-1, 256])


@pytest.mark.filterwarnings("ignore:`torch.jit.load` is deprecated:DeprecationWarning")
@pytest.mark.parametrize("shape", [(1, 16), (3, 5)])
def test_exported_torchscript_matches_the_model(repo, gpt_model, shape):
    module = torch.jit.load(str(repo / "gpt" / "1" / "model.pt"))
    x = np.random.default_rng(0).integers(0, 256, shape, dtype=np.int64)
    with torch.no_grad():
        got = module(torch.from_numpy(x)).numpy()
    np.testing.assert_allclose(got, outputs_of(gpt_model, [x])[0], rtol=1e-5, atol=1e-6)


def test_the_exported_model_directory_can_be_served(repo, gpt_model):
    served = load_model(str(repo / "gpt"), device="cpu")
    assert [(s.name, s.datatype, s.dims) for s in served.outputs] == [
        ("OUTPUT__0", "FP32", (-1, 256))]
    x = np.arange(8, dtype=np.int64).reshape(2, 4)
    np.testing.assert_allclose(served.fn([x])[0], outputs_of(gpt_model, [x])[0],
                               rtol=1e-5, atol=1e-6)


def test_pbtxt_writer_quotes_strings_and_leaves_enums_bare():
    text = to_pbtxt({"name": 'a"b', "input": [{"data_type": "TYPE_FP32", "dims": [1, -1]}]})
    config = text_format.Parse(text, model_config_pb2.ModelConfig())
    assert config.name == 'a"b' and list(config.input[0].dims) == [1, -1]


def test_a_numpy_callable_cannot_be_exported(extra_models, tmp_path):
    with pytest.raises(ConfigError, match="not a torch module"):
        export_triton(extra_models[0], tmp_path)


def test_a_torchscript_file_and_a_factory_serve_with_input_specs(repo, gpt_model):
    script = load_model(str(repo / "gpt" / "1" / "model.pt"), inputs=["INPUT__0:INT64:-1"],
                        device="cpu")
    assert script.name == "model"
    assert [(s.name, s.datatype, s.dims) for s in script.outputs] == [
        ("OUTPUT__0", "FP32", (-1, 256))]
    x = np.arange(6, dtype=np.int64).reshape(1, 6)
    np.testing.assert_allclose(script.fn([x])[0], outputs_of(gpt_model, [x])[0],
                               rtol=1e-5, atol=1e-6)
    mlp = load_model("toyjob:make_model", inputs=["x:FP32:8"], device="cpu")
    assert (mlp.name, mlp.outputs[0].dims) == ("make_model", (1,))
    assert mlp.fn([np.zeros((5, 8), np.float32)])[0].shape == (5, 1)


def test_a_scalar_per_sample_round_trips_through_the_repository(tmp_path):
    import torch

    class Scale(torch.nn.Module):
        def forward(self, x, k):
            return x * k[:, None]

    model = from_module("scale", Scale(), [TensorSpec("INPUT__0", "FP32", (3,)),
                                           TensorSpec("INPUT__1", "FP32", ())], "cpu")
    folder = export_triton(model, tmp_path)
    config = text_format.Parse((folder / "config.pbtxt").read_text(),
                               model_config_pb2.ModelConfig())
    assert list(config.input[1].dims) == [1] and config.input[1].HasField("reshape")
    served = load_model(str(folder), device="cpu")
    assert served.inputs[1].dims == ()
    x, k = np.ones((2, 3), np.float32), np.array([2.0, 3.0], np.float32)
    np.testing.assert_array_equal(served.fn([x, k])[0], [[2, 2, 2], [3, 3, 3]])


class _Positions(torch.nn.Module):
    """Adds each position's index: a trace records the arange's device as a constant."""

    def forward(self, x):
        return x + torch.arange(x.shape[1], device=x.device, dtype=x.dtype)


def test_a_trace_that_pins_the_cpu_asks_for_cpu_instances(tmp_path):
    model = from_module("pos", _Positions(), [TensorSpec("x", "FP32", (-1,))], "cpu")
    folder = export_triton(model, tmp_path, max_batch_size=4, max_queue_delay_us=100)
    config = text_format.Parse((folder / "config.pbtxt").read_text(),
                               model_config_pb2.ModelConfig())
    assert config.instance_group[0].kind == model_config_pb2.ModelInstanceGroup.KIND_CPU


def test_pbtxt_round_trips_the_config_dict():
    from google.protobuf import json_format

    config = {"name": "m", "platform": "pytorch_libtorch", "max_batch_size": 4,
              "input": [{"name": "INPUT__0", "data_type": "TYPE_INT64", "dims": [-1],
                         "reshape": {"shape": []}}],
              "instance_group": [{"count": 1, "kind": "KIND_CPU"}]}
    parsed = text_format.Parse(to_pbtxt(config), model_config_pb2.ModelConfig())
    back = json_format.MessageToDict(parsed, preserving_proto_field_name=True)
    assert back["input"][0]["data_type"] == "TYPE_INT64" and back["max_batch_size"] == 4
    assert back["instance_group"] == [{"count": 1, "kind": "KIND_CPU"}]
