"""Command-line flags, generated from the config dataclasses plus one alias table.

Every config field whose metadata ``flag`` is not ``None`` becomes a flag: ``--field-name`` (or
the spelling in its metadata). Booleans that default to False are switches; booleans that default
to True get a ``--no-field-name`` switch. Flags that do not map one-to-one onto a field (Megatron
spellings such as ``--swiglu`` or ``--disable-bias-linear``) live in ``ALIASES``. The argparse
``Namespace`` is what Megatron-LM's two-step ``parse_args`` / ``validate_args`` hand to its users
(``megatron_args``, built on this module); the run itself takes ``parse_run_config``'s ``RunConfig``
of typed configs. ``megatron.training.arguments`` is Megatron-LM's module of both.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import types
import typing
from dataclasses import dataclass

from megatron.core.config_utils import ConfigError, flag_default
from megatron.core.distributed.distributed_data_parallel_config import DistributedDataParallelConfig
from megatron.core.optimizer.optimizer_config import OptimizerConfig
from megatron.core.transformer.moe_config_fields import parse_moe_layer_freq
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.training import checkpoint_args
from megatron.training.config import (
    CheckpointConfig,
    DataConfig,
    LoggerConfig,
    SchedulerConfig,
    TokenizerConfig,
    TrainingConfig,
)
from megatron.training.config_sections import SECTIONS, ModelImplConfig, flag_name
from megatron.training.flag_parsing import Parser, ParseStop, Value, attach_negative_values, unknown
from megatron.training.fsdp_flags import resolve_megatron_fsdp
from megatron.training.megatron_flag_table import FOREIGN, describe
from megatron.training.megatron_flags import GIVEN, judge, register
from megatron.training.user_errors import USER_ERRORS, name_flags
from megatron.training.validation import validate_run_config


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
    notes: list[str] = dataclasses.field(default_factory=list)
    """Accepted Megatron-LM flags that change nothing here, one line each, for the log."""

    def to_dict(self) -> dict:
        """A plain, JSON-friendly nested dict of the configs (dtypes and callables as strings)."""
        out = {}
        for f in dataclasses.fields(self):
            cfg = getattr(self, f.name)
            if not dataclasses.is_dataclass(cfg):
                continue
            out[f.name] = {k.name: _plain(getattr(cfg, k.name)) for k in dataclasses.fields(cfg)}
        return out


def config_flags() -> dict[tuple[str, str], str]:
    """``(section, field) -> flag`` for the fields of ``RunConfig.to_dict()`` that are flags (a field
    without a flag is absent)."""
    out = {}
    for section, cls in typing.get_type_hints(RunConfig).items():
        if dataclasses.is_dataclass(cls):
            for f in dataclasses.fields(cls):
                flag = flag_name(f)
                if flag is not None:
                    out[(section, f.name)] = flag
    return out


def _plain(v):
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    if isinstance(v, (list, tuple)):
        return [_plain(x) for x in v]
    if callable(v) and not isinstance(v, type):
        # A function's or bound method's name, never its repr: that holds a per-process address, and the
        # saved config is common state that every rank must write identically.
        name = getattr(v, "__qualname__", None) or getattr(getattr(v, "func", None), "__qualname__", None)
        return name or type(v).__qualname__
    return str(v)


# Further Megatron-LM spellings of a field's flag (the same argparse action): flag -> field.
SPELLINGS: dict[str, str] = {
    "--override-opt_param-scheduler": "override_opt_param_scheduler",
    "--use-checkpoint-opt_param-scheduler": "use_checkpoint_opt_param_scheduler",
    "--num-virtual-stages-per-pipeline-rank": "virtual_pipeline_model_parallel_size",
    "--persistent-save-interval": "save_interval",
    "--disable-log-loss-scale-to-tensorboard": "log_loss_scale_to_tensorboard",
    "--disable-pad-vocab-size": "pad_vocab_size",
    "--disable-flight-recorder-dump-on-timeout": "flight_recorder_dump_on_timeout",
}

# Megatron spellings that are not one field each: flag -> (section, argparse kwargs).
ALIASES: dict[str, tuple[str, dict]] = {
    "--swiglu": ("model", dict(action="store_true", help="SwiGLU MLP (sets activation to swiglu).")),
    "--disable-bias-linear": ("model", dict(action="store_true", help="No biases in linear layers.")),
    "--untie-embeddings-and-output-weights": (
        "model",
        dict(action="store_true", help="Separate output-layer weight instead of the word embedding."),
    ),
    "--group-query-attention": (
        "model",
        dict(action="store_true", help="Grouped-query attention with --num-query-groups groups."),
    ),
    "--use-rotary-position-embeddings": (
        "model",
        dict(action="store_true", help="Megatron-LM's older spelling of --position-embedding-type rope."),
    ),
    "--no-position-embedding": (
        "model",
        dict(
            action="store_true",
            help="No learned position table: --position-embedding-type none, unless rope is chosen "
            "(which has none anyway).",
        ),
    ),
    "--recompute-activations": (
        "model",
        dict(action="store_true", help="Same as --recompute-granularity selective."),
    ),
    "--cross-entropy-loss-fusion": (
        "model",
        dict(
            action="store_true",
            dest="cross_entropy_loss_fusion_on",
            help=(
                "Megatron-LM's switch for the fused output layer and cross entropy, which is on here by default "
                "(see --no-cross-entropy-loss-fusion)."
            ),
        ),
    ),
    "--grad-reduce-in-bf16": (
        "data-parallel",
        dict(
            action="store_true",
            help="With --bf16: keep the main gradients in bf16 and reduce them across data-parallel "
            "ranks in bf16 (half the communication and gradient memory; accumulation over "
            "micro-batches also in bf16). Default: fp32.",
        ),
    ),
}


# Fields without a usable default: the run stops with "--flag is required" when one is missing.
REQUIRED = ("num_layers", "hidden_size", "num_attention_heads", "micro_batch_size", "seq_length")


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


def _defaults() -> dict:
    out = {}
    for _, cls in SECTIONS:
        for f in dataclasses.fields(cls):
            if f.name in out:
                continue  # a field of two configs (OptimizerConfig mirrors a few): the first section's
            if flag_default(f) is not dataclasses.MISSING:
                out[f.name] = flag_default(f)
    return out


def default_text(field_name: str, switch: bool) -> str:
    """How --help and docs/flags.md show a flag's default."""
    if switch:
        return "off"
    if field_name in REQUIRED:
        return "required"
    value = _defaults().get(field_name)
    if value is None:
        return "none"
    return " ".join(map(str, value)) if isinstance(value, list) else str(value)


