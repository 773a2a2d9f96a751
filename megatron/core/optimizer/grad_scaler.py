"""Loss scalers for fp16 training.

The scale lives on the host as a Python float: it changes only after the optimizer has learned
(through its one host sync per step) whether the gradients overflowed, so keeping it on the device
would buy nothing and would cost a sync to log it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

from megatron.core.config_utils import ConfigError


class MegatronGradScaler(ABC):
    """Scales the loss before backward so that small fp16 gradients do not flush to zero."""

    def __init__(self, initial_scale: float) -> None:
        if not initial_scale > 0.0:
            raise ConfigError(f"initial_scale must be > 0, got {initial_scale}", params=("initial_scale",))
        self._scale = float(initial_scale)

    @property
    def scale(self) -> float:
        """The current loss scale."""
        return self._scale

    @property
    def inv_scale(self) -> float:
        """1 / scale; exact because scales are powers of two in practice."""
        return 1.0 / self._scale

    @abstractmethod
    def update(self, found_inf: bool) -> None:
        """Advance the scaler after a step; ``found_inf`` is the group-wide overflow flag."""

    @abstractmethod
    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume the scaler exactly."""

    @abstractmethod
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned."""


class ConstantGradScaler(MegatronGradScaler):
    """A fixed loss scale (``--loss-scale X``). Overflowing steps are still skipped."""

    def update(self, found_inf: bool) -> None:
        pass

    def state_dict(self) -> dict[str, Any]:
        return {"scale": self._scale}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        # The flag wins over the checkpoint for a constant scale, as in Megatron.
        pass


class DynamicGradScaler(MegatronGradScaler):
    """Megatron's dynamic loss scale.

    On an overflowing step the growth tracker resets and the hysteresis tracker drops by one; once it
    reaches zero every further overflow multiplies the scale by ``backoff_factor`` (never below
    ``min_scale``). After ``growth_interval`` consecutive clean steps the scale is multiplied by
    ``growth_factor`` and the hysteresis tracker is refilled. Note that a clean step alone does not
    refill the hysteresis tracker: only a growth does.
    """

    def __init__(
        self,
        initial_scale: float,
        min_scale: float,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 1000,
        hysteresis: int = 2,
    ) -> None:
        super().__init__(initial_scale)
        if not 0.0 < min_scale <= initial_scale:
            raise ConfigError(
                f"min_scale must be in (0, initial_scale={initial_scale}], got {min_scale}",
                params=("min_scale", "initial_scale"),
            )
        if not growth_factor > 1.0:
            raise ConfigError(f"growth_factor must be > 1, got {growth_factor}", params=("growth_factor",))
        if not 0.0 < backoff_factor < 1.0:
            raise ConfigError(
                f"backoff_factor must be in (0, 1), got {backoff_factor}", params=("backoff_factor",)
            )
        if growth_interval <= 0:
            raise ConfigError(
                f"growth_interval must be > 0, got {growth_interval}", params=("growth_interval",)
            )
        if hysteresis <= 0:
            raise ConfigError(f"hysteresis must be > 0, got {hysteresis}", params=("hysteresis",))
        self.min_scale = float(min_scale)
        self.growth_factor = float(growth_factor)
        self.backoff_factor = float(backoff_factor)
        self.growth_interval = int(growth_interval)
        self.hysteresis = int(hysteresis)
        self._growth_tracker = 0
        self._hysteresis_tracker = self.hysteresis

    def update(self, found_inf: bool) -> None:
        if found_inf:
            self._growth_tracker = 0
            self._hysteresis_tracker -= 1
            if self._hysteresis_tracker <= 0:
                self._scale = max(self._scale * self.backoff_factor, self.min_scale)
        else:
            self._growth_tracker += 1
            if self._growth_tracker == self.growth_interval:
                self._growth_tracker = 0
                self._hysteresis_tracker = self.hysteresis
                self._scale = self._scale * self.growth_factor

    def state_dict(self) -> dict[str, Any]:
        return {
            "scale": self._scale,
            "growth_tracker": self._growth_tracker,
            "hysteresis_tracker": self._hysteresis_tracker,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._scale = float(state_dict["scale"])
        self._growth_tracker = int(state_dict["growth_tracker"])
        self._hysteresis_tracker = int(state_dict["hysteresis_tracker"])
