"""Megatron-Core's spec utilities and GPT layer specs (megatron.core.transformer.spec_utils,
megatron.core.models.gpt.gpt_layer_specs)."""

import functools

import pytest
import torch
from torch import nn

from megatron.core.config_utils import ConfigError
from megatron.core.models.gpt.gpt_layer_specs import (
    get_gpt_decoder_block_spec,
    get_gpt_layer_local_spec,
    get_gpt_layer_local_submodules,
    get_gpt_layer_with_transformer_engine_spec,
    get_mlp_module_spec,
)
from megatron.core.models.gpt.gpt_model import GPTModel
from megatron.core.transformer import MegatronModule, ModuleSpec, TransformerConfig
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.mlp import MLP, MLPSubmodules
from megatron.core.transformer.moe.experts import GroupedExperts
from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.spec_utils import build_module, get_module, get_submodules, import_module


class Scaled(nn.Module):
    def __init__(self, width, scale=1.0, submodules=None):
        super().__init__()
        self.width, self.scale, self.submodules = width, scale, submodules


def double(x):
    return 2 * x


def test_module_spec_builds_classes_tuples_and_keeps_functions():
    spec = ModuleSpec(module=Scaled, params={"scale": 3.0}, submodules="subs")
    built = build_module(spec, 8)
    assert (built.width, built.scale, built.submodules) == (8, 3.0, "subs")
    assert build_module(spec, 8, scale=5.0).scale == 5.0  # the caller's keyword wins
    assert spec(4).width == 4  # ModuleSpec is callable
    lazy = ModuleSpec(module=("torch.nn", "Linear"), params={"bias": False})
    linear = build_module(lazy, 3, 2)
    assert isinstance(linear, nn.Linear) and linear.bias is None
    assert get_module(lazy) is nn.Linear and import_module(("torch.nn", "Linear")) is nn.Linear
    assert import_module(("no_such_module_here", "X")) is None
    # functions are returned unchanged, never called
    assert build_module(double, 1, 2) is double
    assert build_module(ModuleSpec(module=double), 1) is double
    assert build_module(ModuleSpec(module=(__name__, "double"))) is double
    assert build_module(None) is None
    assert build_module(functools.partial(Scaled, scale=2.0), 6).scale == 2.0
    with pytest.raises(TypeError, match="when instantiating Scaled"):
        build_module(ModuleSpec(module=Scaled, params={"nope": 1}), 2)


def test_get_submodules():
    subs = MLPSubmodules()
    assert get_submodules(ModuleSpec(module=MLP, submodules=subs)) is subs
    assert get_submodules(functools.partial(MLP, submodules=subs)) is subs
    with pytest.raises(ValueError, match="submodules"):
        get_submodules(3)


def test_transformer_package_exports_megatron_core_names():
    from megatron.core.transformer.module import MegatronModule as M

    assert MegatronModule is M and TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=2)


def _cfg(**kw):
    return TransformerConfig(
        num_layers=2, hidden_size=32, num_attention_heads=4, hidden_dropout=0.0, attention_dropout=0.0, **kw
    )


def test_local_spec_signature_refusals_and_attention_mask_type():
    subs = get_gpt_layer_local_submodules()
    assert subs.self_attention.params == {"attn_mask_type": AttnMaskType.causal}
    for kw in (
        dict(multi_latent_attention=True),
        dict(qk_l2_norm=True),
    ):
        name = next(iter(kw))
        with pytest.raises(
            ConfigError, match=rf"get_gpt_layer_local_submodules\({name}=.*not supported here"
        ):
            get_gpt_layer_local_spec(**kw)
    moe = get_mlp_module_spec(num_experts=4)  # experts: the MoE layer in the mlp slot
    assert moe.module is MoELayer and get_submodules(moe).experts is GroupedExperts
    assert get_gpt_layer_local_spec(num_experts=8, moe_grouped_gemm=True).submodules.mlp.module is MoELayer
    mlp = get_mlp_module_spec()  # use_te=True: the local MLP
    assert mlp.module is MLP and get_submodules(mlp).linear_fc1 is not None
    spec = get_gpt_layer_local_spec(fp8="e4m3", normalization="RMSNorm")
    assert isinstance(get_gpt_layer_with_transformer_engine_spec(), ModuleSpec) and spec.module is not None


