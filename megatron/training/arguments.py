"""Command-line flags, generated from the config dataclasses plus one alias table.

Every config field whose metadata ``flag`` is not ``None`` becomes a flag: ``--field-name`` (or
the spelling in its metadata). Booleans that default to False are switches; booleans that default
to True get a ``--no-field-name`` switch. Flags that do not map one-to-one onto a field (Megatron
spellings such as ``--swiglu`` or ``--disable-bias-linear``) live in ``ALIASES``. The argparse
``Namespace`` never leaves this module: ``parse_args`` returns a ``RunConfig`` of typed configs.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import sys
import types
import typing
from dataclasses import dataclass

from megatron.core.config_utils import doc
from megatron.core.distributed.distributed_data_parallel_config import DistributedDataParallelConfig
from megatron.core.optimizer.optimizer_config import OptimizerConfig
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.training.config import (
    CheckpointConfig,
    DataConfig,
    LoggerConfig,
    SchedulerConfig,
    TokenizerConfig,
    TrainingConfig,
)


@dataclass
class ModelImplConfig:
    """Implementation choices that are not part of the model's mathematics."""

    transformer_impl: str = doc("local", "Layer implementation. Only 'local' (this package's own modules "
                                "and SDPA attention) is supported; a Transformer Engine path is not shipped.",
                                choices=("local", "transformer_engine"))
    torch_compile: str = doc(
        "auto", "torch.compile each transformer layer (and the fused cross entropy's elementwise steps). "
        "'auto' and 'on': compiled on CUDA, at any tensor-parallel size; 'off': eager everywhere. "
        "Has no effect on CPU. Compilation adds about a minute at start-up.",
        choices=("auto", "on", "off"))


@dataclass
class RunConfig:
    """Everything one run needs, as typed configs."""

    model: TransformerConfig
    training: TrainingConfig
    scheduler: SchedulerConfig
    optimizer: OptimizerConfig
    data: DataConfig
    tokenizer: TokenizerConfig
    checkpoint: CheckpointConfig
    logger: LoggerConfig
    impl: ModelImplConfig
    ddp: DistributedDataParallelConfig

    def to_dict(self) -> dict:
        """A plain, JSON-friendly nested dict (dtypes and callables as strings)."""
        out = {}
        for f in dataclasses.fields(self):
            cfg = getattr(self, f.name)
            out[f.name] = {k.name: _plain(getattr(cfg, k.name)) for k in dataclasses.fields(cfg)}
        return out


def _plain(v):
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    if isinstance(v, (list, tuple)):
        return [_plain(x) for x in v]
    return str(v)


# (section title, config class) in --help order.
SECTIONS: tuple[tuple[str, type], ...] = (
    ("model", TransformerConfig),
    ("implementation", ModelImplConfig),
    ("data-parallel gradient reduction", DistributedDataParallelConfig),
    ("training", TrainingConfig),
    ("learning-rate and weight-decay schedule", SchedulerConfig),
    ("optimizer and mixed precision", OptimizerConfig),
    ("data", DataConfig),
    ("tokenizer", TokenizerConfig),
    ("checkpointing", CheckpointConfig),
    ("logging and evaluation", LoggerConfig),
)

# Megatron spellings that are not one field each: flag -> (section, argparse kwargs).
ALIASES: dict[str, tuple[str, dict]] = {
    "--swiglu": ("model", dict(action="store_true", help="SwiGLU MLP (sets activation to swiglu).")),
    "--disable-bias-linear": ("model", dict(action="store_true", help="No biases in linear layers.")),
    "--untie-embeddings-and-output-weights": (
        "model", dict(action="store_true", help="Separate output-layer weight instead of the word embedding.")),
    "--group-query-attention": (
        "model", dict(action="store_true", help="Grouped-query attention with --num-query-groups groups.")),
    "--use-rotary-position-embeddings": ("model", dict(
        action="store_true", help="Megatron-LM's older spelling of --position-embedding-type rope.")),
    "--no-position-embedding": ("model", dict(
        action="store_true", help="No learned position table: --position-embedding-type none, unless rope is chosen "
                                  "(which has none anyway).")),
    "--recompute-activations": ("model", dict(action="store_true", help="Same as --recompute-granularity selective.")),
    "--grad-reduce-in-bf16": ("data-parallel", dict(
        action="store_true", help="With --bf16: keep the main gradients in bf16 and reduce them across data-parallel "
                                  "ranks in bf16 (half the communication and gradient memory; accumulation over "
                                  "micro-batches also in bf16). Default: fp32.")),
}


