"""The logits check that ends every conversion: our model, built on the CPU from one of our
checkpoints, and the Hugging Face model, loaded by ``AutoModelForCausalLM.from_pretrained``, run the
same fixed batch in fp32, eval mode; the largest absolute logit difference over the real vocabulary
must be within tolerance.

Both models are held in fp32 at once: the check needs about 8 bytes per parameter of memory
(``--no-check`` skips it for a model that does not fit).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec, get_gpt_layer_local_spec
from megatron.core.models.gpt.gpt_model import GPTModel
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.training.checkpoint_tool.errors import ToolError
from megatron.training.checkpoint_tool.hf_families import ARCH_FIELDS
from megatron.training.checkpoint_tool.reader import SavedCheckpoint

# Default --tolerance: both models compute in fp32 from identical weights (a bf16 export is compared
# against our weights rounded to bf16 the same way), so only the order of fp32 operations differs.
DEFAULT_TOLERANCE = 1e-4
BATCH, SEQ = 3, 32


def model_fields(ckpt: SavedCheckpoint) -> dict[str, Any]:
    """The checkpoint's architecture fields (``ARCH_FIELDS``) from ``args['config']['model']``.

    Raises:
        ToolError: the checkpoint records no model config.
    """
    saved = ckpt.config.get("model")
    if not saved:
        raise ToolError(
            f"{ckpt.dir} records no model config (args['config']['model']); it predates conversions, "
            "re-save it with this version"
        )
    fields = {k: saved[k] for k in ARCH_FIELDS if k in saved}
    missing = [k for k in ("num_layers", "hidden_size", "num_attention_heads") if k not in fields]
    if missing:
        raise ToolError(f"{ckpt.dir}: args['config']['model'] lacks {', '.join(missing)}")
    return fields


def max_positions(ckpt: SavedCheckpoint) -> int:
    """The saved run's ``max_position_embeddings`` (its ``seq_length`` if unset)."""
    training = ckpt.config.get("training", {})
    return int(training.get("max_position_embeddings") or training.get("seq_length") or 2048)


def transformer_config(fields: dict[str, Any], dtype: torch.dtype = torch.float32) -> TransformerConfig:
    """A one-process ``TransformerConfig`` of the architecture ``fields`` in ``dtype``, no dropout,
    weights left uninitialised (they are loaded)."""
    return TransformerConfig(
        **fields,
        params_dtype=dtype,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        perform_initialization=False,
    )


def empty_model(fields: dict[str, Any], padded_vocab: int, max_pos: int, dtype: torch.dtype) -> GPTModel:
    """Our GPTModel of ``fields`` on the CPU, one process, uninitialised weights (a model with experts:
    the decoder block's spec, one layer spec per layer as ``moe_layer_freq`` says)."""
    cfg = transformer_config(fields, dtype)
    if cfg.num_moe_experts:
        spec: Any = get_gpt_decoder_block_spec(cfg, use_transformer_engine=False)
    else:
        spec = get_gpt_layer_local_spec(normalization=cfg.normalization, qk_layernorm=cfg.qk_layernorm)
    return GPTModel(
        cfg,
        spec,
        vocab_size=padded_vocab,
        max_sequence_length=max_pos,
        parallel_output=False,
        device="cpu",
    )


def ours_from_checkpoint(ckpt: SavedCheckpoint, round_to: torch.dtype | None = None) -> GPTModel:
    """Our model with the checkpoint's weights, in fp32 and eval mode. ``round_to``: each weight
    first rounded to that dtype (what an export in that dtype holds); with --apply-layernorm-1p the
    norms' scales ``1 + w`` are rounded to it too, as a model in that dtype computes them (and as the
    export stores them)."""
    fields = model_fields(ckpt)
    padded = ckpt.tensors["embedding.word_embeddings.weight"][0][0]
    model = empty_model(fields, padded, max_positions(ckpt), torch.float32)
    one_p = bool(fields.get("apply_layernorm_1p"))
    with torch.no_grad():
        for name, param in model.named_parameters():
            value = ckpt.read(model.global_param_name(name))
            if round_to is not None:
                value = value.to(round_to)
                if one_p and name.endswith("layernorm.weight"):
                    value = (value + 1).float() - 1  # exact in fp32: the scale is round_to's 1 + w
            param.copy_(value.reshape(param.shape).float())
    return model.eval()


@dataclass
class CheckResult:
    """The logits comparison: the largest absolute difference and where the batch was taken."""

    max_abs_diff: float
    batch: tuple[int, int]
    first_position: int


def fixed_batch(vocab: int, first_position: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """``(tokens [BATCH, SEQ], position ids)``: deterministic tokens below ``vocab``, positions from
    ``first_position``."""
    gen = torch.Generator().manual_seed(1234)
    tokens = torch.randint(0, vocab, (BATCH, SEQ), generator=gen)
    positions = torch.arange(first_position, first_position + SEQ).expand(BATCH, SEQ)
    return tokens, positions


def hf_model(hf_dir: str) -> torch.nn.Module:
    """``AutoModelForCausalLM.from_pretrained(hf_dir)`` in fp32, eval mode.

    Raises:
        ToolError: the directory's weights leave some of the model's tensors missing.
    """
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    loaded: Any = AutoModelForCausalLM.from_pretrained(hf_dir, output_loading_info=True)
    model, info = loaded
    missing = sorted(info.get("missing_keys") or [])
    if missing:
        raise ToolError(f"{hf_dir}: transformers found no weights for {', '.join(missing[:4])}")
    return model.float().eval()


@torch.no_grad()
def compare(ours: GPTModel, hf: torch.nn.Module, vocab: int, first_position: int = 0) -> CheckResult:
    """Run the fixed batch through both models; the largest absolute logit difference over the first
    ``vocab`` (real) entries."""
    tokens, positions = fixed_batch(vocab, first_position)
    mine = ours(tokens, positions, None)[..., :vocab]
    theirs = hf(input_ids=tokens, position_ids=positions).logits[..., :vocab].float()
    return CheckResult(float((mine - theirs).abs().max()), (BATCH, SEQ), first_position)


def run_check(
    ckpt_path: str,
    hf_dir: str,
    vocab: int,
    tolerance: float,
    round_to: torch.dtype | None = None,
    first_position: int = 0,
) -> CheckResult:
    """Compare our model from ``ckpt_path`` with the HF model in ``hf_dir``; print the result.

    Raises:
        ToolError: the difference exceeds ``tolerance`` (one line naming both directories).
    """
    ours = ours_from_checkpoint(SavedCheckpoint(ckpt_path), round_to)
    result = compare(ours, hf_model(hf_dir), vocab, first_position)
    b, s = result.batch
    where = f"{b} sequences of {s} tokens from position {first_position}, fp32 on the CPU"
    if result.max_abs_diff > tolerance:
        raise ToolError(
            f"logits check failed: largest absolute logit difference {result.max_abs_diff:.3e} > "
            f"--tolerance {tolerance:g} between {ckpt_path} and {hf_dir} ({where})"
        )
    print(
        f"logits check: largest absolute logit difference {result.max_abs_diff:.3e} "
        f"(tolerance {tolerance:g}; {where})",
        flush=True,
    )
    return result
