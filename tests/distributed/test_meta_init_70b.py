"""A Llama-3-70B-shaped layer starts on 8 CPU ranks: built on the meta device, sharded by FSDP2 (dp 2)
within tensor parallelism (tp 4), each rank materialising only its shards, then one training step
(forward, backward, SGD step).

One 70B layer is 855M parameters. Layout and precision are chosen so that the 8 ranks fit a small
machine: parameters and gradients stored in bf16 (a 1/8 shard of each tensor per rank), gathered and
computed in fp32 and reduce-scattered in bf16 (MixedPrecisionPolicy; CPUs without bf16 GEMMs run them
orders of magnitude slower), each linear its own FSDP2 unit so that one gathered fp32 weight and its
gradient are in flight at a time (fc1, the largest: 470 MB each per rank under tp 4).

Checked per rank from the kernel's peak resident set (VmHWM, reset between phases): materialising adds
well under this rank's whole tensor-parallel shard, which a model materialised before ``fully_shard``
would hold at once; the step's peak, summed over the ranks, stays within the budget. The figures are
printed (``pytest -s``).
"""

from __future__ import annotations

import re
import resource
import time

import pytest
import torch
from harness import device, run_distributed
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from megatron.core.distributed.meta_init import (
    dim0_shard_range,
    materialize_fsdp_shards_,
    param_attrs,
    restore_param_attrs_,
)
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.models.gpt.gpt_model import GPTModel
from megatron.core.parallel_state import ParallelState
from megatron.core.tensor_parallel.init import init_param_rows_
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.transformer_config import TransformerConfig

WORLD, TP, LAYERS, VOCAB, SEQ, SEED = 8, 4, 1, 1024, 8, 3
MB = 1 << 20
STEP_BUDGET_MB = 12 * 1024  # the 8 ranks' step peaks (above their start), together


def _llama_70b(num_layers: int) -> TransformerConfig:
    return TransformerConfig(
        num_layers=num_layers,
        hidden_size=8192,
        ffn_hidden_size=28672,
        num_attention_heads=64,
        num_query_groups=8,
        activation="swiglu",
        normalization="RMSNorm",
        position_embedding_type="rope",
        add_bias_linear=False,
        share_embeddings_and_output_weights=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        params_dtype=torch.bfloat16,
        init_model_with_meta_device=True,
    )


def _status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        return int(re.search(rf"{field}:\s+(\d+)", f.read()).group(1))  # type: ignore[union-attr]


def _reset_peak() -> int:
    """Reset VmHWM to the current resident set; returns that (kB)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return _status_kb("VmRSS")


def _cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _start_70b(ps: ParallelState) -> dict[str, float]:
    t0, c0 = time.monotonic(), _cpu_s()
    base = _reset_peak()
    model = GPTModel(
        _llama_70b(LAYERS),
        get_gpt_layer_local_spec(),
        vocab_size=VOCAB,
        max_sequence_length=SEQ,
        parallel_state=ps,
        device="meta",
        seed=SEED,
    )
    tp_shard_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    mesh = DeviceMesh.from_group(ps.dp_group, device().type)
    policy = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.bfloat16)
    attrs = param_attrs(model)
    for unit in model.decoder.modules():
        if isinstance(unit, (ColumnParallelLinear, RowParallelLinear)):
            fully_shard(unit, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    restore_param_attrs_(model, attrs)
    materialize_fsdp_shards_(model, device(), SEED, ps.tp_rank, model.global_param_name)
    materialized_kb = _status_kb("VmHWM") - base
    t1, c1 = time.monotonic(), _cpu_s()

    fc1 = model.decoder.layers[0].mlp.linear_fc1.weight
    assert isinstance(fc1, DTensor)
    start, stop = dim0_shard_range(fc1)
    row = torch.empty(1, fc1.shape[1], dtype=fc1.dtype)
    init_param_rows_(
        row,
        fc1,
        model.global_param_name("decoder.layers.0.mlp.linear_fc1.weight"),
        SEED,
        ps.tp_rank,
        stop - 1,
        stop,
    )
    assert torch.equal(fc1.to_local()[-1:], row)

    base = _reset_peak()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    ids = torch.randint(0, VOCAB, (1, SEQ), generator=torch.Generator().manual_seed(0)).to(device())
    loss = model(ids, None, None, labels=ids.roll(-1, 1)).mean()
    loss.backward()
    before = fc1.to_local()[0].clone()
    optimizer.step()
    assert not torch.equal(before, fc1.to_local()[0]), "the step did not update the shard"
    step_kb = _status_kb("VmHWM") - base
    return {
        "loss": loss.item(),
        "tp_shard_mb": tp_shard_bytes / MB,
        "materialized_mb": materialized_kb / 1024,
        "step_mb": step_kb / 1024,
        "rss_start_mb": base / 1024,
        "materialize_s": t1 - t0,
        "step_s": time.monotonic() - t1,
        "materialize_cpu_s": c1 - c0,
        "step_cpu_s": _cpu_s() - c1,
    }


@pytest.mark.slow
def test_llama_70b_layer_starts_on_8_cpu_ranks() -> None:
    t0 = time.monotonic()
    figures = run_distributed(_start_70b, WORLD, tp=TP, backend="gloo", timeout_s=300)
    wall = time.monotonic() - t0
    for rank, f in enumerate(figures):
        print(
            f"rank {rank}: tp shard {f['tp_shard_mb']:.0f} MB, materialise +{f['materialized_mb']:.0f} MB "
            f"in {f['materialize_s']:.1f} s ({f['materialize_cpu_s']:.1f} CPU s), step +{f['step_mb']:.0f} MB "
            f"in {f['step_s']:.1f} s ({f['step_cpu_s']:.1f} CPU s), resident at start "
            f"{f['rss_start_mb']:.0f} MB, loss {f['loss']:.4f}"
        )
    total_step = sum(f["step_mb"] for f in figures)
    cpu = sum(f["materialize_cpu_s"] + f["step_cpu_s"] for f in figures)
    print(f"8 ranks: step peaks together +{total_step:.0f} MB; {wall:.1f} s in all, {cpu:.0f} CPU s")
    assert all(f["loss"] == figures[0]["loss"] and f["loss"] > 0 for f in figures)
    for f in figures:  # each rank holds a 1/dp share, not its whole tensor-parallel shard
        assert f["materialized_mb"] < 0.8 * f["tp_shard_mb"], f
    assert total_step < STEP_BUDGET_MB