# Megatron-LM flags this entry point does not take, each with what to do instead: a Megatron-LM script
# stops with one line naming them, not "unrecognized arguments" and a guess at a similar spelling.
_CP = ("context parallelism is not built yet; for long sequences use --sequence-parallel with "
       "--tensor-model-parallel-size, or --recompute-granularity")
_MOE = "mixture-of-experts layers are not built yet (dense models only)"
_FSDP = ("FSDP is not built; --use-distributed-optimizer shards the optimizer state and main parameters over the "
         "data-parallel ranks")
_OPT_DTYPES = ("the main parameters and Adam moments are fp32, the main gradients fp32 (bf16 with "
               "--grad-reduce-in-bf16); drop it")
_TIMERS = "per-phase timers are not kept: the iteration time is logged, and --profile breaks a step down"
NOT_TAKEN: dict[str, str] = {
    "--use-legacy-models": "there is only one model implementation; drop it",
    "--checkpoint-activations": "use --recompute-granularity full",
    "--cp-comm-type": _CP,
    "--hierarchical-context-parallel-sizes": _CP,
    "--expert-tensor-parallel-size": _MOE,
    "--num-experts": _MOE,
    "--tp-comm-overlap": ("Transformer Engine's overlap of the tensor-parallel collectives; there is no Transformer "
                          "Engine path, and PyTorch's micro-pipelined tensor parallelism measured slower on two "
                          "GPUs (docs/performance.md); drop it"),
    "--fp8-param-gather": ("FP8 parameters need Transformer Engine; FP8 here casts the bf16 weights in each forward "
                           "(docs/fp8.md); drop it"),
    "--use-torch-fsdp2": _FSDP,
    "--use-megatron-fsdp": _FSDP,
    "--data-parallel-sharding-strategy": _FSDP,
    "--use-precision-aware-optimizer": _OPT_DTYPES,
    "--main-grads-dtype": _OPT_DTYPES,
    "--main-params-dtype": _OPT_DTYPES,
    "--exp-avg-dtype": _OPT_DTYPES,
    "--exp-avg-sq-dtype": _OPT_DTYPES,
    "--log-timers-to-tensorboard": _TIMERS,
    "--timing-log-level": _TIMERS,
    "--timing-log-option": _TIMERS,
    "--tensorboard-log-interval": "scalars are written every --log-interval iterations",
    "--async-save": "checkpoints are written synchronously (atomically, see docs/checkpoints.md); drop it",
    "--use-checkpoint-args": ("pass the model flags again: a checkpoint saved for a different model is refused at "
                              "load, listing each flag that differs"),
    "--rampup-batch-size": "batch-size ramp-up is not built; use a fixed --global-batch-size",
    "--log-params-norm": "the parameter norm is not logged (the gradient norm is); drop it",
}
NOT_TAKEN_PREFIXES: dict[str, str] = {"--moe-": _MOE}

# Megatron-LM flags that ask for what this package does anyway: accepted, without effect (the ones
# with a value are checked in _apply_aliases).
_ACCEPTED = "Accepted for Megatron-LM scripts, no effect: "
_NO_KERNEL = (_ACCEPTED + "Megatron-LM's hand-written fused kernel does not exist here; torch.compile fuses each "
              "layer (--torch-compile off runs them unfused).")
