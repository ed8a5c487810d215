"""What ``benchmarks/stage_profile.py`` installs in the ``alpacafarm run`` process it profiles (not a program).

- torch's own FLOP counter (``torch.utils.flop_counter.FlopCounterMode``: every matrix product and attention the
  dispatcher runs, forward and backward, on the main thread);
- a forward hook on every ``nn.Embedding``: tokens read (padding included), and of them the tokens read with
  gradients on (training);
- a wrapper around the OpenVINO backend's public ``sample_ids``: prompt tokens prefilled (once per prompt) and tokens
  generated, each costing ``$ALPACAFARM_PROBE_TOKEN_FLOPS`` (twice the model's linear weights: set by the profiler
  from the recipe's model), since OpenVINO's kernels are not torch's.

A thread samples the running totals every half second; at exit they are written to the JSON file given to
:func:`install`, and the profiler assigns them to stages by the manifests' start and finish times.
"""

from __future__ import annotations

import atexit
import json
import os
import threading
import time
from pathlib import Path

TOTALS = {"flops": 0, "tokens": 0, "grad_tokens": 0, "ov_tokens": 0, "ov_flops": 0}


def install(path: str) -> None:
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    counter = FlopCounterMode(display=False)
    counter.__enter__()

    def seen(module, args, _output) -> None:
        if isinstance(module, torch.nn.Embedding) and args and hasattr(args[0], "numel"):
            TOTALS["tokens"] += int(args[0].numel())
            if torch.is_grad_enabled():
                TOTALS["grad_tokens"] += int(args[0].numel())

    torch.nn.modules.module.register_module_forward_hook(seen)
    token_flops = int(os.environ.get("ALPACAFARM_PROBE_TOKEN_FLOPS", "0"))
    try:
        from alpacafarm_generation.openvino_backend import OpenVINOGenerator
    except ImportError:  # the fast-cpu extra is not installed: nothing samples through OpenVINO
        OpenVINOGenerator = None
    if OpenVINOGenerator is not None:
        original = OpenVINOGenerator.sample_ids

        def sample_ids(self, queries, sampling, progress=None):
            responses = original(self, queries, sampling, progress)
            tokens = sum(len(q) for q in queries) + sum(len(r) for group in responses for r in group)
            TOTALS["ov_tokens"] += tokens
            TOTALS["ov_flops"] += tokens * token_flops
            return responses

        OpenVINOGenerator.sample_ids = sample_ids
    samples: list[dict[str, float]] = []

    def snapshot() -> None:
        for _ in range(3):  # the main thread may add an operator to the counter's table meanwhile
            try:
                flops = counter.get_total_flops()
                break
            except RuntimeError:
                continue
        else:
            return
        samples.append({"t": time.time(), **TOTALS, "flops": flops})

    def sample() -> None:
        while True:
            snapshot()
            time.sleep(0.5)

    threading.Thread(target=sample, daemon=True).start()

    def write() -> None:
        snapshot()
        Path(path).write_text(json.dumps(samples), encoding="utf-8")

    atexit.register(write)
