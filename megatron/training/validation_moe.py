"""The mixture-of-experts checks that need the world size (the config's own are
``TransformerConfig``'s: ``config_checks.check_moe``): the expert grid etp x ep x expert-dp x pp
must tile the world. Each raises ConfigError naming the flags and a valid value."""

from __future__ import annotations

from megatron.core.config_utils import ConfigError
from megatron.core.transformer.moe_config_fields import moe_layer_pattern


def expert_layout(cfg, world_size: int) -> dict[str, int]:
    """{ep, etp, expt_dp, local_experts} of a run with experts (the expert grid of ``world_size``)."""
    m = cfg.model
    ep, etp = m.expert_model_parallel_size, m.expert_tensor_parallel_size
    return dict(
        ep=ep,
        etp=etp,
        expt_dp=world_size // (etp * ep * m.pipeline_model_parallel_size),
        local_experts=m.num_moe_experts // ep,
    )


def check_experts(cfg, world_size: int) -> None:
    """The expert grid: world size divisible by --expert-tensor-parallel-size x
    --expert-model-parallel-size x --pipeline-model-parallel-size (the expert-data-parallel size is
    the rest)."""
    m = cfg.model
    if not m.num_moe_experts:
        return
    ep, etp, pp = m.expert_model_parallel_size, m.expert_tensor_parallel_size, m.pipeline_model_parallel_size
    if world_size % (etp * ep * pp):
        fits = [
            d for d in range(ep, 0, -1) if m.num_moe_experts % d == 0 and world_size % (etp * d * pp) == 0
        ]
        hint = f"; e.g. --expert-model-parallel-size {fits[0]}" if fits else ""
        raise ConfigError(
            f"world size {world_size} is not divisible by --expert-tensor-parallel-size {etp} x "
            f"--expert-model-parallel-size {ep} x --pipeline-model-parallel-size {pp}: the experts' ranks "
            f"must tile the world{hint}"
        )


def expert_layout_line(cfg, world_size: int) -> str:
    """One line: the experts, the MoE layers and the expert grid of ``world_size`` ranks."""
    m = cfg.model
    lay = expert_layout(cfg, world_size)
    moe = [i + 1 for i, on in enumerate(moe_layer_pattern(m)) if on]
    layers = "every layer" if len(moe) == m.num_layers else f"layers {', '.join(map(str, moe))}"
    shared = (
        f", shared experts of {m.moe_shared_expert_intermediate_size}"
        if m.moe_shared_expert_intermediate_size
        else ""
    )
    return (
        f"experts: {m.num_moe_experts} of FFN {m.moe_ffn_hidden_size} (top-{m.moe_router_topk}{shared}) in "
        f"{layers}; expert grid etp {lay['etp']} x ep {lay['ep']} x expert-dp {lay['expt_dp']} x pp "
        f"{m.pipeline_model_parallel_size}: {lay['local_experts']} local experts per rank, each split over "
        f"{lay['etp']} rank(s); expert gradients reduced over expert-dp {lay['expt_dp']}"
    )
