"""GPTModel and its parts against plain reference computations."""

import math

import pytest
import torch
import torch.nn.functional as F

from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.models.gpt.gpt_model import GPTModel
from megatron.core.tensor_parallel.init import init_param_, set_init_attrs
from megatron.core.transformer.attention import DotProductAttention
from megatron.core.transformer.rope import apply_rotary, rotary_cos_sin
from megatron.core.transformer.transformer_config import TransformerConfig


def tiny(**kw):
    base = dict(
        num_layers=2, hidden_size=32, num_attention_heads=4, hidden_dropout=0.0, attention_dropout=0.0
    )
    base.update(kw)
    return TransformerConfig(**base)


def build(cfg, vocab=64, seq=16, seed=7, **kw):
    return GPTModel(
        cfg, get_gpt_layer_local_spec(), vocab_size=vocab, max_sequence_length=seq, seed=seed, **kw
    )


VARIANTS = [
    {},
    dict(
        normalization="RMSNorm",
        activation="swiglu",
        position_embedding_type="rope",
        add_bias_linear=False,
        num_query_groups=2,
        share_embeddings_and_output_weights=False,
    ),
    dict(position_embedding_type="none", qk_layernorm=True, num_query_groups=1, rotary_percent=0.5),
]


@pytest.mark.parametrize("variant", VARIANTS)
def test_forward_shapes_and_loss_matches_cross_entropy(variant):
    model = build(tiny(**variant))
    ids = torch.randint(0, 64, (3, 16))
    labels = torch.randint(0, 64, (3, 16))
    logits = model(ids, None, None)
    assert logits.shape == (3, 16, 64)
    loss = model(ids, None, None, labels=labels)
    assert loss.shape == (3, 16) and loss.dtype == torch.float32
    ref = F.cross_entropy(logits.reshape(-1, 64).float(), labels.reshape(-1), reduction="none").view(3, 16)
    torch.testing.assert_close(loss, ref)
    loss.mean().backward()
    assert all(p.grad is not None for p in model.parameters())


@pytest.mark.parametrize(
    "kw, approximate",
    [
        ({}, "none"),  # Megatron-Core's default: exact GELU
        (dict(bias_gelu_fusion=True), "tanh"),  # Megatron-LM's default bias-GELU fusion
        (dict(bias_gelu_fusion=False), "none"),  # --no-bias-gelu-fusion
        (dict(bias_gelu_fusion=True, add_bias_linear=False), "none"),  # no bias: Megatron drops the fusion
    ],
)
def test_gelu_follows_megatron(kw, approximate):
    """The MLP computes Megatron-LM's GELU: its tanh formula for a biased MLP with the bias-GELU fusion,
    erf's exact GELU otherwise. Inputs are large enough that the two differ well beyond fp32 rounding."""
    cfg = tiny(**kw)
    assert cfg.gelu_approximation == approximate
    mlp = build(cfg).decoder.layers[0].mlp
    x = torch.randn(5, 2, 32) * 30
    h = F.linear(x, mlp.linear_fc1.weight, mlp.linear_fc1.bias)
    tanh_gelu = 0.5 * h * (1.0 + torch.tanh(0.7978845608 * h * (1.0 + 0.044715 * h * h)))
    erf_gelu = 0.5 * h * (1.0 + torch.erf(h / math.sqrt(2.0)))
    assert (tanh_gelu - erf_gelu).abs().max() > 1e-4
    out, bias = mlp(x)
    expected = F.linear(tanh_gelu if approximate == "tanh" else erf_gelu, mlp.linear_fc2.weight)
    torch.testing.assert_close(out, expected)


def test_causality():
    model = build(tiny(position_embedding_type="rope", normalization="RMSNorm"))
    ids = torch.randint(0, 64, (1, 16))
    out1 = model(ids, None, None)
    ids2 = ids.clone()
    ids2[0, 10:] = (ids2[0, 10:] + 1) % 64
    out2 = model(ids2, None, None)
    torch.testing.assert_close(out1[:, :10], out2[:, :10])
    assert not torch.allclose(out1[:, 10:], out2[:, 10:])


