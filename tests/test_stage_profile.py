"""benchmarks/stage_profile.py (issue 60): the work it assigns to a stage is what the probe counted between the
stage's start and finish, and a token's FLOPs are twice the model's linear weights."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import stage_profile


def test_each_stage_gets_the_work_counted_while_it_ran():
    manifests = [{"stage": "a", "started_at": "2026-12-02T05:00:00+00:00", "finished_at": "2026-12-02T05:00:09+00:00",
                  "duration_s": 9.4},
                 {"stage": "b", "started_at": "2026-12-02T05:00:10+00:00", "finished_at": "2026-12-02T05:00:19+00:00",
                  "duration_s": 9.0}]
    from datetime import datetime

    base = datetime.fromisoformat("2026-12-02T05:00:00+00:00").timestamp()
    zero = {"flops": 0, "tokens": 0, "grad_tokens": 0, "ov_tokens": 0, "ov_flops": 0}
    samples = [{"t": base - 1, **zero},
               {"t": base + 9.5, **zero, "flops": 100, "tokens": 10, "ov_tokens": 4, "ov_flops": 40},
               {"t": base + 19.5, **zero, "flops": 250, "tokens": 30, "grad_tokens": 20, "ov_tokens": 4,
                "ov_flops": 40}]
    rows = stage_profile.stage_rows(manifests, samples)
    assert [(r["stage"], r["seconds"], r["flops"], r["tokens"], r["grad_tokens"], r["ov_flops"]) for r in rows] == [
        ("a", 9.4, 100, 10, 0, 40), ("b", 9.0, 150, 20, 20, 0)]


def test_a_token_costs_twice_the_linear_weights(tiny_model_dir: str, tmp_path: Path):
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(tiny_model_dir)
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"name: p\nmodel: {{name: {tiny_model_dir}}}\nstages:\n  - {{name: s, method: sft}}\n",
                      encoding="utf-8")
    h, i, layers, vocab = config.hidden_size, config.intermediate_size, config.num_hidden_layers, config.vocab_size
    kv = config.num_key_value_heads * (h // config.num_attention_heads)
    per_layer = h * h * 2 + h * kv * 2 + 3 * h * i  # q and o, k and v, gate/up/down
    assert stage_profile.token_flops(recipe, []) == 2 * (layers * per_layer + vocab * h)
