"""The recipe schema: what ``alpacafarm run RECIPE.yaml`` accepts.

A recipe is YAML (safe-loaded) validated against strict pydantic models: unknown keys and wrong types are
errors naming the YAML path and line. Plugin-specific blocks (a stage's ``config``, an annotator's ``config``)
are validated by the plugin's own config class (see :func:`validate_plugin_config`).
"""

from __future__ import annotations

import dataclasses
import re
import typing
from pathlib import Path
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    TypeAdapter,
    ValidationError,
    field_validator,
    model_validator,
)

from alpacafarm.errors import RecipeError, UnknownNameError
from alpacafarm.registry import Registry, did_you_mean
from alpacafarm.yamlsource import Path_, SourcedDocument, apply_override, load_with_includes


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class LoraSpec(_Strict):
    """Low-rank adapters (peft) on top of the base model."""

    r: int = Field(16, ge=1)
    alpha: int = Field(32, ge=1)
    dropout: float = Field(0.05, ge=0.0, lt=1.0)
    target_modules: list[str] | str = "all-linear"


class ModelSpec(_Strict):
    """How to obtain the policy/base model: hub ID, local path or offline alias, and how to load it."""

    name: str
    revision: str | None = None
    dtype: Literal["auto", "float32", "float16", "bfloat16"] = "auto"
    #: dtype for sampling and reward scoring only (training keeps ``dtype``): ``bfloat16`` about doubles CPU
    #: generation speed on CPUs with AVX512-BF16/AMX, where training must stay in float32.
    inference_dtype: Literal["float32", "float16", "bfloat16"] | None = None
    device: str = "auto"
    lora: LoraSpec | None = None
    quantization: Literal["4bit", "8bit"] | None = None
    merge_adapters: bool = False
    trust_remote_code: bool = False
    prompt_format: Literal["alpaca", "chat_template"] = "alpaca"


    def for_inference(self) -> ModelSpec:
        """This block as used to sample and score: ``dtype`` replaced by ``inference_dtype`` when one is set."""
        return self if self.inference_dtype is None else self.model_copy(update={"dtype": self.inference_dtype})


class DataSource(_Strict):
    """Records from a local JSON/JSONL/CSV file, a hub dataset, or a dataset bundled with alpacafarm."""

    path: str | None = None
    hub: str | None = None
    builtin: str | None = None
    config: str | None = None
    split: str | None = None
    limit: int | None = Field(None, ge=1)

    @model_validator(mode="after")
    def _one_source(self) -> DataSource:
        given = [k for k in ("path", "hub", "builtin") if getattr(self, k)]
        if len(given) != 1:
            raise ValueError(f"give exactly one of path, hub, builtin (got {', '.join(given) or 'none'})")
        return self


class PluginRef(_Strict):
    """A registered plugin object by name, with its own config block."""

    name: str
    config: dict[str, Any] = Field(default_factory=dict)

    @model_validator(mode="before")
    @classmethod
    def _from_name(cls, value: Any) -> Any:
        return {"name": value} if isinstance(value, str) else value


_STAGE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")


class StageSpec(_Strict):
    """One pipeline step: a registered method, its config, and optional explicit input wiring.

    ``enabled: false`` keeps a stage in the recipe (validated, but not planned or run): optional stages are
    switched on with ``--set stages.<name>.enabled=true``. An evaluation that lists a disabled stage skips it.
    """

    name: str
    method: str
    enabled: bool = True
    config: dict[str, Any] = Field(default_factory=dict)
    inputs: dict[str, str] = Field(default_factory=dict)

    @field_validator("name")
    @classmethod
    def _valid_name(cls, value: str) -> str:
        if not _STAGE_NAME.match(value):
            raise ValueError("stage names use letters, digits, '_', '.', '-' and start with a letter or digit")
        return value


class EvaluationSpec(_Strict):
    """The final evaluation stage: an evaluator, its annotator, and which stages' outputs to evaluate.

    ``policy`` names one stage, or a list of stages compared on one results table (e.g. the SFT outputs, a
    best-of-n sweep and an expert-iteration model's outputs); unset means the last stage.
    """

    evaluator: str = "win_rate"
    annotator: PluginRef | None = None
    policy: str | list[str] | None = None
    config: dict[str, Any] = Field(default_factory=dict)


