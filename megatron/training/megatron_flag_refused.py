"""The rows of ``megatron_flag_table`` that refuse a Megatron-LM flag (with what to use instead),
and the flags accepted only at the values that ask for what this package does."""

from __future__ import annotations

from megatron.training import megatron_flag_reasons as why
from megatron.training.megatron_flags import ALWAYS, REFUSED, ForeignFlag, entries

REFUSED_ROWS: list[ForeignFlag] = [
    *entries(
        REFUSED,
        why.CP,
        """
        --hybrid-context-parallel --max-seqlen-per-dp-cp-rank=1
    """,
    ),
    *entries(
        REFUSED,
        why.MOE,
        """
        --moe-apply-probs-on-input --moe-enable-routing-replay --moe-expert-rank-capacity-factor=1
        --moe-latent-size=1 --moe-mlp-glu-interleave-size=1 --moe-router-force-biased=1
        --moe-router-force-load-balancing --moe-router-padding-for-fp8 --moe-router-padding-for-quantization
        --moe-router-quantile-balancing-ema=1 --moe-shared-expert-glu-interleave-size=1
        --moe-single-grouped-bias --moe-single-grouped-weight
    """,
    ),
    *entries(
        REFUSED,
        why.MOE_FLEX,
        """
        --moe-enable-deepep --moe-flex-dispatcher-backend=1 --moe-deepep-num-sms=1
        --moe-flex-dispatcher-num-sms=1 --moe-hybridep-num-blocks-permute=1
        --moe-hybridep-num-blocks-unpermute=1 --moe-hybridep-num-sms=1
        --moe-hybridep-num-sms-preprocessing=1 --moe-hybridep-pad-uneven-dispatch-inputs
        --moe-ncclep-static-shape --moe-ncclep-zero-copy --moe-permute-fusion-into-hybridep
    """,
    ),
    *entries(REFUSED, why.MOE_RECOMPUTE, "--moe-layer-recompute"),
    *entries(
        REFUSED,
        why.MOE_PAGED_STASH,
        """
        --moe-paged-stash --moe-paged-stash-buffer-size-factor-cpu=1
        --moe-paged-stash-buffer-size-factor-cuda=1 --moe-paged-stash-page-size=1
    """,
    ),
    *entries(
        REFUSED,
        why.MOE_TRACE,
        """
        --moe-routing-trace-capture-hidden-states --moe-routing-trace-capture-logits
        --moe-routing-trace-dump-weights --moe-routing-trace-max-training-iters=1 --moe-routing-trace-path=1
    """,
    ),
    *entries(REFUSED, why.MOE_UPCYCLING, "--moe-use-upcycling --moe-upcycling-granularity=1"),
    *entries(REFUSED, why.ACTIVATIONS, "--use-fused-weighted-squared-relu"),
    *entries(REFUSED, why.OPT_DTYPES, "--use-precision-aware-optimizer"),
    *entries(REFUSED, why.LOCAL_CKPT, "--non-persistent-save-interval=1"),
    *entries(REFUSED, why.CKPT_ARGS, "--use-mp-args-from-checkpoint-args"),
    *entries(
        REFUSED,
        why.CONVERT,
        """
        --ckpt-convert-format=1 --ckpt-convert-save=1 --ckpt-convert-update-legacy-dist-opt-format
    """,
    ),
    *entries(REFUSED, why.PRETRAINED, "--pretrained-checkpoint=1"),
    *entries(REFUSED, why.OVERRIDE_IT, "--override-ckpt-iteration=1"),
    *entries(REFUSED, why.VERIFY, "--verify-integrity"),
    *entries(REFUSED, why.TP_PP_DP, "--use-tp-pp-dp-mapping"),
    *entries(REFUSED, why.DP_RANDOM, "--data-parallel-random-init"),
    *entries(REFUSED, why.DIST_OPT_INST, "--num-distributed-optimizer-instances=1"),
    *entries(REFUSED, why.FAKE_PG, "--fake-process-group"),
    *entries(REFUSED, why.LAZY_MPU, "--lazy-mpu-init"),
    *entries(REFUSED, why.NAN_CHECKS, "--check-for-large-grads"),
    *entries(
        REFUSED,
        why.FAULTS,
        """
        --fault-injector-delay-start-iteration=1 --fault-injector-fault-delay=1
        --fault-injector-fault-probabilities=1 --fault-injector-fault-types=1
        --fault-injector-mtti-seconds=1 --fault-injector-num-ranks=1 --fault-injector-offset-seconds=1
        --fault-injector-ranks=1 --fault-injector-seed=1
    """,
    ),
    *entries(REFUSED, why.HASH, "--check-weight-hash-across-dp-replicas-interval=1"),
    *entries(REFUSED, why.INPROCESS, "--inprocess-restart"),
    *entries(
        REFUSED,
        why.DUMPS,
        """
        --save-activations-interval=1 --save-dgrads-interval=1 --save-params-interval=1
        --save-wgrads-interval=1 --save-tokens-per-expert-interval=1 --dump-param-to-param-group-map=1
    """,
    ),
    *entries(REFUSED, why.MEM_HISTORY, "--record-memory-history --memory-snapshot-path=1"),
    *entries(REFUSED, why.CHAKRA, "--pytorch-profiler-collect-chakra"),
    *entries(REFUSED, why.YAML, "--yaml-cfg=1"),
    *entries(
        REFUSED,
        why.SPEC,
        """
        --spec=* --heterogeneous-layers-config-encoded-json=1 --heterogeneous-layers-config-path=1
    """,
    ),
    *entries(
        REFUSED,
        why.HYBRID,
        """
        --is-hybrid-model --hybrid-layer-pattern=1 --hybrid-override-pattern=1
        --experimental-attention-variant=1 --linear-attention-freq=1 --linear-conv-kernel-dim=1
        --linear-key-head-dim=1 --linear-num-key-heads=1 --linear-num-value-heads=1
        --linear-value-head-dim=1 --disable-dsa-indexer-rotate-activation --disable-dsa-indexer-scoring-relu
        --dsa-indexer-head-dim=1 --dsa-indexer-k-norm-epsilon=1 --dsa-indexer-k-norm-fp32
        --dsa-indexer-loss-coeff=1 --dsa-indexer-n-heads=1 --dsa-indexer-rope-interleaved
        --dsa-indexer-skip-topk-offset=1 --dsa-indexer-topk=1 --dsa-indexer-topk-freq=1
        --dsa-indexer-use-sparse-loss --dsa-kernel-backend=1 --no-dsa-indexer-rotate-activation
        --no-dsa-indexer-scoring-relu
    """,
    ),
    *entries(
        REFUSED,
        why.MLA,
        """
        --multi-latent-attention --q-lora-rank=1 --kv-lora-rank=1 --qk-head-dim=1 --qk-pos-emb-head-dim=1
        --v-head-dim=1 --mla-down-proj-fusion --mscale=1 --mscale-all-dim=1
    """,
    ),
    *entries(
        REFUSED,
        why.MTP,
        """
        --mtp-detach-heads --mtp-hybrid-override-pattern=1 --mtp-loss-scaling-factor=1 --mtp-num-layers=1
        --mtp-standalone --mtp-use-repeated-layer
    """,
    ),
    *entries(
        REFUSED,
        why.ROPE_VARIANTS,
        """
        --rope-type=1 --rotary-interleaved
        --rotary-scaling-factor=1 --mrope-section=+ --no-rope-freq=1 --no-yarn-correction-range-round-to-int
        --yarn-beta-fast=1 --yarn-beta-slow=1 --yarn-correction-range-round-to-int
        --yarn-original-max-position-embeddings=1
    """,
    ),
    *entries(
        REFUSED,
        why.ATTN_VARIANTS,
        """
        --attention-output-gate --softmax-type=1 --window-size=1 --window-attn-skip-freq=1 --qk-l2-norm
        --qk-clip --qk-clip-alpha=1 --qk-clip-threshold=1 --log-max-attention-logit --use-kitchen-attention
        --kitchen-attention-backend=1 --dataloader-inter-document-masking
    """,
    ),
    *entries(
        REFUSED,
        why.ACTIVATIONS,
        """
        --squared-relu --openai-gelu --quick-geglu --glu-linear-offset=1 --activation-func-clamp-value=1
    """,
    ),
    *entries(REFUSED, why.ARCH, "--apply-residual-connection-post-layernorm --fp32-residual-connection"),
    *entries(
        REFUSED,
        why.INIT_VARIANTS,
        """
        --init-method-xavier-uniform --embedding-init-method-std=1 --use-mup --mup-attn-scale-power=1
        --mup-base-head-dim=1 --mup-base-hidden-size=1 --mup-embedding-mult=1 --mup-output-mult=1
        --mup-width-mult=1
    """,
    ),
    *entries(REFUSED, why.LOSS_PRECISION, "--fp16-lm-cross-entropy"),
    *entries(REFUSED, why.WD_QK, "--apply-wd-to-qk-layernorm --no-weight-decay-cond-type=1"),
    *entries(
        REFUSED,
        why.FP8_VARIANTS,
        """
        --fp8-margin=1 --no-fp8-wgrad --disable-fp8-wgrad --fp8-output-proj --fp8-quantizer-factory=1
        --te-precision-config-file=1
    """,
    ),
    *entries(REFUSED, why.FP4, "--fp4-format=1 --fp4-param-gather --fp4-quantizer-factory=1 --fp4-recipe=1"),
    *entries(
        REFUSED,
        why.DATA_VARIANTS,
        """
        --sft --sft-tokenizer-prompt-format=1 --fim-data --fim-eod-token=1 --fim-fragment-rate=1
        --fim-middle-token=1 --fim-no-prefix=1 --fim-pad-token=1 --fim-prefix-token=1 --fim-rate=1
        --fim-split-sample=1 --fim-spm-rate=1 --fim-suffix-token=1 --phase-transition-iterations=1
    """,
    ),
    *entries(
        REFUSED, why.VALID_SETS, "--multiple-validation-sets --validation-set-names=+ --full-validation"
    ),
    *entries(REFUSED, why.EVAL_BATCH, "--eval-micro-batch-size=1 --eval-global-batch-size=1"),
    *entries(REFUSED, why.SPECIAL_TOKENS, "--tokenizer-special-tokens=+"),
    *entries(REFUSED, why.SAMPLE_RATE, "--sample-rate=1"),
    *entries(REFUSED, why.RL_STEP, "--perform-rl-step"),
    *entries(
        REFUSED,
        why.DISTILL,
        """
        --logits-load-decode-threads=1 --logits-load-dir=1 --logits-load-ignore-errors
        --logits-load-kd-loss-alpha=1 --logits-load-msc-prefetch-depth=1 --logits-load-prefetch-factor=1
        --logits-save-dir=1 --logits-save-dtype=1 --logits-save-top-k=1 --logits-save-top-p=1
        --logits-save-top-p-min-k=1
    """,
    ),
    *entries(REFUSED, why.FREEZE, "--freeze-all-layers"),
    *entries(REFUSED, why.DETERMINISTIC, "--deterministic-mode --batch-invariant-mode"),
    *entries(REFUSED, why.BATCH_DECREASE, "--decrease-batch-size-if-needed"),
    *entries(REFUSED, why.MLP_CHUNKS, "--mlp-chunks-for-training=1"),
    *entries(REFUSED, why.TP_SHARDS, "--tensor-parallel-num-weight-shards=1"),
    *entries(REFUSED, why.TEST_MODE, "--test-mode"),
    ForeignFlag(
        "--checkpoint-activations", REFUSED, "Megatron-LM removed it; use --recompute-granularity full"
    ),
    ForeignFlag("--batch-size", REFUSED, "Megatron-LM removed it; use --micro-batch-size", None),
    ForeignFlag(
        "--warmup",
        REFUSED,
        "Megatron-LM removed it; use --lr-warmup-fraction, --lr-warmup-iters or --lr-warmup-samples",
        None,
    ),
    ForeignFlag(
        "--model-parallel-size", REFUSED, "Megatron-LM removed it; use --tensor-model-parallel-size", None
    ),
    # Accepted at the values that ask for what this package does, refused at any other.
    ForeignFlag(
        "--attention-backend",
        ALWAYS,
        why.SDPA,
        None,
        accepted=("auto", "flash", "fused"),
        otherwise=why.SDPA + "; pass auto or drop it",
    ),
    ForeignFlag(
        "--main-grads-dtype",
        ALWAYS,
        "main gradients are fp32 unless --grad-reduce-in-bf16",
        None,
        accepted=("fp32",),
        otherwise="main gradients are fp32 (bf16 with --grad-reduce-in-bf16); pass fp32 or drop it",
    ),
    *[
        ForeignFlag(
            flag,
            ALWAYS,
            what + " fp32",
            None,
            accepted=("fp32",),
            otherwise=what + " fp32; pass fp32 or drop it",
        )
        for flag, what in (
            ("--main-params-dtype", "the optimizer's main parameters are"),
            ("--exp-avg-dtype", "Adam's moments are"),
            ("--exp-avg-sq-dtype", "Adam's moments are"),
        )
    ],
]
