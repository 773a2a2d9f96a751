"""GPTModel: embedding -> transformer block -> final norm -> output layer (-> per-token loss)."""

from __future__ import annotations

from typing import Any

import torch

from megatron.core.config_utils import ConfigError
from megatron.core.execution_plan import ExecutionPlan
from megatron.core.fusions.fp8 import Fp8Gemm
from megatron.core.models.common.embeddings import LanguageModelEmbedding
from megatron.core.models.common.language_module.language_module import LanguageModule
from megatron.core.models.gpt.output_loss import output_loss
from megatron.core.packed_seq_params import PackedSeqParams, document_mask_of
from megatron.core.parallel_state import ParallelState, get_parallel_state
from megatron.core.tensor_parallel import mappings
from megatron.core.tensor_parallel.init import init_param_, tag_param
from megatron.core.tensor_parallel.layers import ColumnParallelLinear
from megatron.core.transformer.attention import mask_for_attention
from megatron.core.transformer.context_parallel.layout import ContextParallelGroups, local_token_indices
from megatron.core.transformer.document_mask import DocumentMask
from megatron.core.transformer.module import shard_of
from megatron.core.transformer.moe.groups import MoEGroups
from megatron.core.transformer.rope import rotary_cos_sin
from megatron.core.transformer.transformer_block import TransformerBlock
from megatron.core.transformer.transformer_config import TransformerConfig


