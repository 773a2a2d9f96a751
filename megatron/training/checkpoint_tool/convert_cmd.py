"""``checkpoint.py convert``: our checkpoints to and from Hugging Face ``transformers`` directories.

    convert --input CKPT --output HF_DIR --to hf [--model-type llama|mistral|qwen2|gpt2|mixtral|qwen2_moe|qwen3_moe]
    convert --input HF_DIR --output CKPT --to megatron

Every conversion ends with the logits check (``model_check``): a difference above ``--tolerance`` is
an error (exit code 2); ``--no-check`` skips it.
"""

from __future__ import annotations

import argparse
import os

from megatron.training.checkpoint_tool import hf_export, hf_import
from megatron.training.checkpoint_tool.errors import ToolError
from megatron.training.checkpoint_tool.hf_families import FAMILIES
from megatron.training.checkpoint_tool.model_check import DEFAULT_TOLERANCE, run_check


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "convert",
        help="convert a checkpoint to a Hugging Face directory (--to hf) or back (--to megatron)",
        description=(
            "Convert our checkpoint to a Hugging Face transformers directory (--to hf) or a Hugging Face "
            "directory to our checkpoint (--to megatron), then run both models on a fixed batch on the "
            "CPU and compare their logits."
        ),
    )
    parser.add_argument(
        "--input",
        required=True,
        help="--to hf: a save directory or one iter_XXXXXXX; "
        "--to megatron: a Hugging Face model directory (config.json + weights)",
    )
    parser.add_argument("--output", required=True, help="the directory to write (created if missing)")
    parser.add_argument("--to", required=True, choices=("hf", "megatron"), help="the output format")
    parser.add_argument(
        "--model-type",
        choices=FAMILIES,
        default=None,
        help="--to hf: the Hugging Face family (default: derived from the checkpoint's flags)",
    )
    parser.add_argument(
        "--ckpt-step",
        type=int,
        default=None,
        help="--to hf: the iteration to export (default: the tracker's)",
    )
    parser.add_argument(
        "--vocab-size",
        type=int,
        default=None,
        help="--to hf: the unpadded vocabulary size, for checkpoints that do not record it",
    )
    parser.add_argument(
        "--dtype",
        choices=tuple(hf_export.DTYPES),
        default=None,
        help="dtype of the written weights (default: the input's)",
    )
    parser.add_argument(
        "--max-shard-size",
        default="5GB",
        help="--to hf: largest safetensors file (default 5GB; e.g. 500MB, 2GiB)",
    )
    parser.add_argument(
        "--tolerance",
        type=float,
        default=DEFAULT_TOLERANCE,
        help=f"largest absolute logit difference allowed (default {DEFAULT_TOLERANCE:g}: both "
        "models compute in fp32 from the same weights)",
    )
    parser.add_argument(
        "--no-check",
        action="store_true",
        help="skip the logits check (not recommended: it is what proves the conversion)",
    )
    parser.set_defaults(func=run)


def _refuse_misplaced(args: argparse.Namespace) -> None:
    """Options of the other direction are refused rather than ignored."""
    if args.to == "megatron":
        for flag, value in (
            ("--model-type", args.model_type),
            ("--ckpt-step", args.ckpt_step),
            ("--vocab-size", args.vocab_size),
        ):
            if value is not None:
                raise ToolError(f"{flag} applies to --to hf only (the Hugging Face config.json decides it)")
    if os.path.abspath(args.input) == os.path.abspath(args.output):
        raise ToolError("--output must differ from --input")
    if os.path.isdir(args.output) and os.listdir(args.output):
        raise ToolError(f"--output {args.output} exists and is not empty; give a new or empty directory")


def run(args: argparse.Namespace) -> int:
    _refuse_misplaced(args)
    if args.tolerance <= 0:
        raise ToolError(f"--tolerance {args.tolerance}: give a positive number such as 1e-4")
    if args.to == "hf":
        plan = hf_export.export(
            args.input,
            args.output,
            args.ckpt_step,
            args.model_type,
            args.vocab_size,
            args.dtype,
            args.max_shard_size,
        )
        if not args.no_check:
            ckpt_dir = hf_export.SavedCheckpoint(args.input, args.ckpt_step).dir
            run_check(ckpt_dir, args.output, plan.vocab, args.tolerance, round_to=plan.dtype)
    else:
        if not os.path.isdir(args.input):
            raise ToolError(f"--input {args.input} is not a directory (give a Hugging Face model directory)")
        done = hf_import.import_hf(args.input, args.output, args.dtype)
        if not args.no_check:
            run_check(args.output, args.input, done["vocab"], args.tolerance)
    if args.no_check:
        print("logits check: skipped (--no-check)", flush=True)
    return 0
