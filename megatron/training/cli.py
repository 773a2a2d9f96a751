"""Entry-point glue: parse flags, report user errors as one line, run ``pretrain``."""

from __future__ import annotations

import os
import sys


def _rank_from_env() -> int:
    return int(os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0")))


class _NoParallelism:
    tp_size = 1


def run(argv: list[str] | None = None) -> int:
    """Parse, validate and train. A user error prints ``error: <message>`` (on rank 0) and returns 2."""
    from megatron.training.arguments import parse_args
    from megatron.training.gpt import GPTProviders
    from megatron.training.initialize import destroy
    from megatron.training.training import TrainingDiverged, pretrain

    try:
        cfg = parse_args(argv)
        if cfg.training.dry_run:
            from megatron.training.dry_run import dry_run

            _, padded = GPTProviders.tokenizer(cfg, _NoParallelism())
            dry_run(cfg, padded)
            return 0
        pretrain(cfg, GPTProviders(cfg))
    except ValueError as e:
        if _rank_from_env() == 0:
            print(f"pretrain_gpt.py: error: {e}", file=sys.stderr, flush=True)
        destroy()
        return 2
    except TrainingDiverged as e:
        print(f"pretrain_gpt.py: error: {e}", file=sys.stderr, flush=True)
        destroy()
        return 3
    destroy()
    return 0