class GPTModel(LanguageModule):
    """A decoder-only language model with Megatron-Core's constructor and forward contract.

    Args:
        config: the model shape and numerics.
        transformer_layer_spec: spec of one decoder layer (``get_gpt_layer_local_spec()``).
        vocab_size: the (already padded) vocabulary size.
        max_sequence_length: positions of the learned position table.
        pre_process / post_process: this pipeline stage owns the embedding / the output layer and loss.
        share_embeddings_and_output_weights, position_embedding_type, rotary_percent, rotary_base,
            seq_len_interpolation_factor: override the config's values when given
            (``seq_len_interpolation_factor``: ``config.rotary_seq_len_interpolation_factor``).
        parallel_output: keep logits sharded over the vocabulary (tp) when returning them.
        parallel_state: process groups; defaults to the instance recorded by
            ``parallel_state.initialize_model_parallel``. Their tp / pp sizes decide how the model is
            split; the config's sizes must be 1 (follow the groups) or equal them.
        num_layers / layer_offset: the layers this stage builds. Default: all layers with pp 1, else
            the layers of this pipeline rank's virtual stage ``vp_stage`` (default 0) in the config's
            pipeline split.
        sequence_parallel: overrides ``config.sequence_parallel`` when given (on only with tp > 1).
        device: where parameters live; built on the meta device and materialised there (with
            ``config.use_cpu_initialization``: materialised and initialised on the CPU, then moved).
        rope_scaling, rope_scaling_factor: Llama 3.x RoPE frequency scaling; override the config's
            ``rope_scaling`` / ``rope_scaling_factor`` when given.
        fp16_lm_cross_entropy, scatter_embedding_sequence_parallel, mtp_block_spec, pg_collection:
            Megatron-Core's; accepted at their defaults (others refused, naming the argument);
            ``pg_collection`` may be the default ParallelState's groups.
        execution_plan: the run's implementation choices (``execution_plan.resolve``); this model
            takes its output layer + loss path from it (the layers take theirs from the spec, e.g.
            ``get_gpt_decoder_block_plan_spec(plan)``). Default ``ExecutionPlan.plain(config)``:
            the torch code, the cross entropy fused where ``config.cross_entropy_loss_fusion`` asks.
        seed: initialisation seed; default ``torch.initial_seed()``. Weights depend only on the seed
            and each parameter's global name, never on the parallel layout. With
            ``config.perform_initialization=False`` they are left uninitialised (for a checkpoint load).

    Raises:
        ConfigError: the config's parallel sizes disagree with the process groups', or do not split
            the model (see ``TransformerConfig.check_parallel_sizes``); ``vp_stage`` out of range;
            an ``execution_plan`` resolved for another tensor-parallel size.
    """

    def __init__(
        self,
        config: TransformerConfig,
        transformer_layer_spec,
        vocab_size: int,
        max_sequence_length: int,
        pre_process: bool = True,
        post_process: bool = True,
        share_embeddings_and_output_weights: bool | None = None,
        position_embedding_type: str | None = None,
        rotary_percent: float | None = None,
        rotary_base: int | None = None,
        seq_len_interpolation_factor: float | None = None,
        parallel_output: bool = True,
        parallel_state: ParallelState | None = None,
        num_layers: int | None = None,
        layer_offset: int = 0,
        sequence_parallel: bool | None = None,
        device: torch.device | str | None = None,
        seed: int | None = None,
        vp_stage: int | None = None,
        fp16_lm_cross_entropy: bool = False,
        rope_scaling: bool | None = None,
        rope_scaling_factor: float | None = None,
        scatter_embedding_sequence_parallel: bool = True,
        mtp_block_spec: Any = None,
        pg_collection: Any = None,
        execution_plan: ExecutionPlan | None = None,
    ):
        super().__init__(config)
        _refuse_unbuilt(fp16_lm_cross_entropy, scatter_embedding_sequence_parallel, mtp_block_spec)
        self.pg = _groups(parallel_state, pg_collection)
        config.check_parallel_sizes(self.pg.tp_size, self.pg.pp_size, self.pg.cp_size)
        plan = _plan_for(execution_plan, config, self.pg.tp_size)
        if num_layers is None and self.pg.pp_size > 1:
            num_layers, layer_offset = _stage_layers(config, self.pg, vp_stage)
        tp_group = self.pg.tp_group
        self.pre_process, self.post_process = pre_process, post_process
        self.parallel_output = parallel_output
        self.vocab_size = vocab_size
        self.max_sequence_length = max_sequence_length
        self.share_embeddings_and_output_weights = (
            config.share_embeddings_and_output_weights
            if share_embeddings_and_output_weights is None
            else share_embeddings_and_output_weights
        )
        self.position_embedding_type = position_embedding_type or config.position_embedding_type
        self.rotary_dim = int(config.kv_channels * (rotary_percent or config.rotary_percent))
        self.rotary_base = rotary_base or config.rotary_base
        self.seq_len_interpolation_factor = (
            config.rotary_seq_len_interpolation_factor
            if seq_len_interpolation_factor is None
            else seq_len_interpolation_factor
        )
        scaling = config.rope_scaling if rope_scaling is None else rope_scaling
        self.rope_scaling_factor = (
            (config.rope_scaling_factor if rope_scaling_factor is None else rope_scaling_factor)
            if scaling
            else None
        )
        # As in Megatron-Core, the config's sequence_parallel decides unless the argument overrides it.
        sp = (
            config.sequence_parallel if sequence_parallel is None else sequence_parallel
        ) and self.pg.tp_size > 1
        self.sequence_parallel = sp
        with torch.device("meta"):
            if pre_process:
                self.embedding = LanguageModelEmbedding(
                    config,
                    vocab_size,
                    max_sequence_length,
                    self.position_embedding_type,
                    tp_group,
                    sp,
                    rng_tracker=self.pg.rng_tracker,
                )
            self.decoder = TransformerBlock(
                config,
                transformer_layer_spec,
                num_layers=num_layers,
                layer_offset=layer_offset,
                post_layer_norm=post_process,
                tp_group=tp_group,
                sequence_parallel=sp,
                rng_tracker=self.pg.rng_tracker,
                cp_groups=ContextParallelGroups.of(self.pg),
                moe_groups=MoEGroups.of(self.pg) if getattr(config, "num_moe_experts", None) else None,
            )
            if post_process:
                tied_here = self.share_embeddings_and_output_weights and pre_process
                self.output_layer = ColumnParallelLinear(
                    config.hidden_size,
                    vocab_size,
                    init_std=config.init_method_std,
                    bias=False,
                    tp_group=tp_group,
                    sequence_parallel=sp,
                    skip_weight_param_allocation=tied_here,
                    params_dtype=config.params_dtype,
                )
        self._materialize(torch.device(device or "cpu"), torch.initial_seed() if seed is None else seed)
        self.input_tensor: torch.Tensor | None = None
        self.fused_cross_entropy = post_process and plan.fused_cross_entropy
        self.output_loss = output_loss(plan, tp_group)
        if post_process and not pre_process and self.share_embeddings_and_output_weights:
            # The last stage's copy of the tied word embedding: its gradient is summed with the first
            # stage's over the embedding group (finalize_model_grads); it is left out of the grad norm.
            tag_param(self.output_layer.weight, shared_embedding_copy=True, shared=True)

    def _materialize(self, device: torch.device, seed: int) -> None:
        """Allocate the meta-built parameters on ``device`` and initialise them (a meta model, for the
        dry run, keeps no values). With ``use_cpu_initialization`` they are allocated and initialised on
        the CPU, then the model moves to ``device``: the values are the same, only the memory differs."""
        on_cpu_first = self.config.use_cpu_initialization and device.type not in ("cpu", "meta")
        recipes = {name: dict(vars(param)) for name, param in self.named_parameters()}

        def restore_recipes() -> None:  # to_empty and .to may replace Parameter objects
            for name, param in self.named_parameters():
                vars(param).update(recipes[name])

        self.to_empty(device="cpu" if on_cpu_first else device)
        restore_recipes()
        for module in self.modules():  # FP8 scaling state starts empty (to_empty left it undefined)
            if isinstance(module, Fp8Gemm) and device.type != "meta":
                module.reset_scaling_state_()
        if device.type != "meta" and self.config.perform_initialization:
            self.init_weights(seed)
        if on_cpu_first:
            self.to(device)
            restore_recipes()

    # ----------------------------------------------------------------------------------------------
    def global_param_name(self, local_name: str) -> str:
        """Layout-independent name: ``decoder.layers.<local>`` becomes the global layer index."""
        prefix = "decoder.layers."
        if local_name.startswith(prefix):
            idx, rest = local_name[len(prefix) :].split(".", 1)
            return f"{prefix}{int(idx) + self.decoder.layer_offset}.{rest}"
        if local_name == "output_layer.weight" and self.share_embeddings_and_output_weights:
            return "embedding.word_embeddings.weight"  # a tied copy on the last stage
        return local_name

    @torch.no_grad()
    def init_weights(self, seed: int) -> None:
        """(Re)initialise every parameter as its shard of the seed's logical tensor."""
        for name, param in self.named_parameters():
            init_param_(param, self.global_param_name(name), seed, tp_rank=self.pg.tp_rank)

    def shared_embedding_or_output_weight(self) -> torch.Tensor | None:
        if self.pre_process:
            return self.embedding.word_embeddings.weight
        if self.post_process and self.share_embeddings_and_output_weights:
            return self.output_layer.weight
        return None

    def set_input_tensor(self, input_tensor: torch.Tensor | list | None) -> None:
        """Megatron-Core's hook for pipeline schedules: the activation ``[s(/tp), b, h]`` received from
        the previous stage, used instead of the embedding when this stage has no ``pre_process``."""
        if isinstance(input_tensor, (list, tuple)):
            self.input_tensor = input_tensor[0] if input_tensor else None
        else:
            self.input_tensor = input_tensor

    # ----------------------------------------------------------------------------------------------
    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None,
        attention_mask: torch.Tensor | DocumentMask | None,
        decoder_input: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        inference_context: Any = None,
        packed_seq_params: PackedSeqParams | None = None,
        *,
        loss_mask: torch.Tensor | None = None,
    ):
        """Logits ``[b, s, V(/tp)]`` when ``labels`` is None, else per-token losses ``[b, s]`` (fp32).

        The arguments are Megatron-Core's, in its order (``inference_context`` must be None: no
        inference here). ``decoder_input`` (else the tensor given to ``set_input_tensor``) replaces
        the embedding on stages without ``pre_process``. On stages without ``post_process`` the
        hidden states ``[s(/tp with sequence parallelism), b, h]`` are returned. Loss masking is
        applied by the caller's loss function; with the fused output layer + cross entropy, the
        gradient reaching the losses must be one scalar times ``loss_mask`` (all ones when None), as
        a masked mean gives.

        ``position_ids`` None: the positions of this rank's tokens in ``0..S-1`` (with context
        parallelism, its chunks' global positions, ``context_parallel.layout``).

        ``attention_mask`` is ``None`` (causal) or Megatron's boolean mask, True = masked:
        ``[b, 1, s, s]``, ``[1, 1, s, s]`` or ``[b, s, s]``. A mask equal to the causal mask runs the fused
        causal attention; telling so compares the whole mask with a cached causal one, which on a GPU is
        a host sync per call (pass ``None`` to skip it). Any other mask is applied as given.
        It may also be a ``DocumentMask`` (packed documents, block-diagonal causal): with context
        parallelism, where inputs are this cp rank's chunks, only None or a DocumentMask is taken.
        ``packed_seq_params`` with ``qkv_format="thd"`` describes packed documents by their offsets
        in the full sequence (``cu_seqlens_q``); it becomes the DocumentMask, and ``attention_mask``
        must then be None.

        Raises:
            ValueError: a dense mask with context parallelism or with ``packed_seq_params``; a
                ``packed_seq_params`` this model does not build (``document_mask_of``); an
                ``inference_context``.
        """
        if inference_context is not None:
            raise ValueError("GPTModel.forward(inference_context=...): inference is not built; pass None")
        if self.pre_process:
            b, seq = input_ids.shape  # this rank's tokens
        else:
            hidden = decoder_input if decoder_input is not None else self.input_tensor
            b, seq = hidden.shape[1], hidden.shape[0] * (self.pg.tp_size if self.sequence_parallel else 1)
        if position_ids is None and (self.pre_process or self.position_embedding_type == "rope"):
            position_ids = self._local_positions(b, seq, input_ids if self.pre_process else hidden)
        if self.pre_process:
            hidden = self.embedding(input_ids, position_ids)
        rotary = None
        if self.position_embedding_type == "rope":
            rotary = rotary_cos_sin(
                position_ids,
                self.rotary_dim,
                self.rotary_base,
                self.seq_len_interpolation_factor,
                self.rope_scaling_factor,
            )
        attention_mask = self._attention_mask(attention_mask, packed_seq_params, b, seq)
        hidden = self.decoder(hidden, attention_mask, rotary)
        if not self.post_process:
            return hidden
        weight = (
            self.shared_embedding_or_output_weight() if self.share_embeddings_and_output_weights else None
        )
        if labels is not None:
            return self.output_loss(hidden, self.output_layer, weight, labels, loss_mask)  # [b, s]
        logits, _ = self.output_layer(hidden, weight=weight)  # [s, b, V/tp]
        if not self.parallel_output:
            logits = mappings.gather_from_tp(logits, self.pg.tp_group)
        return logits.transpose(0, 1).contiguous()

    def _local_positions(self, b: int, seq: int, like: torch.Tensor) -> torch.Tensor:
        """``[b, seq]``: the global positions of this rank's ``seq`` tokens (all of ``0..seq-1``
        without context parallelism)."""
        cp = self.pg.cp_size
        if cp == 1:  # any length (the cp layout needs 2 * cp equal chunks)
            return torch.arange(seq, device=like.device).expand(b, seq)
        return local_token_indices(seq * cp, cp, self.pg.cp_rank, like.device).expand(b, seq)

    def _attention_mask(
        self,
        attention_mask: torch.Tensor | DocumentMask | None,
        packed_seq_params: PackedSeqParams | None,
        b: int,
        seq: int,
    ) -> Any:
        """What the layers take for ``forward``'s mask arguments (``seq``: this rank's tokens)."""
        cp = self.pg.cp_size
        packed = document_mask_of(packed_seq_params, seq * cp, b, cp, self.pg.cp_group if cp > 1 else None)
        if packed is not None:
            if attention_mask is not None:
                raise ValueError(
                    "GPTModel.forward got packed_seq_params (qkv_format='thd') and an attention_mask; "
                    "the packed documents are the mask: pass attention_mask=None"
                )
            return packed
        if cp > 1 and attention_mask is not None and not isinstance(attention_mask, DocumentMask):
            raise ValueError(
                "with context parallelism GPTModel takes attention_mask=None (causal) or a "
                "DocumentMask (packed documents), not a dense mask"
            )
        return mask_for_attention(attention_mask, seq)

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """``nn.Module.load_state_dict``, also taking the tensors ``dist_checkpointing.load`` returns for
        this model's ``sharded_state_dict``: stacked weights (SwiGLU's fc1) come back in their
        checkpoint view ``[2, F/tp, h]`` and are reshaped to the parameter's ``[2F/tp, h]``."""
        params = dict(self.named_parameters())
        fixed = {}
        for name, value in state_dict.items():
            param = params.get(name)
            if (
                param is not None
                and torch.is_tensor(value)
                and getattr(param, "partition_stride", 1) > 1
                and value.shape != param.shape
                and value.numel() == param.numel()
            ):
                value = value.reshape(param.shape)
            fixed[name] = value
        return super().load_state_dict(fixed, strict=strict, assign=assign)

    # ----------------------------------------------------------------------------------------------
    def sharded_state_dict(self, prefix: str = "", sharded_offsets=(), metadata=None) -> dict:
        """Every tensor as a ``ShardedTensor`` with its global key, global shape and shard offset.

        Tensor-parallel weights are offset along their split dim (SwiGLU's fc1 is viewed as
        ``[2, F, h]`` so its two halves split independently); replicated tensors carry the tp rank
        in their replica id, so only tp rank 0 writes them. The data-parallel rank is part of every
        replica id. Expert parameters are blocks of their global ``[num_experts, ...]`` tensor,
        replicated over expert-dp (``shard_of``). The last pipeline stage's copy of a tied embedding
        is a non-main replica of ``embedding.word_embeddings.weight`` (replica id led by 1): the
        checkpoint stores the first stage's tensor only, and loading fills the copy from it.
        """
        tp_rank, dp_rank = self.pg.tp_rank, self.pg.dp_cp_rank  # cp ranks hold replicas too
        out = {}
        for name, tensor in self.state_dict(prefix="", keep_vars=True).items():
            key = prefix + self.global_param_name(name)
            shard = shard_of(key, tensor, tp_rank, dp_rank, self.pg.expt_dp_rank)
            if name == "output_layer.weight" and self.share_embeddings_and_output_weights:
                rid = shard.replica_id
                shard.replica_id = (1, *rid) if isinstance(rid, tuple) else (1, rid)
            out[prefix + name] = shard
        return out