def _help_with_default(f: dataclasses.Field, switch: bool) -> str:
    text = f.metadata.get("help", "")
    default = default_text(f.name, switch)
    if default == "required":
        return f"{text} [required]"
    if default == "none" and "default" in text.lower():
        return text  # the text says how the default is derived
    return f"{text} [default: {default}]"


class _HelpMegatron(argparse.Action):
    def __init__(self, option_strings, dest, **kwargs):
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        print(describe(), flush=True)
        parser.exit(0)


USAGE = "pretrain_gpt.py [--flag value ...]   (python pretrain_gpt.py, or torchrun ... pretrain_gpt.py)"
EPILOG = (
    "Every flag of Megatron-LM's pretrain_gpt.py is taken: the ones above are implemented; the rest are "
    "accepted with a note (they ask for what this package always does, or tune a Megatron internal it does "
    "not have) or refused with what to use instead. `pretrain_gpt.py --help-megatron` lists them; "
    "docs/flags.md has all of it."
)


def _declared_order(cls) -> list[dataclasses.Field]:
    """A config's fields in the order of their latest declaration: its own first, then its bases'
    from the nearest (a field redeclared over a base class's, such as TransformerConfig's over
    ModelParallelConfig's, takes the place of the redeclaration; MoEConfigFields' follow
    TransformerConfig's own)."""
    order: dict[str, int] = {}
    for klass in cls.__mro__:
        for name in vars(klass).get("__annotations__", {}):
            order.setdefault(name, len(order))
    return sorted(dataclasses.fields(cls), key=lambda f: order.get(f.name, len(order)))


# Fields whose flag value is not read by the field's type: field -> converter (raises ValueError).
CONVERTERS = {"moe_layer_freq": parse_moe_layer_freq}


def _metavar(convert) -> str:
    return convert.__name__.upper() if isinstance(convert, type) else "INT|LIST"