def test_qk_layernorm_from_the_spec_or_the_config():
    model = GPTModel(
        _cfg(), get_gpt_layer_local_spec(qk_layernorm=True), vocab_size=64, max_sequence_length=8
    )
    assert model.decoder.layers[0].self_attention.q_layernorm is not None
    plain = GPTModel(_cfg(), get_gpt_layer_local_spec(), vocab_size=64, max_sequence_length=8)
    assert plain.decoder.layers[0].self_attention.q_layernorm is None
    by_config = GPTModel(
        _cfg(qk_layernorm=True), get_gpt_layer_local_spec(), vocab_size=64, max_sequence_length=8
    )
    assert by_config.decoder.layers[0].self_attention.k_layernorm is not None
    spec = get_gpt_layer_local_spec()
    spec.submodules.self_attention.submodules.q_layernorm = IdentityOp
    spec.submodules.self_attention.submodules.k_layernorm = IdentityOp
    none = GPTModel(_cfg(qk_layernorm=True), spec, vocab_size=64, max_sequence_length=8)
    assert none.decoder.layers[0].self_attention.q_layernorm is None


def test_decoder_block_spec_builds_the_same_model_as_the_layer_spec():
    cfg = _cfg()
    block = get_gpt_decoder_block_spec(cfg, use_transformer_engine=False)
    assert len(block.layer_specs) == 2
    ids = torch.randint(0, 64, (2, 8))
    a = GPTModel(cfg, block, vocab_size=64, max_sequence_length=8, seed=2)
    b = GPTModel(cfg, get_gpt_layer_local_spec(), vocab_size=64, max_sequence_length=8, seed=2)
    torch.testing.assert_close(a(ids, None, None), b(ids, None, None), rtol=0, atol=0)


def test_no_mask_attention_type_is_bidirectional():
    from megatron.core.transformer.attention import DotProductAttention

    q, k, v = (torch.randn(5, 1, 2, 4) for _ in range(3))
    causal = DotProductAttention(_cfg()).eval()(q, k, v)
    full = DotProductAttention(_cfg(), attn_mask_type=AttnMaskType.no_mask).eval()(q, k, v)
    ref = torch.softmax(torch.einsum("sbnd,tbnd->bnst", q, k) / 2.0, -1)
    expected = torch.einsum("bnst,tbnd->sbnd", ref, v).reshape(5, 1, 8)
    torch.testing.assert_close(full, expected)
    torch.testing.assert_close(causal[-1], full[-1])  # the last query sees every key either way
    assert not torch.allclose(causal[0], full[0])
    scaled = DotProductAttention(_cfg(), softmax_scale=0.1).eval()(q, k, v)
    assert not torch.allclose(scaled, causal)


def test_megatron_core_style_hand_written_spec_builds():
    """A spec written as Megatron-Core's local spec is (bda functions, keys map, IdentityOp cross attention)."""
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.attention import (
        DotProductAttention,
        SelfAttention,
        SelfAttentionSubmodules,
    )
    from megatron.core.transformer.identity_op import IdentityFuncOp
    from megatron.core.transformer.norms import Norm
    from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules

    spec = ModuleSpec(
        module=TransformerLayer,
        submodules=TransformerLayerSubmodules(
            input_layernorm=Norm,
            self_attention=ModuleSpec(
                module=SelfAttention,
                params={"attn_mask_type": AttnMaskType.causal},
                submodules=SelfAttentionSubmodules(
                    linear_qkv=ColumnParallelLinear,
                    core_attention=DotProductAttention,
                    linear_proj=RowParallelLinear,
                    q_layernorm=IdentityOp,
                    k_layernorm=IdentityOp,
                ),
            ),
            self_attn_bda=IdentityFuncOp,
            cross_attention=IdentityOp,
            pre_mlp_layernorm=Norm,
            mlp=ModuleSpec(
                module=MLP,
                submodules=MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear),
            ),
            mlp_bda=IdentityFuncOp,
            sharded_state_dict_keys_map={"input_layernorm.": "self_attention.linear_qkv."},
        ),
    )
    ids = torch.randint(0, 64, (2, 8))
    a = GPTModel(_cfg(), spec, vocab_size=64, max_sequence_length=8, seed=2)
    b = GPTModel(_cfg(), get_gpt_layer_local_spec(), vocab_size=64, max_sequence_length=8, seed=2)
    torch.testing.assert_close(a(ids, None, None), b(ids, None, None), rtol=0, atol=0)
    layer = build_module(spec, _cfg(), layer_number=1, hidden_dropout=0.5)
    assert layer.hidden_dropout == 0.5
    with pytest.raises(ValueError, match="activation_func is not supported here"):
        MLP(_cfg(), MLPSubmodules(ColumnParallelLinear, RowParallelLinear, activation_func=nn.GELU))


