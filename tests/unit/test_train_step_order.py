"""Trainer.train_step issues the loss all-reduce before the optimizer step queues the weight broadcasts.

NCCL runs one communicator's collectives in issue order. With ``--use-distributed-optimizer
--overlap-param-gather`` the step ends by queueing every parameter's broadcast on the data-parallel
communicator, for the next forward to wait on layer by layer. A loss all-reduce queued on that
communicator after them waited for all of them, and the next forward for it (Llama-3-8B on 4 H200s:
the compute stream idle 50 ms a step; docs/performance.md, twelfth pass).
"""

from types import SimpleNamespace

import torch

from megatron.training import training
from megatron.training.timers import Timers
from megatron.training.training import Trainer


def test_losses_are_reduced_before_the_step_queues_the_weight_broadcasts(monkeypatch):
    calls = []
    dp_group = object()

    def all_reduce(tensor, op=None, group=None, async_op=False):
        calls.append(("all_reduce", group))
        tensor.mul_(2)  # two replicas with the same sums

    monkeypatch.setattr(training.dist, "all_reduce", all_reduce)

    def step(sync=True):
        calls.append(("optimizer step: weight broadcasts queued", dp_group))
        return True, torch.tensor(1.0), None

    chunk = SimpleNamespace(zero_grad_buffer=lambda: None)
    metrics = [{"lm loss": torch.tensor([3.0, 2.0])}, {"lm loss": torch.tensor([1.0, 2.0])}]
    trainer = SimpleNamespace(
        model=[chunk],
        optimizer=SimpleNamespace(zero_grad=lambda: None, step=step),
        scheduler=SimpleNamespace(step=lambda increment: calls.append(("scheduler", None))),
        cfg=SimpleNamespace(training=SimpleNamespace(seq_length=8, micro_batch_size=1)),
        forward_backward=lambda **kwargs: metrics,
        providers=SimpleNamespace(forward_step=None),
        train_iter=None,
        num_microbatches=2,
        global_batch_size=4,
        pg=SimpleNamespace(dp_size=2, dp_cp_size=2, dp_cp_group=dp_group),
        moe=None,  # a dense model: no MoE step hooks
        timers=Timers(0, "minmax", torch.device("cpu")),  # --timing-log-level 0: inert
        guard=None,  # no step checks (megatron.training.rerun)
    )
    trainer._reduce_losses = lambda m: Trainer._reduce_losses(trainer, m)

    losses, success, grad_norm, _ = Trainer.train_step(trainer, sync=False)

    assert calls == [
        ("all_reduce", dp_group),
        ("optimizer step: weight broadcasts queued", dp_group),
        ("scheduler", None),
    ]
    assert success and torch.equal(losses["lm loss"], torch.tensor([8.0, 8.0]))
    assert float(grad_norm) == 1.0
