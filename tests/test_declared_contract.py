"""What a plugin offers beyond its base class is declared (a base-class attribute or method, a config type), never
an attribute or a parameter the core looks for by name: a lookalike is not consulted, a declaration is."""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel, ConfigDict

import alpacafarm
from alpacafarm.annotation import (
    Annotator,
    AnnotatorBuilder,
    aannotate_replicate,
    add_annotator_options,
    annotator_from_options,
)
from alpacafarm.errors import RecipeError, UserError
from alpacafarm.method import Artifact, Method, StageContext
from alpacafarm.recipe import GenerationBackendFields, GenerationBackendOptions, load_recipe
from alpacafarm.registry import Registry
from alpacafarm.types import Annotation, Pair

# ------------------------------------------------------------------------ a stage config's generation backend


class SamplesConfig(GenerationBackendFields):
    model_config = ConfigDict(extra="forbid")


@dataclasses.dataclass
class SamplesDataclassConfig(GenerationBackendOptions):
    rounds: int = 1


class NamedBackendConfig(BaseModel):  # a field that happens to be called ``backend``: a database, not a sampler
    model_config = ConfigDict(extra="forbid")
    backend: str = "sqlite"


def _method(config_class: Any) -> type[Method]:
    class Sampler(Method):
        provides = "report"

        def run(self, context: StageContext) -> Artifact:
            return Artifact("report", None, {})

    Sampler.config_class = config_class
    return Sampler


class BackendPlugin:
    @alpacafarm.hookimpl
    def register_methods(self, register):
        register("samples", _method(SamplesConfig))
        register("samples_dc", _method(SamplesDataclassConfig))
        register("stores", _method(NamedBackendConfig))


@pytest.mark.parametrize("method", ["samples", "samples_dc"])
def test_a_config_that_samples_is_checked_for_a_registered_backend(method: str, register_test_plugin,
                                                                  tmp_path: Path):
    register_test_plugin(BackendPlugin(), "backend-plugin")
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"name: r\nstages:\n  - name: s\n    method: {method}\n    config: {{backend: transformer}}\n",
                      encoding="utf-8")
    with pytest.raises(RecipeError, match=r"r\.yaml:5: stages\[0\]\.config\.backend: unknown generation backend "
                                          r"'transformer'; did you mean 'transformers'"):
        load_recipe(recipe)
    recipe.write_text(f"name: r\nstages:\n  - name: s\n    method: {method}\n    config: {{backend: openai}}\n",
                      encoding="utf-8")
    assert load_recipe(recipe).stage_configs["s"].backend == "openai"


def test_a_field_merely_named_backend_is_not_a_generation_backend(register_test_plugin, tmp_path: Path):
    register_test_plugin(BackendPlugin(), "backend-plugin")
    recipe = tmp_path / "r.yaml"
    recipe.write_text("name: r\nstages:\n  - {name: s, method: stores, config: {backend: postgres}}\n",
                      encoding="utf-8")
    assert load_recipe(recipe).stage_configs["s"].backend == "postgres"  # looked up by name before: refused


# ------------------------------------------------------------------------------------- annotators' declarations


class AnyKeywordJudge(Annotator):
    """Takes any keyword but does not declare replicates: its repeats would be copies."""

    name = "any_keyword"

    async def aannotate(self, pairs: Sequence[Pair], progress: Any = None, **options: Any) -> list[Annotation]:
        return [Annotation(1, self.name) for _ in pairs]


class ReplicatingJudge(AnyKeywordJudge):
    name = "replicating"
    accepts_replicate = True

    async def aannotate(self, pairs: Sequence[Pair], progress: Any = None, **options: Any) -> list[Annotation]:
        return [Annotation(1, self.name, metadata={"replicate": options.get("replicate")}) for _ in pairs]


def test_replicates_are_asked_of_an_annotator_that_declares_them_only():
    import asyncio

    pairs = [Pair("i", "a", "b")]
    with pytest.raises(UserError, match=r"annotator 'any_keyword' cannot draw replicate annotations: its class "
                                        r"AnyKeywordJudge does not declare accepts_replicate = True"):
        asyncio.run(aannotate_replicate(AnyKeywordJudge(), pairs, replicate=1))
    (annotation,) = asyncio.run(aannotate_replicate(ReplicatingJudge(), pairs, replicate=2))
    assert annotation.metadata == {"replicate": 2}
    assert AnyKeywordJudge().annotate(pairs)[0].preference == 1  # replicate 0 is the plain call for everyone


