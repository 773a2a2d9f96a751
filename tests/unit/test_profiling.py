"""Timeline arithmetic of the profiler summary (kernel categories, idle gaps, exposed communication)."""

import json

from megatron.training.profiling import (
    OPTIMIZER_MARK,
    OPTIMIZER_RANGE,
    categorize,
    exposed_communication,
    exposed_pipeline_wait,
    host_summary,
    idle_summary,
    kernel_summary,
    trace_kernels,
)


def kernel(name, start, end):
    return (name, float(start), float(end))


def test_categories():
    assert categorize("nvjet_sm90_tst_128x256_64x4_2x1_v_bz_coopA_NTN") == "matmul"
    assert categorize("cudnn_generated_fort_native_sdpa_sm90_flash_bprop") == "attention"
    assert categorize("ncclDevKernel_AllReduce_Sum_f32_RING_LL") == "communication"
    assert categorize("triton_poi_fused_add_copy_div_lerp_mul_pow_sqrt_0") == "elementwise (triton)"
    # Inductor's FP8 quantisation kernels carry the GEMM's name; they are not GEMMs.
    assert categorize("triton_poi_fused__scaled_mm__to_copy_abs_clamp_mul_7") == "elementwise (triton)"
    for ours in ("_swiglu_bwd_kernel", "_ce_grad_kernel", "_cast_transpose_kernel", "_amax_kernel"):
        assert categorize(ours) == "elementwise (triton)"
    assert categorize("nvjet_sm90_qrtst_128x128_128x6_2x1_v_bz_coopA_algo2_TNT") == "matmul"


def test_exposed_communication_is_comm_time_without_compute():
    # compute 0-100 and 150-200; all-reduce 80-170: 20 us overlapped with compute at each end, 50 exposed.
    events = [kernel("gemm", 0, 100), kernel("ncclDevKernel_AllReduce", 80, 170), kernel("gemm", 150, 200)]
    text, comm_ms, exposed_ms = exposed_communication(events, steps=1)
    assert "0.09 ms per step on the GPU, 0.05 ms of it exposed" in text
    assert (comm_ms, exposed_ms) == (0.09, 0.05)
    assert "idle between kernels: 0.00 ms" in idle_summary(events, steps=1)[0]


def test_pipeline_wait_is_the_exposed_time_of_sends_and_receives_only():
    # compute 0-100 and 400-500; a receive waits 100-300 (exposed), a send 450-520 (20 us exposed); an
    # all-reduce 300-350 is exposed communication but not a pipeline wait.
    events = [
        kernel("gemm", 0, 100),
        kernel("ncclDevKernel_SendRecv(ncclDevKernelArgsStorage<4096ul>)", 100, 300),
        kernel("ncclDevKernel_AllReduce_Sum_bf16_RING_LL", 300, 350),
        kernel("gemm", 400, 500),
        kernel("ncclDevKernel_SendRecv(ncclDevKernelArgsStorage<4096ul>)", 450, 520),
    ]
    text, ms = exposed_pipeline_wait(events, steps=2)
    assert ms == 0.11 and "0.11 ms per step" in text
    assert exposed_communication(events, steps=2)[2] == 0.135
    assert exposed_pipeline_wait(
        [kernel("gemm", 0, 100), kernel("ncclDevKernel_AllReduce", 100, 200)], 1
    ) == ("", 0.0)


def test_idle_gaps_between_kernels():
    text, idle_ms = idle_summary(
        [kernel("a", 0, 100), kernel("b", 50, 80), kernel("c", 300, 400), kernel("d", 1400, 1500)], 1
    )
    assert "1.20 ms per step" in text and "1.00  c -> d" in text and idle_ms == 1.2


def test_trace_kernels_keeps_gpu_work_only_and_summary_counts_per_step(tmp_path):
    """CPU ops and annotations mirrored on the GPU timeline are not kernels; copies and memsets are."""
    trace = {
        "traceEvents": [
            {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 500},
            {
                "ph": "X",
                "cat": "gpu_user_annotation",
                "name": "Optimizer.step#AdamW.step",
                "ts": 0,
                "dur": 900,
            },
            {"ph": "X", "cat": "kernel", "name": "nvjet_sm90_tst_NTN", "ts": 100, "dur": 300},
            {"ph": "X", "cat": "kernel", "name": "nvjet_sm90_tst_NTN", "ts": 1100, "dur": 300},
            {
                "ph": "X",
                "cat": "kernel",
                "name": "unrolled_elementwise_kernel<direct_copy_kernel_cuda>",
                "ts": 400,
                "dur": 200,
            },
            {"ph": "X", "cat": "gpu_memset", "name": "Memset (Device)", "ts": 700, "dur": 100},
            {"ph": "f", "cat": "ac2g", "name": "launch", "ts": 90},
        ]
    }
    path = tmp_path / "trace.json"
    path.write_text(json.dumps(trace))
    kernels = trace_kernels(str(path))
    assert [k[0] for k in kernels] == [
        "nvjet_sm90_tst_NTN",
        "unrolled_elementwise_kernel<direct_copy_kernel_cuda>",
        "Memset (Device)",
        "nvjet_sm90_tst_NTN",
    ]
    text, by_cat = kernel_summary(kernels, steps=2)
    assert by_cat.keys() == {"matmul", "copies"}
    assert abs(by_cat["matmul"] - 0.3) < 1e-9 and abs(by_cat["copies"] - 0.15) < 1e-9
    assert "0.30      1  matmul" in text
    assert abs(idle_summary(kernels, steps=2)[1] - 0.2) < 1e-9  # 600-700 and 800-1100 idle, over two steps