def _refuse_unbuilt(
    fp16_lm_cross_entropy: bool,
    scatter_embedding_sequence_parallel: bool,
    mtp_block_spec: Any,
) -> None:
    """Megatron-Core's GPTModel arguments that ask for what is not built here raise, naming them."""
    for name, value, ok, hint in (
        ("fp16_lm_cross_entropy", fp16_lm_cross_entropy, False, "the cross entropy is computed in fp32"),
        (
            "scatter_embedding_sequence_parallel",
            scatter_embedding_sequence_parallel,
            True,
            "with sequence parallelism the embedding output is always scattered",
        ),
        ("mtp_block_spec", mtp_block_spec, None, "multi-token prediction is not built"),
    ):
        if value is not ok and value != ok:
            raise ConfigError(f"GPTModel({name}={value!r}) is not supported here: {hint}; pass {ok!r}")


def _plan_for(plan: ExecutionPlan | None, config: TransformerConfig, tp_size: int) -> ExecutionPlan:
    """``plan``, checked against the groups' tp size, or the plain plan (the torch code).

    Raises:
        ConfigError: a plan resolved for another tensor-parallel size.
    """
    if plan is None:
        return ExecutionPlan.plain(config, tp_size)
    if plan.tp_size != tp_size:
        raise ConfigError(
            f"the execution plan was resolved for tensor_model_parallel_size {plan.tp_size}, the "
            f"model is built on process groups of size {tp_size}; resolve it for those",
            params=("tensor_model_parallel_size",),
        )
    return plan


