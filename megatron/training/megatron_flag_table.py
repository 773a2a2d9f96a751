"""Megatron-LM 0.19.2's training flags that are not fields of our configs, flag by flag.

See ``megatron_flags`` for the four classes; the reasons are in ``megatron_flag_reasons``, each
shared by the flags it covers. In a flag list ``--flag=1`` marks a flag that takes one value
(``=+``, ``=*``, ``=?``, ``=N`` as argparse's nargs), a bare flag is a switch. The arities are Megatron-LM 0.19.2's, read from its
parser, so that a script's values are consumed exactly as Megatron-LM would consume them.
"""

from __future__ import annotations

import textwrap

from megatron.training import megatron_flag_reasons as why
from megatron.training.megatron_flag_refused import REFUSED_ROWS
from megatron.training.megatron_flags import ALWAYS, NO_EFFECT, REFUSED, ForeignFlag, entries, index

_TABLE: list[ForeignFlag] = [
    *entries(ALWAYS, why.MCORE, "--use-mcore-models"),
    *entries(ALWAYS, why.FLASH, "--use-flash-attn --flash-attention-version=1"),
    *entries(ALWAYS, why.SOFTMAX32, "--attention-softmax-in-fp32 --apply-query-key-layer-scaling"),
    *entries(
        ALWAYS,
        why.FUSED,
        """
        --no-masked-softmax-fusion --no-bias-dropout-fusion --no-bias-swiglu-fusion --no-rope-fusion
        --disable-jit-fuser --no-persist-layer-norm --no-gradient-reduce-div-fusion --fused-residual-rmsnorm
    """,
    ),
    *entries(ALWAYS, why.WGRAD_ACC, "--no-gradient-accumulation-fusion"),
    *entries(
        ALWAYS,
        why.FP32_GRADS,
        """
        --accumulate-allreduce-grads-in-fp32 --ddp-reduce-scatter-with-fp32-accumulation
        --ddp-param-name-patterns-for-fp32-local-accumulation=+
    """,
    ),
    *entries(ALWAYS, why.MEM_TB, "--log-memory-to-tensorboard"),
    *entries(ALWAYS, why.PPL_TB, "--log-validation-ppl-to-tensorboard"),
    *entries(ALWAYS, why.LOCAL_RANK, "--local-rank=1"),
    *entries(ALWAYS, why.DIST_CKPT, "--use-dist-ckpt --dist-ckpt-format=1"),
    *entries(ALWAYS, why.AUTO_FORMAT, "--auto-detect-ckpt-format"),
    *entries(ALWAYS, why.LOADER_SIGNALS, "--exit-signal-handler-for-dataloader"),
    *entries(ALWAYS, why.RESHARD, "--dist-ckpt-optim-fully-reshardable"),
    *entries(ALWAYS, why.MAIN_PARAMS, "--load-main-params-from-ckpt"),
    *entries(ALWAYS, why.NO_MSC, "--disable-msc"),
    *entries(ALWAYS, why.NO_GLOO, "--disable-gloo-process-groups"),
    *entries(
        ALWAYS,
        why.NO_TOK_CKPT,
        """
        --no-use-tokenizer-model-from-checkpoint-args --disable-use-tokenizer-model-from-checkpoint-args
    """,
    ),
    *entries(
        ALWAYS,
        why.TOKENS_READY,
        """
        --tokenizer-hf-no-use-fast --tokenizer-hf-no-include-special-tokens --tokenizer-sentencepiece-legacy
        --no-tokenizer-sentencepiece-ignore-extra-whitespaces
        --disable-tokenizer-sentencepiece-ignore-extra-whitespaces --trust-remote-code --chat-template=1
        --tokenizer-metadata=1
    """,
    ),
    *entries(
        NO_EFFECT,
        why.GC,
        """
        --manual-gc --manual-gc-interval=1 --no-manual-gc-eval --disable-manual-gc-eval
    """,
    ),
    *entries(NO_EFFECT, why.EMPTY_CACHE, "--empty-unused-memory-level=1"),
    *entries(
        NO_EFFECT,
        why.CKPT_PARALLEL,
        """
        --ckpt-fully-parallel-save --no-ckpt-fully-parallel-save --ckpt-fully-parallel-load
        --ckpt-fully-parallel-load-exchange-algo=1 --ckpt-fully-parallel-load-process-group=1
        --ckpt-fully-parallel-save-process-group=1 --ckpt-assume-constant-structure --dist-ckpt-workers=1
        --distrib-optim-fully-reshardable-mem-efficient --disable-ckpt-load-validate-sharding-integrity
        --no-ckpt-load-validate-sharding-integrity --dist-ckpt-save-pre-mcore-014 --no-stream-ckpt-dequant
        --disable-stream-ckpt-dequant
    """,
    ),
    *entries(NO_EFFECT, why.STRICT_LOAD, "--dist-ckpt-strictness=1"),
    *entries(NO_EFFECT, why.LOGLEVEL, "--logging-level=1"),
    *entries(
        NO_EFFECT,
        why.TIMERS,
        """
        --no-barrier-with-level-1-timing
    """,
    ),
    *entries(NO_EFFECT, why.TB_INTERVAL, "--tensorboard-log-interval=1 --tensorboard-queue-size=1"),
    *entries(
        NO_EFFECT,
        why.CUDA_GRAPHS,
        """
        --cuda-graph-impl=1 --cuda-graph-modules=+ --cuda-graph-scope=+ --cuda-graph-warmup-steps=1
        --enable-cuda-graph --external-cuda-graph --optimizer-cuda-graph --te-rng-tracker
        --delay-offload-until-cuda-graph
    """,
    ),
    *entries(
        NO_EFFECT,
        why.TE_KNOB,
        """
        --use-te-activation-func --use-transformer-engine-op-fuser --keep-fp8-transpose-cache
        --fp8-interval=1 --tp-comm-bootstrap-backend=1 --cross-entropy-fusion-impl=1
        --use-grouped-gemm-for-dense-mlp
    """,
    ),
    *entries(
        NO_EFFECT,
        why.TP_OVERLAP,
        """
        --tp-comm-overlap --tp-comm-overlap-cfg=1 --tp-comm-overlap-rs-dgrad --disable-tp-comm-bulk-dgrad
        --disable-tp-comm-bulk-wgrad --disable-tp-comm-overlap-ag --disable-tp-comm-overlap-rs
        --disable-tp-comm-split-ag --disable-tp-comm-split-rs --no-tp-comm-bulk-dgrad
        --no-tp-comm-bulk-wgrad --no-tp-comm-overlap-ag --no-tp-comm-overlap-rs --no-tp-comm-split-ag
        --no-tp-comm-split-rs
    """,
    ),
    *entries(NO_EFFECT, why.FP8_PARAMS, "--fp8-param-gather --reuse-grad-buf-for-mxfp8-param-ag"),
    *entries(
        NO_EFFECT,
        why.DDP_KNOB,
        """
        --ddp-num-buckets=1 --ddp-pad-buckets-for-high-nccl-busbw --no-align-grad-reduce
        --disable-align-grad-reduce --no-align-param-gather --overlap-param-gather-with-optimizer-step
        --create-all-gather-group --suggested-communication-unit-size=1
    """,
    ),
    *entries(
        NO_EFFECT,
        why.PP_KNOB,
        """
        --overlap-p2p-communication-warmup-flush --use-ring-exchange-p2p
        --pipeline-model-parallel-comm-backend=1
    """,
    ),
    *entries(
        NO_EFFECT,
        why.WGRAD_DEFER,
        """
        --defer-embedding-wgrad-compute --wgrad-deferral-limit=1 --delay-wgrad-compute
    """,
    ),
    *entries(
        NO_EFFECT,
        why.NCCL,
        """
        --nccl-communicator-config-path=1 --use-sharp --sharp-enabled-group=1
        --high-priority-stream-groups=+ --use-nccl-ub --symmetric-ar-type=1 --disable-symmetric-registration
    """,
    ),
    *entries(
        NO_EFFECT,
        why.FLIGHT,
        """
        --disable-flight-recorder-extra-dump-on-exec
        --disable-flight-recorder-include-only-active --flight-recorder-dump-path=1
        --flight-recorder-include-stack-trace --flight-recorder-trace-buffer-size=1
        --no-flight-recorder-extra-dump-on-exec
        --no-flight-recorder-include-only-active
    """,
    ),
    *entries(
        NO_EFFECT,
        why.OFFLOAD,
        """
        --cpu-offloading-num-layers=1 --cpu-offloading-retain-pinned-cpu-buffers
        --fine-grained-activation-offloading --offload-modules=+ --activation-offload-fraction=1
        --min-offloaded-tensor-size=1 --fine-grained-offloading-max-inflight-offloads=1
        --delta-offload-bytes-across-pp-ranks=1 --distribute-saved-activations
    """,
    ),
    *entries(
        NO_EFFECT,
        why.ASYNC_KNOB,
        """
        --async-strategy=1 --async-ckpt-cpu-priority=1 --async-ckpt-io-priority=1 --async-ckpt-use-cpu-shm
        --use-persistent-ckpt-worker
    """,
    ),
    *entries(
        NO_EFFECT,
        why.LOCAL_CKPT_KNOB,
        """
        --non-persistent-ckpt-type=1 --non-persistent-global-ckpt-dir=1 --non-persistent-local-ckpt-algo=1
        --non-persistent-local-ckpt-dir=1 --replication --replication-factor=1 --replication-jump=1
    """,
    ),
    *entries(
        NO_EFFECT,
        why.FSDP_KNOB,
        """
        --fsdp-double-buffer --fsdp-db-use-persist-buf-on-alloc-fail
        --fsdp-manual-registration --enable-full-sharding-in-hsdp --outer-dp-sharding-strategy=1
        --disable-strict-fsdp-dtensor-load --no-strict-fsdp-dtensor-load --no-use-layer-wise-param-layout
        --megatron-fsdp-enable-fine-grained-param-gather --megatron-fsdp-grad-comm-dtype=1
        --megatron-fsdp-main-grads-dtype=1 --megatron-fsdp-main-params-dtype=1
        --megatron-fsdp-max-pool-double-buffer
    """,
    ),
    *entries(
        NO_EFFECT,
        why.DATA_KNOB,
        """
        --num-dataset-builder-threads=1 --dataloader-fast-cache-load --dataloader-defer-npy-index-mmap
        --per-dataset-sequences-path=1 --object-storage-cache-path=1
    """,
    ),
    *entries(NO_EFFECT, why.PAD_TOKENS, "--allow-ambiguous-pad-tokens --null-tokenizer-pad-id=1"),
    *entries(NO_EFFECT, why.INIT, "--no-initialization"),
    *entries(NO_EFFECT, why.SYNC, "--train-sync-interval=1"),
    *entries(NO_EFFECT, why.SIGNAL_SHUTDOWN, "--exit-signal-handler-for-training"),
    *entries(
        NO_EFFECT,
        why.CLONE,
        """
        --no-clone-scatter-output-in-embedding --disable-clone-scatter-output-in-embedding
    """,
    ),
    *entries(
        NO_EFFECT,
        why.TELEMETRY,
        """
        --one-logger-async --one-logger-project=1 --one-logger-run-name=1 --no-one-logger
        --app-tag-run-name=1 --app-tag-run-version=1
    """,
    ),
    *entries(
        NO_EFFECT,
        why.FT,
        """
        --enable-ft-package --calc-ft-timeouts --ft-num-warmup-iters=1 --adlr-autoresume
        --adlr-autoresume-interval=1
    """,
    ),
    *entries(
        NO_EFFECT,
        why.INPROCESS_KNOB,
        """
        --inprocess-active-world-size=1 --inprocess-barrier-timeout=1 --inprocess-completion-timeout=1
        --inprocess-empty-cuda-cache --inprocess-granularity=1 --inprocess-hard-timeout=1
        --inprocess-heartbeat-interval=1 --inprocess-heartbeat-timeout=1 --inprocess-last-call-wait=1
        --inprocess-max-iterations=1 --inprocess-monitor-process-interval=1
        --inprocess-monitor-thread-interval=1 --inprocess-progress-watchdog-interval=1
        --inprocess-soft-timeout=1 --inprocess-termination-grace-time=1
    """,
    ),
    *entries(
        NO_EFFECT,
        why.STRAGGLER,
        """
        --disable-straggler-on-startup --straggler-ctrlr-port=1 --straggler-minmax-count=1
        --gpu-sniff-test-interval=1 --run-workload-inspector-server
    """,
    ),
    *entries(NO_EFFECT, why.NVTX, "--nvtx-ranges --record-shapes"),
    *entries(NO_EFFECT, why.CONFIG_DUMP, "--config-logger-dir=1"),
    *entries(NO_EFFECT, why.EXPERIMENTAL, "--enable-experimental"),
    *entries(NO_EFFECT, why.ONNX, "--onnx-safe=1"),
    *entries(NO_EFFECT, why.EXPERT_SHARDS, "--expert-tensor-parallel-num-weight-shards=1"),
    *entries(
        NO_EFFECT,
        why.MOE_OVERLAP,
        """
        --overlap-moe-expert-parallel-comm --ep-overlap-early-attn-memory-release
        --overlap-dispatch-backward-with-experts-wgrad --high-priority-a2a-comm-stream
        --use-grouped-gemm-for-shared-expert
    """,
    ),
    *entries(NO_EFFECT, why.MOE_FUSION, "--moe-router-fusion --moe-permute-fusion"),
    *entries(NO_EFFECT, why.ENERGY, "--log-energy --log-device-memory-used --log-memory-interval=1"),
    *entries(
        NO_EFFECT,
        why.INFERENCE,
        """
        --inference-batch-times-seqlen-threshold=1 --inference-coordinator-port=1
        --inference-cuda-graph-all-prefills --inference-cuda-graph-max-tokens=1
        --inference-cuda-graph-scope=1 --inference-disable-ep-consensus
        --inference-disable-triton-nvls-kernels --inference-dynamic-batching
        --inference-dynamic-batching-async-sched-mode=1 --inference-dynamic-batching-block-size=1
        --inference-dynamic-batching-buffer-size-gb=1
        --inference-dynamic-batching-cuda-graph-mixed-prefill-count=1
        --inference-dynamic-batching-cuda-graph-sizing-distribution=1
        --inference-dynamic-batching-logprobs-mode=1 --inference-dynamic-batching-mamba-memory-ratio=1
        --inference-dynamic-batching-max-requests=1 --inference-dynamic-batching-max-tokens=1
        --inference-dynamic-batching-num-cuda-graphs=1 --inference-dynamic-batching-paused-buffer-size-gb=1
        --inference-dynamic-batching-prefix-caching
        --inference-dynamic-batching-prefix-caching-coordinator-policy=1
        --inference-dynamic-batching-prefix-caching-eviction-policy=1
        --inference-dynamic-batching-prefix-caching-mamba-gb=1
        --inference-dynamic-batching-prefix-caching-routing-alpha=1
        --inference-dynamic-batching-sampling-backend=1
        --inference-dynamic-batching-track-generated-token-events
        --inference-dynamic-batching-track-paused-request-events
        --inference-dynamic-batching-unified-memory-level=1 --inference-fuse-tp-communication
        --inference-grouped-gemm-backend=1 --inference-logging-step-interval=1 --inference-max-requests=1
        --inference-max-seq-length=1 --inference-moe-disable-fused-quant-kernels
        --inference-moe-token-dispatcher-type=1 --inference-rng-tracker --inference-shards=1
        --inference-text-gen-server-logging --inference-use-synchronous-zmq-collectives
        --inference-wandb-logging --no-inference-disable-ep-consensus
        --no-inference-dynamic-batching-prefix-caching --no-inference-text-gen-server-logging
        --no-inference-use-synchronous-zmq-collectives --no-inference-wandb-logging --flash-decode
        --enable-chunked-prefill --num-speculative-tokens=1 --mlp-chunks-for-prefill=1
        --nccl-all-reduce-for-prefill --max-tokens-to-oom=1 --decode-only-cuda-graphs
        --use-legacy-static-engine --cache-mla-latents --moe-pad-experts-for-cuda-graph-inference
        --mamba-inference-conv-states-dtype=1 --mamba-inference-ssm-states-dtype=1
        --use-same-sampling-seed-across-dp-ranks
    """,
    ),
    *entries(
        NO_EFFECT,
        why.RL,
        """
        --no-rl-inference-logprobs-is-correction --no-rl-offload-inference-model-weights-when-idle
        --no-rl-partial-rollouts --no-rl-persist-cuda-graphs --no-rl-skip-bos-token
        --no-rl-training-cuda-graphs --no-rl-use-sequence-packing --no-rl-verify-model-weights-swap
        --rl-consumption-granularity=1 --rl-default-temperature=1 --rl-default-top-k=1 --rl-default-top-p=1
        --rl-generation-lag=1 --rl-importance-sampling-truncation-coef=1
        --rl-inference-expert-model-parallel-size=1 --rl-inference-expert-tensor-model-parallel-size=1
        --rl-inference-logprobs-is-correction --rl-inference-model-unified-memory-level=1
        --rl-inference-parsers=* --rl-inference-pipeline-model-parallel-size=1
        --rl-inference-tensor-model-parallel-size=1 --rl-kv-cache-management-mode=1
        --rl-offload-inference-model-weights-when-idle --rl-offload-optimizer-during-inference
        --rl-partial-rollouts --rl-persist-cuda-graphs --rl-profile --rl-profile-dir=1
        --rl-prompts-per-eval=1 --rl-sequence-packing-algo=1 --rl-sequence-packing-max-sequences-per-bin=1
        --rl-skip-bos-token --rl-submission-granularity=1 --rl-training-cuda-graphs
        --rl-use-sequence-packing --rl-verify-model-weights-swap --grpo-clamp-eps-lower=1
        --grpo-clamp-eps-upper=1 --grpo-entropy-term-weight=1 --grpo-filter-groups-with-same-reward
        --grpo-group-size=1 --grpo-iterations=1 --grpo-kl-beta=1 --grpo-prompts-per-step=1
        --langrl-env-config=1 --refit-method=1
    """,
    ),
    *entries(
        NO_EFFECT,
        why.BERT_T5,
        """
        --mask-prob=1 --short-seq-prob=1 --bert-embedder-type=1 --bert-load=1 --bert-no-binary-head
        --biencoder-projection-dim=1 --biencoder-shared-query-context-model --ict-head-size=1 --ict-load=1
        --retriever-report-topk-accuracies=+ --retriever-score-scaling --block-data-path=1
        --embedding-path=1 --evidence-data-path=1 --titles-data-path=1 --indexer-batch-size=1
        --indexer-log-interval=1 --query-in-block-prob=1 --use-one-sent-docs --output-bert-embeddings
        --encoder-num-layers=1 --encoder-seq-length=1 --decoder-num-layers=1 --decoder-seq-length=1
        --vocab-extra-ids=1 --relative-attention-num-buckets=1 --relative-attention-max-distance=1
    """,
    ),
    *entries(
        NO_EFFECT,
        why.VISION,
        """
        --dino-bottleneck-size=1 --dino-freeze-last-layer=1 --dino-head-hidden-size=1
        --dino-local-crops-number=1 --dino-local-img-size=1 --dino-norm-last-layer --dino-teacher-temp=1
        --dino-warmup-teacher-temp=1 --dino-warmup-teacher-temp-epochs=1 --img-h=1 --img-w=1 --patch-dim=1
        --num-channels=1 --num-classes=1 --classes-fraction=1 --data-per-class-fraction=1 --mask-type=1
        --mask-factor=1 --swin-backbone-type=1 --vision-backbone-type=1 --vision-pretraining
        --vision-pretraining-type=1 --iter-per-epoch=1 --no-data-sharding --head-lr-mult=1
    """,
    ),
    *entries(
        NO_EFFECT,
        why.OTHER_OPT,
        """
        --muon-coefficient-type=1 --muon-extra-scale-factor=1 --muon-fp32-matmul-prec=1 --muon-momentum=1
        --muon-nesterov --muon-no-split-qkv --muon-num-ns-steps=1 --muon-scalar-optimizer=1
        --muon-scale-mode=1 --muon-tp-mode=1 --lion-beta1=1 --lion-beta2=1
    """,
    ),
    *entries(
        NO_EFFECT,
        why.MAMBA_KNOB,
        """
        --mamba-head-dim=1 --mamba-num-groups=1 --mamba-num-heads=1 --mamba-state-dim=1
        --mamba-training-ssm-states-dtype=1 --disable-mamba-mem-eff-path
    """,
    ),
    *entries(NO_EFFECT, why.MSC_KNOB, "--enable-msc"),
    *REFUSED_ROWS,
]

