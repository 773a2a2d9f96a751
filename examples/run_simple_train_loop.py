"""The Megatron-Core library path in one file: groups, model, DDP, mock data, schedule, step, checkpoint.

    torchrun --nproc-per-node 2 examples/run_simple_train_loop.py

Runs with gloo on the CPU and NCCL on GPUs. Tensor parallelism of 2 splits the model over the two
processes.
"""

import os
import sys
import tempfile
from functools import partial

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron.core import dist_checkpointing, parallel_state  # noqa: E402
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder  # noqa: E402
from megatron.core.datasets.gpt_dataset import GPTDatasetConfig, MockGPTDataset  # noqa: E402
from megatron.core.distributed import (  # noqa: E402
    DistributedDataParallel,
    DistributedDataParallelConfig,
    finalize_model_grads,
)
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec  # noqa: E402
from megatron.core.models.gpt.gpt_model import GPTModel  # noqa: E402
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer  # noqa: E402
from megatron.core.pipeline_parallel.schedules import get_forward_backward_func  # noqa: E402
from megatron.core.tokenizer import build_tokenizer  # noqa: E402
from megatron.core.transformer.transformer_config import TransformerConfig  # noqa: E402
from megatron.training.config import TokenizerConfig  # noqa: E402

SEQUENCE_LENGTH = 64


def initialize_distributed(tensor_model_parallel_size: int = 2, pipeline_model_parallel_size: int = 1):
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend="nccl" if cuda else "gloo")
    parallel_state.initialize_model_parallel(tensor_model_parallel_size, pipeline_model_parallel_size)
    return torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")


def model_provider(device):
    config = TransformerConfig(
        num_layers=2, hidden_size=12, num_attention_heads=4, tensor_model_parallel_size=2
    )
    return GPTModel(
        config=config,
        transformer_layer_spec=get_gpt_layer_local_spec(),
        vocab_size=100,
        max_sequence_length=SEQUENCE_LENGTH,
        device=device,
    )


def get_train_data_iterator():
    tokenizer = build_tokenizer(TokenizerConfig(tokenizer_type="NullTokenizer", vocab_size=100))
    config = GPTDatasetConfig(
        random_seed=0,
        sequence_length=SEQUENCE_LENGTH,
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
        tokenizer=tokenizer,
    )
    datasets = BlendedMegatronDatasetBuilder(MockGPTDataset, [1000, None, None], lambda: True, config).build()
    loader = torch.utils.data.DataLoader(
        datasets[0], batch_size=8, shuffle=True, generator=torch.Generator().manual_seed(0)
    )
    return iter(loader)


def forward_step_func(data_iterator, model, device):
    def loss_func(loss_mask, output_tensor):
        losses = output_tensor.float()
        loss_mask = loss_mask.view(-1).float()
        loss = torch.sum(losses.view(-1) * loss_mask) / loss_mask.sum()
        return loss, {"lm loss": loss.detach()}

    data = {k: v.to(device) for k, v in next(data_iterator).items()}
    output_tensor = model(
        data["tokens"], data["position_ids"], None, labels=data["labels"], loss_mask=data["loss_mask"]
    )
    return output_tensor, partial(loss_func, data["loss_mask"])


def main() -> None:
    device = initialize_distributed(tensor_model_parallel_size=2, pipeline_model_parallel_size=1)
    torch.manual_seed(123)
    gpt_model = model_provider(device)
    model = DistributedDataParallel(gpt_model.config, DistributedDataParallelConfig(), gpt_model)
    optimizer = get_megatron_optimizer(
        OptimizerConfig(lr=1e-3),
        [model],
        grad_stats_group=parallel_state.get_parallel_state().mp_group,
        tp_rank=parallel_state.get_tensor_model_parallel_rank(),
    )
    train_iterator = get_train_data_iterator()
    forward_backward_func = get_forward_backward_func()

    for i in range(5):
        model.zero_grad_buffer()
        optimizer.zero_grad()
        losses_reduced = forward_backward_func(
            forward_step_func=partial(forward_step_func, device=device),
            data_iterator=train_iterator,
            model=model,
            num_microbatches=1,
            seq_length=SEQUENCE_LENGTH,
            micro_batch_size=8,
            forward_only=False,
        )
        finalize_model_grads([model])
        optimizer.step()
        if dist.get_rank() == 0:
            print(f"Iteration {i}: Losses reduced: {{'lm loss': {losses_reduced[0]['lm loss'].item():.6f}}}")

    # Save and load the model through distributed checkpointing.
    ckpt_dir = tempfile.mkdtemp(prefix="mcore_example_") if dist.get_rank() == 0 else None
    holder = [ckpt_dir]
    dist.broadcast_object_list(holder, src=0)
    sharded_state_dict = gpt_model.sharded_state_dict(prefix="")
    dist_checkpointing.save(sharded_state_dict=sharded_state_dict, checkpoint_dir=holder[0])
    gpt_model.load_state_dict(
        dist_checkpointing.load(sharded_state_dict=sharded_state_dict, checkpoint_dir=holder[0])
    )
    if dist.get_rank() == 0:
        print("Successfully loaded the model")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
