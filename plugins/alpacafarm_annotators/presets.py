"""Factories for the annotators defined as data in ``configs/*.yaml`` (the 13-annotator pool, presets).

Each file is registered as ``alpacafarm_annotators.presets:preset`` with ``args=(<name>,)``: :func:`preset` makes
its factory, whose ``config_class`` validates a recipe's overrides; ``Registry.create`` calls it with the validated
overrides and it merges them over the file and builds the annotator. Pool members may be any registered annotator (e.g.
``offline``), built through the registry the pool was built from.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Any

from pydantic import BaseModel, ConfigDict, ValidationError, create_model

from alpacafarm.annotation import Annotator, AnnotatorBuilder
from alpacafarm.annotation_cache import AnnotationCache
from alpacafarm.errors import UserError
from alpacafarm_annotators.config import (
    PoolConfig,
    PromptedAnnotatorConfig,
    builtin_annotator_names,
    load_config_file,
)

if TYPE_CHECKING:
    from alpacafarm.registry import Registry


def _overrides_model(base: type[BaseModel]) -> type[BaseModel]:
    """The same fields as ``base``, all optional: what a recipe may change."""
    # The constraints stay (p_label_flip <= 0.5, max_concurrency >= 1, ...): ``recipe check`` validates these
    # overrides, and a value the annotator would refuse at run time must be refused there.
    fields = {name: ((Annotated[(field.annotation, *field.metadata)] if field.metadata else field.annotation) | None,
                     None) for name, field in base.model_fields.items() if name != "kind"}
    return create_model(f"{base.__name__}Overrides", __config__=ConfigDict(extra="forbid"), **fields)


PromptedOverrides = _overrides_model(PromptedAnnotatorConfig)
PoolOverrides = _overrides_model(PoolConfig)


class AnnotatorFactory(AnnotatorBuilder):
    """Builds the annotator named ``name`` from its config file and a recipe's overrides (``config_class``)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.data = load_config_file(name)
        self.kind = self.data.get("kind", "prompted")
        self.config_class = PoolOverrides if self.kind == "pool" else PromptedOverrides

    def config(self, overrides: BaseModel | None = None) -> PromptedAnnotatorConfig | PoolConfig:
        """The file's config with the validated overrides applied."""
        given = overrides.model_dump(exclude_unset=True) if overrides is not None else {}
        merged = {**self.data, **{k: v for k, v in given.items() if v is not None}}
        model = PoolConfig if self.kind == "pool" else PromptedAnnotatorConfig
        try:
            return model.model_validate(merged)
        except ValidationError as exc:
            raise UserError(f"annotator {self.name!r}: invalid config: {str(exc).splitlines()[0]}") from None

    def cli_config(self, options: dict[str, Any]) -> dict[str, Any]:
        """Command-line options → this annotator's overrides: a pool applies them to every member."""
        options = dict(options)
        seed = options.pop("seed", None)
        if self.kind == "pool":
            block: dict[str, Any] = {"overrides": options} if options else {}
            if seed is not None:
                block["seed"] = seed
            return block
        if seed is not None:
            raise UserError(f"--seed applies to pools; {self.name!r} is a single annotator")
        return options

    def __call__(self, overrides: BaseModel | None = None, *, registry: Registry, cache: AnnotationCache | None = None,
                 budget: Any = None) -> Annotator:
        from alpacafarm_annotators.prompted import PromptedAnnotator

        config = self.config(overrides)
        if isinstance(config, PromptedAnnotatorConfig):
            return PromptedAnnotator(config, self.name, cache=cache, budget=budget)
        return build_pool(config, self.name, registry, cache=cache)


def build_pool(config: PoolConfig, name: str, registry: Registry, *, cache: AnnotationCache | None = None) -> Annotator:
    """A pool whose members come from ``registry``; prompted members share one cache and one budget
    (``overrides.max_cost_usd``) and take the pool's ``overrides``."""
    from alpacafarm_annotators.endpoint_requests import Budget
    from alpacafarm_annotators.pool import AnnotatorPool

    budget = Budget(config.overrides.get("max_cost_usd"))
    shared_cache = cache if cache is not None else (AnnotationCache() if config.overrides.get("cache", True) else None)
    members: dict[str, Annotator] = {}
    kinds = {m: registry.get("annotator", m) for m in config.annotators}
    takers = [m for m, t in kinds.items() if isinstance(t, AnnotatorFactory) and t.kind == "prompted"]
    unused = sorted(set(config.overrides) - {"cache"})
    if unused and not takers:  # the settings would be silently ignored
        raise UserError(f"annotator {name!r}: no member of the pool ({', '.join(config.annotators)}) takes "
                        f"settings, so {', '.join(unused)} would do nothing; remove it")
    for member in config.annotators:
        prompted = member in takers
        members[member] = registry.create("annotator", member, config.overrides if prompted else None,
                                          path=("annotators", member), registry=registry, cache=shared_cache,
                                          budget=budget)
    return AnnotatorPool(config, members, name)


#: the keys of a ``kind: alpaca_eval`` preset file (an AlpacaEval config run by this engine, with pool settings)
ALPACA_EVAL_PRESET_KEYS = {"kind", "description", "config", "fallback", "p_label_flip", "randomize_order", "seed",
                           "overrides"}


def alpaca_eval_preset(name: str, data: dict[str, Any]) -> Any:
    """A ``kind: alpaca_eval`` preset (``alpacafarm_ann``...): AlpacaEval's config ``config`` with these settings.
    Without the extra it fails loudly when used, naming the extra and its built-in ``fallback`` (never substituted)."""
    from alpacafarm_annotators.alpaca_eval_source import AlpacaEvalSource

    unknown = sorted(set(data) - ALPACA_EVAL_PRESET_KEYS)
    if unknown or "config" not in data:
        raise UserError(f"annotator {name!r}: configs/{name}.yaml: "
                        + (f"unknown key {unknown[0]!r}" if unknown else "'config' (an AlpacaEval config) is missing")
                        + f" (allowed: {', '.join(sorted(ALPACA_EVAL_PRESET_KEYS))})")
    defaults = {k: data[k] for k in ("p_label_flip", "randomize_order", "seed", "overrides") if k in data}
    return AlpacaEvalSource(data["config"], name, defaults, data.get("description", ""), data.get("fallback"))


def members_identity(registry: Registry, name: str) -> dict[str, Any] | None:
    """The label identities of a pool preset's members that have one (see :func:`alpacafarm.annotation.label_identity`),
    e.g. the offline judge's weights inside ``offline_ann``; None for other presets."""
    from alpacafarm.annotation import label_identity

    data = load_config_file(name)
    members = data.get("annotators") if isinstance(data, dict) and data.get("kind") == "pool" else None
    found = {m: label_identity(registry, m) for m in members or [] if isinstance(m, str) and m != name}
    found = {m: identity for m, identity in found.items() if identity is not None}
    return found or None


def preset(name: str) -> AnnotatorFactory | Any:
    """The target registered as ``name`` (``args=(name,)``): the factory of ``configs/<name>.yaml``, an
    :class:`~alpacafarm_annotators.alpaca_eval_source.AlpacaEvalSource` for a ``kind: alpaca_eval`` file."""
    if name not in builtin_annotator_names():
        raise UserError(f"no annotator config file configs/{name}.yaml")
    data = load_config_file(name)
    if isinstance(data, dict) and data.get("kind") == "alpaca_eval":
        return alpaca_eval_preset(name, data)
    return AnnotatorFactory(name)
