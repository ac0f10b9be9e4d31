import math

import pytest
import torch

from gpufleet.errors import ConfigError
from gpufleet.models import GPT, GPTConfig, build_gpt


def tiny(**kw) -> GPT:
    torch.manual_seed(0)
    cfg = {"n_layer": 2, "n_head": 2, "n_embd": 32, "block_size": 16, **kw}
    return build_gpt(**cfg)


def test_padded_vocab_is_next_multiple_of_64():
    assert GPTConfig(vocab_size=256).padded_vocab_size == 256
    assert GPTConfig(vocab_size=100).padded_vocab_size == 128
    assert GPTConfig(vocab_size=50257).padded_vocab_size == 50304


def test_logits_shape_and_loss_at_init_is_uniform():
    model = tiny()
    idx = torch.randint(0, 256, (4, 16))
    assert model(idx).shape == (4, 16, 256)
    loss = model(idx, targets=torch.randint(0, 256, (4, 16)))
    assert loss.ndim == 0
    assert abs(loss.item() - math.log(256)) < 0.3


def test_padded_vocab_logits_and_loss():
    model = tiny(vocab_size=100)
    idx = torch.randint(0, 100, (2, 8))
    assert model(idx).shape == (2, 8, 128)
    assert model(idx, targets=idx).isfinite()


def test_backward_reaches_every_parameter():
    model = tiny()
    idx = torch.randint(0, 256, (2, 16))
    model(idx, targets=idx).backward()
    for name, p in model.named_parameters():
        assert p.grad is not None, name
        assert p.grad.isfinite().all(), name
    assert model.wte.weight.grad.abs().sum() > 0


def test_adamw_steps_on_a_repeated_batch_lower_the_loss():
    model = tiny()
    opt = torch.optim.AdamW(model.param_groups(weight_decay=0.1), lr=3e-3)
    x = torch.randint(0, 256, (4, 16))
    y = torch.roll(x, -1, dims=1)
    losses = []
    for _ in range(15):
        loss = model(x, targets=y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 1.0, losses


def test_weight_tying_is_one_tensor():
    model = tiny()
    assert model.lm_head.weight is model.wte.weight
    with torch.no_grad():
        model.wte.weight[3].fill_(1.5)
    assert torch.equal(model.lm_head.weight[3], torch.full((32,), 1.5))
    n_unique = sum(p.numel() for p in {id(p): p for p in model.state_dict().values()}.values())
    assert model.num_params() < n_unique  # state_dict lists the tied tensor twice


def test_num_params():
    model = tiny()
    total = sum(p.numel() for p in model.parameters())
    assert model.num_params() == total
    embeddings = 256 * 32 + 16 * 32
    assert model.num_params(exclude_embeddings=True) == total - embeddings


def test_param_groups_hold_every_parameter_once():
    model = tiny()
    decay, no_decay = model.param_groups(weight_decay=0.1)
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    ids = [id(p) for g in (decay, no_decay) for p in g["params"]]
    assert len(ids) == len(set(ids))
    assert set(ids) == {id(p) for p in model.parameters()}
    assert all(p.ndim >= 2 for p in decay["params"])
    assert all(p.ndim < 2 for p in no_decay["params"])
    assert sum(p is model.wte.weight for p in decay["params"]) == 1


def test_attention_is_causal():
    model = tiny().eval()
    idx = torch.randint(0, 256, (1, 16))
    changed = idx.clone()
    changed[0, 10:] = (changed[0, 10:] + 1) % 256
    a, b = model(idx), model(changed)
    assert torch.allclose(a[:, :10], b[:, :10], atol=1e-6)
    assert not torch.allclose(a[:, 10:], b[:, 10:])


def test_shorter_sequences_work_and_too_long_raises():
    model = tiny()
    assert model(torch.zeros(1, 5, dtype=torch.long)).shape == (1, 5, 256)
    with pytest.raises(ValueError, match=r"17.*16"):
        model(torch.zeros(1, 17, dtype=torch.long))


def test_dropout_only_in_training():
    model = tiny(dropout=0.5)
    idx = torch.randint(0, 256, (2, 16))
    model.eval()
    assert torch.equal(model(idx), model(idx))
    model.train()
    assert not torch.equal(model(idx), model(idx))


def test_bias_option():
    with_bias = GPT(GPTConfig(n_layer=1, n_head=2, n_embd=32, block_size=8, bias=True))
    without = GPT(GPTConfig(n_layer=1, n_head=2, n_embd=32, block_size=8))
    assert with_bias.num_params() > without.num_params()
    assert with_bias.blocks[0].attn.c_attn.bias is not None


def test_residual_projections_use_scaled_init():
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=8, n_head=4, n_embd=256, block_size=8))
    proj = model.blocks[0].mlp.c_proj.weight.std().item()
    fc = model.blocks[0].mlp.c_fc.weight.std().item()
    assert fc == pytest.approx(0.02, rel=0.05)
    assert proj == pytest.approx(0.02 / math.sqrt(16), rel=0.05)


@pytest.mark.parametrize("kw, word", [
    ({"n_embd": 30, "n_head": 4}, "n_head"),
    ({"n_layer": 0}, "n_layer"),
    ({"dropout": 1.0}, "dropout"),
])
def test_bad_config_names_the_value(kw, word):
    with pytest.raises(ConfigError, match=word):
        GPTConfig(**kw)


def test_pipeline_stages_chain_to_the_whole_model_with_its_names():
    from gpufleet.models.gpt import lm_loss

    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, block_size=8, n_layer=3, n_head=2, n_embd=16))
    names = [n for n, _ in model.pipeline_units()]
    assert names == ["embed", "blocks.0", "blocks.1", "blocks.2", "head"]
    idx = torch.randint(0, 64, (2, 8))
    whole = model(idx)
    stages = [model.pipeline_stage(names[:2]), model.pipeline_stage(names[2:])]
    torch.testing.assert_close(stages[1](stages[0](idx)), whole)
    # Every name of the whole model, each on one stage (the head's copy of the tie too).
    assert sorted(n for s in stages for n in s.state_dict()) == sorted(model.state_dict())
    assert stages[1].lm_head.weight is not stages[0].wte.weight
    torch.testing.assert_close(lm_loss(whole, idx), model(idx, targets=idx))
