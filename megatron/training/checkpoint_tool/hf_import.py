"""A Hugging Face directory -> our checkpoint (``convert --to megatron``).

Reads ``config.json`` (through ``transformers.AutoConfig``, so its defaults apply) and the weights
(``model.safetensors``, sharded safetensors with their index, or ``pytorch_model.bin``) one tensor at
a time, fills our GPTModel (built on the CPU, one process, tp 1) and saves it with the training's
own ``save_checkpoint``: the keys, shapes, ``metadata.json`` and tracker are what training writes. The
checkpoint is iteration 0 with no optimizer or RNG state; ``converted_from`` names the HF directory.
"""

from __future__ import annotations

import json
import os
import shutil
from types import SimpleNamespace
from typing import Any

import torch

from megatron.core.tokenizer import vocab_size_with_padding
from megatron.training.checkpoint_tool import hf_families, hf_weights
from megatron.training.checkpoint_tool.errors import ToolError
from megatron.training.checkpoint_tool.hf_export import DTYPES
from megatron.training.checkpoint_tool.hf_moe import aux_loss_note, moe_layer_pattern, moe_model_flags
from megatron.training.checkpoint_tool.model_check import empty_model, transformer_config
from megatron.training.checkpointing import save_checkpoint
from megatron.training.loop_utils import model_args_for_check

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "added_tokens.json",
)
MAKE_VOCAB_SIZE_DIVISIBLE_BY = 128  # pretrain_gpt.py's default


class HFTensors:
    """The weights of a HF directory, read one tensor at a time by name.

    Raises:
        ToolError: the directory holds no weights this reads.
    """

    def __init__(self, hf_dir: str) -> None:
        from safetensors import safe_open

        self.dir = hf_dir
        index = os.path.join(hf_dir, "model.safetensors.index.json")
        single = os.path.join(hf_dir, "model.safetensors")
        self.files: dict[str, str] = {}
        self._bin: dict[str, torch.Tensor] | None = None
        if os.path.isfile(index):
            with open(index) as f:
                self.files = {k: os.path.join(hf_dir, v) for k, v in json.load(f)["weight_map"].items()}
        elif os.path.isfile(single):
            with safe_open(single, "pt") as f:
                self.files = dict.fromkeys(f.keys(), single)
        elif os.path.isfile(os.path.join(hf_dir, "pytorch_model.bin")):
            path = os.path.join(hf_dir, "pytorch_model.bin")
            self._bin = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
            self.files = dict.fromkeys(self._bin, path)
        else:
            raise ToolError(
                f"{hf_dir} holds no model.safetensors, model.safetensors.index.json or pytorch_model.bin"
            )

    def _name(self, name: str) -> str:
        """``name`` as stored (checkpoints saved from the base model lack the ``transformer.`` /
        ``model.`` prefix)."""
        if name in self.files:
            return name
        bare = name.split(".", 1)[1]
        if bare in self.files:
            return bare
        raise ToolError(f"{self.dir} holds no tensor {name}")

    def has(self, name: str) -> bool:
        """Whether the directory holds ``name`` (with or without its first prefix)."""
        return name in self.files or name.split(".", 1)[1] in self.files

    def read(self, name: str) -> torch.Tensor:
        stored = self._name(name)
        if self._bin is not None:
            return self._bin[stored]
        from safetensors import safe_open

        with safe_open(self.files[stored], "pt") as f:
            return f.get_tensor(stored)

    def dtype(self, name: str) -> torch.dtype:
        return self.read(name).dtype


def load_hf_config(hf_dir: str) -> Any:
    """``AutoConfig.from_pretrained(hf_dir)`` (local files only).

    Raises:
        ToolError: no readable ``config.json``.
    """
    if not os.path.isfile(os.path.join(hf_dir, "config.json")):
        raise ToolError(f"--input {hf_dir} holds no config.json: give a Hugging Face model directory")
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(hf_dir, local_files_only=True)
    except (OSError, ValueError, KeyError) as e:
        raise ToolError(f"{hf_dir}/config.json cannot be read by transformers: {e}") from None