COMPAT_FLAGS: dict[str, dict] = {
    "--use-mcore-models": dict(action="store_true", help=_ACCEPTED + "the model is always this package's own."),
    "--use-flash-attn": dict(action="store_true", help=_ACCEPTED + "attention always runs through torch's "
                             "scaled_dot_product_attention (cuDNN's fused attention on Hopper)."),
    "--attention-backend": dict(choices=("auto", "flash", "fused", "unfused", "local"), default="auto", help=(
        "Accepted for Megatron-LM scripts at auto, flash or fused (no effect: attention always runs through torch's "
        "scaled_dot_product_attention, which picks cuDNN's fused attention on Hopper); unfused and local are "
        "refused.")),
    "--attention-softmax-in-fp32": dict(action="store_true",
                                        help=_ACCEPTED + "the fused attention kernels keep the softmax in fp32."),
    "--no-masked-softmax-fusion": dict(action="store_true", help=_NO_KERNEL),
    "--no-bias-dropout-fusion": dict(action="store_true", help=_NO_KERNEL),
    "--no-bias-swiglu-fusion": dict(action="store_true", help=_NO_KERNEL),
    "--no-rope-fusion": dict(action="store_true", help=_NO_KERNEL),
    "--no-gradient-accumulation-fusion": dict(action="store_true", help=_ACCEPTED + "weight gradients are always "
                                              "added into the main gradients by a kernel of their own (no APEX)."),
    "--accumulate-allreduce-grads-in-fp32": dict(action="store_true", help=_ACCEPTED + "main gradients are "
                                                 "accumulated and reduced in fp32 unless --grad-reduce-in-bf16."),
    "--log-memory-to-tensorboard": dict(action="store_true", help=_ACCEPTED + "GPU memory is always written with "
                                        "--tensorboard-dir / --wandb-project."),
    "--log-validation-ppl-to-tensorboard": dict(action="store_true", help=_ACCEPTED + "validation perplexity is "
                                                "always written with --tensorboard-dir / --wandb-project."),
    "--context-parallel-size": dict(type=int, default=1, metavar="1",
                                    help="Accepted at 1 for Megatron-LM scripts: " + _CP + "."),
    "--expert-model-parallel-size": dict(type=int, default=1, metavar="1",
                                         help="Accepted at 1 for Megatron-LM scripts: " + _MOE + "."),
}


def _not_taken(flag: str) -> str | None:
    """What to do instead of Megatron-LM flag ``flag``, if it is one this entry point does not take."""
    if flag in NOT_TAKEN:
        return NOT_TAKEN[flag]
    return next((why for prefix, why in NOT_TAKEN_PREFIXES.items() if flag.startswith(prefix)), None)


# Fields without a usable default: the run stops with "--flag is required" when one is missing.
REQUIRED = ("num_layers", "hidden_size", "num_attention_heads", "micro_batch_size", "seq_length")


def _flag_name(f: dataclasses.Field) -> str | None:
    flag = f.metadata.get("flag", "")
    if flag is None:
        return None
    if flag:
        return flag
    if f.type in ("bool", bool) and f.default is True:
        return "--no-" + f.name.replace("_", "-")
    return "--" + f.name.replace("_", "-")


def _base_type(annotation) -> type:
    """int / float / str from annotations such as ``int | None`` or ``list[str] | None``."""
    if isinstance(annotation, str):
        for name, typ in (("float", float), ("int", int), ("bool", bool), ("str", str)):
            if annotation.startswith(name) or f"[{name}]" in annotation:
                return typ
        return str
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        return _base_type(args[0])
    if origin is list:
        return _base_type(typing.get_args(annotation)[0])
    return annotation if annotation in (int, float, str, bool) else str


