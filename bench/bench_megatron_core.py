#!/usr/bin/env python3
"""Training throughput of NVIDIA megatron-core on one GPU, on the same model shapes as bench_gpt.py.

    python -m pip install --no-deps --target DIR .whl/megatron_core-*-cp312-*.whl
    python bench/bench_megatron_core.py --mcore-site DIR [--configs gpt-1.3b,llama-3b] [--iters 10]
                                        [--attention-softmax-in-fp32]

megatron-core and this repository both name their top-level package ``megatron``, so the library is
installed into its own folder DIR (the pip command above; nothing is installed at run time) and
imported from there: DIR goes first on ``sys.path``, the repository root and this script's folder
are dropped from it, and the import is checked to come from DIR.

The model is built as a Megatron-LM user would build it without Transformer Engine or Apex: the
local layer spec (``get_gpt_layer_local_spec``: unfused ``DotProductAttention``, torch LayerNorm or
RMSNorm), bf16 parameters wrapped in ``Float16Module``, megatron-core's ``DistributedDataParallel``
with fp32 gradient accumulation, ``get_megatron_optimizer`` (torch AdamW under a mixed-precision
wrapper with fp32 main weights) and the no-pipelining ``forward_backward_func``. Every fusion that
needs Apex or Transformer Engine is off. Attention softmax runs in bf16, as under Megatron-LM's
default flags; ``--attention-softmax-in-fp32`` gives the library's own default, fp32, which also
keeps every layer's [b, heads, s, s] attention probabilities in fp32 for backward.

One step is: zero the gradient buffers, forward and backward over one micro-batch of synthetic
random tokens (the global batch is the micro-batch), optimizer step. After 3 warm-up steps each of
``--iters`` steps is timed between ``torch.cuda.synchronize()`` calls. The table reports the median
step time, tokens/s, peak allocated memory and the last loss; one JSON line per configuration is
appended to ``$OUT/bench_megatron_core.jsonl`` (or ./bench_out/). A configuration that runs out of
memory is recorded as ``{"config": ..., "oom": true}`` and the next one runs.
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import math
import os
import statistics
import sys
import time
import types
from collections.abc import Iterator
from functools import partial
from typing import Any

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WARMUP = 3

# Shapes of bench_gpt.py CONFIGS and shared/baselines/common.py; both tie embeddings, no dropout.
CONFIGS: dict[str, dict[str, Any]] = {
    "gpt-1.3b": dict(
        num_layers=24,
        hidden_size=2048,
        num_attention_heads=16,
        num_query_groups=16,
        ffn_hidden_size=8192,
        swiglu=False,
        normalization="LayerNorm",
        position_embedding_type="learned_absolute",
        rotary_base=10000,
        bias=True,
        vocab_size=50304,
        seq_length=2048,
        micro_batch_size=8,
    ),
    "llama-3b": dict(
        num_layers=26,
        hidden_size=3072,
        num_attention_heads=24,
        num_query_groups=8,
        ffn_hidden_size=8192,
        swiglu=True,
        normalization="RMSNorm",
        position_embedding_type="rope",
        rotary_base=500000,
        bias=False,
        vocab_size=128256,
        seq_length=4096,
        micro_batch_size=2,
    ),
}


def import_megatron_core(site: str) -> types.ModuleType:
    """Import megatron-core from ``site`` rather than this repository's ``megatron`` package.

    Returns:
        The ``megatron.core`` module.
    Raises:
        ValueError: ``site`` holds no megatron-core, or ``megatron`` resolves elsewhere.
    """
    site = os.path.realpath(site)
    if not os.path.isdir(os.path.join(site, "megatron", "core")):
        raise ValueError(
            f"--mcore-site {site}: no megatron/core there; install the wheel with "
            "pip install --no-deps --target DIR .whl/megatron_core-*.whl"
        )
    if "megatron" in sys.modules:
        raise ValueError(f"megatron already imported from {sys.modules['megatron'].__path__}")
    shadowing = {ROOT, os.path.dirname(os.path.abspath(__file__)), site}
    sys.path[:] = [site] + [p for p in sys.path if os.path.realpath(p or os.curdir) not in shadowing]
    import megatron.core

    if not os.path.realpath(megatron.core.__file__).startswith(site + os.sep):
        raise ValueError(f"megatron.core imported from {megatron.core.__file__}, not from {site}")
    return megatron.core


def init_distributed() -> None:
    """One-process group, model-parallel state (tp=1, pp=1) and megatron-core's RNG tracker."""
    from megatron.core import parallel_state, tensor_parallel

    for key, value in (
        ("MASTER_ADDR", "localhost"),
        ("MASTER_PORT", "29517"),
        ("RANK", "0"),
        ("WORLD_SIZE", "1"),
        ("LOCAL_RANK", "0"),
    ):
        os.environ.setdefault(key, value)
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    torch.distributed.init_process_group(backend="nccl")
    parallel_state.initialize_model_parallel(1, 1)
    tensor_parallel.model_parallel_cuda_manual_seed(1234)


