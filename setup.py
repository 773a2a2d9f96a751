"""Packaging for megatron: a Megatron-style GPT pretraining framework in PyTorch."""

from setuptools import find_packages, setup

setup(
    name="megatron",
    version="0.1.0",
    description="GPT pretraining at any scale: tensor, sequence, pipeline, context, expert and data parallelism.",
    packages=find_packages(include=["megatron", "megatron.*"]),
    python_requires=">=3.10",
    install_requires=[
        "torch>=2.4",
        "numpy",
        "sentencepiece",
        "tiktoken",
        "tokenizers",
        "tensorboard",
        "tqdm",
    ],
    extras_require={
        "dev": [
            "pytest",
            "pytest-xdist",
            "ruff",
            "mypy",
            "transformers>=4.45",
            "safetensors",
        ],  # transformers: HF conversion tests
        "wandb": ["wandb"],
        "te": ["transformer-engine[pytorch]"],
        "torchao": ["torchao>=0.16"],  # --fp8-gemm-impl torchao
    },
)
