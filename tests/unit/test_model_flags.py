"""--apply-layernorm-1p, --rotary-seq-len-interpolation-factor and --use-cpu-initialization against
plain references, and the TransformerConfig fields of Megatron-Core's walkthrough."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.models.gpt.gpt_model import GPTModel
from megatron.core.parallel_state import ParallelState, RankGrid
from megatron.core.tensor_parallel.random import MODEL_PARALLEL_RNG, model_parallel_cuda_manual_seed
from megatron.core.transformer.norms import Norm
from megatron.core.transformer.rope import apply_rotary, rotary_cos_sin
from megatron.core.transformer.transformer_config import TransformerConfig


def tiny(**kw) -> TransformerConfig:
    base = dict(
        num_layers=2, hidden_size=32, num_attention_heads=4, hidden_dropout=0.0, attention_dropout=0.0
    )
    base.update(kw)
    return TransformerConfig(**base)


def build(cfg: TransformerConfig, **kw) -> GPTModel:
    return GPTModel(cfg, get_gpt_layer_local_spec(), vocab_size=64, max_sequence_length=16, seed=5, **kw)


# ------------------------------------------------------------------------------------------------ layernorm 1p
@pytest.mark.parametrize("normalization", ["LayerNorm", "RMSNorm"])
def test_layernorm_1p_equals_a_plain_norm_of_weight_one_plus_w(normalization):
    x = torch.randn(5, 3, 32, generator=torch.Generator().manual_seed(0)) * 3 + 1
    w = torch.randn(32, generator=torch.Generator().manual_seed(1)) * 0.1
    one_p = Norm(tiny(normalization=normalization, apply_layernorm_1p=True), 32)
    with torch.no_grad():
        one_p.weight.copy_(w)
    if normalization == "LayerNorm":
        b = torch.randn(32, generator=torch.Generator().manual_seed(2))
        with torch.no_grad():
            one_p.bias.copy_(b)
        ref = F.layer_norm(x, (32,), 1 + w, b, 1e-5)
    else:
        ref = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * (1 + w)
    torch.testing.assert_close(one_p(x), ref)


def test_layernorm_1p_model_stores_zero_and_matches_the_plain_model():
    """Every norm (layers, final, QK) starts at 0; with weights w the 1p model computes what the plain
    model computes with weights 1 + w (the other weights equal: they do not depend on the flag)."""
    variant = dict(normalization="RMSNorm", qk_layernorm=True, position_embedding_type="rope")
    one_p, plain = build(tiny(apply_layernorm_1p=True, **variant)), build(tiny(**variant))
    norms = [name for name, _ in one_p.named_parameters() if "layernorm" in name and name.endswith("weight")]
    assert {n.split(".")[-2] for n in norms} == {
        "input_layernorm",
        "pre_mlp_layernorm",
        "q_layernorm",
        "k_layernorm",
        "final_layernorm",
    }
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in one_p.named_parameters():
            if name in norms:
                assert torch.count_nonzero(p) == 0
                p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
                plain.get_parameter(name).copy_(1 + p)
            else:
                assert torch.equal(p, plain.get_parameter(name))
    ids = torch.randint(0, 64, (2, 16), generator=gen)
    torch.testing.assert_close(one_p(ids, None, None), plain(ids, None, None))


def test_zero_centered_gamma_is_the_megatron_core_name():
    cfg = tiny(layernorm_zero_centered_gamma=True)
    assert cfg.apply_layernorm_1p and Norm(cfg, 8).zero_centered_gamma
    assert not tiny().layernorm_zero_centered_gamma


# ------------------------------------------------------------------------------------------------ RoPE
def test_rotary_interpolation_divides_positions_by_the_factor():
    """Position p rotates channel pair (i, i + d/2) by (p / f) * base^(-2i/d), by hand."""
    d, base, f = 8, 10000.0, 4.0
    x = torch.randn(1, 1, 1, d, generator=torch.Generator().manual_seed(0))
    for p in (0, 3, 10):
        cos, sin = rotary_cos_sin(torch.tensor([[p]]), d, base, seq_len_interpolation_factor=f)
        out = apply_rotary(x, cos, sin)[0, 0, 0]
        for i in range(d // 2):
            theta = (p / f) * base ** (-2 * i / d)
            a, b = x[0, 0, 0, i], x[0, 0, 0, i + d // 2]
            expect = torch.stack(
                [
                    a * torch.cos(torch.tensor(theta)) - b * torch.sin(torch.tensor(theta)),
                    b * torch.cos(torch.tensor(theta)) + a * torch.sin(torch.tensor(theta)),
                ]
            )
            torch.testing.assert_close(torch.stack([out[i], out[i + d // 2]]), expect)
    # interpolated position 8 with factor 4 is plain position 2
    torch.testing.assert_close(
        rotary_cos_sin(torch.tensor([[8]]), d, base, 4.0), rotary_cos_sin(torch.tensor([[2]]), d, base)
    )


def test_model_uses_the_interpolation_factor():
    cfg = dict(position_embedding_type="rope")
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(4))
    plain = build(tiny(**cfg))(ids, None, None)
    from_config = build(tiny(rotary_seq_len_interpolation_factor=2.0, **cfg))(ids, None, None)
    from_argument = build(tiny(**cfg), seq_len_interpolation_factor=2.0)(ids, None, None)
    assert torch.equal(from_config, from_argument) and not torch.allclose(from_config, plain)
    with pytest.raises(ValueError, match="rotary_seq_len_interpolation_factor must be > 0"):
        tiny(rotary_seq_len_interpolation_factor=0.0)


# ------------------------------------------------------------------------------------------------ CPU init
def test_cpu_initialization_builds_on_the_cpu_then_moves(monkeypatch):
    """With the flag a model for another device is filled on the CPU and then moved with one ``.to``;
    the values are those of the model initialised in place."""
    moves: list[torch.device] = []
    monkeypatch.setattr(GPTModel, "to", lambda self, device: moves.append(torch.device(device)) or self)
    cfg = dict(activation="swiglu", add_bias_linear=False, normalization="RMSNorm", apply_layernorm_1p=True)
    on_cpu = build(tiny(use_cpu_initialization=True, **cfg), device=torch.device("cuda"))
    assert moves == [torch.device("cuda")]  # .to is the stub: the parameters stay where they were filled
    reference = build(tiny(**cfg))
    assert not moves[1:]  # the CPU model is built in place
    for (name, p), q in zip(on_cpu.named_parameters(), reference.parameters()):
        assert p.device.type == "cpu" and torch.equal(p, q), name
        assert vars(p) == vars(q)  # the init / sharding recipes survive


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("bf16", [False, True])
def test_cpu_initialization_values_on_cuda(bf16):
    cfg = dict(activation="swiglu", add_bias_linear=False, bf16=bf16)
    direct = build(tiny(**cfg), device="cuda")
    via_cpu = build(tiny(use_cpu_initialization=True, **cfg), device="cuda")
    for (name, p), q in zip(via_cpu.named_parameters(), direct.parameters()):
        assert p.is_cuda and torch.equal(p, q), name


# ------------------------------------------------------------------------------------------------ config
def test_walkthrough_config_fields():
    cfg = TransformerConfig(
        num_layers=2,
        hidden_size=12,
        num_attention_heads=4,
        use_cpu_initialization=True,
        pipeline_dtype=torch.float32,
    )
    assert cfg.tensor_model_parallel_size == 1 and cfg.pipeline_dtype == torch.float32
    with pytest.raises(
        ValueError, match="pipeline_dtype torch.float32 differs from the parameter dtype torch.bfloat16"
    ):
        TransformerConfig(
            num_layers=2, hidden_size=12, num_attention_heads=4, bf16=True, pipeline_dtype=torch.float32
        )


def test_config_sizes_follow_the_groups_or_must_match():
    cfg = tiny()
    cfg.check_parallel_sizes(2, 4)  # left at 1: the groups decide
    with pytest.raises(
        ValueError,
        match=r"TransformerConfig.tensor_model_parallel_size is 4 but "
        "the model is built on process groups of size 2",
    ):
        tiny(tensor_model_parallel_size=4).check_parallel_sizes(2, 1)
    with pytest.raises(ValueError, match="pipeline_model_parallel_size is 2 but .* size 4"):
        tiny(pipeline_model_parallel_size=2).check_parallel_sizes(1, 4)
    with pytest.raises(
        ValueError, match="num_attention_heads 4 is not divisible by tensor_model_parallel_size 8"
    ):
        cfg.check_parallel_sizes(8, 1)
    assert tiny(sequence_parallel=True).sequence_parallel  # kept: it applies where the groups' tp > 1
    assert not build(tiny(sequence_parallel=True)).sequence_parallel


@pytest.mark.skipif(torch.cuda.is_available(), reason="on CUDA the CUDA generator is seeded instead")
def test_model_parallel_cuda_manual_seed_on_the_cpu():
    """The CPU's default generator gets the seed; the parallel state gets Megatron's named states."""
    ps = ParallelState(grid=RankGrid(), rank=0)
    with torch.random.fork_rng():
        tracker = model_parallel_cuda_manual_seed(123, parallel_state=ps)
        drawn = torch.rand(3)
        assert torch.equal(drawn, torch.rand(3, generator=torch.Generator().manual_seed(123)))
    assert ps.rng_tracker is tracker
    expect = torch.Generator().manual_seed(123 + 2718).get_state()  # tp rank 0
    assert torch.equal(tracker.get_states()[MODEL_PARALLEL_RNG], expect)
    with pytest.raises(ValueError, match="te_rng_tracker=False"):
        model_parallel_cuda_manual_seed(1, te_rng_tracker=True, parallel_state=ps)
