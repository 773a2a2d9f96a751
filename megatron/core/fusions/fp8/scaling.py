"""FP8 scaling, the one definition every GEMM path uses: the scale from an amax, the quantisation,
delayed scaling's history (which amax a scale is read from, and how a new amax enters), and the
scaled GEMM.

``scale = fp8_max / amax``, so the largest value maps to the top of the format:
  * ``tensorwise``: the amax of the tensor being quantised (exact, one reduction per tensor, no state);
  * ``delayed``: the amax from a per-tensor history of the previous calls (``max`` over it or the
    ``most_recent`` entry); the first call, before the history has an entry, uses the current amax.
    Values above the delayed scale saturate at fp8_max.
"""

from __future__ import annotations

import torch


def scale_from_amax(amax: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """fp32 quantisation scale ``fp8_max / amax``; 1 where amax is 0 or not finite."""
    amax = amax.float()
    scale = torch.finfo(dtype).max / amax.clamp(min=1e-12)
    return torch.where(torch.isfinite(amax) & (amax > 0), scale, torch.ones_like(scale))


def quantize(t: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t * scale`` saturated to the format's range and cast to ``dtype`` (computed in fp32)."""
    fmax = torch.finfo(dtype).max
    return (t.float() * scale).clamp(-fmax, fmax).to(dtype)


def current_amax(t: torch.Tensor) -> torch.Tensor:
    """``max |t|`` in fp32 by the torch ops (inside compiled layers Inductor fuses it with t's producer)."""
    return t.detach().abs().amax().float()


def history_amax(row: torch.Tensor, algo: str) -> torch.Tensor:
    """The amax delayed scaling reads from one history row: its max or its most recent entry."""
    return row.amax() if algo == "max" else row[0]


def delayed_scale(
    past: torch.Tensor, initialized: torch.Tensor | None, cur: torch.Tensor | None, dtype: torch.dtype
) -> torch.Tensor:
    """Delayed scaling's scale: from ``past`` (:func:`history_amax`), or, while the row has no entry
    yet (``initialized`` False, a device-side choice without host sync), from the current amax ``cur``.
    ``initialized`` None: the history is known (on the host) to have entries; ``cur`` is not needed."""
    if initialized is None:
        return scale_from_amax(past, dtype)
    assert cur is not None
    return scale_from_amax(torch.where(initialized, past, cur), dtype)


def push_amaxes(history: torch.Tensor, initialized: torch.Tensor, amaxes: torch.Tensor) -> None:
    """``amaxes[r]`` as the most recent entry of every history row ``r`` (the oldest falls out) at
    once: two kernels, no host sync."""
    history.copy_(torch.cat((amaxes.reshape(-1, 1).to(history.dtype), history[:, :-1]), dim=1))
    initialized.fill_(True)  # not ``= True``: on a GPU that copies a host tensor and waits for the stream


def scaled_mm(
    a: torch.Tensor,
    b: torch.Tensor,
    a_inv: torch.Tensor,
    b_inv: torch.Tensor,
    out_dtype: torch.dtype,
    use_scaled_mm: bool = True,
    fast_accum: bool = False,
) -> torch.Tensor:
    """``(a * a_inv) @ (b * b_inv)`` for fp8 ``a [M, K]`` (row-major) and ``b [K, N]`` (column-major).

    ``a_inv`` / ``b_inv`` are the fp32 dequantisation scales (1 / quantisation scale). ``use_scaled_mm``
    False: the dequantised fp8 values multiplied in fp32 (the reference, and FP8 emulated on the
    CPU). ``fast_accum``: Hopper's FP8 tensor cores accumulate without promoting partial sums to fp32
    every few K-blocks, as Transformer Engine and torchao do for the forward GEMM (the gradients'
    GEMMs promote); the reference path ignores it.
    """
    if use_scaled_mm:
        return torch._scaled_mm(
            a, b, scale_a=a_inv, scale_b=b_inv, out_dtype=out_dtype, use_fast_accum=fast_accum
        )
    return ((a.float() * a_inv) @ (b.float() * b_inv)).to(out_dtype)
