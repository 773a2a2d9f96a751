"""A Megatron-Core user's own training loop, made only of Megatron-Core's public names.

    python examples/mcore_library_program.py --save ckpt_1rank            # one process
    torchrun --nproc-per-node 2 examples/mcore_library_program.py         # tp 2
    torchrun --nproc-per-node 4 examples/mcore_library_program.py         # tp 2 x dp 2
    torchrun --nproc-per-node 4 examples/mcore_library_program.py --eval-checkpoint ckpt_1rank

It builds a Llama-style GPT (SwiGLU through ``gated_linear_unit=True, activation_func=F.silu``,
RMSNorm, RoPE, no biases, untied output layer), seeds with ``model_parallel_cuda_manual_seed``, takes
the loss from the vocabulary-parallel logits with ``vocab_parallel_cross_entropy`` called without a
group (the default tensor-parallel group of ``initialize_model_parallel`` is used, as in Megatron-Core),
averages gradients with ``DistributedDataParallel`` + ``finalize_model_grads``, steps the optimizer of
``get_megatron_optimizer``, and saves and loads the model with ``dist_checkpointing``.

Every layout trains the same model: the printed losses and gradient norms are those of one process
(tests/functional/test_mcore_library_program.py compares them). ``--eval-checkpoint`` first loads a
checkpoint saved under any layout into a second model and prints its eval loss; the trained model's
eval loss is printed before and after its own save/load round trip.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.nn.functional as F

from megatron.core import dist_checkpointing, parallel_state
from megatron.core.distributed import (
    DistributedDataParallel,
    DistributedDataParallelConfig,
    finalize_model_grads,
)
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.models.gpt.gpt_model import GPTModel
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed, vocab_parallel_cross_entropy
from megatron.core.transformer import TransformerConfig
from megatron.core.utils import unwrap_model

VOCAB, SEQ, GLOBAL_BATCH = 128, 32, 8


def initialize() -> None:
    """torch.distributed from torchrun's environment (none for a plain ``python``), then the groups."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size > 1:
        torch.distributed.init_process_group("gloo", rank=int(os.environ["RANK"]), world_size=world_size)
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=min(2, world_size))


def build_model() -> GPTModel:
    config = TransformerConfig(
        num_layers=2,
        hidden_size=64,
        num_attention_heads=4,
        num_query_groups=2,
        ffn_hidden_size=96,
        tensor_model_parallel_size=parallel_state.get_tensor_model_parallel_world_size(),
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        normalization="RMSNorm",
        hidden_dropout=0.0,
        attention_dropout=0.0,
        use_cpu_initialization=True,
        pipeline_dtype=torch.float32,
    )
    return GPTModel(
        config=config,
        transformer_layer_spec=get_gpt_layer_local_spec(),
        vocab_size=VOCAB,
        max_sequence_length=SEQ,
        position_embedding_type="rope",
        share_embeddings_and_output_weights=False,
        parallel_output=True,
    )


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This data-parallel rank's rows of the global batch of ``step`` (the same global batch for every
    layout): tokens and next-token labels, ``[b, s]``."""
    gen = torch.Generator().manual_seed(1000 + step)
    data = torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ + 1), generator=gen)
    dp_size, dp_rank = parallel_state.get_data_parallel_world_size(), parallel_state.get_data_parallel_rank()
    rows = data.chunk(dp_size)[dp_rank]
    return rows[:, :-1], rows[:, 1:]


def loss_of(model: torch.nn.Module, step: int) -> torch.Tensor:
    """Mean next-token loss over this rank's rows; the logits stay split over the vocabulary."""
    tokens, labels = batch(step)
    logits = model(tokens, None, None)  # [b, s, V/tp]
    return vocab_parallel_cross_entropy(logits.float(), labels).mean()


def dp_mean(value: torch.Tensor) -> float:
    """The loss of the whole global batch (every data-parallel rank holds an equal share)."""
    value = value.detach().clone()
    if torch.distributed.is_initialized():
        torch.distributed.all_reduce(value, group=parallel_state.get_data_parallel_group())
    return value.item() / parallel_state.get_data_parallel_world_size()


def train(model: DistributedDataParallel, steps: int) -> None:
    optimizer = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=3e-3, weight_decay=0.01, clip_grad=1.0), [model]
    )
    for step in range(steps):
        model.zero_grad_buffer()
        optimizer.zero_grad()
        loss = loss_of(model, step)
        loss.backward()
        finalize_model_grads([model])
        update_successful, grad_norm, _ = optimizer.step()
        assert update_successful
        log(f"step {step} loss {dp_mean(loss):.6f} grad_norm {grad_norm:.6f}")


def evaluate(model: torch.nn.Module) -> float:
    with torch.no_grad():
        return dp_mean(loss_of(model, step=-1))


def log(line: str) -> None:
    if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
        print(line, flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--save", default="ckpt", help="checkpoint directory written after training")
    parser.add_argument(
        "--eval-checkpoint", default=None, help="checkpoint (of any layout) to evaluate first"
    )
    args = parser.parse_args()

    initialize()
    model_parallel_cuda_manual_seed(1234)
    model = build_model()
    if args.eval_checkpoint:
        saved = build_model()
        saved.load_state_dict(
            dist_checkpointing.load(saved.sharded_state_dict(prefix=""), args.eval_checkpoint)
        )
        log(f"loaded eval loss {evaluate(saved):.6f}")
    ddp_config = DistributedDataParallelConfig(overlap_grad_reduce=False, use_distributed_optimizer=False)
    ddp_model = DistributedDataParallel(config=model.config, ddp_config=ddp_config, module=model)
    train(ddp_model, args.steps)
    log(f"eval loss {evaluate(ddp_model):.6f}")

    os.makedirs(args.save, exist_ok=True)
    dist_checkpointing.save(unwrap_model(ddp_model).sharded_state_dict(prefix=""), args.save)
    model_parallel_cuda_manual_seed(4321)  # a differently initialised model, then the saved weights
    fresh = build_model()
    fresh.load_state_dict(dist_checkpointing.load(fresh.sharded_state_dict(prefix=""), args.save))
    log(f"reloaded eval loss {evaluate(fresh):.6f}")
    parallel_state.destroy_model_parallel()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
