"""Why each Megatron-LM 0.19.2 flag of ``megatron_flag_table`` is accepted, noted or refused.

Each reason is written once and shared by the flags it covers; the table says which flags. A reason
reads as the note printed for the flag: what this package does instead, and for a refused flag
what to use.
"""

MCORE = "the model is always this package's own Megatron-Core-style GPTModel"
FLASH = (
    "attention always runs through torch's scaled_dot_product_attention, which picks cuDNN's or "
    "FlashAttention's fused kernel on the GPU"
)
SOFTMAX32 = "the fused attention kernels accumulate the scores and softmax in fp32"
FUSED = (
    "there is no hand-written Megatron kernel to turn off here; torch.compile fuses each layer on the GPU "
    "(--torch-compile off runs them unfused)"
)
WGRAD_ACC = "weight gradients are always added into the main gradients (no APEX fusion to turn off)"
FP32_GRADS = "main gradients are accumulated and reduced in fp32 unless --grad-reduce-in-bf16"
MEM_TB = "GPU memory (allocated, peak allocated, peak reserved) is always written with the scalars"
PPL_TB = "validation perplexity is always written with the scalars"
LOCAL_RANK = "the local rank is read from LOCAL_RANK (torchrun) or SLURM_LOCALID (srun)"
DIST_CKPT = "checkpoints are always distributed (torch.distributed.checkpoint); the format is --ckpt-format"
AUTO_FORMAT = (
    "the format of the checkpoint to load is always read from its files (torch_dist, or Megatron-LM's legacy "
    "torch format)"
)
LOADER_SIGNALS = (
    "DataLoader workers always ignore the stop signals and the rank decides; with --exit-signal-handler it "
    "finishes the step and saves"
)
RESHARD = (
    "optimizer state is always stored per parameter in global coordinates, so it reshards across tensor, "
    "pipeline and data parallelism"
)
MAIN_PARAMS = (
    "the fp32 main parameters are restored from the checkpoint's optimizer state, or from its weights when that"
    " is skipped"
)
NO_MSC = "files are read from the local (or mounted) file system"
NO_GLOO = "no gloo process groups are created beside NCCL on GPUs"
NO_TOK_CKPT = "the tokenizer always comes from this launch's flags, never from a checkpoint"
TOKENS_READY = (
    "pretraining reads token ids written by tools/preprocess_data.py; the tokenizer gives only the vocabulary "
    "size and the end-of-document id, so its encoding options change nothing"
)
GC = (
    "Python's garbage collector runs as usual; the training loop allocates no Python objects per step that "
    "would make a collection costly"
)
EMPTY_CACHE = "the CUDA caching allocator is never emptied during training (that only costs time)"
CKPT_PARALLEL = (
    "every rank writes and reads only its own shards through torch.distributed.checkpoint, already spread over "
    "all ranks"
)
STRICT_LOAD = (
    "loading is strict: a tensor the model needs and the checkpoint lacks is an error naming it, extra tensors "
    "in the checkpoint are ignored"
)
LOGLEVEL = "the log lines are fixed; warnings come through Python's warnings module"
TIMERS = (
    "the --timing-log-level timers synchronise the device but never hold the ranks at a barrier; the block's "
    "(min, max) over ranks shows their spread"
)
TB_INTERVAL = "scalars are written every --log-interval iterations"
CUDA_GRAPHS = (
    "CUDA graphs are not captured; the loop queues the next step before reading the last one, so the host's "
    "launch time stays hidden"
)
TE_KNOB = "a Transformer Engine setting; there is no Transformer Engine path (--transformer-impl local)"
TP_OVERLAP = (
    "Transformer Engine's overlap of tensor-parallel collectives with GEMMs is not used: there is no "
    "Transformer Engine path, and PyTorch's micro-pipelined tensor parallelism measured slower "
    "(docs/performance.md)"
)
FP8_PARAMS = (
    "FP8 here casts the bf16 weights in each forward (docs/fp8.md); parameters and their gathers stay bf16"
)
DDP_KNOB = "gradient buckets are sized by --ddp-bucket-size and reduced as they fill"
PP_KNOB = (
    "the pipeline's sends and receives are torch.distributed's batched point-to-point operations, overlapped by"
    " the schedule (--no-overlap-p2p-communication)"
)
WGRAD_DEFER = "weight gradients are computed in the backward pass where autograd schedules them"
NCCL = "NCCL is used with its defaults; tune it through its environment variables (NCCL_*)"
FLIGHT = (
    "the flight recorder keeps 2000 entries (TORCH_FR_BUFFER_SIZE overrides) and the hang report shows each "
    "rank's recent collectives; set TORCH_FR_DUMP_TEMP_FILE and TORCH_NCCL_DUMP_ON_TIMEOUT for PyTorch's own dumps"
)
OFFLOAD = (
    "activations are not offloaded to the CPU; --recompute-granularity full trades compute for activation "
    "memory instead"
)
ASYNC_KNOB = (
    "tunes Megatron-LM's asynchronous checkpoint worker; --async-save here writes from pinned host memory in a "
    "background thread of each rank"
)
LOCAL_CKPT_KNOB = (
    "tunes non-persistent local checkpoints, which are not built (--non-persistent-save-interval is refused)"
)
FSDP_KNOB = (
    "tunes Megatron-FSDP's own buffers and communication; --use-megatron-fsdp and --use-torch-fsdp2 run on "
    "PyTorch's FSDP2 here, which has no such knob"
)
DATA_KNOB = (
    "dataset indices are built once by global rank 0 and cached (--data-cache-path); loading a cache is already"
    " a memory map"
)
PAD_TOKENS = "GPT samples here are never padded, so no pad token reaches the loss"
INIT = "weights are initialised from the seed and each parameter's global name, then overwritten by --load"
SYNC = "the loop waits only for the step whose results it reads, so the host never runs far ahead"
SIGNAL_SHUTDOWN = (
    "without --exit-signal-handler a stop signal ends the run (the newest complete checkpoint stays the "
    "latest); --exit-signal-handler also saves first"
)
CLONE = "an internal copy in Megatron's embedding that this package does not make"
TELEMETRY = "NVIDIA's internal telemetry (one-logger) is not used"
FT = (
    "NVIDIA's fault-tolerance and autoresume services are not used; a hung collective fails after "
    "--distributed-timeout-minutes and --exit-signal-handler saves on SIGTERM"
)
INPROCESS_KNOB = "tunes in-process restart, which is not built (--inprocess-restart is refused)"
STRAGGLER = (
    "NVIDIA's straggler detector service is not used; --log-straggler names the slowest ranks every "
    "--log-interval"
)
NVTX = "no NVTX ranges are emitted; the PyTorch profiler's trace (--use-pytorch-profiler) names every op"
CONFIG_DUMP = "the run's whole configuration is printed at start and stored in every checkpoint"
EXPERIMENTAL = "there are no experimental features to unlock"
ONNX = "no ONNX export happens during pretraining"
EXPERT_SHARDS = "only with generalized tensor parallelism of the experts, which is not built"
MOE_OVERLAP = (
    "the expert all-to-all is not overlapped with other layers' compute (the dispatchers run in order); "
    "the shared experts run as one dense MLP"
)
MOE_FUSION = "the router and the token permutation run as torch ops (no fused kernels); the same result"
ENERGY = "energy and nvidia-smi memory are not read; GPU memory from PyTorch's allocator is written with the scalars"
INFERENCE = (
    "an inference setting; pretrain_gpt.py runs no inference (Megatron-LM's pretrain_gpt.py ignores it too)"
)
RL = "a reinforcement-learning setting, used only with --perform-rl-step (refused here)"
BERT_T5 = "a setting of Megatron-LM's BERT, T5 and retrieval models; pretrain_gpt.py ignores it (in Megatron-LM too)"
VISION = "a setting of Megatron-LM's vision models; pretrain_gpt.py ignores it (in Megatron-LM too)"
OTHER_OPT = "a setting of --optimizer muon or lion, which are not built (--optimizer takes adam or sgd)"
MAMBA_KNOB = "a setting of Mamba layers, which exist only in hybrid models (refused here)"
MSC_KNOB = "the Multi-Storage Client is not used; files are read from the local (or mounted) file system"
CP = (
    "hybrid (dynamic per-sample) context parallelism is not built; use --context-parallel-size with "
    "--cp-comm-type"
)
MOE = (
    "this mixture-of-experts variant is not built (built: top-k softmax/sigmoid routing, group-limited "
    "routing, aux/seq/global aux and z losses, expert bias, capacity, shared experts, the allgather and "
    "alltoall dispatchers)"
)
MOE_FLEX = (
    "the flex dispatcher (DeepEP / HybridEP / NCCL-EP kernels) is not built; use --moe-token-dispatcher-type "
    "alltoall"
)
MOE_RECOMPUTE = "recompute MoE layers with --recompute-granularity full (whole layers)"
MOE_PAGED_STASH = "activations of the experts are kept as autograd saves them (no paged stash)"
MOE_TRACE = "routing traces are not recorded; --moe-per-layer-logging logs each layer's routing statistics"
MOE_UPCYCLING = "upcycling a dense checkpoint into experts is not built"
OPT_DTYPES = (
    "the optimizer keeps fp32 main parameters and Adam moments (main gradients fp32, or bf16 with "
    "--grad-reduce-in-bf16); drop it, or pass fp32"
)
LOCAL_CKPT = "non-persistent (local) checkpoints are not built; use --save-interval"
CKPT_ARGS = (
    "the parallel layout is never taken from the checkpoint (any layout loads any checkpoint); pass the sizes, "
    "and --use-checkpoint-args for the model's flags"
)
CONVERT = (
    "checkpoints are not converted at load; a torch_dist checkpoint loads under any parallel layout as it is"
)
PRETRAINED = "to start from another run's weights use --load DIR --finetune (weights only, iteration 0)"
OVERRIDE_IT = (
    "the iteration and consumed samples always come from the checkpoint; --ckpt-step N loads another saved "
    "iteration"
)
VERIFY = (
    "checkpoint hashing is not built; the tracker names only complete checkpoints (written last, atomically)"
)
TP_PP_DP = "the rank grid is always ordered tp-cp-ep-dp-pp; drop it"
DP_RANDOM = "weights are identical on every data-parallel rank (layout invariance); drop it"
DIST_OPT_INST = "one distributed optimizer instance spans the data-parallel ranks; drop it"
FAKE_PG = "use --dry-run to see parameters and memory without running on GPUs"
LAZY_MPU = (
    "pretrain_gpt.py always sets up its own process groups; from your own code, use the library "
    "(megatron.core.parallel_state)"
)
NAN_CHECKS = (
    "Megatron-LM's large-gradient check is not built; --check-for-nan-in-loss-and-grad rejects NaN/Inf "
    "gradients and --check-for-spiky-loss spiky losses, re-run per --rerun-mode"
)
FAULTS = (
    "NVIDIA's process fault injector is not built; --error-injection-rate / --error-injection-type inject "
    "NaN gradients or loss spikes for drills"
)
HASH = (
    "weight-hash checks across replicas are not built; data-parallel replicas start from identical weights and "
    "apply identical reduced gradients"
)
INPROCESS = (
    "in-process restart is not built; restart the job (torchrun --max-restarts, or Slurm's requeue) and it "
    "resumes from --load"
)
DUMPS = "dumping tensors, gradients or parameter maps is not built; use the library from your own code"
MEM_HISTORY = (
    "CUDA memory-history snapshots are not built; --profile --use-pytorch-profiler records a trace, and the "
    "scalars hold allocated and peak memory"
)
CHAKRA = "Chakra traces are not built; --use-pytorch-profiler writes a Chrome trace"
YAML = "give the flags on the command line (a shell array, as Megatron-LM's example scripts do)"
SPEC = (
    "custom layer specs are a library feature: build GPTModel with your spec in your own training loop "
    "(examples/run_simple_mcore_train_loop.py)"
)
HYBRID = "hybrid Mamba / linear-attention models are not built; pretrain_gpt.py trains attention-only GPTs"
MLA = "multi-latent attention is not built; use --group-query-attention --num-query-groups N"
MTP = "multi-token prediction is not built"
ROPE_VARIANTS = (
    "only plain RoPE is built (--position-embedding-type rope with --rotary-base, --rotary-percent, "
    "--rotary-seq-len-interpolation-factor and Llama 3's --use-rope-scaling --rope-scaling-factor)"
)
ATTN_VARIANTS = "this attention variant is not built (standard causal softmax attention only)"
ACTIVATIONS = "this activation is not built; use the default GELU or --swiglu"
ARCH = "this architecture change is not built (pre-norm GPT blocks with the residual in the compute dtype)"
INIT_VARIANTS = (
    "weights are initialised normal(0, --init-method-std), output projections with std/sqrt(2 x layers); other "
    "initialisations are not built"
)
LOSS_PRECISION = "the cross entropy is always computed in fp32"
WD_QK = "weight decay never applies to norms or biases (1-D parameters), QK-norm included"
FP8_VARIANTS = (
    "this FP8 setting is not built: FP8 here is --fp8-format with --fp8-recipe tensorwise or delayed, weight "
    "gradients in FP8, margin 0 (docs/fp8.md)"
)
FP4 = "FP4 is not built; FP8 (--fp8-format) is the lowest precision here"
DATA_VARIANTS = (
    "this dataset type is not built; pretrain_gpt.py reads .bin/.idx GPT data (--data-path) or --mock-data"
)
VALID_SETS = (
    "one validation set per run: --valid-data-path (or the --split share) evaluated for --eval-iters batches"
)
EVAL_BATCH = "evaluation uses the training batch sizes; set how much it reads with --eval-iters"
SPECIAL_TOKENS = (
    "added special tokens would change the vocabulary; add them when training the tokenizer instead"
)
SAMPLE_RATE = "sampling a fraction of the data is not built; use --data-path weights or --split"
RL_STEP = "reinforcement learning is not built; pretrain_gpt.py pretrains"
DISTILL = "knowledge distillation from saved logits is not built"
FREEZE = "freezing layers is not built; pretrain_gpt.py trains every parameter"
DETERMINISTIC = "deterministic GPU kernels are not selectable; on the CPU every run is bitwise repeatable"
BATCH_DECREASE = (
    "the global batch is never changed silently; pick one divisible by micro-batch x data-parallel size"
)
MLP_CHUNKS = (
    "chunking the MLP over the sequence is not built; use --recompute-granularity to save activation memory"
)
TP_SHARDS = "only one tensor-parallel axis is built (--tensor-model-parallel-size)"
TEST_MODE = "Megatron-LM's own real-time test harness is not built"
SDPA = (
    "attention always runs through torch's scaled_dot_product_attention (cuDNN's fused attention on Hopper)"
)
