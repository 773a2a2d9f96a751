"""Timeline arithmetic of the profiler summary (kernel categories, idle gaps, exposed communication)."""

from types import SimpleNamespace

from megatron.training.profiling import categorize, exposed_communication, idle_summary


def kernel(name, start, end):
    return SimpleNamespace(key=name, device_type="DeviceType.CUDA", time_range=SimpleNamespace(start=start, end=end))


def test_categories():
    assert categorize("nvjet_sm90_tst_128x256_64x4_2x1_v_bz_coopA_NTN") == "matmul"
    assert categorize("cudnn_generated_fort_native_sdpa_sm90_flash_bprop") == "attention"
    assert categorize("ncclDevKernel_AllReduce_Sum_f32_RING_LL") == "communication"
    assert categorize("triton_poi_fused_add_copy_div_lerp_mul_pow_sqrt_0") == "elementwise (triton)"


def test_exposed_communication_is_comm_time_without_compute():
    # compute 0-100 and 150-200; all-reduce 80-170: 20 us overlapped with compute at each end, 50 exposed.
    events = [kernel("gemm", 0, 100), kernel("ncclDevKernel_AllReduce", 80, 170), kernel("gemm", 150, 200),
              SimpleNamespace(key="Optimizer.step#AdamW.step", device_type="DeviceType.CUDA",
                              time_range=SimpleNamespace(start=0, end=500))]  # an annotation: ignored
    text, comm_ms, exposed_ms = exposed_communication(events, steps=1)
    assert "0.09 ms per step on the GPU, 0.05 ms of it exposed" in text
    assert (comm_ms, exposed_ms) == (0.09, 0.05)
    assert "idle between kernels: 0.00 ms" in idle_summary(events, steps=1)[0]


def test_idle_gaps_between_kernels():
    text, idle_ms = idle_summary([kernel("a", 0, 100), kernel("b", 50, 80), kernel("c", 300, 400),
                                  kernel("d", 1400, 1500)], 1)
    assert "1.20 ms per step" in text and "1.00  c -> d" in text and idle_ms == 1.2
