"""``generate_outputs``: sample the (SFT) model's outputs for an instruction split and write them as JSONL."""

from __future__ import annotations

import time
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from alpacafarm.generation import SamplingConfig, generate_records, write_completions
from alpacafarm.method import OUTPUTS_FILE, Artifact, Method, StageContext


class GenerateOutputsConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    split: str = Field("eval", description="which file of the instructions input (train/eval)")
    max_instructions: int | None = Field(None, ge=1)
    sampling: SamplingConfig = Field(default_factory=lambda: SamplingConfig(temperature=0.7, max_new_tokens=128))
    backend: str = "transformers"
    backend_config: dict[str, Any] = Field(default_factory=dict, description="the backend's own options")


class GenerateOutputs(Method):
    """Writes ``outputs.jsonl`` (instruction, input, output, sample_index, ...) for the chosen split."""

    config_class = GenerateOutputsConfig
    requires = ("sft_model", "instruction_splits")
    provides = "policy_outputs"

    def run(self, context: StageContext) -> Artifact:
        config: GenerateOutputsConfig = self.config
        records = context.records("instruction_splits", config.split)[: config.max_instructions]
        generator = context.generator(config.backend, config.backend_config)
        sampling = config.sampling.model_copy(update={"seed": config.sampling.seed + context.seed})
        started = time.perf_counter()
        with context.progress(f"generating ({config.backend})", len(records)) as advance:
            rows = generate_records(generator, records, sampling, progress=advance)
        seconds = time.perf_counter() - started
        path = context.stage_dir / OUTPUTS_FILE
        write_completions(path, rows)
        tokens = sum(map(sum, generator.last_token_counts or [[0]]))
        return Artifact("outputs", str(path), {"n_instructions": len(records), "n_outputs": len(rows),
                                               "seconds": round(seconds, 2),
                                               "tokens_per_second": round(tokens / seconds, 1) if tokens else None})
