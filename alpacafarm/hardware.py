"""What the machine computes natively, for choices a recipe leaves to it (``inference_dtype: bfloat16_if_native``).

bfloat16 halves the memory traffic of sampling and scoring where the hardware has bfloat16 arithmetic (CPUs with
AVX512-BF16 or AMX, GPUs from Ampere on), and is emulated — tens of times slower — where it has not: measured on
an AVX2-only AMD EPYC with torch 2.13, a 1024² matmul ran at 8.8 GFLOPS in float32 and 0.2 in bfloat16.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path

#: CPU flags (``/proc/cpuinfo``) that mean bfloat16 arithmetic in hardware.
BFLOAT16_CPU_FLAGS = frozenset({"avx512_bf16", "amx_bf16"})


def cpu_flags(cpuinfo: str | None = None) -> frozenset[str]:
    """The CPU's feature flags from ``/proc/cpuinfo`` text (read from the machine when None; empty elsewhere)."""
    if cpuinfo is None:
        path = Path("/proc/cpuinfo")
        cpuinfo = path.read_text(encoding="utf-8", errors="replace") if path.is_file() else ""
    for line in cpuinfo.splitlines():
        if line.startswith("flags"):
            return frozenset(line.partition(":")[2].split())
    return frozenset()


@cache
def native_bfloat16(device: str) -> bool:
    """Whether ``device`` ("cpu", "cuda", "cuda:1", "auto") computes bfloat16 in hardware; "auto" is the device
    the model loads on (a GPU when there is one)."""
    if device.startswith("cuda") or device == "auto":
        import torch

        if torch.cuda.is_available():
            return bool(torch.cuda.is_bf16_supported())
        if device != "auto":
            return False
    return bool(BFLOAT16_CPU_FLAGS & cpu_flags())


def precision_line(dtype: str, inference_dtype: str | None, device: str) -> str:
    """The one line ``alpacafarm run`` prints at its start: the precision sampling and scoring use, and why
    (the recipe's choice, or what ``bfloat16_if_native`` found on this machine and the CPU flags that decided it).
    Training always keeps float32 master weights (:meth:`alpacafarm.recipe.ModelSpec.for_training`)."""
    if inference_dtype is None:
        return f"precision: sampling and scoring in {dtype} (the model block's dtype; no inference_dtype set)"
    if inference_dtype != "bfloat16_if_native":
        return f"precision: sampling and scoring in {inference_dtype} (the model block's inference_dtype)"
    if native_bfloat16(device):
        found = sorted(BFLOAT16_CPU_FLAGS & cpu_flags()) if not device.startswith("cuda") else []
        why = f"this CPU has {', '.join(found)}" if found else "this device computes bfloat16 in hardware"
        return f"precision: sampling and scoring in bfloat16 (inference_dtype: bfloat16_if_native; {why})"
    return ("precision: sampling and scoring in float32 (inference_dtype: bfloat16_if_native; this CPU has none of "
            f"{', '.join(sorted(BFLOAT16_CPU_FLAGS))}, so bfloat16 would be emulated, tens of times slower)")
