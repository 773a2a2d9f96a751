"""Megatron-Core's ModelParallelConfig / TransformerConfig: fields, defaults and __post_init__ rules."""

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from megatron.core.config_utils import ConfigError
from megatron.core.model_parallel_config import ModelParallelConfig
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.models.gpt.gpt_model import GPTModel
from megatron.core.transformer import config_support
from megatron.core.transformer.enums import AttnBackend
from megatron.core.transformer.moe_config_fields import MoEConfigFields
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.training.arguments import configs_from_namespace, parse_namespace

SHAPE = dict(num_layers=2, hidden_size=64, num_attention_heads=4)

# Megatron-Core 0.19.2's defaults of fields its users' training loops rely on.
MCORE_DEFAULTS = dict(
    tensor_model_parallel_size=1,
    pipeline_model_parallel_size=1,
    context_parallel_size=1,
    expert_model_parallel_size=1,
    sequence_parallel=False,
    perform_initialization=True,
    use_cpu_initialization=False,
    fp16=False,
    bf16=False,
    params_dtype=torch.float32,
    timers=None,
    gradient_accumulation_fusion=False,
    tp_comm_overlap=False,
    batch_p2p_comm=True,
    overlap_p2p_comm=False,
    deallocate_pipeline_outputs=False,
    variable_seq_lengths=False,
    cross_entropy_loss_fusion=False,
    cpu_offloading=False,
    barrier_with_L1_time=True,
    gated_linear_unit=False,
    activation_func=F.gelu,
    bias_activation_fusion=False,
    add_bias_linear=True,
    apply_residual_connection_post_layernorm=False,
    layernorm_zero_centered_gamma=False,
    normalization="LayerNorm",
    apply_query_key_layer_scaling=False,
    attention_softmax_in_fp32=True,
    masked_softmax_fusion=False,
    persist_layer_norm=False,
    memory_efficient_layer_norm=False,
    bias_dropout_fusion=False,
    apply_rope_fusion=False,
    init_method_std=0.02,
    hidden_dropout=0.1,
    attention_dropout=0.1,
    layernorm_epsilon=1e-5,
    fp8=None,
    fp8_recipe="delayed",
    recompute_granularity=None,
    num_moe_experts=None,
    moe_router_topk=2,
    moe_ffn_hidden_size=None,
    moe_grouped_gemm=False,
    moe_aux_loss_coeff=0.0,
    moe_token_dispatcher_type="allgather",
    cp_comm_type=None,
    multi_latent_attention=False,
    mtp_num_layers=None,
    attention_backend=AttnBackend.auto,
    transformer_impl="transformer_engine",
    rotary_interleaved=False,
    window_size=None,
    softmax_scale=None,
)


def test_transformer_config_is_a_model_parallel_config_with_megatron_core_defaults():
    cfg = TransformerConfig(**SHAPE)
    assert isinstance(cfg, ModelParallelConfig)
    for name, default in MCORE_DEFAULTS.items():
        assert getattr(cfg, name) == default, name
    # derived as Megatron-Core derives them
    assert (cfg.kv_channels, cfg.ffn_hidden_size, cfg.num_query_groups) == (16, 256, 4)
    assert cfg.expert_tensor_parallel_size == 1 and cfg.autocast_dtype == torch.float32
    assert cfg.recompute_modules == ["core_attn"] and cfg.embedding_init_method_std == 0.02
    w = torch.empty(2000)
    cfg.init_method(w)
    assert abs(w.std().item() - 0.02) < 0.003
    cfg.output_layer_init_method(w)
    assert abs(w.std().item() - 0.02 / 2) < 0.002  # std / sqrt(2 * num_layers)
    ModelParallelConfig(tensor_model_parallel_size=2, sequence_parallel=True)


def test_every_field_is_implemented_or_in_the_support_table():
    own = set(vars(TransformerConfig)["__annotations__"]) | set(vars(MoEConfigFields)["__annotations__"])
    table = config_support.support_table()
    names = [f.name for f in dataclasses.fields(TransformerConfig)]
    assert [n for n in names if n not in own and n not in table] == []
    assert [n for n in table if n in own or n not in names] == []
    # library-only fields add no flags
    assert all(
        f.metadata.get("flag") is None for f in dataclasses.fields(TransformerConfig) if f.name not in own
    )