def build_parser() -> Parser:
    """The full parser; ``--help`` groups flags by config and prints each field's documentation."""
    parser = Parser(
        prog="pretrain_gpt.py",
        allow_abbrev=False,
        usage=USAGE,
        epilog=EPILOG,
        description="Pretrain a GPT model. Flags are spelled as in Megatron-LM.",
    )
    parser.add_argument(
        "--help-megatron",
        action=_HelpMegatron,
        help="List Megatron-LM's flags that are accepted without effect or refused here, and why.",
    )
    groups = {}
    for title, cls in SECTIONS:
        group = parser.add_argument_group(title)
        groups[title.split(" ")[0]] = group
        hints = typing.get_type_hints(cls)
        for f in _declared_order(cls):
            flag = flag_name(f)
            if flag is None:
                continue
            switch = hints[f.name] is bool
            kwargs: dict = dict(
                dest=f.name, default=argparse.SUPPRESS, help=_help_with_default(f, switch).replace("%", "%%")
            )
            if switch:
                kwargs["action"] = "store_false" if flag_default(f) is True else "store_true"
            else:
                convert = CONVERTERS.get(f.name) or _base_type(hints[f.name])
                choices = f.metadata.get("choices")
                kwargs.update(
                    action=Value,
                    convert=convert,
                    allowed=choices,
                    metavar=f.metadata.get("metavar")
                    or ("{" + ",".join(str(c) for c in choices) + "}" if choices else _metavar(convert)),
                )
                if f.metadata.get("nargs"):
                    kwargs["nargs"] = f.metadata["nargs"]
            group.add_argument(flag, *[s for s, name in SPELLINGS.items() if name == f.name], **kwargs)
    for flag, (section, kwargs) in ALIASES.items():
        groups[section].add_argument(
            flag, default=False, **{**kwargs, "help": kwargs["help"] + " [default: off]"}
        )
    register(parser, FOREIGN)
    return parser


def flag_list() -> list[str]:
    """Every flag the parser implements (not the foreign ones it only notes or refuses), sorted;
    pinned by a snapshot test."""
    parser = build_parser()
    return sorted(
        s
        for a in parser._actions
        if a.dest != GIVEN
        for s in a.option_strings
        if s.startswith("--") and s not in ("--help", "--help-megatron")
    )


def parse_namespace(
    argv: list[str],
    parser: Parser | None = None,
    ignore_unknown: bool = False,
    foreign_given: list | None = None,
) -> tuple[dict, list[str]]:
    """(flag values by config field, notes on the accepted foreign flags). Every mistake of the
    command line (unknown flags, refused Megatron-LM flags, bad values and choices) is reported
    together: one line each, then exit code 2. ``parser`` defaults to ``build_parser()``;
    ``ignore_unknown`` drops flags that neither it nor Megatron-LM knows (refused ones still stop);
    ``foreign_given`` receives the accepted Megatron-LM flags that are not ours, as (entry, value)."""
    parser = parser or build_parser()
    arity = {s: a.nargs for a in parser._actions for s in a.option_strings}
    stop = None
    try:
        ns, extras = parser.parse_known_args(attach_negative_values(argv, arity))
    except ParseStop as e:
        ns, extras, stop = argparse.Namespace(), [], str(e)
    values = vars(ns)
    given = values.pop(GIVEN, [])
    if foreign_given is not None:
        foreign_given.extend(given)
    notes, refusals = judge(given)
    known = [s for a in parser._actions for s in a.option_strings]
    mistakes = (
        refusals
        + ([] if ignore_unknown else unknown(extras, known))
        + parser.mistakes
        + ([stop] if stop else [])
    )
    if mistakes:
        if len(mistakes) == 1:
            parser.exit(2, f"{parser.prog}: error: {mistakes[0]} (see --help)\n")
        parser.exit(
            2,
            f"{parser.prog}: error: {len(mistakes)} problems with the flags (see --help; "
            "--help-megatron lists the Megatron-LM flags refused here):\n  " + "\n  ".join(mistakes) + "\n",
        )
    if values.get("grad_reduce_in_bf16") and any(
        e.flag == "--accumulate-allreduce-grads-in-fp32" for e, _ in given
    ):
        raise ConfigError(
            "--accumulate-allreduce-grads-in-fp32 contradicts --grad-reduce-in-bf16; keep one of them"
        )
    return values, notes