@dataclasses.dataclass
class SeededConfig:
    seed: int = 0
    base_url: str | None = None


class SeededJudge(Annotator):
    config_class = SeededConfig

    def __init__(self, config: SeededConfig) -> None:
        self.config = config

    @classmethod
    def cli_config(cls, options: dict[str, Any]) -> dict[str, Any]:
        return {**options, "seed": options.get("seed", 0) + 100}


class PresetBuilder(AnnotatorBuilder):
    config_class = SeededConfig

    def cli_config(self, options: dict[str, Any]) -> dict[str, Any]:
        return {"seed": 7}

    def __call__(self, config: Any, **runtime: Any) -> Annotator:
        return SeededJudge(config)


def seeded_function(config: Any) -> Annotator:
    return SeededJudge(config)


seeded_function.config_class = SeededConfig  # type: ignore[attr-defined]
seeded_function.cli_config = lambda options: {"seed": 999}  # type: ignore[attr-defined]  # not a declaration


def _options(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_annotator_options(parser)
    return parser.parse_args(list(argv))


def test_cli_config_is_the_declared_method_of_an_annotator_class_or_builder():
    registry = Registry()
    registry.add("annotator", "seeded", SeededJudge, "p")
    registry.add("annotator", "preset", PresetBuilder(), "p")
    registry.add("annotator", "function", seeded_function, "p")
    assert annotator_from_options(registry, "seeded", _options("--seed", "3")).config.seed == 103
    assert annotator_from_options(registry, "preset", _options("--seed", "3")).config.seed == 7
    # a function's attribute named cli_config is no declaration: the options are its block
    assert annotator_from_options(registry, "function", _options("--seed", "3")).config.seed == 3
    with pytest.raises(UserError, match=r"^annotator 'function' takes no --no-cache \(its config fields: "
                                        r"base_url, seed\)$"):
        annotator_from_options(registry, "function", _options("--no-cache"))


# ------------------------------------------------------------------------------------- the reward's text order


def test_scoring_batches_follow_a_reward_scorers_full_text_and_nothing_else_by_name():
    from alpacafarm.reward_selection import score_batches
    from alpacafarm.rewards import RewardScorer
    from alpacafarm.testing import tiny_sequence_classifier, tiny_tokenizer

    rows = [{"instruction": "Say it.", "input": "x", "output": "short"},  # an input: the longer prompt template
            {"instruction": "Say it.", "input": "", "output": "a longer answer than that one"}]
    tokenizer = tiny_tokenizer()
    scorer = RewardScorer(tiny_sequence_classifier(tokenizer), tokenizer)
    full = [len(scorer.full_text(row, row["output"])) for row in rows]
    raw = [len(row["instruction"]) + len(row["input"]) + len(row["output"]) for row in rows]
    assert full[0] > full[1] and raw[0] < raw[1]  # the two orders disagree on these rows
    assert score_batches(scorer, rows, 1) == [[0], [1]]  # the scorer's own order: its full texts

    def reward(records: Any, completions: Any) -> list[float]:
        return [0.0] * len(completions)

    reward.full_text = lambda record, completion: "x" * (100 - len(completion))  # type: ignore[attr-defined]
    assert score_batches(reward, rows, 1) == [[1], [0]]  # any other function: the rows' own text lengths


# ------------------------------------------------------------------------------------------ a method's class


class LooksLikeAMethod:  # every attribute a Method declares, but not a Method
    config_class = None
    provides = "report"
    requires: tuple[str, ...] = ()
    optional: tuple[str, ...] = ()
    annotator_role = None


class LookalikePlugin:
    @alpacafarm.hookimpl
    def register_methods(self, register):
        register("lookalike", LooksLikeAMethod)


def test_a_method_target_that_is_not_a_method_class_is_refused_when_the_recipe_loads(register_test_plugin,
                                                                                      tmp_path: Path):
    from alpacafarm.errors import PluginError

    register_test_plugin(LookalikePlugin(), "lookalike-plugin")
    recipe = tmp_path / "r.yaml"
    recipe.write_text("name: r\nstages:\n  - {name: s, method: lookalike}\n", encoding="utf-8")
    with pytest.raises(PluginError, match=r"^method 'lookalike' of plugin 'lookalike-plugin': its target "
                                          r".*LooksLikeAMethod is not a subclass of alpacafarm\.method\.Method$"):
        load_recipe(recipe)
