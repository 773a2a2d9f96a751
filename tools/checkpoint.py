"""Inspect, compare and convert checkpoints offline (one CPU process):

    python tools/checkpoint.py inspect CKPT [--json]
    python tools/checkpoint.py diff CKPT_A CKPT_B
    python tools/checkpoint.py convert --input CKPT --output HF_DIR --to hf
    python tools/checkpoint.py convert --input HF_DIR --output CKPT --to megatron

``python tools/checkpoint.py SUBCOMMAND --help`` explains each; docs/checkpoints.md has the details.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron.training.checkpoint_tool.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
