"""Megatron-Core's module classes and rotary embeddings: MegatronModule, Float16Module,
LanguageModule, RotaryEmbedding and apply_rotary_pos_emb."""

import pytest
import torch
from torch import nn

from megatron.core.config_utils import ConfigError
from megatron.core.models.common.embeddings import LanguageModelEmbedding
from megatron.core.models.common.embeddings.rope_utils import apply_rotary_pos_emb
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
from megatron.core.models.common.language_module.language_module import LanguageModule
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.models.gpt.gpt_model import GPTModel
from megatron.core.transformer.module import Float16Module, MegatronModule
from megatron.core.transformer.rope import apply_rotary, rotary_cos_sin
from megatron.core.transformer.transformer_config import TransformerConfig


def _cfg(**kw):
    return TransformerConfig(
        num_layers=2, hidden_size=32, num_attention_heads=4, hidden_dropout=0.0, attention_dropout=0.0, **kw
    )


def _model(cfg, **kw):
    return GPTModel(cfg, get_gpt_layer_local_spec(), vocab_size=64, max_sequence_length=8, seed=4, **kw)


def test_gpt_model_is_a_megatron_language_module():
    model = _model(_cfg())
    assert isinstance(model, LanguageModule) and isinstance(model, MegatronModule)
    assert model.config.hidden_size == 32 and LanguageModelEmbedding is type(model.embedding)
    model.set_is_first_microbatch()
    sd = MegatronModule.sharded_state_dict(model, prefix="m.")
    assert "m.output_layer.weight" not in sd or sd["m.output_layer.weight"].key == "m.output_layer.weight"
    assert sd["m.embedding.word_embeddings.weight"].global_shape == (64, 32)


def test_compute_language_model_loss_takes_megatron_core_shapes():
    model = _model(_cfg())
    ids, labels = torch.randint(0, 64, (2, 8)), torch.randint(0, 64, (2, 8))
    logits = model(ids, None, None)  # [b, s, V]
    loss = model.compute_language_model_loss(
        labels, logits.transpose(0, 1)
    )  # labels [b, s], logits [s, b, V]
    assert loss.shape == (2, 8) and loss.dtype == torch.float32
    expected = nn.functional.cross_entropy(logits.reshape(-1, 64), labels.reshape(-1), reduction="none")
    torch.testing.assert_close(loss, expected.view(2, 8))
    torch.testing.assert_close(loss, model(ids, None, None, labels=labels))


class _Stage(nn.Module):
    def __init__(self, pre_process=True, post_process=True):
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.pre_process, self.post_process = pre_process, post_process
        self.seen = None

    def forward(self, x, ids):
        self.seen = (x.dtype, ids.dtype)
        return self.linear(x.to(self.linear.weight.dtype)), ids


@pytest.mark.parametrize("dtype_flag,dtype", [("bf16", torch.bfloat16), ("fp16", torch.float16)])
def test_float16_module_casts_inputs_on_the_first_stage_and_outputs_on_the_last(dtype_flag, dtype):
    cfg = _cfg(**{dtype_flag: True})
    wrapped = Float16Module(cfg, _Stage())
    assert wrapped.module.linear.weight.dtype == dtype and isinstance(wrapped, MegatronModule)
    x, ids = torch.randn(2, 4), torch.arange(2)
    out, out_ids = wrapped(x, ids)
    assert (
        wrapped.module.seen == (dtype, torch.int64)
        and out.dtype == torch.float32
        and out_ids.dtype == torch.int64
    )
    assert wrapped(x, ids, fp32_output=False)[0].dtype == dtype
    middle = Float16Module(cfg, _Stage(pre_process=False, post_process=False))
    out, _ = middle(x, ids)
    assert middle.module.seen[0] == torch.float32 and out.dtype == dtype
    assert set(wrapped.state_dict()) == {"linear.weight", "linear.bias"}
    with pytest.raises(ValueError, match="fp16=True or config.bf16=True"):
        Float16Module(_cfg(), _Stage())


def test_float16_module_runs_a_gpt_model():
    cfg = _cfg(bf16=True)
    model = Float16Module(cfg, _model(cfg))
    logits = model(torch.randint(0, 64, (2, 8)), None, None)
    assert logits.dtype == torch.float32 and logits.shape == (2, 8, 64)


def test_rotary_embedding_and_apply_rotary_pos_emb_equal_our_rope():
    cfg = _cfg()
    rope = RotaryEmbedding(
        kv_channels=8, rotary_percent=0.5, rotary_base=500, seq_len_interpolation_factor=2.0
    )
    freqs = rope(6, offset=3)
    assert freqs.shape == (6, 1, 1, 4) and freqs.dtype == torch.float32
    positions = torch.arange(3, 9).expand(2, 6)
    cos, sin = rotary_cos_sin(positions, 4, 500, 2.0)
    torch.testing.assert_close(freqs.cos().expand_as(cos), cos)
    t = torch.randn(6, 2, 4, 8)
    torch.testing.assert_close(apply_rotary_pos_emb(t, freqs, cfg), apply_rotary(t, cos, sin))
    # channel pair i turns by position * base ** (-2i / d): check one value by hand
    assert freqs[0, 0, 0, 1].item() == pytest.approx(3 / 2.0 * 500 ** (-2 / 4))
    assert torch.equal(apply_rotary_pos_emb(t, freqs, cfg)[..., 4:], t[..., 4:])