def _groups(parallel_state: ParallelState | None, pg_collection: Any) -> ParallelState:
    """The ParallelState to build on: ``parallel_state``, or Megatron-Core's ``pg_collection`` when it is
    a ParallelState or holds the default ParallelState's tp / pp groups, else the default.

    Raises:
        ConfigError: a ``pg_collection`` of other groups (pass ``parallel_state=`` instead).
    """
    if parallel_state is not None:
        return parallel_state
    if isinstance(pg_collection, ParallelState):
        return pg_collection
    default = get_parallel_state()
    if pg_collection is not None:
        for name, group in (("tp", default.tp_group), ("pp", default.pp_group)):
            given = getattr(pg_collection, name, None)
            if given is not None and given is not group:
                raise ConfigError(
                    f"GPTModel(pg_collection=...) holds a {name} group other than parallel_state's; "
                    "pass parallel_state=<the ParallelState of those groups> instead"
                )
    return default


def _stage_layers(config: TransformerConfig, pg: ParallelState, vp_stage: int | None) -> tuple[int, int]:
    """(layers, offset of the first) of this pipeline rank's virtual stage ``vp_stage`` in the config's split."""
    vpp = config.virtual_pipeline_model_parallel_size or 1
    chunk = 0 if vp_stage is None else vp_stage
    if not 0 <= chunk < vpp:
        raise ConfigError(
            f"vp_stage {vp_stage} is not a virtual pipeline stage of this rank; use 0 .. {vpp - 1} "
            "(virtual_pipeline_model_parallel_size)",
            params=("virtual_pipeline_model_parallel_size",),
        )
    layout = config.pipeline_layout(pg.pp_size, config.virtual_pipeline_model_parallel_size)
    return layout.num_layers_of(pg.pp_rank, chunk), layout.offset_of(pg.pp_rank, chunk)
