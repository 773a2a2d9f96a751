"""The per-rank memory estimate (megatron/training/memory_estimate.py): each term against what this
code allocates (autograd's saved tensors of a real layer on the CPU) and against its flag."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch

from megatron.core.execution_plan import ExecutionPlan
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.models.gpt.gpt_model import GPTModel
from megatron.core.transformer.rope import rotary_cos_sin
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.training.arguments import parse_run_config
from megatron.training.memory_activations import Kernels, activation_shape, layer_activation_bytes
from megatron.training.memory_estimate import GiB, estimate, largest_micro_batch
from megatron.training.memory_params import stage_params
from megatron.training.memory_state import padded_buckets

S, B = 64, 2


def _saved_bytes(layer: torch.nn.Module, x: torch.Tensor, rotary) -> int:
    """Bytes of the distinct storages autograd saves in ``layer``'s forward, parameters excluded."""
    params = {p.untyped_storage().data_ptr() for p in layer.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        layer(x, None, rotary)
    return sum(seen.values())


LAYERS = {
    "gelu, bias, learned positions": dict(add_bias_linear=True),
    "gelu, rope, hidden dropout": dict(position_embedding_type="rope", hidden_dropout=0.1),
    "swiglu, gqa, rope": dict(
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        num_query_groups=2,
        position_embedding_type="rope",
        add_bias_linear=False,
    ),
    "swiglu, gqa, qk layernorm, dropout": dict(
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        num_query_groups=2,
        qk_layernorm=True,
        hidden_dropout=0.1,
        add_bias_linear=False,
    ),
}


@pytest.mark.parametrize("name", list(LAYERS))
def test_layer_activations_are_what_autograd_saves(name):
    """The per-layer count equals the bytes of the tensors a real bf16 layer saves on the CPU
    (the CPU's mask and norm-statistic dtypes; CUDA's differ only in those widths)."""
    extra = dict(LAYERS[name])
    rope = extra.pop("position_embedding_type", "learned_absolute") == "rope"
    config = TransformerConfig(
        num_layers=1,
        hidden_size=128,
        num_attention_heads=4,
        ffn_hidden_size=384,
        params_dtype=torch.bfloat16,
        bf16=True,
        attention_dropout=0.0,
        hidden_dropout=extra.pop("hidden_dropout", 0.0),
        normalization="LayerNorm",
        **extra,
    )
    model = GPTModel(
        config,
        get_gpt_layer_local_spec(qk_layernorm=config.qk_layernorm),
        vocab_size=256,
        max_sequence_length=S,
        position_embedding_type="rope" if rope else "learned_absolute",
    ).train()
    x = torch.randn(S, B, 128, dtype=torch.bfloat16, requires_grad=True)
    rotary = rotary_cos_sin(torch.arange(S).expand(B, S), config.rotary_dim, 10000.0) if rope else None
    measured = _saved_bytes(model.decoder.layers[0], x, rotary)
    m = dataclasses.replace(config, position_embedding_type="rope" if rope else "learned_absolute")
    cfg = SimpleNamespace(model=m, training=SimpleNamespace(seq_length=S))
    kernels = Kernels.from_plan(ExecutionPlan.plain(m))
    assert layer_activation_bytes(cfg, activation_shape(cfg, B), kernels) == measured


def test_a_stage_saves_what_the_estimate_counts():
    """A whole bf16 stage on the CPU (embedding, two layers, final norm, fused output layer + loss):
    the estimate's activations per micro-batch are the saved tensors' bytes."""
    from megatron.core.parallel_state import ParallelState, RankGrid
    from megatron.training.gpt import model_provider

    cfg = _config("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 --vocab-size 256")
    plan = ExecutionPlan.plain(cfg.model)
    model = model_provider(cfg, 256, ParallelState(grid=RankGrid(), rank=0), "cpu", plan=plan)[0].train()
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.untyped_storage().data_ptr() not in params:
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    ids, labels = torch.randint(0, 256, (2, 32)), torch.randint(0, 256, (2, 32))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(ids, None, None, labels=labels, loss_mask=torch.ones(2, 32))
    stage = estimate(cfg, 256, 1, Kernels.from_plan(plan))[0]
    assert plan.cross_entropy == "fused_eager"
    assert stage.activations_per_microbatch == pytest.approx(sum(seen.values()), rel=0.01)


BASE = (
    "--num-layers 8 --hidden-size 1024 --num-attention-heads 16 --ffn-hidden-size 4096 --seq-length 2048 "
    "--max-position-embeddings 2048 --micro-batch-size 2 --lr 1e-4 --mock-data --train-iters 2 --bf16 "
    "--dry-run --hidden-dropout 0 --attention-dropout 0"
)


def _config(extra: str = "", base: str = BASE):
    argv = base.split() + extra.split()
    if "--vocab-size" not in argv:
        argv += ["--vocab-size", "32768"]
    if "--lr" not in argv:
        argv += "--lr 1e-4 --mock-data --train-iters 2 --bf16 --micro-batch-size 2".split()
    return parse_run_config(argv)


def _stages(extra: str = "", world: int = 1):
    cfg = _config(extra + f" --world-size {world}")
    return cfg, estimate(cfg, 32768, world)


def test_full_recompute_keeps_only_the_checkpointed_inputs():
    _, plain = _stages()
    _, full = _stages("--recompute-granularity full --recompute-method uniform --recompute-num-layers 1")
    _, pairs = _stages("--recompute-granularity full --recompute-method uniform --recompute-num-layers 2")
    _, block = _stages("--recompute-granularity full --recompute-method block --recompute-num-layers 4")
    _, selective = _stages("--recompute-granularity selective")
    layer_input = 2048 * 2 * 1024 * 2  # [s, b, h] bf16
    a = {k: v[0].activations_per_microbatch for k, v in dict(plain=plain, full=full, pairs=pairs).items()}
    assert a["full"] < a["plain"] / 5
    assert a["pairs"] == pytest.approx(a["full"] - 4 * layer_input)  # 4 checkpointed groups instead of 8
    assert full[0].activations_per_microbatch < block[0].activations_per_microbatch < a["plain"]
    # Selective recompute drops only attention's log-sum-exp here (fused SDPA keeps no score matrix).
    assert a["plain"] - selective[0].activations_per_microbatch == 8 * 2048 * 2 * 16 * 4
    assert full[0].peak < plain[0].peak


def test_distributed_optimizer_divides_the_optimizer_state_by_dp_within_padding():
    cfg, plain = _stages(world=24)
    _, dist_opt = _stages("--use-distributed-optimizer", world=24)
    ratio = dist_opt[0].optimizer / plain[0].optimizer
    buckets = padded_buckets(cfg, stage_params(cfg, 32768).chunks[0][0].params, 24)
    assert len(buckets) == 3 and all(b % 384 == 0 for b in buckets)  # lcm(dp, 128)
    padding = sum(buckets) / plain[0].params - 1
    assert 0 < padding < 1e-4
    assert ratio == pytest.approx((1 + padding) / 24, rel=1e-9)
    assert dist_opt[0].weights == pytest.approx(plain[0].weights * (1 + padding))


def test_fsdp_divides_params_gradients_and_optimizer_state():
    _, one = _stages("--use-torch-fsdp2", world=1)
    _, four = _stages("--use-torch-fsdp2", world=4)
    for term in ("weights", "gradients", "optimizer"):
        assert getattr(four[0], term) == pytest.approx(getattr(one[0], term) / 4, rel=1e-3), term
    # ZeRO-2 keeps every layer's gathered bf16 params from forward to backward.
    _, zero2 = _stages("--use-torch-fsdp2 --torch-fsdp2-no-reshard-after-forward", world=4)
    layer = 12 * 1024**2 + 13 * 1024  # params of one layer (GELU, biases, LayerNorm)
    assert zero2[0].fsdp_gathered - four[0].fsdp_gathered == 2 * layer * (8 - 2)
    _, megatron_fsdp = _stages(
        "--use-megatron-fsdp --data-parallel-sharding-strategy optim_grads_params", world=4
    )
    assert megatron_fsdp[0].peak == four[0].peak


def test_optimizer_offload_moves_that_fraction_of_the_state_to_the_host():
    _, plain = _stages()
    _, full = _stages("--optimizer-cpu-offload")
    _, half = _stages("--optimizer-cpu-offload --optimizer-offload-fraction 0.5")
    n = plain[0].params
    assert plain[0].host == 0 and full[0].optimizer == 0
    # fp32 main params and two moments, plus two staging slots each way of a quarter of them
    assert full[0].host == 12 * n + 2 * (n / 4) * (2 + 2)  # bf16 gradients (one micro-batch), bf16 params
    assert half[0].optimizer == pytest.approx(plain[0].optimizer / 2)
    assert half[0].host == 6 * n + 2 * (n / 8) * (2 + 2)
    assert full[0].peak == pytest.approx(plain[0].peak - plain[0].optimizer)


def test_1f1b_keeps_pp_minus_rank_micro_batches_and_interleaving_megatrons_warm_up():
    base = "--pipeline-model-parallel-size 4 --global-batch-size 32"
    _, stages = _stages(base, world=4)
    assert [s.microbatches_in_flight for s in stages] == [4, 3, 2, 1]
    inner = [s.activations_at_peak / s.activations_per_microbatch for s in stages[1:-1]]
    assert inner == pytest.approx([3, 2])
    _, few = _stages("--pipeline-model-parallel-size 4 --global-batch-size 4", world=4)
    assert [s.microbatches_in_flight for s in few] == [2, 2, 2, 1]  # M = 2 micro-batches
    _, vpp = _stages(base + " --virtual-pipeline-model-parallel-size 2", world=4)
    # Warm-up 2 (pp - rank - 1) + (vpp - 1) x pp forwards, then one more before the first backward:
    # rank 0 holds 11 chunk-micro-batches, i.e. 5.5 micro-batches of its two chunks.
    assert [s.microbatches_in_flight for s in vpp] == [5.5, 4.5, 3.5, 2.5]


def test_sequence_parallel_divides_the_residual_stream_by_tp():
    cfg, tp = _stages("--tensor-model-parallel-size 4", world=4)
    _, sp = _stages("--tensor-model-parallel-size 4 --sequence-parallel", world=4)
    plain_layer = layer_activation_bytes(cfg, activation_shape(cfg, 2), Kernels())
    sp_cfg = _config("--tensor-model-parallel-size 4 --sequence-parallel --world-size 4")
    sp_layer = layer_activation_bytes(sp_cfg, activation_shape(sp_cfg, 2), Kernels())
    stream = 2 * 2048 * 2 * 1024 * 2 + 2 * 2 * 2048 * 2 * 4  # layer input, mid residual, LayerNorm stats
    assert plain_layer - sp_layer == pytest.approx(stream * 3 / 4)  # /tp; the linears' gathered inputs stay
    assert sp[0].activations_per_microbatch < tp[0].activations_per_microbatch


def test_gradients_follow_the_reduction_dtype_and_aliasing():
    _, one_mb = _stages()
    _, accumulate = _stages("--global-batch-size 4")
    _, bf16 = _stages("--global-batch-size 4 --grad-reduce-in-bf16")
    n = one_mb[0].params
    assert one_mb[0].gradients == 2 * n  # one micro-batch, no DP: the bf16 gradients themselves
    assert accumulate[0].gradients == 4 * n and bf16[0].gradients == 2 * n  # the buckets' dtype
    _, dp2 = _stages("", world=2)
    assert dp2[0].gradients == 4 * n  # reduced in fp32: copied into the buckets


def test_fp8_saves_one_byte_inputs_and_weight_copies():
    _, bf16 = _stages()
    _, fp8 = _stages("--fp8-format hybrid --fp8-recipe tensorwise")
    assert fp8[0].other > 0  # the amax histories
    per_layer_weights = 4 * 1024 * 1024 + 4096 * 1024 * 2  # qkv + proj, fc1 + fc2 (one byte each)
    tokens = 2048 * 2
    saved_less = tokens * (1024 + 1024 + 4096)  # ln1, ln2, fc2 inputs at one byte instead of two
    extra = tokens * 1024  # linear_proj's fp8 copy of attention's output
    assert fp8[0].activations_per_microbatch - bf16[0].activations_per_microbatch == 8 * (
        per_layer_weights - saved_less + extra
    )


def test_largest_micro_batch_fits_and_the_next_does_not():
    cfg = _config()
    best = largest_micro_batch(cfg, 32768, 1, 20 * GiB)
    assert best is not None and best[1] <= 20 * GiB
    over = estimate(cfg, 32768, 1, micro_batch_size=best[0] + 1)
    assert max(s.peak for s in over) > 20 * GiB
    assert largest_micro_batch(cfg, 32768, 1, 1 * GiB) is None


def test_context_parallel_divides_activations_and_shards_only_the_distributed_optimizer_over_cp():
    """cp N: each rank holds S / N tokens of every activation (about 1 / N of them; allgather keeps
    the whole sequence's keys and values); parameters and gradients are replicated over cp; the
    distributed optimizer shards over dp x cp; the data-parallel size is world / (tp x pp x cp)."""
    from megatron.training.memory_estimate import data_parallel_size

    _, one = _stages("--global-batch-size 2")
    cfg2, two = _stages("--context-parallel-size 2 --global-batch-size 2", world=2)
    _, four = _stages("--context-parallel-size 4 --global-batch-size 2", world=4)
    assert data_parallel_size(cfg2, 2) == 1 and data_parallel_size(cfg2, 8) == 4
    a1, a2, a4 = (s[0].activations_per_microbatch for s in (one, two, four))
    assert a2 < 0.6 * a1 and a4 < 0.6 * a2
    cfg1 = _config("--global-batch-size 2")
    p2p_layer = layer_activation_bytes(cfg2, activation_shape(cfg2, 2), Kernels())
    assert p2p_layer == layer_activation_bytes(cfg1, activation_shape(cfg1, 2), Kernels()) / 2
    assert (two[0].weights, two[0].optimizer) == (one[0].weights, one[0].optimizer)
    shape2 = activation_shape(cfg2, 2)
    assert (shape2.seq, shape2.tokens, shape2.cp) == (1024, 2048, 2)
    gathered = _config("--context-parallel-size 2 --cp-comm-type allgather --world-size 2")
    kv = 2 * 2048 * 2 * 1024 * 2  # the whole sequence's k and v: [S, b, n_kv * d] bf16 each
    assert layer_activation_bytes(gathered, shape2, Kernels()) - layer_activation_bytes(
        cfg2, shape2, Kernels()
    ) == pytest.approx(kv)
    _, opt_dp2 = _stages("--use-distributed-optimizer --global-batch-size 4", world=2)
    _, opt_cp2 = _stages(
        "--use-distributed-optimizer --context-parallel-size 2 --global-batch-size 2", world=2
    )
    assert opt_cp2[0].optimizer == opt_dp2[0].optimizer < one[0].optimizer / 1.9


def test_dry_run_prints_the_context_parallel_layout():
    from megatron.training.dry_run import dry_run

    base = BASE.replace(
        "--dry-run", "--dry-run --context-parallel-size 4 --world-size 8 --global-batch-size 4"
    )
    lines: list[str] = []
    dry_run(_config(base=base), 32768, log=lines.append)
    cp = next(ln for ln in lines if "context parallel" in ln)
    assert "4 ranks per sequence, 512 of its 2048 tokens per rank; data-parallel size 2" in cp