@pytest.mark.parametrize(
    "field,value",
    [
        ("moe_latent_size", 64),
        ("moe_single_grouped_weight", True),
        ("multi_latent_attention", True),
        ("mtp_num_layers", 1),
        ("window_size", (8, 0)),
        ("fp4", "e2m1"),
        ("apply_residual_connection_post_layernorm", True),
        ("rotary_interleaved", True),
        ("enable_autocast", True),
        ("tensor_parallel_num_weight_shards", 2),
        ("use_mup", True),
        ("experimental_attention_variant", "dsa"),
    ],
)
def test_a_field_asking_for_what_is_not_built_is_refused_naming_it(field, value):
    with pytest.raises(ConfigError, match=rf"TransformerConfig\.{field}=.*not supported here: .+"):
        TransformerConfig(**SHAPE, **{field: value})


@pytest.mark.parametrize(
    "field,value",
    [
        ("tp_comm_overlap", True),
        ("masked_softmax_fusion", True),
        ("bias_dropout_fusion", True),
        ("gradient_accumulation_fusion", True),
        ("attention_backend", AttnBackend.flash),
        ("moe_router_topk", 4),
        ("apply_rope_fusion", True),
        ("persist_layer_norm", True),
        ("deallocate_pipeline_outputs", True),
        ("cpu_offloading", True),
        ("enable_cuda_graph", True),
        ("transformer_impl", "local"),
    ],
)
def test_a_performance_knob_without_effect_is_accepted(field, value):
    assert getattr(TransformerConfig(**SHAPE, **{field: value}), field) == value


def test_post_init_checks_of_megatron_core():
    with pytest.raises(
        ValueError, match="num_attention_heads 4 is not divisible by tensor_model_parallel_size 3"
    ):
        TransformerConfig(**SHAPE, tensor_model_parallel_size=3)
    cfg = TransformerConfig(**SHAPE, apply_query_key_layer_scaling=True, attention_softmax_in_fp32=False)
    assert cfg.attention_softmax_in_fp32
    with pytest.raises(ConfigError, match="defer_embedding_wgrad_compute"):
        TransformerConfig(**SHAPE, defer_embedding_wgrad_compute=True)
    with pytest.raises(ConfigError, match="overlap_p2p_comm_warmup_flush"):
        TransformerConfig(**SHAPE, overlap_p2p_comm_warmup_flush=True)
    with pytest.raises(ConfigError, match="recompute_num_layers must be None"):
        TransformerConfig(**SHAPE, recompute_granularity="selective", recompute_num_layers=1)
    with pytest.raises(ConfigError, match="recompute_modules"):
        TransformerConfig(**SHAPE, recompute_granularity="selective", recompute_modules=["mlp"])
    with pytest.raises(ConfigError, match="init_method"):
        TransformerConfig(**SHAPE, init_method=torch.nn.init.xavier_normal_)
    assert TransformerConfig(**SHAPE, bf16=True).autocast_dtype == torch.bfloat16
    assert TransformerConfig(**SHAPE, tensor_model_parallel_size=2).expert_tensor_parallel_size == 2
    # a constructed config re-validates (dataclasses.replace) with its derived values
    assert dataclasses.replace(cfg, hidden_dropout=0.0).init_method_std == 0.02


def test_activation_fields_and_activation_are_one_setting():
    glu = TransformerConfig(**SHAPE, gated_linear_unit=True, activation_func=F.silu)
    assert glu.activation == "swiglu" and glu.ffn_hidden_size == 256  # Megatron-Core: 4h
    flag = TransformerConfig(**SHAPE, activation="swiglu")
    assert flag.gated_linear_unit and flag.activation_func is F.silu and flag.ffn_hidden_size == 128  # 8h/3
    assert TransformerConfig(**SHAPE).activation == "gelu"
    for kw in (
        dict(gated_linear_unit=True),
        dict(activation_func=F.relu),
        dict(activation_func=F.silu),
        dict(gated_linear_unit=True, activation_func=torch.tanh),
    ):
        with pytest.raises(
            ConfigError, match="activation_func=.* is not built here; use activation_func=F.gelu"
        ):
            TransformerConfig(**SHAPE, **kw)


def test_megatron_core_names_of_our_settings():
    cfg = TransformerConfig(**SHAPE, fp8="e4m3", bf16=True)
    assert cfg.fp8_format == "e4m3" == cfg.fp8
    cfg = TransformerConfig(
        num_layers=6,
        hidden_size=64,
        num_attention_heads=4,
        pipeline_model_parallel_size=2,
        num_layers_in_first_pipeline_stage=2,
    )
    assert cfg.decoder_first_pipeline_num_layers == 2
    with pytest.raises(ConfigError, match="contradicts"):
        TransformerConfig(**SHAPE, fp8="e4m3", fp8_format="hybrid", bf16=True)


BASE = (
    "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 16 --micro-batch-size 2 "
    "--train-iters 1 --lr 1e-3 --mock-data --vocab-size 128"
).split()


