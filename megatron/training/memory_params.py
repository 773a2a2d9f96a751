"""The parameters each pipeline stage's chunks hold on one rank, from the whole model built on meta.

The whole model is built once on the meta device without tensor or pipeline splitting (no memory, a
fraction of a second even for 70B shapes); each parameter is then assigned to the virtual stage that
builds it (``TransformerConfig.pipeline_layout``) and sized for one tensor-parallel rank from its
partitioning recipe (``partition_dim``, set by ``tensor_parallel.init.set_init_attrs``); an expert
parameter (``moe.expert_params``) holds this ep rank's E / ep experts, split over expert-tp.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field

from megatron.core.parallel_state import ParallelState, RankGrid
from megatron.core.transformer.moe.expert_params import is_expert_param
from megatron.training.gpt import model_provider

# Replicated parameters fed by sequence-sharded activations: tagged ``sequence_parallel`` (their
# gradient is summed over tp after backward, so DDP gives them bucket storage).
_SP_TAGGED = re.compile(
    r"(input_layernorm|pre_mlp_layernorm|final_layernorm)\.(weight|bias)$|(linear_proj|linear_fc2)\.bias$"
)
_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")


@dataclass(frozen=True)
class ParamInfo:
    """One parameter as one tensor-parallel rank holds it."""

    name: str
    numel: int
    rows: int  # dim 0 (what FSDP2 shards)
    sp_tagged: bool  # its gradient is reduced again after backward (no aliasing of a single gradient)
    tied_copy: bool = False  # the last stage's copy of the tied word embedding
    expert: bool = False  # an expert parameter: its gradients reduced and its state sharded over expert-dp


@dataclass
class ChunkParams:
    """The parameters of chunk ``chunk`` of pipeline rank ``pp_rank``, in registration order."""

    pp_rank: int
    chunk: int
    offset: int  # 0-based global index of its first layer
    num_layers: int
    pre_process: bool
    post_process: bool
    params: list[ParamInfo] = field(default_factory=list)
    layers: list[list[ParamInfo]] = field(default_factory=list)  # the params of each of its layers


@dataclass
class StageParams:
    """Every chunk of every pipeline rank, and what one layer's linears hold."""

    chunks: list[list[ChunkParams]]  # [pp_rank][chunk]
    total: int  # parameters of the whole model (one copy of a tied embedding)
    layer_linear_numels: dict[str, int]  # local weight elements of each linear of a layer


def _whole(model):
    """The model config without any split (one process builds every layer; cp ranks hold every
    parameter whole, so the parameters are those of cp 1)."""
    return dataclasses.replace(
        model,
        tensor_model_parallel_size=1,
        pipeline_model_parallel_size=1,
        context_parallel_size=1,
        virtual_pipeline_model_parallel_size=None,
        num_layers_per_virtual_pipeline_stage=None,
        decoder_first_pipeline_num_layers=None,
        decoder_last_pipeline_num_layers=None,
        pipeline_model_parallel_layout=None,
        account_for_embedding_in_pipeline_split=False,
        account_for_loss_in_pipeline_split=False,
        microbatch_group_size_per_virtual_pipeline_stage=None,
        num_layers_in_first_pipeline_stage=None,
        num_layers_in_last_pipeline_stage=None,
        microbatch_group_size_per_vp_stage=None,
        expert_model_parallel_size=1,
        expert_tensor_parallel_size=1,
    )


def whole_model_on_meta(cfg, padded_vocab_size: int) -> list:
    """The whole model in one process on the meta device (its chunks: one)."""
    whole = dataclasses.replace(cfg, model=_whole(cfg.model))
    return model_provider(whole, padded_vocab_size, ParallelState(grid=RankGrid(), rank=0), "meta")


def _local(name: str, param, tp: int, sp: bool, ep: int = 1, etp: int = 1) -> ParamInfo:
    """One rank's part of ``param`` of the whole model: split over tp along its partition dim, or,
    an expert parameter (``[E, ...]``), its E / ep local experts split over etp."""
    dim = getattr(param, "partition_dim", -1)
    shape = list(param.shape)
    split = tp
    if is_expert_param(param):
        shape[0] //= ep
        split = etp
    if dim is not None and dim >= 0 and split > 1:
        shape[dim] //= split
    numel = 1
    for n in shape:
        numel *= n
    sp_tagged = sp and bool(_SP_TAGGED.search(name))
    return ParamInfo(name, numel, shape[0] if shape else 1, sp_tagged, expert=is_expert_param(param))


def stage_params(cfg, padded_vocab_size: int, chunks: list | None = None) -> StageParams:
    """Assign the whole model's parameters (``chunks``: built here on meta if not given) to stages."""
    m = cfg.model
    tp, pp = m.tensor_model_parallel_size, m.pipeline_model_parallel_size
    vpp = m.virtual_pipeline_model_parallel_size or 1
    sp = m.sequence_parallel and tp > 1
    model = (chunks if chunks is not None else whole_model_on_meta(cfg, padded_vocab_size))[0]
    layer_params: dict[int, list[ParamInfo]] = {}
    first, last = [], []
    total = 0
    for name, param in model.named_parameters():
        total += param.numel()
        info = _local(name, param, tp, sp, m.expert_model_parallel_size, m.expert_tensor_parallel_size)
        hit = _LAYER.match(name)
        if hit:
            layer_params.setdefault(int(hit.group(1)), []).append(info)
        elif name.startswith("embedding."):
            first.append(info)
        else:
            last.append(info)
    tied = m.share_embeddings_and_output_weights and pp > 1
    if tied:
        word = next(p for p in first if p.name.endswith("word_embeddings.weight"))
        last.append(dataclasses.replace(word, name="output_layer.weight", tied_copy=True))
    layout = m.pipeline_layout()
    stages = []
    for r in range(pp):
        row = []
        for c in range(vpp):
            offset, n = layout.offset_of(r, c), layout.num_layers_of(r, c)
            chunk = ChunkParams(r, c, offset, n, r == 0 and c == 0, r == pp - 1 and c == vpp - 1)
            chunk.layers = [layer_params.get(i, []) for i in range(offset, offset + n)]
            chunk.params = (
                (first if chunk.pre_process else [])
                + [p for layer in chunk.layers for p in layer]
                + (last if chunk.post_process else [])
            )
            row.append(chunk)
        stages.append(row)
    linears = {}
    for info in layer_params.get(0, []):
        for linear in ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"):
            if info.name.endswith(f"{linear}.weight"):
                linears[linear] = info.numel
    return StageParams(stages, total, linears)
