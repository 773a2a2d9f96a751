#!/usr/bin/env python3
"""Pretrain a GPT model: flags -> configs -> megatron.training.pretrain().

    torchrun --nproc-per-node N pretrain_gpt.py --num-layers 12 --hidden-size 768 ... (see README)

Runs on the CPU with gloo when no GPU is present, on the local GPU with NCCL otherwise.
"""

import sys


def main(argv=None) -> int:
    from megatron.training.cli import run

    return run(argv)


if __name__ == "__main__":
    sys.exit(main())