def transformer_config(shape: dict, attention_softmax_in_fp32: bool):
    """megatron-core ``TransformerConfig`` for one of CONFIGS (or a smaller dict of the same keys)."""
    import torch.nn.functional as F
    from megatron.core.transformer.enums import AttnBackend

    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(
        num_layers=shape["num_layers"],
        hidden_size=shape["hidden_size"],
        num_attention_heads=shape["num_attention_heads"],
        num_query_groups=shape["num_query_groups"],
        ffn_hidden_size=shape["ffn_hidden_size"],
        normalization=shape["normalization"],
        gated_linear_unit=shape["swiglu"],
        activation_func=F.silu if shape["swiglu"] else F.gelu,
        add_bias_linear=shape["bias"],
        hidden_dropout=0.0,
        attention_dropout=0.0,
        bf16=True,
        params_dtype=torch.bfloat16,
        attention_backend=AttnBackend.local,
        attention_softmax_in_fp32=attention_softmax_in_fp32,
        # These need Apex, Transformer Engine or megatron's custom CUDA kernels, none installed.
        gradient_accumulation_fusion=False,
        masked_softmax_fusion=False,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        persist_layer_norm=False,
    )


def build_model(shape: dict, config, device: torch.device) -> torch.nn.Module:
    """GPTModel on the local spec, in bf16 (Float16Module), wrapped in megatron-core's DDP."""
    from megatron.core.transformer.module import Float16Module

    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    model = GPTModel(
        config=config,
        transformer_layer_spec=get_gpt_layer_local_spec(normalization=shape["normalization"]),
        vocab_size=shape["vocab_size"],
        max_sequence_length=shape["seq_length"],
        pre_process=True,
        post_process=True,
        share_embeddings_and_output_weights=True,
        position_embedding_type=shape["position_embedding_type"],
        rotary_base=shape["rotary_base"],
    )
    model.to(device)  # norms are built on the CPU; linear weights already sit on the GPU
    return DistributedDataParallel(
        config=config,
        ddp_config=DistributedDataParallelConfig(grad_reduce_in_fp32=True),
        module=Float16Module(config, model),
    )


def build_optimizer(model: torch.nn.Module):
    """``get_megatron_optimizer`` with the bench's AdamW settings; hooks its loss scale and grad
    finalisation into the model config as Megatron-LM's training loop does (no overlapped grad
    reduction, so no ``no_sync_func``)."""
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    optimizer = get_megatron_optimizer(
        OptimizerConfig(
            optimizer="adam",
            lr=1e-4,
            bf16=True,
            params_dtype=torch.bfloat16,
            clip_grad=1.0,
            weight_decay=0.1,
            adam_beta2=0.95,
            use_distributed_optimizer=False,
        ),
        [model],
    )
    model.config.grad_scale_func = optimizer.scale_loss
    model.config.finalize_model_grads_func = finalize_model_grads
    return optimizer


def synthetic_batch(shape: dict, device: torch.device) -> dict:
    """Random tokens, labels shifted by one, all-ones loss mask and a causal mask on ``device``."""
    b, s = shape["micro_batch_size"], shape["seq_length"]
    gen = torch.Generator().manual_seed(1234)
    text = torch.randint(0, shape["vocab_size"], (b, s + 1), generator=gen).to(device)  # [b, s+1]
    # Megatron's boolean mask convention: True = masked (future position). [1, 1, s, s] broadcasts over
    # batch and heads; DotProductAttention would otherwise rebuild it on every layer of every step.
    causal = torch.triu(torch.ones(s, s, dtype=torch.bool, device=device), diagonal=1).view(1, 1, s, s)
    return {
        "tokens": text[:, :-1].contiguous(),  # [b, s]
        "labels": text[:, 1:].contiguous(),  # [b, s]
        "loss_mask": torch.ones(b, s, dtype=torch.float, device=device),  # [b, s]
        "position_ids": torch.arange(s, device=device).unsqueeze(0).expand(b, s),  # [b, s]
        "attention_mask": causal,
    }


def loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor):
    """Megatron-LM's GPT loss: masked sum and token count; the schedule divides one by the other.

    Returns:
        (summed loss, number of tokens, {"lm loss": [summed loss, number of tokens]}).
    """
    losses = output_tensor.view(-1).float()  # per-token cross entropy, [b * s]
    mask = loss_mask.view(-1).float()
    loss = torch.sum(losses * mask)
    num_tokens = mask.sum().detach().to(torch.int)
    return loss, num_tokens, {"lm loss": torch.cat([loss.detach().view(1), num_tokens.view(1).float()])}


def forward_step(data_iterator: Iterator[dict], model: torch.nn.Module):
    """The ``forward_step_func`` of megatron-core's schedules: the model returns per-token losses."""
    batch = next(data_iterator)
    output = model(
        batch["tokens"],
        batch["position_ids"],
        batch["attention_mask"],
        labels=batch["labels"],
        loss_mask=batch["loss_mask"],
    )
    return output, partial(loss_func, batch["loss_mask"])


