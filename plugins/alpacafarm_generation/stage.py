"""``generate_outputs``: sample the (SFT) model's outputs for an instruction split and write them as JSONL."""

from __future__ import annotations

import time
from typing import Any

from pydantic import ConfigDict, Field

from alpacafarm.artifact_names import ArtifactName
from alpacafarm.generation import SamplingConfig, write_completions
from alpacafarm.method import OUTPUTS_FILE, Artifact, Method, Ranks, StageContext, System
from alpacafarm.recipe import GenerationBackendFields


class GenerateOutputsConfig(GenerationBackendFields):
    """Which instructions and how to sample them.

    Sampling defaults to the evaluation decoding: temperature 0.7 (the paper, Section 4.1: every system but
    best-of-n) and top_p 0.9 (the released decoding, ``HFDecodingArguments`` in ``alpaca_farm/inference/decode.py``;
    the paper states no top_p for its own models, 1.0 for the API baselines).
    """

    model_config = ConfigDict(extra="forbid")

    split: str = Field("eval", description="which file of the instructions input (train/eval)")
    max_instructions: int | None = Field(None, ge=1)
    sampling: SamplingConfig = Field(
        default_factory=lambda: SamplingConfig(temperature=0.7, top_p=0.9, max_new_tokens=128),
        description="omitted: the evaluation decoding; a sampling block given replaces it (unset fields take "
                    "SamplingConfig's own defaults, top_p 1.0)")
    snapshots: bool = Field(False, description=(
        "also sample every snapshot the model's stage listed (e.g. PPO's snapshot_steps): one system per step for "
        "the evaluation, so win-rate and proxy reward can be followed over training"))


class GenerateOutputs(Method):
    """Writes ``outputs.jsonl`` (instruction, input, output, sample_index, ...) for the chosen split.

    With ``snapshots: true`` it samples each snapshot of the ``sft_model`` input too (its artifact's
    :class:`~alpacafarm.artifacts.Snapshot` list) into ``step-<N>.jsonl``, with the same seed for every step, and
    hands them on as the artifact's :class:`~alpacafarm.artifacts.System` list (``<stage>@<step>``, each with its
    ``step`` and the ``train_reward`` its stage recorded there, e.g. PPO's mean rollout reward since the snapshot
    before): the evaluation judges each and plots win-rate and proxy reward against the step. The artifact's path
    is ``outputs.jsonl``, the final model's samples, either way."""

    config_class = GenerateOutputsConfig
    requires = (ArtifactName.SFT_MODEL, ArtifactName.INSTRUCTION_SPLITS)
    #: ``kl_reference`` (e.g. ``inputs: {sft_model: ppo, kl_reference: base_model}``): each output also gets its
    #: ``logprob`` under the sampled model and ``reference_logprob`` under this one, at the sampling temperature,
    #: from which the evaluation estimates the policy's KL to the reference (:mod:`alpacafarm.divergence`)
    optional = (ArtifactName.KL_REFERENCE,)
    provides = ArtifactName.POLICY_OUTPUTS
    ranks = Ranks.ALL  # the transformers backend's batches are split across ranks

    def run(self, context: StageContext) -> Artifact:
        config: GenerateOutputsConfig = self.config
        records = context.records("instruction_splits", config.split)[: config.max_instructions]
        sampling = config.sampling.model_copy(update={"seed": config.sampling.seed + context.seed})
        started = time.perf_counter()
        rows, tokens = context.generate_on_ranks(config.backend, config.backend_config, records, sampling,
                                                 f"generating ({config.backend})")
        seconds = time.perf_counter() - started
        path = context.stage_dir / OUTPUTS_FILE
        if context.is_main:
            write_completions(path, self.with_logprobs(context, rows, context.input("sft_model").path))
        metadata = {"n_instructions": len(records), "n_outputs": len(rows), "seconds": round(seconds, 2),
                    "tokens_per_second": round(tokens / seconds, 1) if tokens else None}
        systems = self.sample_snapshots(context, records, sampling) if config.snapshots else []
        return Artifact("outputs", str(path), metadata, systems=systems)

    def sample_snapshots(self, context: StageContext, records: list[dict[str, Any]],
                         sampling: Any) -> list[System]:
        """Sample every snapshot of the ``sft_model`` input; one :class:`System` per snapshot, by step."""
        from pathlib import Path

        from alpacafarm.errors import UserError

        model = context.input("sft_model")
        if not model.snapshots:
            raise UserError(f"stage {context.stage!r}: snapshots: true, but the model's stage hands on no "
                            "snapshots (PPO writes them with snapshot_steps)")
        final = Path(model.path).resolve() if model.path else None
        systems: list[System] = []
        for snapshot in sorted(model.snapshots, key=lambda s: s.step):
            if Path(snapshot.path).resolve() == final:  # the final policy: sampled above
                path = context.stage_dir / OUTPUTS_FILE
            else:
                path = context.stage_dir / f"step-{snapshot.step}.jsonl"
                rows, _ = context.generate_on_ranks(self.config.backend, self.config.backend_config, records,
                                                    sampling, f"generating step {snapshot.step} "
                                                    f"({self.config.backend})", model_path=snapshot.path)
                if context.is_main:
                    write_completions(path, self.with_logprobs(context, rows, str(snapshot.path)))
            systems.append(System(f"{context.stage}@{snapshot.step}", str(path), step=snapshot.step,
                                  train_reward=snapshot.train_reward))
        return systems

    def with_logprobs(self, context: StageContext, rows: list[dict[str, Any]], model_path: str) -> list[dict[str, Any]]:
        """``rows`` with ``logprob`` (under ``model_path``) and ``reference_logprob`` (under the ``kl_reference``
        input) when the recipe wires one; the rows unchanged otherwise."""
        if "kl_reference" not in context.inputs:
            return rows
        from alpacafarm.divergence import sequence_logprobs
        from alpacafarm.errors import UserError

        sampling = self.config.sampling
        if sampling.temperature <= 0:
            raise UserError(f"stage {context.stage!r}: a kl_reference needs sampling at a temperature > 0 (greedy "
                            "outputs have no distribution to compare)")
        spec = context.recipe.model
        scored = {}
        with context.progress("log-probabilities for the KL", 2) as advance:
            for field, location in (("logprob", model_path), ("reference_logprob",
                                                              context.input("kl_reference").path)):
                scored[field] = sequence_logprobs(spec, location, rows, temperature=sampling.temperature,
                                                  max_new_tokens=sampling.max_new_tokens,
                                                  batch_size=sampling.batch_size)
                advance(1)
        return [{**row, "logprob": lp, "reference_logprob": ref}
                for row, lp, ref in zip(rows, scored["logprob"], scored["reference_logprob"], strict=True)]
