"""Our checkpoint -> a Hugging Face ``transformers`` directory (``convert --to hf``).

Reads the checkpoint one tensor at a time (``reader.SavedCheckpoint``: any tp / pp / dp /
distributed-optimizer / FSDP2 layout, since keys and global shapes do not depend on it) and writes
safetensors shards as they fill: memory holds at most one shard plus the tensors being converted.
Writes ``config.json``, ``generation_config.json``, ``model.safetensors`` (or
``model-0000k-of-0000n.safetensors`` + ``model.safetensors.index.json``) and the tokenizer files when
the run's tokenizer can be saved as a HF one.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from typing import Any

import torch

from megatron.core.tokenizer import build_tokenizer
from megatron.core.tokenizer.gpt2_bpe import EOD_TOKEN, load_byte_level_bpe
from megatron.core.tokenizer.huggingface_tokenizer import HuggingFaceTokenizer
from megatron.training.checkpoint_tool import hf_families, hf_weights
from megatron.training.checkpoint_tool.errors import ToolError
from megatron.training.checkpoint_tool.model_check import max_positions, model_fields
from megatron.training.checkpoint_tool.reader import SavedCheckpoint

MODEL_PREFIXES = ("embedding.", "decoder.", "output_layer.")
SIZE_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}


def parse_size(text: str) -> int:
    """``"5GB"`` (10^9), ``"500MiB"`` (2^20) or a byte count -> bytes.

    Raises:
        ToolError: not a size (names ``--max-shard-size``).
    """
    found = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMG]i?B|B)?\s*", text, flags=re.IGNORECASE)
    if not found or float(found.group(1)) <= 0:
        raise ToolError(f"--max-shard-size {text!r}: give a size such as 5GB, 500MB or 2GiB")
    return int(float(found.group(1)) * SIZE_UNITS[(found.group(2) or "").upper()])


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@dataclass
class ExportPlan:
    """What an export writes: the family, our model fields, the vocabulary sizes, the pieces, and the
    output dtype."""

    family: str
    fields: dict[str, Any]
    vocab: int
    padded: int
    pieces: list[hf_weights.Piece]
    dtype: torch.dtype


def unpadded_vocab(ckpt: SavedCheckpoint, given: int | None, padded: int) -> int:
    """The real vocabulary size: ``--vocab-size``, else the checkpoint's ``args['vocab_size']``, else
    the saved tokenizer's (rebuilt from the saved tokenizer config).

    Raises:
        ToolError: none of these is known, or it exceeds the embedding's rows.
    """
    vocab = given or ckpt.args.get("vocab_size")
    if not vocab:
        try:
            cfg = ckpt.config.get("tokenizer") or {}
            vocab = build_tokenizer(type("TokenizerConfig", (), cfg)).vocab_size
        except (ValueError, OSError, ImportError):  # missing or moved files: the size is not known
            vocab = None
    if not vocab:
        raise ToolError(
            f"{ckpt.dir} does not record its unpadded vocabulary size and its tokenizer cannot be "
            "built here: pass --vocab-size N (the tokenizer's vocabulary size)"
        )
    if vocab > padded:
        raise ToolError(f"--vocab-size {vocab} exceeds the checkpoint's {padded} embedding rows")
    return int(vocab)


def plan_export(
    ckpt: SavedCheckpoint, model_type: str | None, vocab_size: int | None, dtype: str | None
) -> ExportPlan:
    """Decide the family (``model_type``, else the one an import recorded, else derived from the
    flags), the vocabulary and the tensors of an export; check the checkpoint holds exactly the model
    tensors the family has.

    Raises:
        ToolError: the family cannot express the model, or the checkpoint's tensors do not fit it.
    """
    fields = model_fields(ckpt)
    family = model_type or ckpt.common.get("hf_model_type") or hf_families.detect_family(fields)
    hf_families.check_expressible(family, fields)
    emb = ckpt.tensors.get("embedding.word_embeddings.weight")
    if emb is None:
        raise ToolError(f"{ckpt.dir} holds no embedding.word_embeddings.weight: not a GPT model checkpoint")
    padded = emb[0][0]
    vocab = unpadded_vocab(ckpt, vocab_size, padded)
    pieces = hf_weights.pieces_for(family, fields, vocab, padded)
    wanted = {k for p in pieces for k in p.ours}
    held = {k for k in ckpt.tensors if k.startswith(MODEL_PREFIXES)}
    if wanted - held:
        raise ToolError(f"{ckpt.dir} lacks {sorted(wanted - held)[0]}, which a {family} model has")
    if held - wanted:
        raise ToolError(f"--model-type {family} cannot express {sorted(held - wanted)[0]} (in {ckpt.dir})")
    out_dtype = DTYPES[dtype] if dtype else emb[1]
    return ExportPlan(family, fields, vocab, padded, pieces, out_dtype)


def _hf_shapes(ckpt: SavedCheckpoint, piece: hf_weights.Piece) -> list[tuple[str, torch.Size]]:
    """The HF names and shapes ``piece`` writes, from our shapes (run on meta tensors)."""
    metas = [torch.empty(ckpt.tensors[k][0], device="meta") for k in piece.ours]
    return [(name, t.shape) for name, t in zip(piece.theirs, piece.to_hf(metas))]


def shard_groups(ckpt: SavedCheckpoint, plan: ExportPlan, max_bytes: int) -> list[list[hf_weights.Piece]]:
    """The pieces cut into consecutive shards of at most ``max_bytes`` (a piece larger than that is a
    shard by itself)."""
    itemsize = torch.empty((), dtype=plan.dtype).element_size()
    groups: list[list[hf_weights.Piece]] = [[]]
    size = 0
    for piece in plan.pieces:
        nbytes = sum(s.numel() for _, s in _hf_shapes(ckpt, piece)) * itemsize
        if groups[-1] and size + nbytes > max_bytes:
            groups.append([])
            size = 0
        groups[-1].append(piece)
        size += nbytes
    return groups


def _readable_as_umask_allows(path: str) -> None:
    """Give ``path`` the permissions a plain ``open`` would (safetensors writes owner-only files)."""
    umask = os.umask(0o022)
    os.umask(umask)
    os.chmod(path, 0o666 & ~umask)


def write_weights(ckpt: SavedCheckpoint, plan: ExportPlan, out: str, max_bytes: int) -> list[str]:
    """Write the safetensors shard(s) (and the index for more than one); return the file names."""
    from safetensors.torch import save_file

    groups = shard_groups(ckpt, plan, max_bytes)
    n = len(groups)
    names = (
        ["model.safetensors"] if n == 1 else [f"model-{k + 1:05d}-of-{n:05d}.safetensors" for k in range(n)]
    )
    weight_map: dict[str, str] = {}
    total = 0
    for name, group in zip(names, groups):
        shard: dict[str, torch.Tensor] = {}
        for piece in group:
            # Cast first: a fold (1 + w of --apply-layernorm-1p) rounds as a model in that dtype does.
            converted = piece.to_hf([ckpt.read(k, plan.dtype) for k in piece.ours])
            for hf_name, t in zip(piece.theirs, converted):
                shard[hf_name] = t.contiguous()
                weight_map[hf_name] = name
                total += shard[hf_name].numel() * shard[hf_name].element_size()
        save_file(shard, os.path.join(out, name), metadata={"format": "pt"})
        _readable_as_umask_allows(os.path.join(out, name))
        del shard
    if n > 1:
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        with open(os.path.join(out, "model.safetensors.index.json"), "w") as f:
            json.dump(index, f, indent=2, sort_keys=True)
    return names


def _hf_tokenizer(path: str) -> Any:
    """A ``transformers`` tokenizer of ``--tokenizer-model`` ``path``: a directory AutoTokenizer reads,
    else its (or the file's) ``tokenizer.json`` with the end-of-document token our
    HuggingFaceTokenizer finds as eos."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    if os.path.isdir(path) and os.path.isfile(os.path.join(path, "tokenizer_config.json")):
        return AutoTokenizer.from_pretrained(path)
    file = os.path.join(path, "tokenizer.json") if os.path.isdir(path) else path
    ours = HuggingFaceTokenizer(file)
    tok = PreTrainedTokenizerFast(tokenizer_file=file)
    eos = tok.convert_ids_to_tokens(ours.eod)
    tok.add_special_tokens({"eos_token": eos, "bos_token": eos})
    return tok


def _tokenizer(ckpt: SavedCheckpoint) -> tuple[Any, str]:
    """(a ``transformers`` tokenizer of the run, or None; a line saying what was done)."""
    cfg = ckpt.config.get("tokenizer") or {}
    kind = cfg.get("tokenizer_type")
    try:
        if kind == "HuggingFaceTokenizer" and cfg.get("tokenizer_model"):
            return _hf_tokenizer(cfg["tokenizer_model"]), f"tokenizer: saved from {cfg['tokenizer_model']}"
        if kind == "GPT2BPETokenizer" and cfg.get("vocab_file") and cfg.get("merge_file"):
            from transformers import PreTrainedTokenizerFast

            bpe = load_byte_level_bpe(cfg["vocab_file"], cfg["merge_file"])
            tok = PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token=EOD_TOKEN, eos_token=EOD_TOKEN)
            return tok, f"tokenizer: GPT-2 BPE from {cfg['vocab_file']} and {cfg['merge_file']}"
    except (OSError, ValueError, KeyError) as e:  # moved or unreadable files: the weights still export
        return None, f"tokenizer: not written ({kind} files could not be read: {e})"
    if not kind:
        return None, "tokenizer: not written (the checkpoint records no tokenizer)"
    return None, f"tokenizer: not written ({kind} is not saved as a Hugging Face tokenizer)"


