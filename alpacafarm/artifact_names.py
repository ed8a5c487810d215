"""The names stages' artifacts go by between stages: a method's ``requires``, ``optional`` and ``provides``.

A stage's input is wired by name (:mod:`alpacafarm.stage_wiring`): the latest earlier stage that *provides* that
name, a data source of that name, or a fallback. :class:`ArtifactName` holds the names the built-ins use, each
with its meaning in :data:`MEANINGS` (CONTRIBUTING's table lists the same names; ``tests/test_artifact_names.py``
keeps them one list). An ``ArtifactName`` is a ``str``: a method may write ``requires = (ArtifactName.SFT_MODEL,
ArtifactName.PREFERENCES)`` or the plain strings (:class:`alpacafarm.method.Method` keeps them as plain strings),
and a plugin may hand on a name of its own (document its format).
"""

from __future__ import annotations

from enum import StrEnum


class ArtifactName(StrEnum):
    """A name the built-in stages require and provide artifacts under (its meaning: :data:`MEANINGS`); not to be
    confused with an artifact's typed hand-offs (``files``, ``systems``, ...: :mod:`alpacafarm.artifacts`)."""

    BASE_MODEL = "base_model"
    SFT_DATA = "sft_data"
    SFT_MODEL = "sft_model"
    INSTRUCTIONS = "instructions"
    INSTRUCTION_SPLITS = "instruction_splits"
    PREFERENCES = "preferences"
    REWARD_MODEL = "reward_model"
    POLICY_OUTPUTS = "policy_outputs"
    POLICY_MODEL = "policy_model"
    KL_REFERENCE = "kl_reference"
    POLICY = "policy"
    EVALUATION = "evaluation"
    MODEL_REPORT = "model_report"


_ = ArtifactName
#: What the artifact behind each name is.
MEANINGS: dict[ArtifactName, str] = {
    _.BASE_MODEL: "the recipe's model block (hub ID, local folder or offline alias, how to load it); its path is "
                  "model.name; provided by the pipeline",
    _.SFT_DATA: "demonstrations to fine-tune on: records with instruction, input, output",
    _.SFT_MODEL: "a causal-LM folder (weights and tokenizer), the starting policy of every method; sft's, else "
                 "base_model",
    _.INSTRUCTIONS: "instruction records (instruction, optional input, often a reference answer)",
    _.INSTRUCTION_SPLITS: "a folder with train.jsonl and eval.jsonl (and validation.jsonl), named in the artifact's "
                          "files",
    _.PREFERENCES: "preferences.jsonl: instruction, input, output_1, output_2, preference (1, 2, 0 tie, null)",
    _.REWARD_MODEL: "a sequence-classifier folder (one score per text), used through context.reward_function()",
    _.POLICY_OUTPUTS: "an outputs file (JSONL: instruction, input, output, ...), or several systems",
    _.POLICY_MODEL: "a causal-LM folder trained from the SFT model (stages/<stage>/model/, with metrics.json)",
    _.KL_REFERENCE: "a model folder the answers' KL is measured against (generate_outputs: wired by inputs:)",
    _.POLICY: "an evaluator's input: the evaluated stage's artifact (one policy:<stage> input each)",
    _.EVALUATION: "the evaluation's results (metrics.json, tables)",
    _.MODEL_REPORT: "a summary of a model (summary.json)",
}
del _