def _apply_aliases(ns: dict) -> None:
    if ns.pop("use_rotary_position_embeddings", False):
        if ns.get("position_embedding_type", "rope") != "rope":
            raise ConfigError(
                f"--use-rotary-position-embeddings contradicts --position-embedding-type "
                f"{ns['position_embedding_type']}; keep one of them"
            )
        ns["position_embedding_type"] = "rope"
    if (
        ns.pop("no_position_embedding", False)
        and ns.get("position_embedding_type", "learned_absolute") == "learned_absolute"
    ):
        ns["position_embedding_type"] = "none"
    if ns.pop("swiglu", False):
        ns["activation"] = "swiglu"
    if ns.pop("disable_bias_linear", False):
        ns["add_bias_linear"] = False
    if ns.pop("untie_embeddings_and_output_weights", False):
        ns["share_embeddings_and_output_weights"] = False
    if ns.pop("cross_entropy_loss_fusion_on", False) and ns.get("cross_entropy_loss_fusion") is False:
        raise ConfigError(
            "--cross-entropy-loss-fusion contradicts --no-cross-entropy-loss-fusion; keep one of them"
        )
    if ns.pop("recompute_activations", False):
        ns.setdefault("recompute_granularity", "selective")
    if ns.pop("grad_reduce_in_bf16", False):
        if not ns.get("bf16"):
            raise ConfigError(
                "--grad-reduce-in-bf16 needs --bf16 (the gradients are in the parameters' dtype); "
                "add --bf16 or drop --grad-reduce-in-bf16"
            )
        ns["grad_reduce_in_fp32"] = False
    gqa = ns.pop("group_query_attention", False)
    if not gqa and ns.get("num_query_groups") is not None:
        raise ConfigError("--num-query-groups only takes effect with --group-query-attention; add that flag")
    if gqa and ns.get("num_query_groups") is None:
        raise ConfigError(
            "--group-query-attention needs --num-query-groups N (N divides --num-attention-heads)"
        )


def _build(cls, ns: dict, **derived):
    names = {f.name for f in dataclasses.fields(cls)}
    values = {
        f.name: f.metadata["app_default"] for f in dataclasses.fields(cls) if "app_default" in f.metadata
    }
    values.update({k: v for k, v in ns.items() if k in names})
    values.update({k: v for k, v in derived.items() if k in names})
    return cls(**values)


def configs_from_namespace(ns: dict) -> RunConfig:
    """Build (and so validate) every config from parsed flag values; raises ValueError on user errors.
    With --use-checkpoint-args, the architecture flags not given are first read from the --load
    checkpoint (``checkpoint_args``; its note line in ``notes``)."""
    ns = dict(ns)
    _apply_aliases(ns)
    taken = []
    if ns.get("use_checkpoint_args"):
        taken = checkpoint_args.fill_from_checkpoint(ns, ns.get("load"), ns.get("ckpt_step"))
    for required in REQUIRED:
        if ns.get(required) is None:
            raise ConfigError(f"--{required.replace('_', '-')} is required")
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
        ddp=_build(
            DistributedDataParallelConfig,
            ns,
            alias_single_gradients=(
                optimizer.optimizer == "adam" and optimizer.use_fused_adam and not model.fp16
            ),
        ),
        notes=taken,
    )


def run_config_from_values(values: dict, notes: list[str], world_size: int | None = None) -> RunConfig:
    """Build and validate the run's configs from flag values by field (``parse_namespace``'s), for
    ``world_size`` processes (default: ``--world-size``, else the launcher's).

    Raises:
        ConfigError: naming the flags (the library's parameter names rewritten, ``user_errors``).
    """
    try:
        cfg = configs_from_namespace(values)
        notes = [*notes, *cfg.notes]
        if cfg.model.sequence_parallel and cfg.model.tensor_model_parallel_size == 1:
            cfg.model.sequence_parallel = False  # as Megatron-LM does
            notes.append("note: --sequence-parallel is off: it needs --tensor-model-parallel-size > 1")
        notes.extend(resolve_megatron_fsdp(cfg))
        cfg.notes = notes
        validate_run_config(cfg, world_size)
    except USER_ERRORS as e:
        name_flags(e)
        raise
    return cfg


def parse_run_config(argv: list[str] | None = None) -> RunConfig:
    """Parse and validate ``argv`` (default ``sys.argv[1:]``) into the run's configs. Flags that cannot
    be taken (unknown, refused, bad values) are reported together and exit with code 2; invalid
    combinations raise ``ValueError`` with the flag name and a valid value. ``cfg.notes`` holds one
    line per accepted Megatron-LM flag that changes nothing here, for the log."""
    ns, notes = parse_namespace(sys.argv[1:] if argv is None else argv)
    return run_config_from_values(ns, notes)


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
