"""``inference_dtype: bfloat16_if_native``: bfloat16 only where the device computes it in hardware."""

from __future__ import annotations

import pytest

from alpacafarm.hardware import BFLOAT16_CPU_FLAGS, cpu_flags, native_bfloat16
from alpacafarm.recipe import ModelSpec

AVX2_ONLY = "processor\t: 0\nflags\t\t: fpu sse2 avx avx2 fma\n"
SAPPHIRE_RAPIDS = "processor\t: 0\nflags\t\t: fpu avx2 avx512f avx512_bf16 amx_bf16 amx_tile\n"


def test_cpu_flags_are_read_from_cpuinfo_text():
    assert "avx2" in cpu_flags(AVX2_ONLY) and not BFLOAT16_CPU_FLAGS & cpu_flags(AVX2_ONLY)
    assert cpu_flags(SAPPHIRE_RAPIDS) >= BFLOAT16_CPU_FLAGS
    assert not cpu_flags("no flags line here")


@pytest.mark.parametrize(("native", "expected"), [(False, "float32"), (True, "bfloat16")])
def test_bfloat16_if_native_resolves_on_the_machine(monkeypatch: pytest.MonkeyPatch, native: bool, expected: str):
    """On an AVX2-only CPU, sampling and scoring in emulated bfloat16 ran ~40x slower than float32: the recipes
    that asked for bfloat16 to go faster went far slower. ``bfloat16_if_native`` asks for it only where it is
    native; an explicit ``bfloat16`` is kept as written."""
    import alpacafarm.hardware as hardware

    native_bfloat16.cache_clear()
    monkeypatch.setattr(hardware, "cpu_flags", lambda cpuinfo=None: cpu_flags(SAPPHIRE_RAPIDS if native
                                                                              else AVX2_ONLY))
    try:
        spec = ModelSpec(name="m", dtype="float32", device="cpu", inference_dtype="bfloat16_if_native")
        assert spec.for_inference().dtype == expected
        assert spec.for_training().dtype == "float32"
        explicit = ModelSpec(name="m", dtype="float32", device="cpu", inference_dtype="bfloat16")
        assert explicit.for_inference().dtype == "bfloat16"
    finally:
        native_bfloat16.cache_clear()


@pytest.mark.parametrize(("native", "expected"), [
    (False, "float32 (inference_dtype: bfloat16_if_native; this CPU has none of amx_bf16, avx512_bf16"),
    (True, "bfloat16 (inference_dtype: bfloat16_if_native; this CPU has amx_bf16, avx512_bf16)"),
])
def test_the_precision_line_names_the_choice_and_the_flags_that_decided_it(monkeypatch: pytest.MonkeyPatch,
                                                                          native: bool, expected: str):
    """A user whose quickstart ran four times slower than the README said could not tell why: nothing printed the
    precision ``bfloat16_if_native`` chose. ``alpacafarm run`` prints this line at its start."""
    import alpacafarm.hardware as hardware
    from alpacafarm.hardware import precision_line

    native_bfloat16.cache_clear()
    monkeypatch.setattr(hardware, "cpu_flags", lambda cpuinfo=None: cpu_flags(SAPPHIRE_RAPIDS if native
                                                                              else AVX2_ONLY))
    try:
        assert precision_line("float32", "bfloat16_if_native", "cpu").startswith(
            f"precision: sampling and scoring in {expected}")
        assert precision_line("float32", "bfloat16", "cpu").endswith("in bfloat16 (the model block's inference_dtype)")
        assert "in float32 (the model block's dtype; no inference_dtype set)" in precision_line("float32", None, "cpu")
    finally:
        native_bfloat16.cache_clear()
