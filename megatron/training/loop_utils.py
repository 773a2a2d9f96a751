"""Small pieces of the training loop: printing, signals, the schedule, interval statistics."""

from __future__ import annotations

import math
import os
import resource
import signal
import sys
import time

import torch
import torch.distributed as dist

from megatron.core.num_microbatches_calculator import (
    NumMicroBatchesCalculator,
    build_num_microbatches_calculator,
)
from megatron.core.optimizer.clip_grads import params_l2_norm as core_params_l2_norm
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from megatron.training.checkpointing import find_arg
from megatron.training.metrics import LossSpikeWatch, format_iteration_line


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def is_last_rank() -> bool:
    return not dist.is_initialized() or dist.get_rank() == dist.get_world_size() - 1


def print_rank_0(msg: str) -> None:
    if _rank() == 0:
        print(msg, flush=True)


def print_rank_last(msg: str) -> None:
    if is_last_rank():
        print(msg, flush=True)


class DistributedSignalHandler:
    """Turns SIGTERM (or the ``--exit-signal``) and SIGINT into a request to finish the step, save and exit.

    ``received`` is the number of the first signal (0 before any); the loop max-reduces it over
    ranks. Further SIGTERMs are ignored: under SLURM a rank can get the same SIGTERM twice (from
    SLURM and forwarded by torchrun). Once a SIGINT is involved, the next signal aborts
    (KeyboardInterrupt): a second Ctrl-C, or torchrun's SIGTERM after a second Ctrl-C reached it.
    """

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self, signals: tuple[int, ...] = SIGNALS):
        self.received = 0
        self._previous = {s: signal.signal(s, self._handle) for s in signals}

    def _handle(self, signum: int, frame) -> None:
        if not self.received:
            self.received = signum
            _notice(
                f"received {signal_name(signum)}: finishing the step, saving and exiting"
                + (" (Ctrl-C again aborts)" if signum == signal.SIGINT else "")
            )
            return
        if signal.SIGINT in (signum, self.received):
            self.release()
            raise KeyboardInterrupt

    def release(self) -> None:
        """Restore the handlers that were installed before (idempotent)."""
        for s, previous in self._previous.items():
            signal.signal(s, previous)
        self._previous = {}


def signal_name(number: float) -> str:
    """``15`` -> ``SIGTERM``."""
    return signal.Signals(int(number)).name


def _notice(msg: str) -> None:
    """One line on rank 0's stderr from a signal handler: os.write, because the handler may run
    while the main thread is inside a buffered write to the same stream."""
    if _rank() != 0:
        return
    try:
        os.write(sys.stderr.fileno(), f"{msg}\n".encode())
    except (OSError, ValueError, AttributeError):  # stderr replaced (tests) or closed
        pass


def wrap_each_iterator(iterators, wrap):
    """The training iterators (one, or the per-model-chunk list whose entries may be None or the same
    iterator twice: virtual stages share the first and last stage's) with each distinct one wrapped
    once by ``wrap(iterator, index)``; the structure, Nones and sharing kept."""
    single = not isinstance(iterators, list)
    wrapped: dict[int, object] = {}
    out = []
    for it in [iterators] if single else iterators:
        if it is not None and id(it) not in wrapped:
            wrapped[id(it)] = wrap(it, len(wrapped))
        out.append(None if it is None else wrapped[id(it)])
    return out[0] if single else out


