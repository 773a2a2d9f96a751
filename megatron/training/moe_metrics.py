"""The trainer's mixture-of-experts hooks: after every step the routers' expert bias moves towards
balance (``--moe-router-enable-expert-bias``) and the global-batch token counts restart
(``global_aux_loss``); at each log line the auxiliary losses and routing statistics recorded since
the previous one are reduced over the ranks and read (one host sync per log line, none per step)."""

from __future__ import annotations

from megatron.core.transformer.moe import moe_utils

# The tracker's name of each load-balancing type's loss (Megatron-Core's names).
LOSS_NAMES = dict(zip(("aux_loss", "seq_aux_loss", "global_aux_loss"), moe_utils.AUX_LOSS_NAMES))
# What the log line shows, in order: (metric, label).
LINE_METRICS = (
    *((name, name) for name in moe_utils.AUX_LOSS_NAMES),
    ("z_loss", "z_loss"),
)


def tracked_losses(model_config) -> list[str]:
    """The auxiliary losses the routers record for ``model_config``: each load-balancing type with a
    coefficient > 0, and the z-loss with one."""
    types = model_config.moe_router_load_balancing_type
    types = [types] if isinstance(types, str) else list(types)
    coeffs = model_config.moe_aux_loss_coeff
    coeffs = list(coeffs) if isinstance(coeffs, (list, tuple)) else [coeffs] * len(types)
    names = [LOSS_NAMES[t] for t, c in zip(types, coeffs) if t in LOSS_NAMES and c > 0]
    return names + (["z_loss"] if model_config.moe_z_loss_coeff else [])


class MoEStepHooks:
    """Called by the trainer after every step (:meth:`after_step`) and at every log line
    (:meth:`read`, on every rank: the values are reduced over pp, the routers' groups and dp)."""

    def __init__(self, model_config, pg) -> None:
        self.config, self.pg = model_config, pg
        self.names = tracked_losses(model_config)
        types = model_config.moe_router_load_balancing_type
        self.global_counts = "global_aux_loss" in ([types] if isinstance(types, str) else types)
        self.microbatches = 0  # run since the last read

    def after_step(self, model_chunks: list, num_microbatches: int) -> None:
        self.microbatches += num_microbatches
        if self.config.moe_router_enable_expert_bias:
            moe_utils.update_expert_bias(model_chunks)
        if self.global_counts:
            moe_utils.reset_global_aux_loss_tracker(model_chunks)

    def read(self) -> dict[str, float]:
        """The losses (per micro-batch, averaged over the MoE layers and the steps since the last read),
        the expert load imbalance (max / mean tokens per expert), the dropped-token fraction, and
        with ``--moe-per-layer-logging`` each layer's; the tracker is cleared."""
        c = self.config
        out = moe_utils.track_moe_metrics(
            1.0 / max(self.microbatches, 1),
            per_layer_logging=c.moe_per_layer_logging,
            force_initialize=True,
            track_names=self.names,
            num_layers=c.num_layers,
            moe_layer_freq=c.moe_layer_freq,
            num_experts=c.num_moe_experts,
            pp_group=self.pg.pp_group,
            dp_group=self.pg.dp_group,
        )
        self.microbatches = 0
        return out


def format_moe_metrics(metrics: dict[str, float]) -> list[str]:
    """The log line's MoE fields: the losses, then the load imbalance and dropped tokens."""
    parts = [f"{label}: {metrics[name]:.6E}" for name, label in LINE_METRICS if name in metrics]
    if "expert_load_imbalance" in metrics:
        parts.append(
            f"expert load max/mean: {metrics['expert_load_imbalance']:.3f} "
            f"(worst layer {metrics['expert_load_imbalance_max']:.3f})"
        )
    if "dropped_token_fraction" in metrics:
        parts.append(f"dropped tokens: {100 * metrics['dropped_token_fraction']:.2f}%")
    return parts
