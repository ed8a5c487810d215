"""``preference_data``: sample outputs from the SFT model, pair them, and label the pairs with the recipe's
annotator — the paper's recipe for a pairwise-feedback dataset (Section 3.1: two samples per instruction at
temperature 1.0, compared by the simulated annotators).

Each instruction gets ``k`` samples; exact duplicates are dropped (they would only ever tie); the rest are paired
``(s0, s1), (s2, s3), ...`` (``adjacent``, the paper's k = 2 case) or every pair (``all``). The dataset is JSON
lines loadable with ``datasets.load_dataset("json", data_files=...)``.

Missing labels fail the stage: when more than ``max_unlabelled_fraction`` of the pairs have no label (``failed``:
the annotator got no answer; ``unparsed``: its answer could not be read; ties are labels), the stage raises one
line naming the endpoint and the first error before anything is recorded, so it is never "complete" with holes.
What was answered is in the annotation cache: the next run (no ``--force`` needed) asks only for what is missing.
Within the tolerance, unlabelled pairs are written with ``preference: null`` and their ``outcome`` (methods skip
them) and counted in the stage's metrics, next to the run's ledger (requests, tokens, dollars).
"""

from __future__ import annotations

import itertools
import time
from collections import Counter
from typing import Literal

from pydantic import ConfigDict, Field

from alpacafarm.annotation import check_unlabelled
from alpacafarm.artifact_names import ArtifactName
from alpacafarm.data import write_jsonl
from alpacafarm.generation import SamplingConfig
from alpacafarm.method import Artifact, Method, Ranks, StageContext
from alpacafarm.recipe import GenerationBackendFields
from alpacafarm.types import Pair


class PreferenceDataConfig(GenerationBackendFields):
    model_config = ConfigDict(extra="forbid")

    split: str = Field("train", description="which file of the instruction splits to use")
    max_instructions: int | None = Field(None, ge=1)
    k: int = Field(2, ge=2, description="samples per instruction")
    pairing: Literal["adjacent", "all"] = "adjacent"
    sampling: SamplingConfig = Field(default_factory=lambda: SamplingConfig(temperature=1.0, max_new_tokens=128))
    max_unlabelled_fraction: float = Field(
        0.05, ge=0.0, le=1.0, description="the stage fails when more pairs than this have no label (failed or "
        "unparsed); what was labelled is cached, so a re-run asks only for the rest")


def make_pairs(samples: list[str], pairing: str) -> list[tuple[str, str]]:
    """Pairs of distinct samples (duplicates dropped first, order kept)."""
    unique = list(dict.fromkeys(s for s in samples if s.strip()))
    if pairing == "all":
        return list(itertools.combinations(unique, 2))
    return [(unique[i], unique[i + 1]) for i in range(0, len(unique) - 1, 2)]


class PreferenceData(Method):
    config_class = PreferenceDataConfig
    requires = (ArtifactName.SFT_MODEL, ArtifactName.INSTRUCTION_SPLITS)
    provides = ArtifactName.PREFERENCES
    annotator_role = "feedback"
    ranks = Ranks.ALL  # sampling is split across ranks; annotation and the file are the main process's

    def run(self, context: StageContext) -> Artifact:
        config: PreferenceDataConfig = self.config
        records = context.records("instruction_splits", config.split)[: config.max_instructions]
        sampling = config.sampling.model_copy(update={"n": config.k, "seed": config.sampling.seed + context.seed})
        # the generator is closed inside (the policy freed before the annotator: a local judge may need the memory)
        rows, _ = context.generate_on_ranks(config.backend, config.backend_config, records, sampling, "sampling")
        if not context.is_main:  # annotation runs once (on the main process), which writes the preferences
            return Artifact("dataset", str(context.stage_dir / "preferences.jsonl"))

        by_instruction: dict[int, list[str]] = {}
        for i, row in enumerate(rows):
            by_instruction.setdefault(i // config.k, []).append(row["output"])
        examples = []
        for index, samples in by_instruction.items():
            record = records[index]
            for out_1, out_2 in make_pairs(samples, config.pairing):
                examples.append({"instruction": record["instruction"], "input": record.get("input") or "",
                                 "output_1": out_1, "output_2": out_2})
        dropped = len(records) - len({e["instruction"] + "\x00" + e["input"] for e in examples})

        annotator = context.make_annotator("feedback")
        started = time.perf_counter()
        try:
            with context.progress(f"annotating ({annotator.name})", len(examples)) as advance:
                annotations = annotator.annotate([Pair.from_record(e) for e in examples],
                                                 lambda n, cost: advance(n))
            usage = annotator.usage()
        finally:
            annotator.close()
        outcomes = check_unlabelled(annotations, config.max_unlabelled_fraction,
                                    f"stage {context.stage!r} (annotator {annotator.name!r})")
        for example, annotation in zip(examples, annotations, strict=True):
            example.update(preference=annotation.preference, annotator=annotation.annotator,
                           noise=annotation.noise, price_usd=annotation.price_usd, outcome=annotation.outcome)
            if annotation.acceptable is not None:  # the pointwise labels KTO reads (kto.binary_feedback)
                example.update(acceptable_1=annotation.acceptable[0], acceptable_2=annotation.acceptable[1])
        path = context.stage_dir / "preferences.jsonl"
        write_jsonl(path, examples)
        labels = Counter(e["preference"] for e in examples)
        return Artifact("dataset", str(path), {
            "n_pairs": len(examples), "n_instructions": len(records), "instructions_without_pair": dropped,
            "labels": {str(k): v for k, v in labels.items()},
            "outcomes": outcomes.counts, "first_error": outcomes.first_error,
            "ledger": usage.to_json(), "cost_usd": round(usage.price_usd, 6),
            "annotation_seconds": round(time.perf_counter() - started, 2)})