def test_host_summary_counts_outermost_operators_per_thread_and_our_ops():
    def op(name, tid, start, dur):
        return {"ph": "X", "cat": "cpu_op", "name": name, "tid": tid, "ts": start, "dur": dur}

    events = [
        op("Torch-Compiled Region: 0/1", 1, 0, 3000),  # outermost: counts 3 ms
        op("megatron::fp8_cast_transpose", 1, 100, 200),  # nested: not counted again
        op("megatron::fp8_cast_transpose", 1, 500, 400),
        op("aten::mm", 1, 5000, 1000),  # a second outermost op: 1 ms
        op("autograd::engine::evaluate_function: X", 2, 0, 5000),  # the backward thread: 5 ms
        {
            "ph": "X",
            "cat": "cuda_runtime",
            "name": "cudaDeviceSynchronize",
            "tid": 1,
            "ts": 7000,
            "dur": 9000,
        },
        {"ph": "X", "cat": "user_annotation", "name": "ProfilerStep#3", "tid": 1, "ts": 0, "dur": 20000},
        op("aten::view", 3, 0, 10),  # under 1 ms per step: left out
    ]
    text, busy = host_summary(events, steps=2)
    assert busy == {"2": 2.5, "1": 2.0}
    assert "thread 2 2.5 ms, thread 1 2.0 ms" in text  # the busiest first
    assert "megatron::fp8_cast_transpose: 1 calls per step, 300 us each" in text
    assert host_summary([], steps=1) == ("host: no operators recorded", {})


def test_kernels_launched_by_the_optimizer_step_count_as_optimizer(tmp_path):
    """The compiled optimizer's Triton kernels are named like any other Triton kernel: the host range
    around the optimizer step (``OPTIMIZER_RANGE``) decides, through the launches' correlation ids;
    its collectives stay communication."""

    def launch(cat, ts, corr):
        return {
            "ph": "X",
            "cat": cat,
            "name": "cuLaunchKernel",
            "ts": ts,
            "dur": 5,
            "args": {"correlation": corr},
        }

    def gpu(name, ts, dur, corr):
        return {"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur, "args": {"correlation": corr}}

    adam = "triton_poi_fused__to_copy_add_div_lerp_mul_sqrt_0"
    trace = {
        "traceEvents": [
            launch("cuda_driver", 10, 1),
            launch("cuda_runtime", 20, 2),  # forward/backward
            {"ph": "X", "cat": "user_annotation", "name": OPTIMIZER_RANGE, "ts": 100, "dur": 100},
            launch("cuda_driver", 110, 3),
            launch("cuda_runtime", 120, 4),
            launch("cuda_runtime", 130, 5),
            gpu(adam, 300, 40, 3),
            gpu("nvjet_sm90_tst_NTN", 200, 100, 2),
            gpu("triton_poi_fused_add_1", 100, 10, 1),
            gpu("ncclDevKernel_Broadcast_RING_LL", 340, 20, 4),
            gpu("multi_tensor_apply_kernel<LpNorm>", 360, 10, 5),
        ]
    }
    path = tmp_path / "trace.json"
    path.write_text(json.dumps(trace))
    kernels = trace_kernels(str(path))
    assert [k[0] for k in kernels][-3:] == [
        OPTIMIZER_MARK + adam,
        OPTIMIZER_MARK + "ncclDevKernel_Broadcast_RING_LL",
        OPTIMIZER_MARK + "multi_tensor_apply_kernel<LpNorm>",
    ]
    _, by_cat = kernel_summary(kernels, steps=1)
    assert by_cat == {"optimizer": 0.05, "matmul": 0.1, "elementwise (triton)": 0.01, "communication": 0.02}
    assert exposed_communication(kernels, steps=1)[1] == 0.02
    # without the range, the same kernels fall under their names' categories
    trace["traceEvents"] = [e for e in trace["traceEvents"] if e["cat"] != "user_annotation"]
    path.write_text(json.dumps(trace))
    assert kernel_summary(trace_kernels(str(path)), steps=1)[1]["elementwise (triton)"] == 0.05