def train_step(
    model: torch.nn.Module, optimizer, data_iterator: Iterator[dict], shape: dict
) -> tuple[torch.Tensor, float]:
    """One optimizer step over one micro-batch.

    Returns:
        ([summed loss, number of tokens] on the device, gradient norm before clipping).
    """
    from megatron.core.pipeline_parallel import get_forward_backward_func

    model.zero_grad_buffer()
    optimizer.zero_grad()
    losses = get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=data_iterator,
        model=[model],
        num_microbatches=1,
        seq_length=shape["seq_length"],
        micro_batch_size=shape["micro_batch_size"],
        forward_only=False,
    )
    update_successful, grad_norm, _ = optimizer.step()
    assert update_successful, "bf16 without a loss scaler never skips a step"
    return losses[0]["lm loss"], grad_norm


def module_classes(model: torch.nn.Module, suffix: str) -> str:
    """Class names of the modules whose qualified name ends in ``suffix`` (e.g. the core attention)."""
    return ",".join(sorted({type(m).__name__ for n, m in model.named_modules() if n.endswith(suffix)}))


def bench_config(name: str, args: argparse.Namespace) -> dict:
    """Build, warm up and time one configuration on the current GPU."""
    shape = CONFIGS[name]
    device = torch.device("cuda", torch.cuda.current_device())
    config = transformer_config(shape, args.attention_softmax_in_fp32)
    model = build_model(shape, config, device)
    optimizer = build_optimizer(model)
    data = itertools.repeat(synthetic_batch(shape, device))
    for _ in range(WARMUP):
        train_step(model, optimizer, data, shape)
    times = []
    for _ in range(args.iters):
        torch.cuda.synchronize()
        start = time.perf_counter()
        report, grad_norm = train_step(model, optimizer, data, shape)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    step_s = statistics.median(times)
    loss = (report[0] / report[1]).item()
    return {
        "config": name,
        "oom": False,
        "attention": module_classes(model, "core_attention"),
        "norm": module_classes(model, "input_layernorm"),
        "attention_softmax_in_fp32": args.attention_softmax_in_fp32,
        "num_params": sum(p.numel() for p in model.parameters()),
        "micro_batch_size": shape["micro_batch_size"],
        "seq_length": shape["seq_length"],
        "steps": args.iters,
        "step_ms": step_s * 1e3,
        "step_ms_all": [round(t * 1e3, 2) for t in times],
        "tokens_per_s": shape["micro_batch_size"] * shape["seq_length"] / step_s,
        "peak_gib": torch.cuda.max_memory_allocated() / 2**30,
        "final_loss": loss,
        "loss_finite": math.isfinite(loss),
        "grad_norm": grad_norm,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--mcore-site",
        required=True,
        help="folder made by pip install --no-deps --target DIR .whl/megatron_core-*.whl",
    )
    ap.add_argument(
        "--configs", default="gpt-1.3b,llama-3b", help=f"comma-separated, from {', '.join(CONFIGS)}"
    )
    ap.add_argument(
        "--iters", type=int, default=10, help="timed steps per configuration, after 3 warm-up steps"
    )
    ap.add_argument(
        "--attention-softmax-in-fp32",
        action="store_true",
        help="softmax of the unfused attention in fp32 (library default) rather than bf16",
    )
    args = ap.parse_args()
    names = args.configs.split(",")
    unknown = [n for n in names if n not in CONFIGS]
    if unknown:
        raise ValueError(f"--configs: unknown {unknown}; choose from {list(CONFIGS)}")
    mcore = import_megatron_core(args.mcore_site)
    init_distributed()
    print(
        f"megatron-core {mcore.__version__} from {os.path.dirname(mcore.__file__)}; torch {torch.__version__}; "
        f"{torch.cuda.get_device_name()}",
        flush=True,
    )
    out_dir = os.environ.get("OUT") or os.path.join(ROOT, "bench_out")
    os.makedirs(out_dir, exist_ok=True)
    common = {
        "framework": "megatron-core",
        "mcore_version": mcore.__version__,
        "torch": torch.__version__,
        "gpu": torch.cuda.get_device_name(),
    }
    print(
        f"\n{'config':<10} {'step ms':>9} {'tokens/s':>10} {'peak GiB':>9} {'loss':>8}  attention", flush=True
    )
    for name in names:
        torch.cuda.reset_peak_memory_stats()
        try:
            rec = bench_config(name, args)
        except torch.OutOfMemoryError:
            rec = {"config": name, "oom": True}
        gc.collect()  # DDP's grad hooks put the model and optimizer in reference cycles
        torch.cuda.empty_cache()
        if rec["oom"]:
            print(f"{name:<10} {'OOM':>9}", flush=True)
        else:
            print(
                f"{name:<10} {rec['step_ms']:9.1f} {rec['tokens_per_s']:10.0f} {rec['peak_gib']:9.1f} "
                f"{rec['final_loss']:8.4f}  {rec['attention']} ({rec['norm']})",
                flush=True,
            )
        with open(os.path.join(out_dir, "bench_megatron_core.jsonl"), "a") as f:
            f.write(json.dumps({**common, **rec}) + "\n")
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
