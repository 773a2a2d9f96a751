"""Learning-rate and weight-decay schedules, counted in samples (Megatron semantics).

Each successful iteration calls ``step(global_batch_size)``. LR: linear warm-up from ``init_lr`` to
``max_lr`` over ``lr_warmup_steps``; then, with r = (step - warmup) / (decay - warmup), ``linear``
(1 - r), ``cosine`` (0.5 (cos(pi r) + 1)), ``WSD`` (constant until ``decay - wsd_decay``, then
linear / cosine / exponential (2 * 0.5^r' - 1) / minus_sqrt (1 - sqrt(r')) over the last
``wsd_decay_steps``), giving ``min_lr + coeff (max_lr - min_lr)``; ``inverse-square-root`` gives
``max_lr sqrt(warmup) / sqrt(step)`` floored at ``min_lr``; ``constant`` stays at ``max_lr``. Past
``lr_decay_steps`` the LR is ``min_lr`` (except ``constant``). WD grows from ``start_wd`` to
``end_wd`` over ``wd_incr_steps`` (``constant``, ``linear`` or ``cosine``). Each param group gets
``lr * lr_mult`` and ``wd * wd_mult``, where a group's own ``max_lr`` / ``min_lr`` replace the
scheduler's in the formulas (``--decoupled-lr``: the embedding and output layer groups, marked
``is_decoupled_lr``, follow ``decoupled_lr`` / ``decoupled_min_lr`` on the same warm-up and decay).
"""

from __future__ import annotations

import math
from typing import Any

from megatron.core.config_utils import ConfigError

LR_DECAY_STYLES = ("constant", "linear", "cosine", "inverse-square-root", "WSD")
WSD_DECAY_STYLES = ("linear", "cosine", "exponential", "minus_sqrt")
WD_INCR_STYLES = ("constant", "linear", "cosine")

# The schedule's fields a checkpoint records, checked against this run's at load, in that order
# (lr_decay_style is settled before the WSD fields).
_CHECKED_FIELDS = (
    "max_lr",
    "min_lr",
    "lr_warmup_steps",
    "lr_decay_steps",
    "lr_decay_style",
    "start_wd",
    "end_wd",
    "wd_incr_steps",
    "wd_incr_style",
    "wsd_decay_steps",
    "lr_wsd_decay_style",
    "decoupled_lr",
    "decoupled_min_lr",
)
# Fields that checkpoints saved before they existed lack; there they were None.
_NEWER_FIELDS = ("decoupled_lr", "decoupled_min_lr")