def _app_model(extra: list[str]) -> TransformerConfig:
    return configs_from_namespace(parse_namespace(BASE + extra)[0]).model


def test_library_defaults_are_megatron_core_s_and_the_app_keeps_megatron_lm_s():
    lib, app = TransformerConfig(**SHAPE), _app_model([])
    assert (lib.overlap_p2p_comm, lib.cross_entropy_loss_fusion) == (False, False)
    assert (app.overlap_p2p_comm, app.cross_entropy_loss_fusion, app.transformer_impl) == (
        True,
        True,
        "local",
    )
    assert not _app_model(["--no-overlap-p2p-communication"]).overlap_p2p_comm
    # GELU, tied embeddings and the FP8 amax history: Megatron-Core's in the library, Megatron-LM's flags' in the app.
    assert (lib.gelu_approximation, lib.share_embeddings_and_output_weights) == ("none", False)
    assert (lib.fp8_amax_history_len, lib.fp8_amax_compute_algo) == (1, "most_recent")
    assert (app.gelu_approximation, app.share_embeddings_and_output_weights) == ("tanh", True)
    assert (app.fp8_amax_history_len, app.fp8_amax_compute_algo) == (1024, "max")
    model = GPTModel(lib, get_gpt_layer_local_spec(), vocab_size=128, max_sequence_length=16)
    assert not model.share_embeddings_and_output_weights and model.output_layer.weight is not None
    mlp = model.decoder.layers[0].mlp
    x = torch.randn(3, 1, 64) * 30  # large enough that the tanh approximation differs from erf's GELU
    h = torch.nn.functional.linear(x, mlp.linear_fc1.weight, mlp.linear_fc1.bias)
    want = torch.nn.functional.linear(F.gelu(h), mlp.linear_fc2.weight, mlp.linear_fc2.bias)
    out, bias = mlp(x)
    torch.testing.assert_close(out if bias is None else out + bias, want)


def test_glu_silu_config_builds_the_swiglu_model_the_app_builds():
    lib = TransformerConfig(
        **SHAPE,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        normalization="RMSNorm",
        hidden_dropout=0.0,
        attention_dropout=0.0,
    )
    app = _app_model(
        "--swiglu --disable-bias-linear --normalization RMSNorm --ffn-hidden-size 256 "
        "--hidden-dropout 0 --attention-dropout 0 --untie-embeddings-and-output-weights".split()
    )
    models = [
        GPTModel(c, get_gpt_layer_local_spec(), vocab_size=128, max_sequence_length=16, seed=5)
        for c in (lib, app)
    ]
    fc1 = models[0].decoder.layers[0].mlp.linear_fc1.weight
    assert fc1.shape == (2 * 256, 64)
    ids = torch.randint(0, 128, (2, 16))
    torch.testing.assert_close(models[0](ids, None, None), models[1](ids, None, None), rtol=0, atol=0)


def test_perform_initialization_false_skips_initialisation(monkeypatch):
    calls = []
    monkeypatch.setattr(GPTModel, "init_weights", lambda self, seed: calls.append(seed))
    GPTModel(TransformerConfig(**SHAPE, perform_initialization=False), get_gpt_layer_local_spec(), 128, 16)
    assert calls == []
    GPTModel(TransformerConfig(**SHAPE), get_gpt_layer_local_spec(), 128, 16, seed=1)
    assert calls == [1]


def test_bias_activation_fusion_is_megatron_core_s_bias_gelu():
    cfg = TransformerConfig(**SHAPE, bias_gelu_fusion=False, bias_activation_fusion=True)
    assert cfg.gelu_approximation == "tanh"
    assert TransformerConfig(**SHAPE, bias_gelu_fusion=False).gelu_approximation == "none"
    with pytest.raises(
        ConfigError, match="bias_activation_fusion=True with a GELU MLP needs add_bias_linear=True"
    ):
        TransformerConfig(**SHAPE, bias_activation_fusion=True, add_bias_linear=False)


def test_context_parallel_fields_are_built_and_the_one_rank_attention_refuses_cp_groups():
    from types import SimpleNamespace

    from megatron.core.transformer.dot_product_attention import DotProductAttention

    cfg = TransformerConfig(**SHAPE, context_parallel_size=2, cp_comm_type="a2a")
    assert (cfg.context_parallel_size, cfg.cp_comm_type) == (2, "a2a")
    with pytest.raises(ConfigError, match="context_parallel_size 2 use ContextParallelAttention"):
        DotProductAttention(cfg, cp_groups=SimpleNamespace(size=2))
    DotProductAttention(cfg, cp_groups=SimpleNamespace(size=1))  # one cp rank: the plain attention