def test_a_spec_written_with_megatron_core_import_paths_builds_the_local_model():
    """Megatron-Core's local layer spec written by hand, every name imported from the module Megatron-Core
    keeps it in (dot_product_attention, torch_norm, fused_bias_dropout, ...), builds the model of
    get_gpt_layer_local_spec; the named bias-dropout-add computes residual + dropout(x + bias)."""
    from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules
    from megatron.core.transformer.dot_product_attention import DotProductAttention as DPA
    from megatron.core.transformer.torch_norm import WrappedTorchNorm
    from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules

    spec = ModuleSpec(
        module=TransformerLayer,
        submodules=TransformerLayerSubmodules(
            input_layernorm=WrappedTorchNorm,
            self_attention=ModuleSpec(
                module=SelfAttention,
                params={"attn_mask_type": AttnMaskType.causal},
                submodules=SelfAttentionSubmodules(
                    linear_qkv=ColumnParallelLinear,
                    core_attention=DPA,
                    linear_proj=RowParallelLinear,
                    q_layernorm=IdentityOp,
                    k_layernorm=IdentityOp,
                ),
            ),
            self_attn_bda=get_bias_dropout_add,
            pre_mlp_layernorm=WrappedTorchNorm,
            mlp=ModuleSpec(
                module=MLP,
                submodules=MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear),
            ),
            mlp_bda=get_bias_dropout_add,
        ),
    )
    ids = torch.randint(0, 64, (2, 8))
    cfg = _cfg(normalization="RMSNorm")
    a = GPTModel(cfg, spec, vocab_size=64, max_sequence_length=8, seed=4)
    b = GPTModel(cfg, get_gpt_layer_local_spec(), vocab_size=64, max_sequence_length=8, seed=4)
    torch.testing.assert_close(a(ids, None, None), b(ids, None, None), rtol=0, atol=0)

    x, bias, residual = torch.randn(4, 3), torch.randn(3), torch.randn(4, 3)
    for fused in (False, True):
        torch.testing.assert_close(
            get_bias_dropout_add(False, fused)((x, bias), residual, 0.5), residual + x + bias
        )
        torch.manual_seed(0)
        dropped = get_bias_dropout_add(True, fused)((x, None), residual, 0.5) - residual
        assert ((dropped == 0) | torch.isclose(dropped, 2 * x)).all() and (dropped == 0).any()


def test_the_moe_groups_go_only_to_an_mlp_that_takes_them():
    """TransformerLayer hands the MoE groups to the mlp slot only where the module takes them: an MoE
    layer, not the dense MLP of a layer the pattern leaves dense (or a user's own MLP)."""
    import functools

    from megatron.core.transformer.mlp import MLP, MLPSubmodules
    from megatron.core.transformer.moe.moe_layer import MoELayer
    from megatron.core.transformer.spec_utils import ModuleSpec, accepts_keyword

    assert accepts_keyword(MoELayer, "moe_groups") and accepts_keyword(
        ModuleSpec(module=MoELayer), "moe_groups"
    )
    assert not accepts_keyword(MLP, "moe_groups")
    assert not accepts_keyword(ModuleSpec(module=MLP, submodules=MLPSubmodules()), "moe_groups")
    assert not accepts_keyword(functools.partial(MLP, submodules=MLPSubmodules()), "moe_groups")
    assert accepts_keyword(lambda config, **kwargs: None, "moe_groups")