def fill_model(model: torch.nn.Module, pieces: list[hf_weights.Piece], tensors: HFTensors) -> None:
    """Copy every piece's converted tensors into ``model``'s parameters (one piece at a time).

    Raises:
        ToolError: a shape that does not fit (the config and the weights disagree).
    """
    params = dict(model.named_parameters())
    filled = set()
    with torch.no_grad():
        for piece in pieces:
            theirs = [tensors.read(n) for n in piece.theirs]
            for key, value in zip(piece.ours, piece.to_ours(theirs)):
                param = params[key]
                if value.numel() != param.numel():
                    raise ToolError(
                        f"{tensors.dir}: {piece.theirs[0]} has shape {tuple(theirs[0].shape)}, which does not "
                        f"fit config.json's model ({key} {tuple(param.shape)})"
                    )
                param.copy_(value.reshape(param.shape))
                filled.add(key)
    assert filled == set(params), f"parameters not converted: {sorted(set(params) - filled)}"


def copy_tokenizer(hf_dir: str, out: str) -> str | None:
    """Copy the HF tokenizer files into ``out/tokenizer``; its path when it holds a ``tokenizer.json``
    (what our HuggingFaceTokenizer reads), else None."""
    present = [n for n in TOKENIZER_FILES if os.path.isfile(os.path.join(hf_dir, n))]
    if "tokenizer.json" not in present:
        return None
    target = os.path.join(os.path.abspath(out), "tokenizer")
    os.makedirs(target, exist_ok=True)
    for name in present:
        shutil.copy2(os.path.join(hf_dir, name), os.path.join(target, name))
    return target


def saved_args(
    fields: dict[str, Any], max_pos: int, vocab: int, padded: int, tokenizer_dir: str | None
) -> dict[str, Any]:
    """``args`` as ``TrainerCheckpointing.save`` writes them: the shape flags at the top level
    (``model_args_for_check``), ``vocab_size``, ``layout``, and ``config`` with the model,
    training and tokenizer fields that rebuild the model (``--use-checkpoint-args``)."""
    cfg = SimpleNamespace(
        model=transformer_config(fields), training=SimpleNamespace(max_position_embeddings=max_pos)
    )
    checks = model_args_for_check(cfg, padded)
    args: dict[str, Any] = {flag.lstrip("-").replace("-", "_"): value for flag, value in checks.items()}
    tokenizer = {}
    if tokenizer_dir:
        tokenizer = {"tokenizer_type": "HuggingFaceTokenizer", "tokenizer_model": tokenizer_dir}
    args["config"] = {
        "model": dict(fields),
        "training": {"max_position_embeddings": max_pos},
        "tokenizer": tokenizer,
    }
    args["vocab_size"] = vocab
    args["layout"] = {
        "world_size": 1,
        "tensor_model_parallel_size": 1,
        "pipeline_model_parallel_size": 1,
        "virtual_pipeline_model_parallel_size": 1,
        "data_parallel_size": 1,
        "sequence_parallel": False,
        "use_distributed_optimizer": False,
        "use_torch_fsdp2": False,
    }
    return args


def model_flags(fields: dict[str, Any], max_pos: int, padded: int) -> list[str]:
    """The pretrain_gpt.py flags of the architecture ``fields`` (what ``--use-checkpoint-args`` fills in)."""
    f = fields
    flags = [
        f"--num-layers {f['num_layers']}",
        f"--hidden-size {f['hidden_size']}",
        f"--ffn-hidden-size {f['ffn_hidden_size']}",
        f"--num-attention-heads {f['num_attention_heads']}",
    ]
    if f["num_query_groups"] != f["num_attention_heads"]:
        flags.append(f"--group-query-attention --num-query-groups {f['num_query_groups']}")
    if f["kv_channels"] * f["num_attention_heads"] != f["hidden_size"]:
        flags.append(f"--kv-channels {f['kv_channels']}")
    flags += [f"--normalization {f['normalization']}", f"--norm-epsilon {f['layernorm_epsilon']}"]
    if f["activation"] == "swiglu":
        flags.append("--swiglu")
    elif not f["bias_gelu_fusion"]:
        flags.append("--no-bias-gelu-fusion")
    if not f["add_bias_linear"]:
        flags.append("--disable-bias-linear")
        if f["add_qkv_bias"]:
            flags.append("--add-qkv-bias")
    flags.append(f"--position-embedding-type {f['position_embedding_type']}")
    if f["position_embedding_type"] == "rope":
        flags.append(f"--rotary-base {f['rotary_base']}")
        if f["rope_scaling"]:
            flags.append(f"--use-rope-scaling --rope-scaling-factor {f['rope_scaling_factor']}")
        if f["rotary_seq_len_interpolation_factor"]:
            flags.append(f"--rotary-seq-len-interpolation-factor {f['rotary_seq_len_interpolation_factor']}")
    if not f["share_embeddings_and_output_weights"]:
        flags.append("--untie-embeddings-and-output-weights")
    flags += moe_model_flags(f)
    flags += [f"--max-position-embeddings {max_pos}", f"--padded-vocab-size {padded}"]
    return flags