class OptimizerParamScheduler:
    """Sets ``lr`` and ``weight_decay`` of every param group of ``optimizer`` from the sample count.

    ``optimizer`` is anything with ``param_groups`` (a torch optimizer or a MegatronOptimizer).
    The constructor applies step 0 immediately.

    Raises:
        ConfigError: an invalid schedule, naming the parameters (e.g. ``min_lr`` above ``max_lr``).
    """

    def __init__(
        self,
        optimizer: Any,
        init_lr: float,
        max_lr: float,
        min_lr: float,
        lr_warmup_steps: int,
        lr_decay_steps: int,
        lr_decay_style: str,
        start_wd: float,
        end_wd: float,
        wd_incr_steps: int,
        wd_incr_style: str,
        use_checkpoint_opt_param_scheduler: bool = True,
        override_opt_param_scheduler: bool = False,
        wsd_decay_steps: int | None = None,
        lr_wsd_decay_style: str | None = None,
        decoupled_lr: float | None = None,
        decoupled_min_lr: float | None = None,
    ) -> None:
        self.optimizer = optimizer
        self.init_lr = float(init_lr)
        self.max_lr = float(max_lr)
        self.min_lr = float(min_lr)
        self.lr_warmup_steps = int(lr_warmup_steps)
        self.lr_decay_steps = int(lr_decay_steps)
        self.lr_decay_style = lr_decay_style
        self.wsd_decay_steps = wsd_decay_steps
        self.lr_wsd_decay_style = lr_wsd_decay_style or "exponential"
        self.decoupled_lr = None if decoupled_lr is None else float(decoupled_lr)
        self.decoupled_min_lr = None if decoupled_min_lr is None else float(decoupled_min_lr)
        self.start_wd = float(start_wd)
        self.end_wd = float(end_wd)
        self.wd_incr_steps = int(wd_incr_steps)
        self.wd_incr_style = wd_incr_style
        self.use_checkpoint_opt_param_scheduler = use_checkpoint_opt_param_scheduler
        self.override_opt_param_scheduler = override_opt_param_scheduler
        self.num_steps = 0
        self._validate()
        if self.decoupled_lr is not None:
            self._set_decoupled_bounds()
        self.step(0)

    def _validate(self) -> None:
        if self.lr_decay_style not in LR_DECAY_STYLES:
            raise ConfigError(
                f"lr_decay_style {self.lr_decay_style!r} is not valid; choose one of {list(LR_DECAY_STYLES)}",
                params=("lr_decay_style",),
            )
        if self.wd_incr_style not in WD_INCR_STYLES:
            raise ConfigError(
                f"wd_incr_style {self.wd_incr_style!r} is not valid; choose one of {list(WD_INCR_STYLES)}",
                params=("wd_incr_style",),
            )
        if self.min_lr < 0.0:
            raise ConfigError(f"min_lr must be >= 0, got {self.min_lr}", params=("min_lr",))
        if self.max_lr < self.min_lr:
            raise ConfigError(
                f"max_lr ({self.max_lr}) must be >= min_lr ({self.min_lr})", params=("max_lr", "min_lr")
            )
        if self.init_lr > self.max_lr:
            raise ConfigError(
                f"init_lr ({self.init_lr}) must be <= max_lr ({self.max_lr})", params=("init_lr", "max_lr")
            )
        if self.decoupled_lr is not None and self.decoupled_lr < self._decoupled_floor():
            raise ConfigError(
                f"decoupled_lr ({self.decoupled_lr}) must be >= its floor {self._decoupled_floor()} "
                "(decoupled_min_lr, default min_lr); pass decoupled_min_lr <= decoupled_lr",
                params=("decoupled_lr", "decoupled_min_lr", "min_lr"),
            )
        if self.lr_decay_steps <= 0:
            raise ConfigError(
                f"lr_decay_steps must be > 0, got {self.lr_decay_steps}", params=("lr_decay_steps",)
            )
        if not 0 <= self.lr_warmup_steps < self.lr_decay_steps:
            raise ConfigError(
                f"LR warm-up ({self.lr_warmup_steps} samples, lr_warmup_steps) must be "
                f"in [0, LR decay length {self.lr_decay_steps}) (lr_decay_steps)",
                params=("lr_warmup_steps", "lr_decay_steps"),
            )
        if self.lr_decay_style == "WSD":
            if self.wsd_decay_steps is None or not 0 < self.wsd_decay_steps <= self.lr_decay_steps:
                raise ConfigError(
                    f"lr_decay_style WSD needs wsd_decay_steps in (0, {self.lr_decay_steps}], got {self.wsd_decay_steps}",
                    params=("lr_decay_style", "wsd_decay_steps"),
                )
            if self.lr_wsd_decay_style not in WSD_DECAY_STYLES:
                raise ConfigError(
                    f"lr_wsd_decay_style {self.lr_wsd_decay_style!r} is not valid; "
                    f"choose one of {list(WSD_DECAY_STYLES)}",
                    params=("lr_wsd_decay_style",),
                )
        if self.start_wd < 0.0:
            raise ConfigError(f"start_wd must be >= 0, got {self.start_wd}", params=("start_wd",))
        if self.end_wd < self.start_wd:
            raise ConfigError(
                f"end_wd ({self.end_wd}) must be >= start_wd ({self.start_wd})", params=("end_wd", "start_wd")
            )
        if self.wd_incr_style == "constant" and self.start_wd != self.end_wd:
            raise ConfigError(
                f"wd_incr_style constant needs start_wd == end_wd, got {self.start_wd} and {self.end_wd}",
                params=("wd_incr_style", "start_wd", "end_wd"),
            )
        if self.wd_incr_style != "constant" and self.wd_incr_steps <= 0:
            raise ConfigError(
                f"wd_incr_steps (the weight-decay increment length) must be > 0 samples, got "
                f"{self.wd_incr_steps}",
                params=("wd_incr_steps",),
            )
        if self.override_opt_param_scheduler and self.use_checkpoint_opt_param_scheduler:
            raise ConfigError(
                "override_opt_param_scheduler and use_checkpoint_opt_param_scheduler are mutually exclusive",
                params=("override_opt_param_scheduler", "use_checkpoint_opt_param_scheduler"),
            )

    def _decoupled_floor(self) -> float:
        return self.min_lr if self.decoupled_min_lr is None else self.decoupled_min_lr

    def _set_decoupled_bounds(self) -> None:
        """Point the ``is_decoupled_lr`` groups at ``decoupled_lr`` and its floor; without
        ``decoupled_lr`` they follow ``max_lr`` / ``min_lr`` like the others."""
        for group in self.optimizer.param_groups:
            if not group.get("is_decoupled_lr"):
                continue
            if self.decoupled_lr is None:
                group.pop("max_lr", None)
                group.pop("min_lr", None)
            else:
                group["max_lr"], group["min_lr"] = self.decoupled_lr, self._decoupled_floor()

    def get_wd(self, param_group: dict[str, Any] | None = None) -> float:
        """The weight decay (before ``wd_mult``) at the current sample count; a ``param_group``'s own
        ``start_wd``/``end_wd`` win, as in Megatron-Core."""
        start = self.start_wd if param_group is None else param_group.get("start_wd", self.start_wd)
        end = self.end_wd if param_group is None else param_group.get("end_wd", self.end_wd)
        if self.num_steps > self.wd_incr_steps or self.wd_incr_style == "constant":
            return end
        ratio = float(self.num_steps) / float(self.wd_incr_steps)
        if self.wd_incr_style == "linear":
            coeff = ratio
        else:  # cosine
            coeff = 0.5 * (math.cos(math.pi * (1.0 - ratio)) + 1.0)
        return start + coeff * (end - start)

    def get_lr(self, param_group: dict[str, Any]) -> float:
        """The LR (before ``lr_mult``) for ``param_group``; a group's ``max_lr``/``min_lr`` win."""
        max_lr = param_group.get("max_lr", self.max_lr)
        min_lr = param_group.get("min_lr", self.min_lr)
        if self.lr_warmup_steps > 0 and self.num_steps <= self.lr_warmup_steps:
            return self.init_lr + (max_lr - self.init_lr) * float(self.num_steps) / float(
                self.lr_warmup_steps
            )
        if self.lr_decay_style == "constant":
            return max_lr
        if self.num_steps > self.lr_decay_steps:
            return min_lr
        if self.lr_decay_style == "inverse-square-root":
            warmup = max(self.lr_warmup_steps, 1)
            steps = max(self.num_steps, 1)
            return max(min_lr, max_lr * warmup**0.5 / steps**0.5)
        ratio = float(self.num_steps - self.lr_warmup_steps) / float(
            self.lr_decay_steps - self.lr_warmup_steps
        )
        if self.lr_decay_style == "linear":
            coeff = 1.0 - ratio
        elif self.lr_decay_style == "cosine":
            coeff = 0.5 * (math.cos(math.pi * ratio) + 1.0)
        else:  # WSD
            coeff = self._wsd_coeff()
        return min_lr + coeff * (max_lr - min_lr)

    def _wsd_coeff(self) -> float:
        assert self.wsd_decay_steps is not None
        anneal_start = self.lr_decay_steps - self.wsd_decay_steps
        if self.num_steps <= anneal_start:
            return 1.0
        r = float(self.num_steps - anneal_start) / float(self.wsd_decay_steps)
        style = self.lr_wsd_decay_style
        if style == "linear":
            return 1.0 - r
        if style == "cosine":
            return 0.5 * (math.cos(math.pi * r) + 1.0)
        if style == "exponential":
            return 2.0 * math.pow(0.5, r) - 1.0
        return 1.0 - math.sqrt(r)  # minus_sqrt

    def step(self, increment: int) -> None:
        """Advance by ``increment`` samples and set ``lr``/``weight_decay`` on every param group."""
        self.num_steps += increment
        for group in self.optimizer.param_groups:
            group["lr"] = self.get_lr(group) * group.get("lr_mult", 1.0)
            group["weight_decay"] = self.get_wd(group) * group.get("wd_mult", 1.0)

    def state_dict(self) -> dict[str, Any]:
        """The schedule and the sample count."""
        return {
            "max_lr": self.max_lr,
            "lr_warmup_steps": self.lr_warmup_steps,
            "num_steps": self.num_steps,
            "lr_decay_style": self.lr_decay_style,
            "lr_decay_steps": self.lr_decay_steps,
            "min_lr": self.min_lr,
            "start_wd": self.start_wd,
            "end_wd": self.end_wd,
            "wd_incr_style": self.wd_incr_style,
            "wd_incr_steps": self.wd_incr_steps,
            "wsd_decay_steps": self.wsd_decay_steps,
            "lr_wsd_decay_style": self.lr_wsd_decay_style,
            "decoupled_lr": self.decoupled_lr,
            "decoupled_min_lr": self.decoupled_min_lr,
        }

    def _check_and_set(self, name: str, current: Any, saved: Any) -> Any:
        if self.override_opt_param_scheduler:
            return current
        if self.use_checkpoint_opt_param_scheduler or current == saved:
            return saved
        raise ConfigError(
            f"{name}: this run's value ({current!r}) differs from the checkpoint's ({saved!r}); "
            "set override_opt_param_scheduler to use this run's values or "
            "use_checkpoint_opt_param_scheduler to use the checkpoint's",
            params=(name, "override_opt_param_scheduler", "use_checkpoint_opt_param_scheduler"),
        )

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore the sample count; take the schedule from the flags or the checkpoint.

        With ``override_opt_param_scheduler`` this run's values win; with
        ``use_checkpoint_opt_param_scheduler`` the checkpoint's win; with neither they must agree.

        Raises:
            ConfigError: a value differs and neither option is set (the message names the parameter).
        """
        renames = {
            "start_lr": "max_lr",
            "warmup_iter": "lr_warmup_steps",
            "warmup_steps": "lr_warmup_steps",
            "end_iter": "lr_decay_steps",
            "decay_steps": "lr_decay_steps",
            "decay_style": "lr_decay_style",
            "num_iters": "num_steps",
        }  # names used by older Megatron checkpoints
        saved = {renames.get(k, k): v for k, v in state_dict.items()}
        for name in _NEWER_FIELDS:
            saved.setdefault(name, None)
        decoupled = (self.decoupled_lr, self.decoupled_min_lr)
        for name in _CHECKED_FIELDS:
            if name not in saved:
                continue
            if name in ("wsd_decay_steps", "lr_wsd_decay_style") and self.lr_decay_style != "WSD":
                continue
            setattr(self, name, self._check_and_set(name, getattr(self, name), saved[name]))
        self._validate()
        if self.decoupled_lr is not None or (self.decoupled_lr, self.decoupled_min_lr) != decoupled:
            self._set_decoupled_bounds()
        self.num_steps = 0
        self.step(int(saved["num_steps"]))
