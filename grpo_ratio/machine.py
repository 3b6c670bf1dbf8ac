"""Memory of a benchmarked run on Linux: the peak resident set size inside a block (the kernel's `VmHWM` after a
reset, else a psutil sampling thread), and the glibc settings that make freed tensors show up as freed. Used by
benchmarks/step_cost.py; `psutil` is imported only where the kernel counter is unavailable or RSS is read."""

from __future__ import annotations

import contextlib
import ctypes
import gc
import re
import threading
from pathlib import Path


def _read_status_kb(key: str) -> int:
    match = re.search(rf"^{key}:\s+(\d+) kB", Path("/proc/self/status").read_text(), re.M)
    return int(match.group(1))


def _reset_kernel_peak() -> bool:
    """Reset the kernel's peak-RSS counter (Linux >= 4.0); False where that is not possible."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def rss_bytes() -> int:
    """Current resident set size of this process, in bytes."""
    import psutil

    return psutil.Process().memory_info().rss


class PeakRSS:
    """Peak resident set size (bytes) of this process inside a `with` block: the kernel's `VmHWM` after a reset,
    else a psutil sampling thread (5 ms period)."""

    def __enter__(self):
        self.peak = rss_bytes()
        self._kernel = _reset_kernel_peak()
        self.method = "kernel VmHWM (reset via /proc/self/clear_refs)"
        if not self._kernel:
            self.method = "psutil RSS sampled every 5 ms"
            self._stop = threading.Event()
            self._thread = threading.Thread(target=self._sample, daemon=True)
            self._thread.start()
        return self

    def _sample(self):
        while not self._stop.wait(0.005):
            self.peak = max(self.peak, rss_bytes())

    def __exit__(self, *exc):
        if self._kernel:
            self.peak = max(self.peak, _read_status_kb("VmHWM") * 1024)
        else:
            self._stop.set()
            self._thread.join()
            self.peak = max(self.peak, rss_bytes())


def release_memory() -> None:
    """Collect garbage and hand freed heap memory back to the OS, so the next arm starts from a clean baseline."""
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def steady_malloc() -> None:
    """glibc: serve every allocation above 128 KiB by mmap, so freed tensors return to the OS. By default glibc
    raises that threshold after frees (up to 32 MiB), and one arm's freed weights would then be reused by the next
    without showing in its RSS."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").mallopt(-3, 128 * 1024)  # M_MMAP_THRESHOLD; setting it disables the dynamic one


def machine_record() -> dict:
    """The machine a benchmark ran on, for its result file: `cpu` (the model name in /proc/cpuinfo, else
    `platform.processor()`), `cores` (os.cpu_count()), `isa` (the widest x86 matmul extensions torch's
    CPU kernels detect: AVX2, AVX512, AVX512-BF16, AMX), `native_bf16` (AVX512-BF16 or AMX: whether bf16 autocast runs
    natively or is emulated, `grpo_ratio.checks.cpu_has_native_bf16`) and `load_before` (the 1-minute load average when
    the record is made: 0.0 on an idle machine). Timings move with all of them, so a table says which machine it is
    from."""
    import os
    import platform

    import torch

    cpu = platform.processor()
    with contextlib.suppress(OSError):
        match = re.search(r"^model name\s*:\s*(.+)$", Path("/proc/cpuinfo").read_text(), re.M)
        cpu = match.group(1).strip() if match else cpu
    checks = {"AVX2": "_is_avx2_supported", "AVX512": "_is_avx512_supported",
              "AVX512-BF16": "_is_avx512_bf16_supported", "AMX": "_is_amx_tile_supported"}
    isa = [name for name, fn in checks.items() if getattr(torch.cpu, fn, lambda: False)()]
    return {"cpu": cpu, "cores": os.cpu_count(), "isa": isa, "native_bf16": cpu_has_native_bf16(),
            "load_before": round(os.getloadavg()[0], 2)}


def describe_machine(machine: dict | None, load: bool = True) -> str:
    """One phrase for a table header from `machine_record()`'s dict (with its start load unless `load=False`);
    "machine not recorded" for results made before the record existed."""
    if not machine:
        return "machine not recorded"
    bf16 = "native bf16" if machine["native_bf16"] else "no native bf16: bf16 emulated"
    isa = "/".join(machine.get("isa", [])) or "no AVX2"
    text = f"{machine['cores']}-core {machine['cpu']} ({isa}; {bf16})"
    return text + (f", load {machine['load_before']:.2f} at the start" if load else "")


def cpu_has_native_bf16() -> bool:
    import torch

    """Whether this CPU computes bf16 matmuls natively (x86 AVX512-BF16 or AMX, as torch's oneDNN kernels use them);
    False on CPUs where torch emulates bf16 (AVX2-only x86: measured ~50x slower than fp32 for a SmolLM2-sized
    matmul on a 2-core AMD EPYC, docs/benchmarks.md)."""
    return bool(torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())
