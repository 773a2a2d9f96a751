"""Meta-device initialisation under FSDP2: a GPTModel built on the meta device, sharded by fully_shard over
the data-parallel ranks and materialised with materialize_fsdp_shards_ holds bitwise the weights of a
single-process GPTModel with the same seed (each tensor-parallel shard gathered over dp), and computes
its loss; shards shorter than the others and empty ones are filled too."""

from __future__ import annotations

import pytest
import torch
from harness import device, distributed_test
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from megatron.core.distributed.meta_init import (
    dim0_shard_range,
    materialize_fsdp_shards_,
    param_attrs,
    restore_param_attrs_,
)
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.models.gpt.gpt_model import GPTModel
from megatron.core.parallel_state import ParallelState, RankGrid
from megatron.core.tensor_parallel.init import init_param_, set_init_attrs
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.transformer_layer import TransformerLayer

S, B, VOCAB, SEED = 8, 2, 70, 5  # 70 vocabulary rows: uneven dim-0 chunks over dp 4 (and 35 per tp rank)

LLAMA = dict(
    normalization="RMSNorm",
    activation="swiglu",
    position_embedding_type="rope",
    add_bias_linear=False,
    num_query_groups=2,
    share_embeddings_and_output_weights=False,
)
GPT = dict(share_embeddings_and_output_weights=True)  # LayerNorm with biases, GELU, tied, learned positions


def _build(variant: dict, ps: ParallelState, dev: torch.device | str) -> GPTModel:
    cfg = TransformerConfig(
        num_layers=2,
        hidden_size=16,
        num_attention_heads=4,
        ffn_hidden_size=40,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        **variant,
    )
    return GPTModel(
        cfg,
        get_gpt_layer_local_spec(),
        vocab_size=VOCAB,
        max_sequence_length=S,
        parallel_state=ps,
        device=dev,
        seed=SEED,
    )


def _shard(model: torch.nn.Module, mesh: DeviceMesh) -> None:
    """fully_shard per decoder layer and on the root, parameter attributes carried across."""
    attrs = param_attrs(model)
    for layer in model.modules():
        if isinstance(layer, TransformerLayer):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    restore_param_attrs_(model, attrs)


def _tp_shard(full: torch.Tensor, param: torch.Tensor, tp_rank: int) -> torch.Tensor:
    """The tensor-parallel shard ``param`` holds of the single-process tensor ``full``."""
    dim, stride = getattr(param, "partition_dim", -1), getattr(param, "partition_stride", 1)
    if dim < 0 or full.shape == param.shape:
        return full
    if dim == 0:  # each of ``stride`` stacked sub-tensors split separately
        sub = param.shape[0] // stride
        return full.view(stride, -1, *full.shape[1:]).narrow(1, tp_rank * sub, sub).reshape(param.shape)
    return full.narrow(dim, tp_rank * param.shape[dim], param.shape[dim])


@pytest.mark.parametrize("variant", ["llama", "gpt"])
@pytest.mark.parametrize("world,tp", [(2, 1), (4, 1), (4, 2)])
@distributed_test(world_size="world", tp="tp")
def test_meta_fsdp_shards_equal_single_process_weights(
    ps: ParallelState, world: int, tp: int, variant: str
) -> None:
    spec = LLAMA if variant == "llama" else GPT
    model = _build(spec, ps, "meta")
    assert all(p.is_meta for p in model.parameters())
    mesh = DeviceMesh.from_group(ps.dp_group, device().type)
    _shard(model, mesh)
    materialize_fsdp_shards_(model, device(), SEED, ps.tp_rank, model.global_param_name)

    reference = _build(spec, ParallelState(grid=RankGrid(), rank=0), "cpu")
    ref_params = dict(reference.named_parameters())
    for name, param in model.named_parameters():
        assert isinstance(param, DTensor) and not param.is_meta, name
        rows = param.shape[0]
        start, stop = dim0_shard_range(param)
        chunk = -(-rows // ps.dp_size)
        assert (start, stop) == (min(ps.dp_rank * chunk, rows), min((ps.dp_rank + 1) * chunk, rows))
        whole = param.full_tensor().cpu()
        expected = _tp_shard(ref_params[name].detach(), param, ps.tp_rank)
        assert torch.equal(whole, expected), name

    ids = torch.randint(0, VOCAB, (B, S), generator=torch.Generator().manual_seed(0))
    labels = ids.roll(-1, 1)
    loss = model(ids.to(device()), None, None, labels=labels.to(device())).mean()
    loss.backward()
    expected_loss = reference(ids, None, None, labels=labels).mean().detach()
    torch.testing.assert_close(loss.detach().cpu(), expected_loss, rtol=1e-5, atol=1e-5)  # CPU or GPU kernels


@distributed_test(world_size=4)
def test_short_and_empty_shards(ps: ParallelState) -> None:
    """A 3-row weight over dp 4: ranks 0-2 hold one row each, rank 3 none; a 9-row one: 3, 3, 3, 0. A
    parameter outside every FSDP2 unit is materialised whole."""
    with torch.device("meta"):
        outer, inner = torch.nn.Module(), torch.nn.Module()
        inner.a = torch.nn.Parameter(torch.empty(3, 5))
        inner.b = torch.nn.Parameter(torch.empty(9))
        outer.inner = inner
        outer.c = torch.nn.Parameter(torch.empty(4, 3))
    set_init_attrs(inner.a, std=0.5, partition_dim=0, partition_size=1)
    set_init_attrs(inner.b, std=0.1)
    set_init_attrs(outer.c, std=0.2)
    _shard(inner, DeviceMesh.from_group(ps.dp_group, device().type))
    materialize_fsdp_shards_(outer, device(), SEED, 0, lambda name: f"extra.{name}")
    for name, rows in (("a", 3), ("b", 9)):
        param = getattr(inner, name)
        local = param.to_local()
        chunk = -(-rows // 4)
        assert local.shape[0] == max(0, min(chunk, rows - ps.dp_rank * chunk)), name
        expected = set_init_attrs(torch.empty(param.shape), std=param.init_std)
        init_param_(expected, f"extra.inner.{name}", SEED)
        assert torch.equal(param.full_tensor().cpu(), expected), name
    assert not isinstance(outer.c, DTensor) and outer.c.device.type == device().type
    expected = set_init_attrs(torch.empty(4, 3), std=0.2)
    init_param_(expected, "extra.c", SEED)
    assert torch.equal(outer.c.detach().cpu(), expected)


@distributed_test(world_size=2)
def test_parameters_without_a_recipe_are_refused(ps: ParallelState) -> None:
    with torch.device("meta"):
        module = torch.nn.Linear(4, 4, bias=False)
    fully_shard(module, mesh=DeviceMesh.from_group(ps.dp_group, device().type))  # attributes dropped
    with pytest.raises(ValueError, match="weight carries no init recipe"):
        materialize_fsdp_shards_(module, device(), SEED, 0, str)