def test_gqa_attention_matches_naive():
    torch.manual_seed(0)
    s, b, n_q, n_kv, d = 8, 2, 4, 2, 16
    q, k, v = torch.randn(s, b, n_q, d), torch.randn(s, b, n_kv, d), torch.randn(s, b, n_kv, d)
    out = DotProductAttention(tiny()).eval()(q, k, v)  # [s, b, n_q*d]
    kk = k.repeat_interleave(n_q // n_kv, dim=2)
    vv = v.repeat_interleave(n_q // n_kv, dim=2)
    scores = torch.einsum("sbnd,tbnd->bnst", q, kk) / math.sqrt(d)
    scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf"))
    ref = torch.einsum("bnst,tbnd->sbnd", scores.softmax(-1), vv).reshape(s, b, n_q * d)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_explicit_mask_blocks_documents():
    s = 6
    q = k = v = torch.randn(s, 1, 2, 8)
    causal = torch.ones(s, s, dtype=torch.bool).triu(1)
    attn = DotProductAttention(tiny()).eval()
    torch.testing.assert_close(attn(q, k, v, causal.view(1, 1, s, s)), attn(q, k, v))


def test_rope_relative_positions():
    d = 8
    q, k = torch.randn(1, 1, 1, d), torch.randn(1, 1, 1, d)

    def score(pq, pk):
        cq, sq = rotary_cos_sin(torch.tensor([[pq]]), d, 10000.0)
        ck, sk = rotary_cos_sin(torch.tensor([[pk]]), d, 10000.0)
        return (apply_rotary(q, cq, sq) * apply_rotary(k, ck, sk)).sum()

    torch.testing.assert_close(score(5, 2), score(13, 10))
    assert not torch.allclose(score(5, 2), score(5, 4))
    cos, sin = rotary_cos_sin(torch.tensor([[3]]), d, 10000.0)
    torch.testing.assert_close(apply_rotary(q, cos, sin).norm(), q.norm())


@pytest.mark.parametrize("dim,stride", [(0, 1), (1, 1), (0, 2)])
def test_sharded_init_equals_full_init(dim, stride):
    full = set_init_attrs(torch.empty(600, 12), std=0.02)
    init_param_(full, "w", seed=3)
    shards = []
    for r in range(3):
        shape = [600, 12]
        shape[dim] //= 3
        p = set_init_attrs(
            torch.empty(*shape), std=0.02, partition_dim=dim, partition_size=3, partition_stride=stride
        )
        init_param_(p, "w", seed=3, tp_rank=r)
        shards.append(p)
    if stride == 1:
        torch.testing.assert_close(torch.cat(shards, dim), full, rtol=0, atol=0)
    else:  # [gate; up]: each half is split separately
        halves = [torch.cat([sh.view(2, -1, 12)[i] for sh in shards]) for i in range(2)]
        torch.testing.assert_close(torch.cat(halves), full, rtol=0, atol=0)


def test_init_depends_on_seed_and_name_only():
    a = build(tiny(), seed=1)
    b = build(tiny(), seed=1)
    c = build(tiny(), seed=2)
    for (name, pa), pb, pc in zip(a.named_parameters(), b.parameters(), c.parameters()):
        assert torch.equal(pa, pb), name
        if pa.std() > 0:
            assert not torch.equal(pa, pc), name
    w = a.decoder.layers[0].self_attention.linear_proj.weight
    assert abs(w.std().item() - 0.02 / math.sqrt(4)) < 0.003  # scaled init std / sqrt(2L)


def test_sharded_state_dict_covers_state_dict():
    model = build(tiny(share_embeddings_and_output_weights=False))
    sd = model.sharded_state_dict(prefix="")
    assert set(sd) == set(model.state_dict())
    for key, sh in sd.items():
        assert (
            sh.key == key
            and sh.global_shape == tuple(sh.data.shape)
            and sh.data.data_ptr() == model.state_dict()[key].data_ptr()
        )
    tied = build(tiny(share_embeddings_and_output_weights=True)).sharded_state_dict()
    assert "output_layer.weight" not in tied


def test_megatron_core_example_shapes():
    config = TransformerConfig(num_layers=2, hidden_size=12, num_attention_heads=4)
    model = GPTModel(
        config=config,
        transformer_layer_spec=get_gpt_layer_local_spec(),
        vocab_size=100,
        max_sequence_length=64,
    )
    ids = torch.randint(0, 100, (2, 64))
    pos = torch.arange(64).expand(2, 64)
    assert model(ids, pos, None, labels=ids).shape == (2, 64)


def test_config_errors_name_the_parameter():
    with pytest.raises(ValueError, match="num_attention_heads 5 does not divide hidden_size 32"):
        tiny(num_attention_heads=5)
    with pytest.raises(ValueError, match="num_query_groups 3"):
        tiny(num_query_groups=3)
    with pytest.raises(ValueError, match="fp16 and bf16"):
        tiny(fp16=True, bf16=True)
    with pytest.raises(ValueError, match="normalization 'BatchNorm' is not valid"):
        tiny(normalization="BatchNorm")
    assert tiny(activation="swiglu", hidden_size=96, num_attention_heads=4).ffn_hidden_size == 256
