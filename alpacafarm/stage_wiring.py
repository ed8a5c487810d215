"""Planning a recipe's stages: each stage's inputs wired to the stage, data source or model that provides them.

:func:`plan` resolves every stage's inputs (an explicit ``inputs:`` entry, else the latest earlier stage that
provides the requirement, a data source of that name, a stage of that name, or the model block for ``sft_model``);
errors name the stage and the YAML path. :func:`input_warnings` says where a stage took the latest of several
providers because the recipe named none. :mod:`alpacafarm.pipeline` runs what is planned here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from alpacafarm.artifact_names import ArtifactName
from alpacafarm.errors import did_you_mean
from alpacafarm.method import Method
from alpacafarm.recipe import LoadedRecipe
from alpacafarm.registry import Registry

BASE_MODEL = str(ArtifactName.BASE_MODEL)
EVALUATION_STAGE = "evaluate"
#: Requirements that fall back to another provider when no stage provides them.
FALLBACKS = {str(ArtifactName.SFT_MODEL): BASE_MODEL}


@dataclass
class PlannedStage:
    """A stage ready to run: its method class, validated config, and where each input comes from."""

    name: str
    method: str
    method_cls: type[Method]
    plugin: str
    kind: str  # "method" or "evaluator": the plugin kind (registry.PLUGIN_KINDS) that builds it
    config: Any
    raw_config: dict[str, Any]
    inputs: dict[str, str] = field(default_factory=dict)
    #: Inputs the recipe did not name that several earlier stages provide: requirement -> those stages, in order
    #: (the stage takes the last one; :func:`input_warnings` says so).
    ambiguous: dict[str, list[str]] = field(default_factory=dict)


def plan(loaded: LoadedRecipe, registry: Registry) -> list[PlannedStage]:
    """Resolve every stage's inputs; errors name the stage and the YAML path."""
    recipe, doc = loaded.recipe, loaded.source
    planned: list[PlannedStage] = []
    providers: dict[str, list[str]] = {}  # what → every stage that provides it, in order (the latest last)

    def resolve(where: tuple[Any, ...], stage_name: str, method: str, requirement: str, explicit: str | None,
                optional: bool = False) -> str | None:
        known = [BASE_MODEL, *recipe.data, *(p.name for p in planned)]
        if explicit is not None:
            if explicit in known and not (explicit == BASE_MODEL and recipe.model is None):
                return explicit
            raise doc.error(
                (*where, "inputs", requirement),
                f"{explicit!r} is not an earlier stage, a data name or {BASE_MODEL!r}{did_you_mean(explicit, known)}",
            )
        for candidate in (providers.get(requirement, [None])[-1], requirement if requirement in recipe.data else None,
                          requirement if any(p.name == requirement for p in planned) else None):
            if candidate:
                return candidate
        if optional:
            return None
        fallback = FALLBACKS.get(requirement, requirement)
        if fallback == BASE_MODEL and recipe.model is not None:
            return BASE_MODEL
        if fallback == BASE_MODEL:
            raise doc.error(("model",), f"stage {stage_name!r} (method {method!r}) needs a model: add a 'model:' block")
        named = where[0] if len(where) == 1 else f"{where[0]}[{where[1]}]"
        raise doc.error(
            where,
            f"stage {stage_name!r} (method {method!r}) needs {requirement!r} but no earlier stage provides it and no "
            f"data source is named so; add one, or set {named}.inputs.{requirement}",
        )

    def wire(where: tuple[Any, ...], name: str, method: str, requires: tuple[str, ...], optional: tuple[str, ...],
             explicit: dict[str, str]) -> tuple[dict[str, str], dict[str, list[str]]]:
        """The stage's inputs, and those the recipe left unnamed that it took from the latest of several providers."""
        inputs = {r: resolve(where, name, method, r, explicit.get(r)) for r in requires}
        for r in optional:
            provider = resolve(where, name, method, r, explicit.get(r), optional=True)
            if provider is not None:
                inputs[r] = provider
        ambiguous = {r: list(providers[r]) for r, source in inputs.items()
                     if r not in explicit and len(providers.get(r, ())) > 1 and source == providers[r][-1]}
        return inputs, ambiguous

    for i, spec in enumerate(recipe.stages):
        if not spec.enabled:
            continue
        entry = registry.entry("method", spec.method)
        method_cls = registry.target_class("method", spec.method)  # a Method subclass, else one line
        inputs, ambiguous = wire(("stages", i), spec.name, spec.method, method_cls.requires, method_cls.optional,
                                 spec.inputs)
        planned.append(PlannedStage(spec.name, spec.method, method_cls, entry.plugin, "method",
                                    loaded.stage_configs[spec.name], dict(spec.config), inputs, ambiguous))
        providers.setdefault(method_cls.provides, []).append(spec.name)

    if recipe.evaluation is not None:
        evaluation = recipe.evaluation
        entry = registry.entry("evaluator", evaluation.evaluator)
        evaluator_cls = registry.target_class("evaluator", evaluation.evaluator)
        policies = policy_stages(recipe, [p.name for p in planned], doc)
        inputs, ambiguous = wire(("evaluation",), EVALUATION_STAGE, evaluation.evaluator,
                      tuple(r for r in evaluator_cls.requires if r != "policy"),
                      evaluator_cls.optional, evaluation.inputs)
        if isinstance(evaluation.policy, list):  # several systems: one input per evaluated stage
            inputs.update({f"policy:{name}": name for name in policies})
        else:
            inputs["policy"] = policies[0]
        planned.append(PlannedStage(EVALUATION_STAGE, evaluation.evaluator, evaluator_cls, entry.plugin, "evaluator",
                                    loaded.stage_configs[EVALUATION_STAGE], dict(evaluation.config), inputs, ambiguous))
    return planned


def input_warnings(stages: list[PlannedStage]) -> list[str]:
    """One line per input a stage takes from the latest of several stages that provide it, the recipe naming none
    (a recipe with both the annotators' and the reward model's pairs, two reward models, ...): the rule is
    documented, but the choice is easy to miss, so ``run``, ``run --plan`` and ``recipe check`` say it."""
    lines = []
    for stage in stages:
        for requirement, providers in stage.ambiguous.items():
            where = "evaluation.inputs" if stage.kind == "evaluator" else f"stages.{stage.name}.inputs"
            lines.append(f"stage {stage.name!r} takes {requirement!r} from {providers[-1]!r}, the latest of "
                         f"{len(providers)} stages that provide it ({', '.join(map(repr, providers))}); "
                         f"name one in {where}.{requirement} to choose")
    return lines


def policy_stages(recipe: Any, planned: list[str], doc: Any) -> list[str]:
    """The stages the evaluation evaluates: ``evaluation.policy`` (one name or a list), else the last stage.

    Listed stages that are disabled (``enabled: false``) are left out; an unknown name is an error.
    """
    policy = recipe.evaluation.policy
    if policy is None:
        return [planned[-1]]
    names = [policy] if isinstance(policy, str) else list(policy)
    disabled = {s.name for s in recipe.stages if not s.enabled}
    for i, name in enumerate(names):
        if name not in planned and name not in disabled:
            path = ("evaluation", "policy") if isinstance(policy, str) else ("evaluation", "policy", i)
            raise doc.error(path, f"no stage named {name!r}{did_you_mean(name, planned)}")
    chosen = [name for name in names if name in planned]
    if not chosen:
        raise doc.error(("evaluation", "policy"), "every evaluated stage is disabled")
    return chosen