class _Parser(argparse.ArgumentParser):
    """Reports a bad flag in one line, with the closest valid spelling, instead of the whole usage."""

    def error(self, message: str):
        if message.startswith("unrecognized arguments:"):
            # (arg as given, flag name, what to do instead if a Megatron-LM flag not taken); values are skipped
            flags = [(a, name, _not_taken(name)) for a in message.split(":", 1)[1].split() if a.startswith("--")
                     for name in [a.split("=")[0]]]
            not_taken = [f"{name}: {why}" for _, name, why in flags if why]
            if not_taken:
                others = [a for a, _, why in flags if not why]
                message = ("Megatron-LM flags not taken here: " + "; ".join(not_taken)
                           + (f"; also unrecognized: {' '.join(others)}" if others else ""))
            else:
                known = [s for a in self._actions for s in a.option_strings]
                hints = [f"{a} -> did you mean {close[0]}?" for a, name, _ in flags
                         if (close := difflib.get_close_matches(name, known, n=1))]
                if hints:
                    message += " (" + "; ".join(hints) + ")"
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def build_parser() -> argparse.ArgumentParser:
    """The full parser; ``--help`` groups flags by config and prints each field's documentation."""
    parser = _Parser(
        prog="pretrain_gpt.py", allow_abbrev=False,
        description="Pretrain a GPT model. Flags are spelled as in Megatron-LM.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    groups = {}
    for title, cls in SECTIONS:
        group = parser.add_argument_group(title)
        groups[title.split(" ")[0]] = group
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            flag = _flag_name(f)
            if flag is None:
                continue
            kwargs = dict(dest=f.name, help=f.metadata.get("help", ""))
            if hints[f.name] is bool:
                kwargs["action"] = "store_false" if f.default is True else "store_true"
            else:
                kwargs["type"] = _base_type(hints[f.name])
                if f.metadata.get("nargs"):
                    kwargs["nargs"] = f.metadata["nargs"]
                if f.metadata.get("choices"):
                    kwargs["choices"] = f.metadata["choices"]
            kwargs["default"] = argparse.SUPPRESS
            group.add_argument(flag, **kwargs)
    for flag, (section, kwargs) in ALIASES.items():
        groups[section].add_argument(flag, default=False, **kwargs)
    compat = parser.add_argument_group("Megatron-LM compatibility (accepted, no effect)")
    for flag, kwargs in COMPAT_FLAGS.items():
        compat.add_argument(flag, **{"default": False, **kwargs})
    return parser


def flag_list() -> list[str]:
    """Every flag the parser accepts, sorted (pinned by a snapshot test)."""
    parser = build_parser()
    return sorted(s for a in parser._actions for s in a.option_strings if s.startswith("--") and s != "--help")


def _apply_compat(ns: dict) -> None:
    """Check and drop the COMPAT_FLAGS: they change nothing, but some values ask for what is not here."""
    compat = {flag: ns.pop(flag[2:].replace("-", "_"), False) for flag in COMPAT_FLAGS}
    for flag, why in (("--context-parallel-size", _CP), ("--expert-model-parallel-size", _MOE)):
        if compat[flag] not in (False, 1):
            raise ValueError(f"{flag} {compat[flag]}: {why}; pass {flag} 1 or drop it")
    if compat["--attention-backend"] in ("unfused", "local"):
        raise ValueError(f"--attention-backend {compat['--attention-backend']}: attention always runs through torch's "
                         "scaled_dot_product_attention (cuDNN's fused attention on Hopper); pass auto or drop it")
    if compat["--accumulate-allreduce-grads-in-fp32"] and ns.get("grad_reduce_in_bf16"):
        raise ValueError("--accumulate-allreduce-grads-in-fp32 contradicts --grad-reduce-in-bf16; keep one of them")


def _apply_aliases(ns: dict) -> None:
    _apply_compat(ns)
    if ns.pop("use_rotary_position_embeddings", False):
        if ns.get("position_embedding_type", "rope") != "rope":
            raise ValueError(f"--use-rotary-position-embeddings contradicts --position-embedding-type "
                             f"{ns['position_embedding_type']}; keep one of them")
        ns["position_embedding_type"] = "rope"
    if ns.pop("no_position_embedding", False) and ns.get("position_embedding_type", "learned_absolute") == "learned_absolute":
        ns["position_embedding_type"] = "none"
    if ns.pop("swiglu", False):
        ns["activation"] = "swiglu"
    if ns.pop("disable_bias_linear", False):
        ns["add_bias_linear"] = False
    if ns.pop("untie_embeddings_and_output_weights", False):
        ns["share_embeddings_and_output_weights"] = False
    if ns.pop("recompute_activations", False):
        ns.setdefault("recompute_granularity", "selective")
    if ns.pop("grad_reduce_in_bf16", False):
        if not ns.get("bf16"):
            raise ValueError("--grad-reduce-in-bf16 needs --bf16 (the gradients are in the parameters' dtype); "
                             "add --bf16 or drop --grad-reduce-in-bf16")
        ns["grad_reduce_in_fp32"] = False
    gqa = ns.pop("group_query_attention", False)
    if not gqa and ns.get("num_query_groups") is not None:
        raise ValueError("--num-query-groups only takes effect with --group-query-attention; add that flag")
    if gqa and ns.get("num_query_groups") is None:
        raise ValueError("--group-query-attention needs --num-query-groups N (N divides --num-attention-heads)")


def _build(cls, ns: dict, **derived):
    names = {f.name for f in dataclasses.fields(cls)}
    values = {k: v for k, v in ns.items() if k in names}
    values.update({k: v for k, v in derived.items() if k in names})
    return cls(**values)


def configs_from_namespace(ns: dict) -> RunConfig:
    """Build (and so validate) every config from parsed flag values; raises ValueError on user errors."""
    ns = dict(ns)
    _apply_aliases(ns)
    for required in REQUIRED:
        if ns.get(required) is None:
            raise ValueError(f"--{required.replace('_', '-')} is required")
    model = _build(TransformerConfig, ns)
    optimizer = _build(OptimizerConfig, ns, fp16=model.fp16, bf16=model.bf16)
    return RunConfig(
        model=model,
        training=_build(TrainingConfig, ns),
        scheduler=_build(SchedulerConfig, ns),
        optimizer=optimizer,
        data=_build(DataConfig, ns),
        tokenizer=_build(TokenizerConfig, ns),
        checkpoint=_build(CheckpointConfig, ns),
        logger=_build(LoggerConfig, ns),
        impl=_build(ModelImplConfig, ns),
        # Aliased single gradients pay only when the optimizer reads them in their own dtype (the
        # one-pass AdamW without a loss scaler); otherwise it would widen them into new fp32 tensors.
        ddp=_build(DistributedDataParallelConfig, ns, alias_single_gradients=(
            optimizer.optimizer == "adam" and optimizer.use_fused_adam and not model.fp16)),
    )


def parse_args(argv: list[str] | None = None) -> RunConfig:
    """Parse and validate ``argv``. Unknown flags exit with argparse's usage message (code 2);
    invalid values raise ``ValueError`` with the flag name and a valid value."""
    from megatron.training.validation import validate_run_config

    parser = build_parser()
    ns = vars(parser.parse_args(sys.argv[1:] if argv is None else argv))
    cfg = configs_from_namespace(ns)
    validate_run_config(cfg)
    return cfg


def format_arguments(cfg: RunConfig) -> str:
    """Megatron's argument dump: one ``name .... value`` line per setting, sorted case-insensitively."""
    flat = {}
    for section in cfg.to_dict().values():
        flat.update(section)
    lines = ["------------------------ arguments ------------------------"]
    for name in sorted(flat, key=str.lower):
        dots = "." * max(1, 48 - len(name))
        lines.append(f"  {name} {dots} {flat[name]}")
    lines.append("-------------------- end of arguments ---------------------")
    return "\n".join(lines)
