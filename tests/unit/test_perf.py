"""The perf/ figures: model FLOPs against torch's own FLOP counter, device peaks, peak memory of processes."""

import subprocess
import sys
import time

import pytest
import torch
from support.tiny_model import build_tiny_model
from torch.utils.flop_counter import FlopCounterMode
from transformers import AutoConfig, AutoModelForCausalLM

from slime.utils.perf import (
    ModelShape,
    PhaseTimer,
    cpu_has_bf16_matmul,
    cpu_peak_tflops,
    cpuinfo_peak_tflops,
    device_peak_tflops,
    forward_flops,
    process_tree_peak_memory_gb,
)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_forward_flops_equal_torch_flop_counter(arch, tmp_path):
    """torch counts every matmul of a real forward (eager attention, so the score matmuls are counted too)."""
    model_dir = build_tiny_model(tmp_path, arch=arch)
    model = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="eager")
    config = AutoConfig.from_pretrained(model_dir)
    lengths = [7, 33]
    counted = 0
    for length in lengths:  # one sequence at a time, as packed sequences attend only within themselves
        with FlopCounterMode(display=False) as counter, torch.no_grad():
            model(torch.randint(0, config.vocab_size, (1, length)))
        counted += counter.get_total_flops()
    assert forward_flops(ModelShape.from_hf_config(config), lengths) == counted
    # Logits of the last 5 positions only (as the trainers compute them): the LM head counts for those alone.
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        model(torch.randint(0, config.vocab_size, (1, 33)), logits_to_keep=5)
    assert forward_flops(ModelShape.from_hf_config(config), [33], head_tokens=5) == counter.get_total_flops()


def test_phase_times_nest_in_the_step_time():
    timer = PhaseTimer()
    with timer.phase("generate"):
        time.sleep(0.05)
    for _ in range(2):  # a phase entered twice adds up
        with timer.phase("offload"):
            time.sleep(0.02)
    metrics = timer.metrics()
    assert metrics["perf/generate_time"] >= 0.05 and metrics["perf/offload_time"] >= 0.04
    assert metrics["perf/generate_time"] + metrics["perf/offload_time"] <= metrics["perf/step_time"]


def test_peaks_default_per_device_and_take_the_flag():
    assert device_peak_tflops(123.0) == 123.0
    if not torch.cuda.is_available():
        assert device_peak_tflops() == cpu_peak_tflops(torch.get_num_threads())
    assert cpu_peak_tflops(2) == pytest.approx(2 * cpu_peak_tflops(1))
    assert 1e-3 < cpu_peak_tflops(1) < 10  # one core: gigaFLOPs to a few TFLOPs


def test_cpuinfo_peak_reads_the_clock_and_the_vector_width_in_linux_order():
    # /proc/cpuinfo lists `cpu MHz` before `flags`; a reader that stops at the clock misses AVX-512 (4x too low).
    avx512 = "processor\t: 0\ncpu MHz\t\t: 2600.000\nflags\t\t: fpu sse2 avx2 fma avx512f\n\nprocessor\t: 1\n"
    assert cpuinfo_peak_tflops(avx512, 1) == pytest.approx(2.6e9 * 2 * 2 * 16 / 1e12)  # 0.1664
    assert cpuinfo_peak_tflops("flags : sse2 avx2 fma\ncpu MHz : 3000", 2) == pytest.approx(2 * 3e9 * 2 * 2 * 8 / 1e12)
    assert cpuinfo_peak_tflops("flags : sse2", 1) == pytest.approx(2e9 * 2 * 2 * 4 / 1e12)  # no clock: 2 GHz


def test_process_tree_peak_memory_counts_children():
    """A parent whose child holds 300 MB: the tree's peak includes it, also after the child freed it."""
    child = "b = bytearray(300 * 2**20); b[::4096] = b'x' * len(b[::4096]); del b; print('freed', flush=True); input()"
    parent = f"import subprocess, sys; subprocess.run([sys.executable, '-c', {child!r}])"
    process = subprocess.Popen([sys.executable, "-c", parent], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert process.stdout.readline().strip() == "freed"
        assert process_tree_peak_memory_gb(process.pid) >= 0.29
    finally:
        process.communicate("\n", timeout=30)
    assert process_tree_peak_memory_gb(process.pid) == 0.0  # gone


def test_bf16_matmul_units_are_read_from_the_flags():
    assert cpu_has_bf16_matmul("cpu MHz : 2600\nflags : avx512f amx_tile amx_bf16\n")
    assert cpu_has_bf16_matmul("flags\t\t: fpu avx512_bf16 avx512f\nflags : avx2")
    assert not cpu_has_bf16_matmul("flags : fpu avx2 fma\ncpu MHz : 3000")
    assert not cpu_has_bf16_matmul("processor : 0\n")
