#!/usr/bin/env python3
"""Pipeline bubble on GPUs: measured against the theoretical (p-1)/(v*m+p-1).

    torchrun --nproc-per-node 2 bench/pipeline_bubble.py --microbatches 1,2,4,8,16,32 --vpp 1,2,4

For each (v, m): builds this rank's GPT chunks (pp = world size, bf16), then
  * T     = measured time of one training step through the real schedule (1F1B or interleaved);
  * ideal = the slowest stage's own compute for the step: the same chunks run forward+backward on
            m micro-batches with no communication and no waiting (max over ranks);
  * bubble = 1 - ideal / T  (the share of the step a stage is idle or communicating),
compared with Megatron's (p-1)/(v*m+p-1) for equal stages. The last stage also holds the
output layer and loss, so stages are not perfectly equal; its extra work shows up in ``ideal``.
Prints a table and writes $OUT/pipeline_bubble.json (or ./pipeline_bubble.json without $OUT).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from functools import partial

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron.core import parallel_state  # noqa: E402
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec  # noqa: E402
from megatron.core.models.gpt.gpt_model import GPTModel  # noqa: E402
from megatron.core.pipeline_parallel.layout import build_pipeline_layout  # noqa: E402
from megatron.core.pipeline_parallel.schedules import get_forward_backward_func  # noqa: E402
from megatron.core.transformer.transformer_config import TransformerConfig  # noqa: E402
from megatron.training.gpt import forward_step  # noqa: E402


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-layers", type=int, default=16)
    p.add_argument("--hidden-size", type=int, default=2048)
    p.add_argument("--num-attention-heads", type=int, default=16)
    p.add_argument("--seq-length", type=int, default=2048)
    p.add_argument("--micro-batch-size", type=int, default=1)
    p.add_argument("--vocab-size", type=int, default=32768)
    p.add_argument("--microbatches", default="1,2,4,8,16,32", help="comma-separated micro-batch counts m")
    p.add_argument("--vpp", default="1,2,4", help="comma-separated virtual chunks per rank v")
    p.add_argument("--steps", type=int, default=5, help="timed steps per point (after 2 warm-up steps)")
    p.add_argument(
        "--no-overlap-p2p-communication",
        dest="overlap_p2p_comm",
        action="store_false",
        help="wait for each pipeline exchange instead of overlapping it with compute",
    )
    return p.parse_args()


def build(args, pg, vpp: int, device) -> tuple[list[GPTModel], TransformerConfig]:
    cfg = TransformerConfig(
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        num_attention_heads=args.num_attention_heads,
        bf16=True,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        pipeline_model_parallel_size=pg.pp_size,
        virtual_pipeline_model_parallel_size=vpp if vpp > 1 else None,
        position_embedding_type="rope",
        normalization="RMSNorm",
        activation="swiglu",
        add_bias_linear=False,
        overlap_p2p_comm=args.overlap_p2p_comm,
    )
    layout = build_pipeline_layout(cfg.num_layers, pg.pp_size, vpp)
    chunks = [
        GPTModel(
            cfg,
            get_gpt_layer_local_spec(),
            args.vocab_size,
            args.seq_length,
            parallel_state=pg,
            device=device,
            seed=1234,
            pre_process=pg.pp_rank == 0 and c == 0,
            post_process=pg.pp_rank == pg.pp_size - 1 and c == vpp - 1,
            num_layers=layout.num_layers_of(pg.pp_rank, c),
            layer_offset=layout.offset_of(pg.pp_rank, c),
        )
        for c in range(vpp)
    ]
    return chunks, cfg


def batches(args, device):
    while True:
        tokens = torch.randint(0, args.vocab_size, (args.micro_batch_size, args.seq_length), device=device)
        yield {
            "tokens": tokens,
            "labels": tokens.roll(-1, 1),
            "position_ids": None,
            "loss_mask": torch.ones_like(tokens, dtype=torch.float32),
        }


def _clean(batch):
    return {k: v for k, v in batch.items() if v is not None}


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    dist.barrier()


def timed(fn, steps: int, device) -> float:
    for _ in range(2):
        fn()
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(steps):
        fn()
    _sync(device)
    return (time.perf_counter() - t0) / steps


def stage_compute(chunks, args, m: int, device) -> None:
    """This rank's forward+backward of m micro-batches on every chunk, with no pipeline communication."""
    shape = (args.seq_length, args.micro_batch_size, args.hidden_size)
    data = batches(args, device)
    for _ in range(m):
        for chunk in chunks:
            b = next(data)
            x = (
                None
                if chunk.pre_process
                else torch.randn(shape, device=device, dtype=torch.bfloat16, requires_grad=True)
            )
            chunk.set_input_tensor(x)
            out = chunk(b["tokens"], None, None, labels=b["labels"] if chunk.post_process else None)
            if chunk.post_process:
                out.float().mean().backward()
            else:
                out.backward(torch.ones_like(out))


def main() -> None:
    args = parse()
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:  # a CPU smoke run of the script itself (numbers meaningless)
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    pp = dist.get_world_size()
    pg = parallel_state.initialize_model_parallel(pipeline_model_parallel_size=pp)
    rows = []
    for v in [int(x) for x in args.vpp.split(",")]:
        if args.num_layers % (pp * v):
            continue
        chunks, cfg = build(args, pg, v, device)
        func = get_forward_backward_func(pp, v)
        for m in [int(x) for x in args.microbatches.split(",")]:
            if v > 1 and (m < pp or (m % pp and m % pp < pp)):
                continue  # the interleaved schedule's micro-batch rule
            it = (_clean(b) for b in batches(args, device))
            step_fn = partial(
                func,
                forward_step_func=partial(
                    forward_step, seq_length=args.seq_length, micro_batch_size=args.micro_batch_size
                ),
                data_iterator=[it] * v,
                model=chunks,
                num_microbatches=m,
                seq_length=args.seq_length,
                micro_batch_size=args.micro_batch_size,
            )
            step = timed(step_fn, args.steps, device)
            ideal = torch.tensor(
                [timed(partial(stage_compute, chunks, args, m, device), args.steps, device)], device=device
            )
            dist.all_reduce(ideal, op=dist.ReduceOp.MAX)
            measured = 1.0 - ideal.item() / step
            theory = (pp - 1) / (v * m + pp - 1)
            rows.append(
                dict(
                    pp=pp,
                    vpp=v,
                    microbatches=m,
                    step_ms=step * 1e3,
                    ideal_ms=ideal.item() * 1e3,
                    bubble_measured=measured,
                    bubble_theory=theory,
                )
            )
            for chunk in chunks:
                chunk.zero_grad(set_to_none=True)
        del chunks
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if dist.get_rank() == 0:
        print(
            f"device: {name}  pp={pp}  layers={args.num_layers} "
            f"hidden={args.hidden_size} seq={args.seq_length} mbs={args.micro_batch_size} bf16"
        )
        print(f"{'vpp':>4} {'m':>4} {'step ms':>10} {'ideal ms':>10} {'bubble':>8} {'theory':>8}")
        for r in rows:
            print(
                f"{r['vpp']:>4} {r['microbatches']:>4} {r['step_ms']:>10.2f} {r['ideal_ms']:>10.2f} "
                f"{r['bubble_measured']:>8.3f} {r['bubble_theory']:>8.3f}"
            )
        out_dir = os.environ.get("OUT", ".")
        os.makedirs(out_dir, exist_ok=True)
        with open(os.path.join(out_dir, "pipeline_bubble.json"), "w") as f:
            json.dump({"config": vars(args), "device": name, "rows": rows}, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
