"""The mixture-of-experts fields of ``TransformerConfig`` that this package implements, with
Megatron-Core's names and defaults and the training application's flags (Megatron-LM's spelling).

Kept apart from ``transformer_config`` (which derives from :class:`MoEConfigFields`) so that each
file stays readable; the checks are ``config_checks.check_moe``. The MoE fields not listed here are
Megatron-Core's knobs of mechanisms not built (``mcore_config_fields``; ``config_support`` says what
each does here).
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from typing import Any

from megatron.core.config_utils import doc
from megatron.core.transformer.mcore_config_fields import MegatronCoreTransformerFields

SCORE_FUNCTIONS = ("softmax", "sigmoid", "sqrtsoftplus")
LOAD_BALANCING_TYPES = ("aux_loss", "seq_aux_loss", "global_aux_loss", "none")
DISPATCHERS = ("allgather", "alltoall")


@dataclass
class MoEConfigFields(MegatronCoreTransformerFields):
    """Experts, routing, load balancing, capacity, shared experts and expert parallelism."""

    num_moe_experts: int | None = doc(
        None,
        "Number of routed experts E per MoE layer; each token goes to --moe-router-topk of them. "
        "Default: none (every layer has a dense MLP).",
        flag="--num-experts",
    )
    moe_ffn_hidden_size: int | None = doc(
        None, "Hidden size of each routed expert's MLP (F_moe). Default: --ffn-hidden-size."
    )
    moe_layer_freq: int | list[int] = doc(
        1,
        "Which layers are MoE layers: an int N makes layer i (0-based) an MoE layer when i % N == 0; "
        'a list expression such as "[0]*1+[1]*3" gives one 0 (dense) or 1 (MoE) per layer '
        "(--num-layers entries). Only with --num-experts.",
    )
    moe_router_topk: int = doc(2, "Experts each token is routed to (k).")
    moe_router_score_function: str = doc(
        "softmax",
        "Router scores: 'softmax' (top-k of the logits, then softmax over the k chosen; with "
        "--moe-router-pre-softmax softmax over all experts first), 'sigmoid' or 'sqrtsoftplus' (top-k "
        "of sigmoid / sqrt(softplus) scores, normalised over the k chosen when k > 1).",
        choices=SCORE_FUNCTIONS,
    )
    moe_router_pre_softmax: bool = doc(
        False, "Softmax over all experts before the top-k choice (softmax score function)."
    )
    moe_router_topk_scaling_factor: float | None = doc(
        None, "Multiply the chosen experts' routing weights by this factor. Default: 1."
    )
    moe_router_num_groups: int | None = doc(
        None,
        "Group-limited routing: experts are split into this many equal groups (e.g. one per ep rank); "
        "a token picks --moe-router-group-topk groups, then its top-k experts inside them.",
    )
    moe_router_group_topk: int | None = doc(
        None, "Group-limited routing: groups each token may choose (with --moe-router-num-groups)."
    )
    moe_router_dtype: str | None = doc(
        None,
        "Dtype of the routing math (logits, scores, top-k, auxiliary losses): fp32 or fp64; the routing "
        "weights it returns, and the combine of the experts' outputs, are fp32 either way. Default: "
        "fp32 (the router never computes in bf16 here).",
        choices=("fp32", "fp64"),
    )
    moe_router_load_balancing_type: str | list[str] = doc(
        "aux_loss",
        "Load balancing: 'aux_loss' (Switch/GShard loss over the micro-batch's tokens), "
        "'seq_aux_loss' (per sequence), 'global_aux_loss' (over the global batch's statistics) or "
        "'none'; several types add their losses, each with its --moe-aux-loss-coeff. Sinkhorn and "
        "quantile balancing are not built.",
        nargs="+",
        choices=LOAD_BALANCING_TYPES,
    )
    moe_aux_loss_coeff: float | list[float] = doc(
        0.0,
        "Coefficient of the load-balancing loss (1e-2 is a common choice); one per "
        "--moe-router-load-balancing-type when several are given.",
        nargs="+",
    )
    moe_z_loss_coeff: float | None = doc(
        None, "Coefficient of the router z-loss mean(logsumexp(logits)^2). Default: no z-loss."
    )
    moe_router_enable_expert_bias: bool = doc(
        False,
        "Aux-loss-free balancing: a per-expert bias added to the scores for the top-k choice only "
        "(not the weights), moved by --moe-router-bias-update-rate towards balance after every step. "
        "Needs --moe-router-score-function sigmoid or sqrtsoftplus.",
    )
    moe_router_bias_update_rate: float = doc(
        1e-3, "Step of the expert-bias update: bias += rate x sign(mean count - expert's count)."
    )
    moe_input_jitter_eps: float | None = doc(
        None,
        "Multiply the router's input by uniform noise in [1 - eps, 1 + eps] while training. Default: off.",
    )
    moe_expert_capacity_factor: float | None = doc(
        None,
        "Expert capacity = factor x tokens x k / E; tokens over an expert's capacity are dropped "
        "(--moe-token-drop-policy). Default: no dropping.",
    )
    moe_pad_expert_input_to_capacity: bool = doc(
        False, "Pad every expert's input to its capacity (needs --moe-expert-capacity-factor)."
    )
    moe_token_drop_policy: str = doc(
        "probs",
        "Which tokens over capacity are dropped: the lowest routing weights ('probs') or the last "
        "in the sequence ('position').",
        choices=("probs", "position"),
    )
    moe_shared_expert_intermediate_size: int | None = doc(
        None,
        "Hidden size of the shared experts' MLP (all shared experts together), run on every token "
        "beside the routed experts. Default: no shared experts.",
    )
    moe_shared_expert_gate: bool = doc(
        False,
        "Scale the shared experts' output per token by sigmoid(x . w_gate) (Qwen2-MoE's shared-expert "
        "gate; w_gate [1, h] is a parameter of the shared experts).",
    )
    moe_shared_expert_overlap: bool = doc(
        False,
        "Run the shared experts while the routed tokens are exchanged (--moe-token-dispatcher-type "
        "alltoall); the same result.",
    )
    moe_grouped_gemm: bool = doc(
        False,
        "Run the local experts in one grouped GEMM (torch._grouped_mm on Hopper in bf16) instead of "
        "a loop over experts; the same result, where it runs; elsewhere the loop.",
    )
    moe_token_dispatcher_type: str = doc(
        "allgather",
        "How tokens reach their experts: 'allgather' (gather the tokens of the expert-parallel (x "
        "expert-tp) ranks, each rank computes its experts) or 'alltoall' (send each token to the ep "
        "rank of its expert). The flex dispatcher (DeepEP) is not built.",
        choices=DISPATCHERS,
    )
    moe_per_layer_logging: bool = doc(
        False, "Log the auxiliary losses and expert statistics of every MoE layer, not only their mean."
    )
    expert_model_parallel_size: int = doc(
        1,
        "Expert-parallel degree: each MoE layer's experts are split over this many ranks, carved "
        "from the data- (x context-) parallel ranks; --num-experts must be divisible by it.",
    )
    expert_tensor_parallel_size: int | None = doc(
        None,
        "Tensor-parallel degree of each expert's weights. The world size must be divisible by it x "
        "--expert-model-parallel-size x --pipeline-model-parallel-size. Default: "
        "--tensor-model-parallel-size.",
    )


def parse_moe_layer_freq(text: str | int | list[int]) -> int | list[int]:
    """``--moe-layer-freq``'s value: an int, or a list expression of 0/1 entries built from list
    literals, ``*`` by an int and ``+`` (``"[0]*1+[1]*3"``, ``"[1,0,1,0]"``). Nothing is evaluated:
    the expression is read from its syntax tree.

    Raises:
        ValueError: any other text (a name, a call, a non-integer entry).
    """
    if isinstance(text, (int, list)):
        return text
    try:
        return int(text)
    except ValueError:
        pass
    try:
        tree = ast.parse(text.strip(), mode="eval").body
    except SyntaxError as e:
        raise ValueError(f"not an int or a list expression: {text!r}") from e
    value = _list_value(tree)
    if not isinstance(value, list):
        raise ValueError(f"not a list of layer flags: {text!r}")
    return value


parse_moe_layer_freq.example = '"[0]*1+[1]*3"'  # type: ignore[attr-defined]


def _list_value(node: ast.AST) -> Any:
    """An int or a list of ints from list literals, ``*`` and ``+``; anything else raises ValueError."""
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return node.value
    if isinstance(node, ast.List):
        items = [_list_value(e) for e in node.elts]
        if not all(type(i) is int for i in items):
            raise ValueError("list entries must be integers")
        return items
    if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Mult, ast.Add)):
        left, right = _list_value(node.left), _list_value(node.right)
        if isinstance(node.op, ast.Add) and isinstance(left, list) and isinstance(right, list):
            return left + right
        if isinstance(node.op, ast.Mult) and {type(left), type(right)} == {list, int}:
            count = left if isinstance(left, int) else right
            if not 0 <= count <= 1 << 16:
                raise ValueError("a list repeat count must be between 0 and 65536")
            return (left if isinstance(left, list) else right) * count
    raise ValueError(f"unsupported expression: {ast.dump(node)}")


def moe_layer_pattern(config: Any) -> list[bool]:
    """Which of the ``config.num_layers`` layers (index = 0-based layer) are MoE layers: none
    without experts; ``moe_layer_freq`` N marks layer i when i % N == 0; a list is used as given."""
    num_layers = config.num_layers
    if not getattr(config, "num_moe_experts", None):
        return [False] * num_layers
    freq = config.moe_layer_freq
    if isinstance(freq, int):
        return [i % freq == 0 for i in range(num_layers)]
    return [bool(v) for v in freq]