FOREIGN: dict[str, ForeignFlag] = index(_TABLE)

# Families refused as a whole, for flags of newer Megatron-LM releases that the table does not list.
_REFUSED_PREFIXES = {"--moe-": why.MOE}


def refusal_for_unlisted(flag: str) -> str | None:
    """What to use instead of a flag of a family refused as a whole (``--moe-*``), else None."""
    return next((why for prefix, why in _REFUSED_PREFIXES.items() if flag.startswith(prefix)), None)


def describe() -> str:
    """The table as text for ``--help-megatron``: each class, its reasons and their flags."""
    titles = {
        ALWAYS: "Accepted: they ask for what this package always does",
        NO_EFFECT: "Accepted with a note: no effect here",
        REFUSED: "Refused, with what to use instead",
    }
    lines = ["Megatron-LM flags that are not implemented as such (the implemented ones are in --help):"]
    for kind, title in titles.items():
        lines += ["", f"{title}:"]
        by_reason: dict[str, list[str]] = {}
        for e in FOREIGN.values():
            if e.kind == kind:
                by_reason.setdefault(e.why, []).append(
                    e.flag + (f" (at {', '.join(e.accepted)})" if e.accepted else "")
                )
        for reason, flags in by_reason.items():
            lines += textwrap.wrap(
                " ".join(flags), 100, initial_indent="  ", subsequent_indent="  ", break_on_hyphens=False
            )
            lines += textwrap.wrap(reason, 100, initial_indent="      ", subsequent_indent="      ")
    return "\n".join(lines)
