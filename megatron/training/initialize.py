"""Process-group set-up, device choice and seeding."""

from __future__ import annotations

import os
import random
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist

from megatron.core.parallel_state import ParallelState, destroy_model_parallel, initialize_model_parallel


def _env_int(*names: str, default: int) -> int:
    for n in names:
        if os.environ.get(n):
            return int(os.environ[n])
    return default


def initialize_distributed(backend: str = "auto", timeout_minutes: int = 10, tp: int = 1,
                           pp: int = 1) -> tuple[torch.device, ParallelState]:
    """Join the process group torchrun (or srun) describes, or run alone.

    Without CUDA the backend is gloo on the CPU; with CUDA, NCCL on ``cuda:LOCAL_RANK``. A single
    process started with plain ``python`` gets a one-rank group too, so every code path is the same.
    """
    rank = _env_int("RANK", "SLURM_PROCID", default=0)
    world = _env_int("WORLD_SIZE", "SLURM_NTASKS", default=1)
    local_rank = _env_int("LOCAL_RANK", "SLURM_LOCALID", default=0)
    use_cuda = torch.cuda.is_available()
    if backend == "auto":
        backend = "nccl" if use_cuda else "gloo"
    if backend == "nccl" and not use_cuda:
        raise ValueError("--distributed-backend nccl needs CUDA GPUs; use gloo (or auto) on the CPU")
    device = torch.device("cuda", local_rank) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        if os.environ.get("MASTER_ADDR") and os.environ.get("MASTER_PORT"):
            init_method = "env://"  # torchrun (joins its store) or srun with the variables exported
        elif world == 1:
            init_method = f"tcp://127.0.0.1:{_free_port()}"  # plain `python pretrain_gpt.py`
        else:
            raise ValueError(f"{world} processes but MASTER_ADDR/MASTER_PORT are not set; launch with torchrun, "
                             "or export MASTER_ADDR=<first node> MASTER_PORT=29500 in the srun script")
        dist.init_process_group(backend=backend, init_method=init_method, rank=rank, world_size=world,
                                timeout=timedelta(minutes=timeout_minutes),
                                device_id=device if backend == "nccl" else None)
    return device, initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def set_random_seeds(seed: int, pp_rank: int = 0) -> None:
    """Python, NumPy and torch (CPU and CUDA) seeds: ``seed + 100 * pp_rank`` as in Megatron."""
    s = seed + 100 * pp_rank
    random.seed(s)
    np.random.seed(s)
    torch.manual_seed(s)
    if torch.cuda.is_available():
        torch.cuda.manual_seed_all(s)


def destroy() -> None:
    destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
