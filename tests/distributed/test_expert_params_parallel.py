"""Expert parameters under expert parallelism (4 gloo ranks, one spawn): a toy MoE layer whose local
experts see every token of their expert-parallel group (all-gather dispatch, reduce-scatter combine)
gives, under ep1 / ep2 / ep4, with plain, overlapped, averaged-in-collective DDP and the distributed
optimizer, and FSDP2, the single-process gradients, grad norm, params norm and optimizer steps; an
ep2 checkpoint (model and distributed-optimizer state) resumes under ep1, ep2 and ep4 (and FSDP2) on
the same curve; an ep2 x etp2 checkpoint of a strided expert weight loads under other ep / etp; and
a GPTModel with MoE layers takes the single-process step under ep2 (alltoall) and ep4 (allgather)
with the distributed optimizer, its ep2 checkpoint loading under ep4."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.distributed as dist
from harness import device, run_distributed
from torch import nn

from megatron.core import dist_checkpointing
from megatron.core.distributed import (
    DistributedDataParallel,
    DistributedDataParallelConfig,
    TorchFullyShardedDataParallel,
    finalize_model_grads,
)
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.models.gpt.gpt_model import GPTModel
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer, get_param_groups
from megatron.core.optimizer.clip_grads import params_l2_norm
from megatron.core.optimizer.optimizer import MegatronOptimizer
from megatron.core.parallel_state import ParallelState, RankGrid, build_parallel_state
from megatron.core.tensor_parallel.init import init_param_, set_init_attrs
from megatron.core.tensor_parallel.mappings import gather_from_sp, reduce_scatter_to_sp
from megatron.core.transformer.module import MegatronModule, shard_of
from megatron.core.transformer.moe.expert_params import tag_expert_param
from megatron.core.transformer.transformer_config import TransformerConfig

WORLD, E, H, T, MICRO, STEPS = 4, 4, 8, 3, 2, 3  # ranks, experts, hidden, tokens per rank
OPT = OptimizerConfig(lr=0.05, weight_decay=0.1, clip_grad=0.5)
DDP_CONFIGS = {
    "plain": DistributedDataParallelConfig(),
    "overlap": DistributedDataParallelConfig(overlap_grad_reduce=True, bucket_size=40),
    "avg": DistributedDataParallelConfig(overlap_grad_reduce=True, average_in_collective=True),
    "distopt": DistributedDataParallelConfig(
        use_distributed_optimizer=True, overlap_grad_reduce=True, overlap_param_gather=True, bucket_size=40
    ),
    "fsdp": DistributedDataParallelConfig(use_torch_fsdp2=True),
}


class Experts(nn.Module):
    """This rank's experts: ``weight`` ``[E_local, H, H]`` and ``bias`` ``[E_local, H]`` (expert-tagged)."""

    def __init__(self, ps: ParallelState) -> None:
        super().__init__()
        local = E // ps.ep_size
        tags = dict(num_experts=E, ep_rank=ps.ep_rank, ep_size=ps.ep_size, etp_rank=0, init_std=0.3)
        self.weight = tag_expert_param(nn.Parameter(torch.empty(local, H, H, device=device())), **tags)
        self.bias = tag_expert_param(nn.Parameter(torch.empty(local, H, device=device())), **tags)
        self.offset = ps.ep_rank * local

    def forward(self, tokens: torch.Tensor, expert: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(tokens)
        for i in range(self.weight.shape[0]):
            mask = (expert == self.offset + i).unsqueeze(-1)
            out = out + mask * (tokens @ self.weight[i].t() + self.bias[i])
        return out


class ToyMoE(MegatronModule):
    """h = x W_d^T + b_d; token g goes to expert (3g + m + step) % E, on the ep rank holding it;
    y = h W_e^T + b_e; loss mean of |y + h|^2."""

    def __init__(self, ps: ParallelState, seed: int) -> None:
        super().__init__(SimpleNamespace(num_moe_experts=E))
        self.pg = ps
        self.dense = nn.Linear(H, H, device=device())
        set_init_attrs(self.dense.weight, std=0.3)
        set_init_attrs(self.dense.bias, std=0.3)
        self.experts = Experts(ps)
        for name, p in self.named_parameters():
            init_param_(p, name, seed)
        self.ep_group = ps.groups.get("ep")
        self.ep_ranks = ps.group_ranks.get("ep", [0])

    def forward(self, x: torch.Tensor, step: int, m: int) -> torch.Tensor:
        h = self.dense(x)  # [n, H]
        tokens = gather_from_sp(h, self.ep_group)  # [ep * n, H], the ep group's tokens in rank order
        n = x.shape[0]
        rows = torch.arange(tokens.shape[0], device=x.device)
        global_index = torch.tensor(self.ep_ranks, device=x.device)[rows // n] * n + rows % n
        out = self.experts(tokens, (3 * global_index + m + step) % E)
        y = reduce_scatter_to_sp(out, self.ep_group)  # [n, H], each token's output back on its rank
        return ((y + h) ** 2).sum(-1).mean()


def _inputs() -> torch.Tensor:
    return torch.randn(STEPS, MICRO, WORLD * T, H, generator=torch.Generator().manual_seed(0))


def _reference() -> dict[str, Any]:
    """One process, every rank's tokens: per step the gradients, grad norm and weights after it."""
    model = ToyMoE(ParallelState(grid=RankGrid(), rank=0), seed=3)
    opt = MegatronOptimizer(OPT, get_param_groups([model], OPT))
    x = _inputs().to(device())
    out: dict[str, Any] = {
        "init": {n: p.detach().clone() for n, p in model.named_parameters()},
        "params_norm": float(torch.cat([p.detach().view(-1) for p in model.parameters()]).norm()),
    }
    for step in range(STEPS):
        for p in model.parameters():
            p.grad = None
        for m in range(MICRO):
            (model(x[step, m], step, m) / MICRO).backward()
        out[f"grads{step}"] = {n: p.grad.clone() for n, p in model.named_parameters()}
        ok, norm, _ = opt.step()
        assert ok
        out[f"norm{step}"] = norm
        out[f"weights{step}"] = {n: p.detach().clone() for n, p in model.named_parameters()}
    return out


def _local(ref: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """This rank's block of a reference tensor: its local experts, or all of a dense one."""
    if getattr(p, "expert_parallel", False):
        return ref[p.expert_offset : p.expert_offset + p.shape[0]]  # type: ignore[attr-defined]
    return ref


def _max_err(wrapper: Any, ref: dict[str, torch.Tensor], grads: bool = False) -> float:
    """Largest difference to the reference of the weights (or gradients) this rank holds: a DDP
    wrapper's whole params (its owned pieces' gradients with the distributed optimizer), an FSDP2
    wrapper's local rows."""
    err = 0.0
    fsdp = isinstance(wrapper, TorchFullyShardedDataParallel)
    named = wrapper._views.items() if fsdp else wrapper.module.named_parameters()
    for name, p in named:
        if fsdp:  # rows [start, stop) of the local (expert) shard
            start, stop, _ = wrapper._rows(name)
            want = _local(ref[name], wrapper._dtensors[name])[start:stop]
        else:
            want = _local(ref[name], p)
        got = (wrapper.owned_main_grad(p) if grads else p.detach()).reshape(-1)
        want = want.reshape(-1)
        if grads and not fsdp and wrapper.distributed_optimizer:
            piece = wrapper._piece_of.get(id(p))
            want = want[piece.start : piece.stop] if piece is not None else want[:0]
        err = max(err, float((got - want).abs().max()) if got.numel() else 0.0)
    return err


def _build(
    ps: ParallelState, config: DistributedDataParallelConfig, seed: int = 3
) -> tuple[ToyMoE, Any, Any]:
    """The toy (seed 3: the reference's weights), its DDP (or FSDP2) wrapper and optimizer."""
    model = ToyMoE(ps, seed)
    if config.use_torch_fsdp2:
        fsdp = TorchFullyShardedDataParallel(model.config, config, model, parallel_state=ps)
        return model, fsdp, get_megatron_optimizer(OPT, [fsdp], grad_stats_group=dist.group.WORLD)
    ddp = DistributedDataParallel(model.config, config, model, ps)
    return model, ddp, get_megatron_optimizer(OPT, [ddp])


def _step(model: ToyMoE, ddp: DistributedDataParallel, opt: Any, step: int, ref: dict) -> dict[str, Any]:
    """One training step on this rank's tokens (two micro-batches); its errors to the reference."""
    rank = torch.distributed.get_rank()  # tp = cp = 1: the dense dp rank
    x = _inputs()[step, :, rank * T : (rank + 1) * T].to(device())
    ddp.zero_grad_buffer()
    with ddp.no_sync():
        (model(x[0], step, 0) / MICRO).backward()
    (model(x[1], step, 1) / MICRO).backward()
    finalize_model_grads([ddp])
    grad_err = _max_err(ddp, ref[f"grads{step}"], grads=True)
    ok, norm, _ = opt.step()
    opt.finish_param_sync()
    return {
        "grad": grad_err,
        "norm": abs(norm - ref[f"norm{step}"]) / ref[f"norm{step}"],
        "weights": _max_err(ddp, ref[f"weights{step}"]),
        "ok": ok,
    }


def _body(_: ParallelState, ckpt: str) -> dict[str, Any]:
    """Every layout's errors to the reference, by name (the tests below check them)."""
    ref = _reference()
    results: dict[str, Any] = {"clipped": [ref[f"norm{s}"] > OPT.clip_grad for s in range(STEPS)]}
    for ep in (1, 2, 4):
        ps = build_parallel_state(ep=ep)
        assert ps.expt_dp_size == WORLD // ep
        for name, config in DDP_CONFIGS.items():
            model, ddp, opt = _build(ps, config)
            results[f"init ep{ep}"] = _max_err(ddp, ref["init"])
            if name == "plain":
                results[f"params_norm ep{ep}"] = abs(params_l2_norm([ddp], ps, device()) - ref["params_norm"])
            for step in range(2):
                results[f"ep{ep} {name} step{step}"] = _step(model, ddp, opt, step, ref)
            if ep == 2 and name == "distopt":
                model_sd = ddp.sharded_state_dict()
                state = {"model": model_sd, "optimizer": opt.sharded_state_dict(model_sd)}
                dist_checkpointing.save(state, ckpt)
    for ep, name in ((1, "plain"), (4, "distopt"), (2, "overlap"), (4, "fsdp")):
        ps = build_parallel_state(ep=ep)
        model, ddp, opt = _build(ps, DDP_CONFIGS[name], seed=11)  # other weights: the load must set them
        model_sd = ddp.sharded_state_dict()
        request = {"model": model_sd, "optimizer": opt.sharded_state_dict(model_sd)}
        loaded = dist_checkpointing.load(request, ckpt)
        opt.load_sharded_state_dict(loaded["optimizer"])
        results[f"loaded ep{ep}"] = _max_err(ddp, ref["weights1"])
        results[f"resumed ep{ep} {name}"] = _step(model, ddp, opt, 2, ref)
    results.update(_etp_reshard(ckpt + "_etp"))
    results.update(_gpt_moe(ckpt + "_gpt"))
    return results


def _gpt(ps: ParallelState, dispatcher: str, seed: int = 3) -> GPTModel:
    """A 2-layer MoE GPT (4 experts, top-2, SwiGLU experts) of this layout."""
    cfg = TransformerConfig(
        num_layers=2,
        hidden_size=16,
        num_attention_heads=2,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        num_moe_experts=E,
        moe_router_topk=2,
        moe_ffn_hidden_size=8,
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        moe_token_dispatcher_type=dispatcher,
        expert_model_parallel_size=ps.ep_size,
    )
    spec = get_gpt_layer_local_spec(num_experts=E)
    return GPTModel(
        cfg, spec, vocab_size=32, max_sequence_length=8, parallel_state=ps, device=device(), seed=seed
    )


def _gpt_moe(ckpt: str) -> dict[str, float]:
    """GPTModel with MoE layers: one distributed-optimizer step under ep2 (alltoall) and ep4
    (allgather) gives the single-process grad norm and weights; ep2's checkpoint loads under ep4."""
    ids = torch.randint(0, 32, (WORLD * 2, 8), generator=torch.Generator().manual_seed(1)).to(device())
    solo = _gpt(ParallelState(grid=RankGrid(), rank=0), "alltoall")
    opt = MegatronOptimizer(OPT, get_param_groups([solo], OPT))
    solo(ids, None, None, labels=ids).mean().backward()
    _, ref_norm, _ = opt.step()
    ref = {n: p.detach().clone() for n, p in solo.named_parameters()}
    rank, errors = torch.distributed.get_rank(), {}
    for ep, dispatcher in ((2, "alltoall"), (4, "allgather")):
        ps = build_parallel_state(ep=ep)
        model = _gpt(ps, dispatcher)
        ddp = DistributedDataParallel(model.config, DDP_CONFIGS["distopt"], model, ps)
        opt = get_megatron_optimizer(OPT, [ddp])
        local = ids[rank * 2 : (rank + 1) * 2]
        ddp(local, None, None, labels=local).mean().backward()
        finalize_model_grads([ddp])
        _, norm, _ = opt.step()
        opt.finish_param_sync()
        errors[f"gpt ep{ep} norm"] = abs(norm - ref_norm) / ref_norm
        errors[f"gpt ep{ep} weights"] = _max_err(ddp, ref)
        if ep == 2:
            dist_checkpointing.save({"model": ddp.sharded_state_dict()}, ckpt)
    model = _gpt(build_parallel_state(ep=4), "alltoall", seed=11)
    dist_checkpointing.load({"model": model.sharded_state_dict()}, ckpt)
    errors["gpt loaded ep4"] = _max_err(SimpleNamespace(module=model), ref)
    return errors


def _swiglu_fc1(ps: ParallelState, value: float | None = None) -> torch.Tensor:
    """An fc1-like expert weight ``[E_local, 2F / etp, H]`` ([gate; up] split separately), F = 4."""
    w = torch.empty(E // ps.ep_size, 8 // ps.expt_tp_size, H, device=device())
    tag_expert_param(
        w,
        num_experts=E,
        ep_rank=ps.ep_rank,
        ep_size=ps.ep_size,
        etp_rank=ps.expt_tp_rank,
        init_std=0.3,
        partition_dim=1,
        partition_size=ps.expt_tp_size,
        partition_stride=2,
    )
    if value is None:
        init_param_(w, "fc1", seed=3)
    else:
        w.fill_(value)
    return w


def _etp_reshard(ckpt: str) -> dict[str, float]:
    """An ep2 x etp2 checkpoint of a strided expert weight loads under ep1 / ep4 with etp 1 and
    under ep1 x etp2: each rank gets the values its own layout initialises."""
    ps = build_parallel_state(ep=2, etp=2)
    w = _swiglu_fc1(ps)
    dist_checkpointing.save({"w": shard_of("fc1", w, 0, 0, ps.expt_dp_rank)}, ckpt)
    errors = {}
    for ep, etp in ((1, 1), (4, 1), (1, 2)):
        ps = build_parallel_state(ep=ep, etp=etp)
        w = _swiglu_fc1(ps, value=float("nan"))
        dist_checkpointing.load({"w": shard_of("fc1", w, 0, 0, ps.expt_dp_rank)}, ckpt)
        errors[f"etp reshard ep{ep} etp{etp}"] = float((w - _swiglu_fc1(ps)).abs().max())
    return errors


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> list[dict[str, Any]]:
    ckpt = str(tmp_path_factory.mktemp("expert_ckpt"))
    return run_distributed(_body, world_size=WORLD, kwargs={"ckpt": ckpt}, timeout_s=300)


def _all(results: list[dict[str, Any]], prefix: str) -> dict[str, Any]:
    found = {
        f"rank{r} {k}": v for r, res in enumerate(results) for k, v in res.items() if k.startswith(prefix)
    }
    assert found, prefix
    return found


def test_the_reference_steps_are_clipped(results) -> None:
    assert all(results[0]["clipped"]), "clip_grad should act, so that the norm decides the step"


def test_init_is_the_single_process_init_under_every_ep(results) -> None:
    assert all(v == 0.0 for v in _all(results, "init").values())


@pytest.mark.parametrize("ep", [1, 2, 4])
@pytest.mark.parametrize("config", sorted(DDP_CONFIGS))
def test_gradients_norm_and_steps_match_one_process(results, ep: int, config: str) -> None:
    for key, r in _all(results, f"ep{ep} {config} ").items():
        assert r["ok"], key
        assert r["grad"] < 1e-5, (key, r)
        assert r["norm"] < 1e-5, (key, r)
        assert r["weights"] < 1e-5, (key, r)


def test_params_norm_matches_one_process(results) -> None:
    norms = _all(results, "params_norm")
    assert all(v < 1e-4 for v in norms.values()), norms


def test_ep2_etp2_checkpoint_loads_under_other_ep_and_etp(results) -> None:
    errors = _all(results, "etp reshard")
    assert all(v == 0.0 for v in errors.values()), errors


def test_gpt_moe_step_and_checkpoint_match_one_process(results) -> None:
    errors = _all(results, "gpt")
    assert all(v < 1e-5 for v in errors.values()), errors


def test_ep2_checkpoint_resumes_under_ep1_ep2_and_ep4(results) -> None:
    assert all(v < 1e-6 for v in _all(results, "loaded").values())
    for key, r in _all(results, "resumed").items():
        assert r["ok"] and r["grad"] < 1e-5 and r["norm"] < 1e-5 and r["weights"] < 1e-5, (key, r)