def build_scheduler(cfg, optimizer, train_iters: int) -> OptimizerParamScheduler:
    """LR / WD schedule with every length converted to samples, as Megatron does."""
    t, s, o = cfg.training, cfg.scheduler, cfg.optimizer
    gbs = t.global_batch_size
    if t.train_iters is not None:
        decay = (s.lr_decay_iters or t.train_iters) * gbs
        warmup = s.lr_warmup_iters * gbs
        wsd = (s.lr_wsd_decay_iters or 0) * gbs
        total = t.train_iters * gbs
    else:
        decay = s.lr_decay_samples or t.train_samples
        warmup = s.lr_warmup_samples
        wsd = s.lr_wsd_decay_samples or 0
        total = t.train_samples
    if s.lr_warmup_fraction is not None:
        warmup = int(s.lr_warmup_fraction * decay)
    wd = o.weight_decay
    return OptimizerParamScheduler(
        optimizer,
        init_lr=s.lr_warmup_init,
        max_lr=o.lr,
        min_lr=o.min_lr,
        lr_warmup_steps=warmup,
        lr_decay_steps=decay,
        lr_decay_style=s.lr_decay_style,
        start_wd=wd if s.start_weight_decay is None else s.start_weight_decay,
        end_wd=wd if s.end_weight_decay is None else s.end_weight_decay,
        wd_incr_steps=total,
        wd_incr_style=s.weight_decay_incr_style,
        use_checkpoint_opt_param_scheduler=s.use_checkpoint_opt_param_scheduler,
        override_opt_param_scheduler=s.override_opt_param_scheduler,
        wsd_decay_steps=wsd or None,
        lr_wsd_decay_style=s.lr_wsd_decay_style,
        decoupled_lr=o.decoupled_lr,
        decoupled_min_lr=o.decoupled_min_lr,
    )


def build_batch_calculator(cfg, dp_size: int, rank: int = 0, log=None) -> NumMicroBatchesCalculator:
    """The global batch size schedule of ``cfg`` (constant, --rampup-batch-size or
    --step-batch-size-schedule in tokens of --seq-length) for ``dp_size`` data-parallel ranks."""
    t = cfg.training
    return build_num_microbatches_calculator(
        rank,
        t.rampup_batch_size,
        t.global_batch_size,
        t.micro_batch_size,
        dp_size,
        step_batch_size_schedule=t.step_batch_size_schedule,
        seq_length=t.seq_length,
        log=log,
    )


def train_iters_of(cfg, batches: NumMicroBatchesCalculator) -> int:
    """--train-iters, or the steps of --train-samples under the batch schedule (Megatron's
    update_train_iters: a ramp's steps counted one by one, a last partial batch dropped)."""
    t = cfg.training
    return t.train_iters if t.train_iters is not None else batches.iterations_for_samples(t.train_samples)


def model_args_for_check(cfg, padded_vocab_size: int) -> dict:
    """Flags that fix the model's tensor shapes (or how its weights read), as {flag: value}; a checkpoint
    must agree on all."""
    m = cfg.model
    out = {
        "--num-layers": m.num_layers,
        "--hidden-size": m.hidden_size,
        "--num-attention-heads": m.num_attention_heads,
        "--num-query-groups": m.num_query_groups,
        "--kv-channels": m.kv_channels,
        "--ffn-hidden-size": m.ffn_hidden_size,
        "--normalization": m.normalization,
        "--swiglu": m.activation == "swiglu",
        "--disable-bias-linear": not m.add_bias_linear,
        "--qk-layernorm": m.qk_layernorm,
        "--apply-layernorm-1p": m.apply_layernorm_1p,  # same shapes, but stored norm weights read as w or 1 + w
        "--position-embedding-type": m.position_embedding_type,
        "--untie-embeddings-and-output-weights": not m.share_embeddings_and_output_weights,
        "--padded-vocab-size": padded_vocab_size,
    }
    if m.position_embedding_type == "learned_absolute":
        out["--max-position-embeddings"] = cfg.training.max_position_embeddings
    if getattr(m, "num_moe_experts", None):  # experts: their count, sizes and which layers hold them
        out["--num-experts"] = m.num_moe_experts
        out["--moe-ffn-hidden-size"] = m.moe_ffn_hidden_size or m.ffn_hidden_size
        out["--moe-shared-expert-intermediate-size"] = m.moe_shared_expert_intermediate_size
        out["--moe-layer-freq"] = m.moe_layer_freq
    return out