class Recipe(_Strict):
    """A whole experiment: model, data, feedback annotator, stages, evaluation."""

    name: str
    description: str = ""
    seed: int = 42
    output_dir: str | None = None
    model: ModelSpec | None = None
    data: dict[str, DataSource] = Field(default_factory=dict)
    annotator: PluginRef | None = None
    stages: list[StageSpec] = Field(min_length=1)
    evaluation: EvaluationSpec | None = None

    def annotator_for(self, role: str) -> PluginRef | None:
        """The annotator for ``role``: ``evaluation`` uses ``evaluation.annotator`` if set; otherwise ``annotator``."""
        if role == "evaluation" and self.evaluation is not None and self.evaluation.annotator is not None:
            return self.evaluation.annotator
        return self.annotator


@dataclasses.dataclass
class LoadedRecipe:
    """A validated recipe, its source document (for error locations) and validated plugin configs."""

    recipe: Recipe
    source: SourcedDocument
    path: Path
    stage_configs: dict[str, Any] = dataclasses.field(default_factory=dict)

    def resolved(self) -> dict[str, Any]:
        """The recipe after includes and overrides, as plain data (written into the run directory)."""
        return self.recipe.model_dump(mode="json")


# --------------------------------------------------------------------------------------------- validation


def _unwrap_model(annotation: Any) -> Any:
    """The pydantic model class inside ``X | None``, ``list[X]`` or ``dict[str, X]`` (for key suggestions)."""
    for arg in typing.get_args(annotation) or ():
        inner = _unwrap_model(arg)
        if inner is not None:
            return inner
    return annotation if isinstance(annotation, type) and issubclass(annotation, BaseModel) else None


def _known_keys(root: type[BaseModel], loc: tuple) -> list[str]:
    model: Any = root
    for part in loc:
        if isinstance(part, int) or model is None:
            continue
        field = model.model_fields.get(part)
        model = _unwrap_model(field.annotation) if field is not None else None
    return sorted(model.model_fields) if model is not None else []


def _data_path(loc: tuple, data: Any) -> Path_:
    """Drop pydantic's union/validator tags from an error location, keeping the real path into ``data``."""
    path: list[str | int] = []
    node = data
    for part in loc:
        if (isinstance(node, dict) and part in node) or (isinstance(node, list) and isinstance(part, int) and 0 <= part < len(node)):
            path.append(part)
            node = node[part]
    return tuple(path)


def _pydantic_error(exc: ValidationError, doc: SourcedDocument, root_path: Path_, data: Any, root: Any) -> RecipeError:
    # An unknown key explains a "missing" one next to it (a misspelling), so it is reported first.
    errors = sorted(exc.errors(), key=lambda e: e["type"] != "extra_forbidden")
    first = errors[0]
    loc = tuple(first["loc"])
    path = (*root_path, *_data_path(loc, data))
    if first["type"] == "extra_forbidden":
        key = loc[-1]
        known = _known_keys(root, loc[:-1]) if isinstance(root, type) and issubclass(root, BaseModel) else []
        message = f"unknown key {key!r}{did_you_mean(str(key), known)}"
        if known:
            message += f" (allowed: {', '.join(known)})"
    else:
        message = first["msg"]
        if first["type"] == "missing":
            path = (*root_path, *_data_path(loc[:-1], data))
            message = f"missing required key {loc[-1]!r}"
    if len(errors) > 1:
        message += f" (and {len(errors) - 1} more error{'s' if len(errors) > 2 else ''})"
    return doc.error(path, message)


def validate_plugin_config(config_class: Any, data: dict[str, Any], doc: SourcedDocument, path: Path_) -> Any:
    """Validate a plugin's config block with the plugin's own config class and return the config object.

    ``config_class`` may be a pydantic model, a dataclass (TRL's and transformers' configs are dataclasses;
    each field is type-checked and coerced, and ``__post_init__`` errors are reported at ``path``), or
    ``None`` (the plugin takes no config: the block must be empty).
    """
    if not isinstance(data, dict):
        raise doc.error(path, f"must be a mapping, got {type(data).__name__}")
    if config_class is None:
        if data:
            raise doc.error((*path, next(iter(data))), "unknown key: this plugin takes no config")
        return None
    if isinstance(config_class, type) and issubclass(config_class, BaseModel):
        try:
            return config_class.model_validate(data)
        except ValidationError as exc:
            raise _pydantic_error(exc, doc, path, data, config_class) from None
    if dataclasses.is_dataclass(config_class):
        return _validate_dataclass(config_class, data, doc, path)
    raise RecipeError(f"{config_class!r} is not a pydantic model or dataclass; plugins must declare one")


