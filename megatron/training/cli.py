"""Entry-point glue: parse flags, report user errors as one line, run ``pretrain``."""

from __future__ import annotations

import os
import sys

from megatron.training import training
from megatron.training.arguments import parse_run_config
from megatron.training.dry_run import dry_run
from megatron.training.gpt import GPTProviders
from megatron.training.initialize import destroy, stop_job, wait_if_leaving
from megatron.training.user_errors import USER_ERRORS, flag_message


def _rank_from_env() -> int:
    return int(os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0")))


class _Layout:
    """The parallel sizes a dry run plans for, where the providers read them from a ParallelState."""

    def __init__(self, tp_size: int):
        self.tp_size = tp_size


def run(argv: list[str] | None = None) -> int:
    """Parse, validate and train; returns the exit code.

    A user error (``user_errors.USER_ERRORS``: a ``ConfigError``, a checkpoint's or a data file's
    error) prints ``pretrain_gpt.py: error: <message>`` once per job, with the library's parameter
    names written as flags (``user_errors.flag_message``), and exits 2 on every rank; divergence
    does the same with 3 (see ``initialize.stop_job``: in a job of several processes every rank
    leaves from there). Any other exception (a ``ValueError`` from torch included) is a bug and
    keeps its traceback. An abort of ``--exit-signal-handler``'s graceful exit (a second Ctrl-C)
    returns 130.
    """
    try:
        cfg = parse_run_config(argv)
        if _rank_from_env() == 0 and cfg.notes:
            print("\n".join(cfg.notes), flush=True)
        if cfg.training.dry_run:
            # Padded as the real run pads it: a multiple of divisible-by x the tensor-parallel size.
            _, padded = GPTProviders.tokenizer(cfg, _Layout(cfg.model.tensor_model_parallel_size))
            dry_run(cfg, padded)
            return 0
        training.pretrain(cfg, GPTProviders(cfg))  # through the module: tests replace it there
    except USER_ERRORS as e:
        return stop_job(flag_message(e), 2)
    except training.TrainingDiverged as e:
        return stop_job(str(e), 3)
    except KeyboardInterrupt:
        if _rank_from_env() == 0:
            print(
                "pretrain_gpt.py: aborted; the checkpoints saved before remain (an interrupted save is "
                "never loaded)",
                file=sys.stderr,
                flush=True,
            )
        return 130
    except Exception:
        wait_if_leaving()
        raise
    destroy()
    return 0