def gelu_change_note(saved_args, model) -> str | None:
    """A note when a biased GELU model resumes with another GELU than its checkpoint was trained with.

    ``saved_args`` is the checkpoint's ``args``; ``model`` this run's TransformerConfig. Checkpoints
    that do not record ``bias_gelu_fusion`` predate GELU following Megatron-LM and were trained with
    the exact GELU. (Not a refusal: the weights fit either function.)
    """
    if model.activation != "gelu" or not model.add_bias_linear:
        return None
    found, fusion = find_arg(saved_args, "bias_gelu_fusion")
    saved = "tanh" if found and fusion else "none"
    if saved == model.gelu_approximation:
        return None
    names = {"tanh": "Megatron-LM's tanh approximation of GELU", "none": "the exact (erf) GELU"}
    fix = "drop --no-bias-gelu-fusion" if saved == "tanh" else "pass --no-bias-gelu-fusion"
    return (
        f"note: the checkpoint was trained with {names[saved]}{'' if found else ' (it predates the flag)'}; "
        f"this run computes {names[model.gelu_approximation]}. To keep the checkpoint's, {fix}"
    )


def params_l2_norm(model_chunks: list, parallel_state, device: torch.device) -> float:
    """The L2 norm of the whole model's parameters (``--log-params-norm``), the same under every
    layout (``megatron.core.optimizer.clip_grads.params_l2_norm``: tensor-parallel shards, pipeline
    stages and expert shards summed, replicated and tied copies counted once). Every rank calls it."""
    return core_params_l2_norm(model_chunks, parallel_state, device)


def average_losses(steps: list[tuple]) -> tuple[dict[str, float], int, int]:
    """(mean loss by name, skipped steps, nan steps) of one log line's steps, each ``({name: (sum,
    count)}, update_successful)``.

    A step is a nan iteration when any of its losses is NaN or Inf, skipped (fp16 overflow) or not:
    with --no-check-for-nan-in-loss-and-grad such a step is taken. A third entry True marks a step
    rejected for a NaN/Inf gradient (its losses finite) as one too. The mean is over the taken steps
    with finite losses, so that a NaN never hides in it; a name whose every taken step was non-finite
    shows NaN."""
    sums: dict[str, float] = {}
    taken = skipped = nan = 0
    names: dict[str, None] = {}  # every loss name of a taken step, in order
    for losses, success, *marked in steps:
        values = {k: v[0] / max(v[1], 1.0) for k, v in losses.items()}
        finite = all(math.isfinite(v) for v in values.values())
        nan += not finite or bool(marked and marked[0])
        if not success:
            skipped += 1
            continue
        names.update(dict.fromkeys(values))
        if finite:
            taken += 1
            for k, v in values.items():
                sums[k] = sums.get(k, 0.0) + v
    avg = {k: sums[k] / taken if k in sums else math.nan for k in names}
    return avg, skipped, nan