def _validate_dataclass(cls: type, data: dict[str, Any], doc: SourcedDocument, path: Path_) -> Any:
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    for key in data:
        if key not in fields:
            raise doc.error((*path, key), f"unknown key {key!r}{did_you_mean(key, list(fields))} for {cls.__name__}")
    try:
        hints = typing.get_type_hints(cls)
    except Exception:  # unresolvable forward references: fall back to the constructor's own checks
        hints = {}
    values = {}
    for key, value in data.items():
        hint = hints.get(key)
        if hint is None:
            values[key] = value
            continue
        try:
            adapter = TypeAdapter(hint)
        except Exception:  # a type pydantic cannot describe: pass the value through unchanged
            values[key] = value
            continue
        try:
            values[key] = adapter.validate_python(value)
        except ValidationError as exc:
            raise doc.error((*path, key), f"{exc.errors()[0]['msg']} (got {value!r})") from None
    try:
        return cls(**values)
    except (TypeError, ValueError) as exc:
        raise doc.error(path, f"{cls.__name__}: {exc}") from None


def _check_name(registry: Registry, kind: str, name: str, doc: SourcedDocument, path: Path_) -> Any:
    try:
        return registry.entry(kind, name)
    except UnknownNameError as exc:
        failed = _failed_plugins_hint()
        raise doc.error(path, f"{exc}{failed}") from None


def _failed_plugins_hint() -> str:
    from alpacafarm.plugins import get_plugins

    failures = get_plugins().failures
    if not failures:
        return ""
    return " — note: plugin(s) failed to load: " + "; ".join(f"{f.name} ({f.error})" for f in failures)


def validate_plugin_ref(registry: Registry, kind: str, ref: PluginRef, doc: SourcedDocument, path: Path_) -> Any:
    """Check that ``ref.name`` is registered; validate ``ref.config`` with the target's ``config_class``.

    A target without a ``config_class`` receives its config block as a plain dict.
    """
    entry = _check_name(registry, kind, ref.name, doc, (*path, "name"))
    config_class = getattr(entry.load(), "config_class", None)
    if config_class is None:
        return dict(ref.config)
    return validate_plugin_config(config_class, ref.config, doc, (*path, "config"))


def load_recipe(path: str | Path, overrides: list[str] | tuple[str, ...] = (), registry: Registry | None = None) -> LoadedRecipe:
    """Load, merge includes, apply ``--set`` overrides, validate the schema and every plugin config block."""
    doc = load_with_includes(Path(path))
    for text in overrides:
        apply_override(doc, text)
    try:
        recipe = Recipe.model_validate(doc.data)
    except ValidationError as exc:
        raise _pydantic_error(exc, doc, (), doc.data, Recipe) from None
    loaded = LoadedRecipe(recipe, doc, Path(path))
    seen: set[str] = set()
    for i, stage in enumerate(recipe.stages):
        if stage.name in seen or stage.name in recipe.data or stage.name in ("base_model", "evaluate"):
            raise doc.error(("stages", i, "name"), f"stage name {stage.name!r} is already used by a stage, a data "
                            "source or the pipeline itself (base_model, evaluate)")
        seen.add(stage.name)
    if registry is None:
        from alpacafarm.plugins import get_registry

        registry = get_registry()
    for i, stage in enumerate(recipe.stages):
        method_cls = _check_name(registry, "method", stage.method, doc, ("stages", i, "method")).load()
        loaded.stage_configs[stage.name] = validate_plugin_config(
            getattr(method_cls, "config_class", None), stage.config, doc, ("stages", i, "config")
        )
        accepted = (*getattr(method_cls, "requires", ()), *getattr(method_cls, "optional", ()))
        for requirement in stage.inputs:
            if requirement not in accepted:
                raise doc.error(
                    ("stages", i, "inputs", requirement),
                    f"method {stage.method!r} has no input {requirement!r} (inputs: {', '.join(accepted) or 'none'})",
                )
    if recipe.annotator is not None:
        validate_plugin_ref(registry, "annotator", recipe.annotator, doc, ("annotator",))
    if recipe.evaluation is not None:
        _check_name(registry, "evaluator", recipe.evaluation.evaluator, doc, ("evaluation", "evaluator"))
        if recipe.evaluation.annotator is not None:
            validate_plugin_ref(registry, "annotator", recipe.evaluation.annotator, doc, ("evaluation", "annotator"))
    for name, source in recipe.data.items():
        if source.path and not Path(source.path).is_file():
            raise doc.error(("data", name, "path"), f"file not found: {source.path}")
    return loaded