def _report(
    hf_dir: str, flags: list[str], tokenizer_dir: str | None, vocab: int, padded: int, window: int | None
) -> None:
    """Print the flags of the imported model and what a user must know to train it."""
    if window is not None:
        print(
            f"note: config.json sliding_window {window}: attention here is full causal attention, the same "
            f"function for sequences up to {window} tokens",
            flush=True,
        )
    print("pretrain_gpt.py model flags (or --use-checkpoint-args):", flush=True)
    print("  " + " ".join(flags), flush=True)
    if tokenizer_dir:
        print(f"  --tokenizer-type HuggingFaceTokenizer --tokenizer-model {tokenizer_dir}", flush=True)
    else:
        print(f"note: {hf_dir} holds no tokenizer.json; pass your tokenizer's flags", flush=True)
    print(
        f"note: the vocabulary of {vocab} is padded to {padded} rows (a multiple of {MAKE_VOCAB_SIZE_DIVISIBLE_BY}); "
        f"keep --padded-vocab-size {padded} at any --tensor-model-parallel-size that divides it",
        flush=True,
    )


def import_hf(hf_dir: str, out: str, dtype: str | None = None) -> dict[str, Any]:
    """Write our checkpoint of the HF model in ``hf_dir`` to the save directory ``out`` (iteration 0).

    Returns:
        ``{"family", "fields", "vocab", "padded", "max_pos", "flags", "tokenizer"}``.

    Raises:
        ToolError: the model is not one of the families, or the weights do not fit its config.
    """
    hf_cfg = load_hf_config(hf_dir)
    family, fields, max_pos = hf_families.fields_from_hf(hf_cfg)
    window = getattr(hf_cfg, "sliding_window", None) if family in ("mistral", "mixtral") else None
    vocab = int(hf_cfg.vocab_size)
    padded = vocab_size_with_padding(vocab, MAKE_VOCAB_SIZE_DIVISIBLE_BY, 1, log=None)
    tensors = HFTensors(hf_dir)
    first_moe = next((i for i, x in enumerate(moe_layer_pattern(fields)) if x), None)
    fused = first_moe is not None and tensors.has(f"model.layers.{first_moe}.mlp.experts.gate_up_proj")
    pieces = hf_weights.pieces_for(family, fields, vocab, padded, fused)
    weights_dtype = DTYPES[dtype] if dtype else tensors.dtype(pieces[0].theirs[0])
    model = empty_model(fields, padded, max_pos, weights_dtype)
    fill_model(model, pieces, tensors)
    tokenizer_dir = copy_tokenizer(hf_dir, out)
    extra = {
        "iteration": 0,
        "consumed_train_samples": 0,
        "consumed_valid_samples": 0,
        "num_floating_point_operations_so_far": 0,
        "checkpoint_version": 3.0,
        "converted_from": os.path.abspath(hf_dir),
        "hf_model_type": family,
        "args": saved_args(fields, max_pos, vocab, padded, tokenizer_dir),
    }
    save_checkpoint(
        out, 0, model.sharded_state_dict(), None, None, extra_state=extra, save_optim=False, save_rng=False
    )
    flags = model_flags(fields, max_pos, padded)
    print(
        f"converted {hf_dir} ({hf_families.ARCHITECTURES[family]}, weights in {weights_dtype}) to {out}",
        flush=True,
    )
    _report(hf_dir, flags, tokenizer_dir, vocab, padded, window if window and window < max_pos else None)
    note = aux_loss_note(fields)
    if note:
        print(note, flush=True)
    return {
        "family": family,
        "fields": fields,
        "vocab": vocab,
        "padded": padded,
        "max_pos": max_pos,
        "flags": flags,
        "tokenizer": tokenizer_dir,
    }