class IntervalLog:
    """Collects per-step results (host numbers) between log lines, then prints one line. The time per
    iteration is the time between the device finishing the last step of the previous line and the
    last step of this one, over the steps in between.

    On a GPU that time comes from the steps' CUDA events (the device's clock): the host runs ahead of
    the device and can be held back inside a later step's launch (a full launch queue), so the host
    time at which a step is read lags its end by a varying amount, which would shift time from one
    step's figure to the next (the last step of a run looked twice as fast as it was)."""

    def __init__(self, trainer):
        self.trainer = trainer
        self.t0 = time.perf_counter()
        self.event0 = None  # the CUDA event of the previous line's last step
        self.event = None
        self.decoupled_lr = None  # the --decoupled-lr groups' learning rate after the last step
        self.spikes = LossSpikeWatch()
        self._reset()

    def _reset(self) -> None:
        self.steps: list = []
        self.batches: list[tuple[int, float]] = []  # (global batch size, model FLOPs) of each step
        self.grad_norm: float | None = None
        self.num_zeros: float | None = None
        self.moe: dict[str, float] = {}

    def record(
        self,
        losses: dict,
        success: bool,
        grad_norm,
        lr: float,
        loss_scale: float,
        done: float,
        num_zeros: float | None = None,
        event=None,
        global_batch_size: int | None = None,
        flops: float | None = None,
        decoupled_lr: float | None = None,
        moe: dict[str, float] | None = None,
        non_finite: bool = False,
    ) -> None:
        """One step's results: ``losses`` {name: (sum, count)}, the learning rate and loss scale that
        the step left behind, ``done`` (the ``perf_counter()`` time the step was seen finished), with
        ``--log-num-zeros-in-grad`` the number of zero gradient elements, and on a GPU the timing
        event recorded at the step's end. ``global_batch_size`` and ``flops`` are the step's (default
        the trainer's constant ones); ``decoupled_lr`` the --decoupled-lr groups' learning rate;
        ``moe`` the MoE losses and routing statistics since the last line (``moe_metrics``)."""
        self.steps.append((losses, success, non_finite))
        tr = self.trainer
        self.batches.append(
            (
                tr.global_batch_size if global_batch_size is None else global_batch_size,
                tr.flops_per_step if flops is None else flops,
            )
        )
        self.lr, self.loss_scale, self.done, self.event = lr, loss_scale, done, event
        self.decoupled_lr = decoupled_lr
        if grad_norm is not None:
            self.grad_norm = grad_norm
        if num_zeros is not None:
            self.num_zeros = num_zeros
        if moe:
            self.moe = moe

    def flush(self) -> None:
        """Print the log line of the steps recorded since the last one and write the same record to
        the metrics writer (and, with --timing-log-level, the timer block; every rank calls it)."""
        tr = self.trainer
        n = len(self.steps)
        if self.event0 is not None and self.event is not None:
            elapsed = self.event0.elapsed_time(self.event) / 1000.0 / max(n, 1)
        else:  # the first line (from start-up, a host interval) or no device events (CPU)
            elapsed = (self.done - self.t0) / max(n, 1)
        self.t0, self.event0 = self.done, self.event
        avg, skipped, nan = average_losses(self.steps)
        for line in self.spikes.check(tr.state.iteration - n + 1, tr.state.iteration, avg):
            print_rank_last(line)
        record = self._record(elapsed, avg, skipped, nan)
        timers = getattr(tr, "timers", None)
        block, timer_scalars = timers.report(tr.state.iteration, n) if timers is not None else (None, {})
        if getattr(tr.cfg.logger, "log_timers_to_tensorboard", False):
            record.update(timer_scalars)
        print_rank_last(format_iteration_line(tr.state.iteration, tr.train_iters, record))
        if block is not None:
            print_rank_last(block)
        tr.writer.log_scalars(record, tr.state.iteration, tr.state.consumed_train_samples)
        self._reset()

    def _record(self, elapsed: float, avg: dict, skipped: int, nan: int) -> dict:
        """The one set of values of a log line, by the names TensorBoard shows them under; the line,
        the metrics file, TensorBoard and W&B all get it (a value that does not exist is left out)."""
        tr = self.trainer
        n = len(self.batches)
        # Per step on average: with a batch-size ramp the steps of one line differ.
        flops = sum(f for _, f in self.batches) / max(n, 1)
        samples = sum(b for b, _ in self.batches) / max(n, 1)
        tflops = flops / (elapsed * 1e12 * tr.world_size)
        consumed = tr.state.consumed_train_samples
        values = {
            "consumed-samples": consumed,
            "iteration-time": elapsed,
            "throughput": tflops,
            "tokens-per-sec-per-gpu": samples * tr.cfg.training.seq_length / elapsed / tr.world_size,
            "mfu": (tflops / tr.peak_tflops) if tr.peak_tflops else None,
            "learning-rate": self.lr,
            "decoupled-learning-rate": self.decoupled_lr,  # --decoupled-lr, on stages that hold those params
            "batch-size": self.batches[-1][0] if self.batches else tr.global_batch_size,  # the last step's
            **avg,
            **self.moe,
            "loss-scale": self.loss_scale,
            "grad-norm": self.grad_norm,
            "num-zeros": self.num_zeros,
            "params-norm": (
                params_l2_norm(tr.model, tr.pg, tr.device) if tr.cfg.logger.log_params_norm else None
            ),
            "skipped-iterations": skipped,
            "nan-iterations": nan,
            "consumed-tokens": consumed * tr.cfg.training.seq_length,
            **memory_scalars(tr.device),
            "world-size": tr.world_size
            if getattr(tr.cfg.logger, "log_world_size_to_tensorboard", False)
            else None,
        }
        return {k: v for k, v in values.items() if v is not None}