def test_rotary_embedding_returns_this_cp_ranks_positions(monkeypatch):
    """With a cp group of N > 1 ranks, ``forward(S)`` is the zigzag slice of the whole sequence's angles
    (rank r: chunks r and 2N-1-r of 2N); ``packed_seq`` keeps every position; apply_rotary_pos_emb
    takes the cp group and rotates by the rows it is given (already the rank's)."""
    from megatron.core.models.common.embeddings import rotary_pos_embedding as rpe
    from megatron.core.transformer.context_parallel.layout import local_token_indices

    group = object()  # a stand-in cp group of 2 ranks; the module asks its size and rank only
    monkeypatch.setattr(rpe, "group_size", lambda g: 2 if g is group else 1)
    whole = RotaryEmbedding(8, 1.0)(16)
    for rank in (0, 1):
        monkeypatch.setattr(rpe, "group_rank", lambda g, r=rank: r if g is group else 0)
        mine = RotaryEmbedding(8, 1.0, cp_group=group)(16)
        assert torch.equal(mine, whole[local_token_indices(16, 2, rank)])
        assert torch.equal(RotaryEmbedding(8, 1.0)(16, cp_group=group), mine)
        assert torch.equal(RotaryEmbedding(8, 1.0, cp_group=group)(16, packed_seq=True), whole)
    t = torch.randn(8, 1, 2, 8)
    assert torch.equal(
        apply_rotary_pos_emb(t, mine, _cfg(), cp_group=group), apply_rotary_pos_emb(t, mine, _cfg())
    )
    with pytest.raises(ConfigError, match="4 equal chunks"):
        RotaryEmbedding(8, 1.0, cp_group=group)(6)


def test_rotary_refusals():
    with pytest.raises(ConfigError, match="rotary_interleaved"):
        RotaryEmbedding(8, 1.0, rotary_interleaved=True)
    with pytest.raises(ConfigError, match="cu_seqlens"):
        apply_rotary_pos_emb(
            torch.randn(2, 1, 1, 4), torch.zeros(2, 1, 1, 4), _cfg(), cu_seqlens=torch.tensor([0, 2])
        )
    scaled = RotaryEmbedding(64, 1.0, rope_scaling=True, rotary_base=500000)
    plain = RotaryEmbedding(64, 1.0, rotary_base=500000)
    assert scaled.inv_freq[0] == plain.inv_freq[0] and scaled.inv_freq[-1] == pytest.approx(
        plain.inv_freq[-1] / 8
    )


def test_gpt_model_takes_megatron_core_arguments():
    from megatron.core.process_groups_config import ProcessGroupCollection

    model = _model(
        _cfg(),
        fp16_lm_cross_entropy=False,
        rope_scaling=False,
        scatter_embedding_sequence_parallel=True,
        mtp_block_spec=None,
        pg_collection=ProcessGroupCollection(),
    )
    assert model.pg.tp_size == 1
    for kw in (dict(fp16_lm_cross_entropy=True), dict(mtp_block_spec=object())):
        with pytest.raises(ConfigError, match=rf"GPTModel\({next(iter(kw))}=.*not supported here"):
            _model(_cfg(), **kw)


def test_gpt_model_rope_scaling_argument_is_the_configs():
    """GPTModel(rope_scaling=True, rope_scaling_factor=f) runs Llama 3's scaled RoPE, as the config's
    rope_scaling / rope_scaling_factor do; it changes the logits of a rope model."""
    tokens = torch.randint(0, 64, (1, 16))
    cfg = dict(position_embedding_type="rope", rotary_base=500000)
    torch.manual_seed(0)
    by_arg = _model(_cfg(**cfg), rope_scaling=True, rope_scaling_factor=4.0)
    torch.manual_seed(0)
    by_cfg = _model(_cfg(**cfg, rope_scaling=True, rope_scaling_factor=4.0))
    torch.manual_seed(0)
    plain = _model(_cfg(**cfg))
    with torch.no_grad():
        positions = torch.arange(16)[None] * 1000  # far apart: the scaled (long) wavelengths matter
        a, b, c = (m.eval()(tokens, positions, None) for m in (by_arg, by_cfg, plain))
    assert torch.equal(a, b)
    assert not torch.allclose(a, c)


def test_swiglu_model_loads_what_dist_checkpointing_returns(tmp_path):
    """``model.load_state_dict(dist_checkpointing.load(model.sharded_state_dict(), d))``, Megatron-Core's
    pattern, with SwiGLU's stacked fc1 (stored as [2, F, h])."""
    import torch.nn.functional as F

    from megatron.core import dist_checkpointing

    cfg = _cfg(gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False)
    model, fresh = (
        _model(cfg),
        GPTModel(cfg, get_gpt_layer_local_spec(), vocab_size=64, max_sequence_length=8, seed=9),
    )
    dist_checkpointing.save(model.sharded_state_dict(prefix=""), str(tmp_path))
    fresh.load_state_dict(dist_checkpointing.load(fresh.sharded_state_dict(prefix=""), str(tmp_path)))
    for (name, a), b in zip(model.state_dict().items(), fresh.state_dict().values()):
        assert torch.equal(a, b), name
