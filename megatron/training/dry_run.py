"""``--dry-run``: validate the configuration and report what a step will need, touching no GPU."""

from __future__ import annotations

import dataclasses

from megatron.core.parallel_state import ParallelState, RankGrid
from megatron.training.flops import num_floating_point_operations, shape_from_config
from megatron.training.gpt import model_provider
from megatron.training.validation import planned_world_size

BYTES = {"torch.float32": 4, "torch.bfloat16": 2, "torch.float16": 2}


def estimate_memory_bytes(cfg, num_params: int, padded_vocab_size: int) -> dict[str, float]:
    """Per-GPU memory estimate for the first pipeline stage (no recompute).

    Parameters are spread over tp x pp ranks. Per parameter: weights in the param dtype, main
    gradients (fp32, or bf16 with ``--grad-reduce-in-bf16``), optimizer state (fp32 main params when the model is bf16/fp16, plus Adam's two moments
    or SGD's momentum; divided by the data-parallel size with ``--use-distributed-optimizer``, which
    splits whole params, so it is the balanced share). Activations: about 34 bytes per token and hidden unit per layer with fused
    (flash/cuDNN) attention; 1F1B keeps pp micro-batches of L/pp layers alive on the first stage, i.e.
    L layers' worth; tensor parallelism divides them (all of them with sequence parallelism, the
    matmul-side half without). Plus the logits of one micro-batch chunk on the last stage, bounded by
    the fused cross entropy.
    """
    m, t = cfg.model, cfg.training
    tp, pp = m.tensor_model_parallel_size, getattr(m, "pipeline_model_parallel_size", 1)
    local_params = num_params / (tp * pp)
    p_bytes = BYTES.get(str(m.params_dtype), 4)
    master = 4 if p_bytes < 4 else 0
    moments = 8 if cfg.optimizer.optimizer == "adam" else 4
    tokens = t.seq_length * t.micro_batch_size
    ffn_scale = m.ffn_hidden_size / (4 * m.hidden_size) * (1.5 if m.activation == "swiglu" else 1.0)
    per_layer = tokens * m.hidden_size * (18 + 16 * ffn_scale)
    per_layer /= tp if m.sequence_parallel else 2.0 / (1.0 + 1.0 / tp)
    logits = (
        min(tokens * padded_vocab_size / tp, 2**30) * 2
    )  # fused CE: bf16 logits overwritten by their grads
    dp = planned_world_size(cfg) // (tp * pp) if cfg.ddp.use_distributed_optimizer else 1
    return {
        "weights": local_params * p_bytes,
        "gradients": local_params * (4 if cfg.ddp.grad_reduce_in_fp32 else p_bytes),  # --grad-reduce-in-bf16
        "optimizer": local_params * (master + moments) / max(dp, 1),
        "activations": per_layer * m.num_layers + logits,
    }


def dry_run(cfg, padded_vocab_size: int, log=print) -> None:

    # The whole model in one process, so without the pipeline split (uneven first/last stage sizes
    # only describe a split over several pipeline ranks); the parameter count is the same.
    whole = dataclasses.replace(
        cfg,
        model=dataclasses.replace(
            cfg.model,
            tensor_model_parallel_size=1,
            pipeline_model_parallel_size=1,
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
        ),
    )
    chunks = model_provider(whole, padded_vocab_size, ParallelState(grid=RankGrid(), rank=0), "meta")
    num_params = sum(p.numel() for chunk in chunks for p in chunk.parameters())
    mem = estimate_memory_bytes(cfg, num_params, padded_vocab_size)
    world = planned_world_size(cfg)
    t = cfg.training
    flops = num_floating_point_operations(
        shape_from_config(cfg.model, padded_vocab_size), t.global_batch_size, t.seq_length
    )
    log(f"dry run: configuration is valid for {world} process(es)")
    log(f"  parameters: {num_params:,} (padded vocabulary {padded_vocab_size})")
    for k, v in mem.items():
        log(f"  {k + ' memory':<20} {v / 2**30:10.2f} GiB per GPU")
    log(f"  {'total (estimate)':<20} {sum(mem.values()) / 2**30:10.2f} GiB per GPU")
    log(f"  model FLOPs per step: {flops:.4e} ({t.global_batch_size} samples x {t.seq_length} tokens)")
    for name, peak in (("H100/H200 SXM", 989e12), ("A100", 312e12)):
        log(
            f"  predicted step time at 45% MFU on {world} x {name}: {flops / (0.45 * peak * world) * 1e3:.1f} ms"
        )