def write_configs(ckpt: SavedCheckpoint, plan: ExportPlan, out: str, tokenizer: Any) -> None:
    """``config.json`` and ``generation_config.json``; special token ids from the tokenizer."""
    bos = getattr(tokenizer, "bos_token_id", None)
    eos = getattr(tokenizer, "eos_token_id", None)
    if eos is None:
        eos = bos
    max_pos = max(max_positions(ckpt), int(ckpt.config.get("training", {}).get("seq_length") or 0))
    if plan.family == "gpt2":  # the learned table's rows
        max_pos = ckpt.tensors["embedding.position_embeddings.weight"][0][0]
    config = hf_families.hf_config(
        plan.family, plan.fields, plan.vocab, max_pos, dtype_name(plan.dtype), bos, eos
    )
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    generation = {"_from_model_config": True, "bos_token_id": bos, "eos_token_id": eos}
    with open(os.path.join(out, "generation_config.json"), "w") as f:
        json.dump(generation, f, indent=2)


def export(
    input_path: str,
    out: str,
    ckpt_step: int | None = None,
    model_type: str | None = None,
    vocab_size: int | None = None,
    dtype: str | None = None,
    max_shard_size: str = "5GB",
) -> ExportPlan:
    """Write the HF directory ``out`` of the checkpoint at ``input_path``; return what was decided.

    Raises:
        ToolError / CheckpointError: the input is not a complete checkpoint, or cannot be expressed.
    """
    max_bytes = parse_size(max_shard_size)
    ckpt = SavedCheckpoint(input_path, ckpt_step)
    plan = plan_export(ckpt, model_type, vocab_size, dtype)
    os.makedirs(out, exist_ok=True)
    tokenizer, tok_line = _tokenizer(ckpt)
    files = write_weights(ckpt, plan, out, max_bytes)
    write_configs(ckpt, plan, out, tokenizer)
    if tokenizer is not None:
        tokenizer.save_pretrained(out)
    print(
        f"wrote {out}: {hf_families.ARCHITECTURES[plan.family]} from {ckpt.dir} (iteration {ckpt.iteration}), "
        f"{len(files)} safetensors file(s) in {dtype_name(plan.dtype)}, vocabulary {plan.vocab} "
        f"(padding of {plan.padded - plan.vocab} rows removed)",
        flush=True,
    )
    print(tok_line, flush=True)
    return plan
