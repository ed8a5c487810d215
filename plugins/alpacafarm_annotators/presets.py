"""Factories for the annotators defined as data in ``configs/*.yaml`` (the 13-annotator pool, presets).

``alpacafarm_annotators.presets:<name>`` resolves (lazily, through the module ``__getattr__``) to a factory whose
``config_class`` validates a recipe's overrides; calling it merges the overrides over the file and builds the
annotator. Pool members may be any registered annotator (e.g. ``offline``), built through the registry.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, create_model

from alpacafarm.annotation import Annotator
from alpacafarm.annotation_cache import AnnotationCache
from alpacafarm.errors import UserError
from alpacafarm_annotators.config import (
    PoolConfig,
    PromptedAnnotatorConfig,
    builtin_annotator_names,
    load_config_file,
)


def _overrides_model(base: type[BaseModel]) -> type[BaseModel]:
    """The same fields as ``base``, all optional: what a recipe may change."""
    fields = {name: (field.annotation | None, None) for name, field in base.model_fields.items() if name != "kind"}
    return create_model(f"{base.__name__}Overrides", __config__=ConfigDict(extra="forbid"), **fields)


PromptedOverrides = _overrides_model(PromptedAnnotatorConfig)
PoolOverrides = _overrides_model(PoolConfig)


class AnnotatorFactory:
    """Builds the annotator named ``name`` from its config file and a recipe's overrides."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.data = load_config_file(name)
        self.kind = self.data.get("kind", "prompted")
        self.config_class = PoolOverrides if self.kind == "pool" else PromptedOverrides

    def config(self, overrides: BaseModel | dict[str, Any] | None = None) -> PromptedAnnotatorConfig | PoolConfig:
        if isinstance(overrides, BaseModel):
            overrides = overrides.model_dump(exclude_unset=True)
        merged = {**self.data, **{k: v for k, v in (overrides or {}).items() if v is not None}}
        model = PoolConfig if self.kind == "pool" else PromptedAnnotatorConfig
        try:
            return model.model_validate(merged)
        except Exception as exc:
            raise UserError(f"annotator {self.name!r}: invalid config: {str(exc).splitlines()[0]}") from None

    def __call__(self, overrides: BaseModel | dict[str, Any] | None = None, *, cache: AnnotationCache | None = None,
                 budget: Any = None) -> Annotator:
        from alpacafarm_annotators.prompted import PromptedAnnotator

        config = self.config(overrides)
        if isinstance(config, PromptedAnnotatorConfig):
            return PromptedAnnotator(config, self.name, cache=cache, budget=budget)
        return build_pool(config, self.name, cache=cache)


def build_pool(config: PoolConfig, name: str, *, cache: AnnotationCache | None = None) -> Annotator:
    """A pool whose prompted members share one cache and one budget (``overrides.max_cost_usd``)."""
    from alpacafarm.plugins import get_registry
    from alpacafarm_annotators.pool import AnnotatorPool
    from alpacafarm_annotators.requests import Budget

    registry = get_registry()
    budget = Budget(config.overrides.get("max_cost_usd"))
    shared_cache = cache if cache is not None else (AnnotationCache() if config.overrides.get("cache", True) else None)
    members: dict[str, Annotator] = {}
    for member in dict.fromkeys(config.annotators):
        factory = registry.get("annotator", member)
        if isinstance(factory, AnnotatorFactory) and factory.kind == "prompted":
            members[member] = factory(config.overrides, cache=shared_cache, budget=budget)
        else:
            members[member] = factory({})
    return AnnotatorPool(config, members, name)


def __getattr__(name: str) -> AnnotatorFactory:
    if name in builtin_annotator_names():
        return AnnotatorFactory(name)
    raise AttributeError(name)