def memory_scalars(device: torch.device) -> dict[str, int]:
    """The allocator's figures of ``device`` (a GPU) and this process's peak resident host memory."""
    out = {}
    if device.type == "cuda":
        out["mem-allocated-bytes"] = torch.cuda.memory_allocated(device)
        out["mem-max-allocated-bytes"] = torch.cuda.max_memory_allocated(device)
        out["mem-max-reserved-bytes"] = torch.cuda.max_memory_reserved(device)
    out["mem-host-max-rss-bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    return out


class InFlightStep:
    """A queued step's loss sums and scalars (grad norm, zero count, exit flags) on their way to the
    host: one non-blocking copy into pinned memory and an event, so reading them waits for this step
    only, not for the steps queued after it.

    ``scalars`` maps names to 0-dim device tensors, host numbers or None (absent); ``flags`` is the
    ``[signal number, time is up]`` tensor or None; ``lr`` and ``loss_scale`` are what the step left behind.
    """

    def __init__(
        self,
        iteration: int,
        losses: dict,
        success: bool,
        scalars: dict,
        flags,
        device: torch.device,
        lr: float,
        loss_scale: float,
    ):
        self.iteration, self.success = iteration, success
        self.lr, self.loss_scale = lr, loss_scale
        self.keys = list(losses)
        parts = [losses[k].float().view(-1) for k in self.keys]
        self.host = {k: v for k, v in scalars.items() if not torch.is_tensor(v)}
        self.queued = [k for k, v in scalars.items() if torch.is_tensor(v)]
        parts += [scalars[k].float().view(1) for k in self.queued]
        self.has_flags = flags is not None
        if flags is not None:
            parts.append(flags.float().view(-1))
        vec = torch.cat(parts) if parts else torch.zeros(0, device=device)
        self.event = None
        self.done: float | None = None  # perf_counter() when the step had finished on the device
        if device.type == "cuda":
            self.values = torch.empty(vec.shape, dtype=vec.dtype, pin_memory=True)
            self.values.copy_(vec, non_blocking=True)
            self.event = torch.cuda.Event(enable_timing=True)  # IntervalLog times steps by it
            self.event.record()
        else:
            self.values = vec
            self.done = time.perf_counter()  # CPU ops ran synchronously

    def read(self) -> tuple[dict, dict, list[float] | None]:
        """(losses {name: (sum, count)}, scalars {name: number or None}, exit flags); waits for this step."""
        if self.event is not None:
            self.event.synchronize()
            self.done = time.perf_counter()
        values = self.values.tolist()
        losses = {k: (values[2 * i], values[2 * i + 1]) for i, k in enumerate(self.keys)}
        pos = 2 * len(self.keys)
        scalars = dict(self.host)
        for k in self.queued:
            scalars[k] = values[pos]
            pos += 1
        flags = values[pos : pos + 2] if self.has_flags else None
        return losses, scalars, flags
