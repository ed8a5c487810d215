"""The recipe schema: what ``alpacafarm run RECIPE.yaml`` accepts.

A recipe is YAML (safe-loaded) validated against strict pydantic models: unknown keys and wrong types are
errors naming the YAML path and line. Plugin-specific blocks (a stage's ``config``, an annotator's ``config``)
are validated by the plugin's own config class (see :mod:`alpacafarm.plugin_config`).

A stage config that samples through a generation backend says so by its type: it subclasses
:class:`GenerationBackendOptions` (a dataclass config, e.g. one built on a TRL config) or
:class:`GenerationBackendFields` (a pydantic config), which give it ``backend`` and ``backend_config``; loading the
recipe then checks that ``backend`` names a registered generation backend. A field merely named ``backend`` means
nothing to the recipe.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from alpacafarm.errors import UnknownNameError
from alpacafarm.plugin_config import pydantic_error
from alpacafarm.registry import Registry
from alpacafarm.yamlsource import Path_, SourcedDocument, apply_override, load_with_includes


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")

    @field_validator("*", mode="before")
    @classmethod
    def _no_bool_for_numbers(cls, value: Any, info: ValidationInfo) -> Any:
        """``seed: true`` is a mistake, not the number 1 (pydantic's lax mode would take it)."""
        from alpacafarm.plugin_config import number_not_bool

        if isinstance(value, bool) and number_not_bool(cls.model_fields[info.field_name].annotation):
            raise ValueError(f"expected a number, got {str(value).lower()}")
        return value


@dataclasses.dataclass
class GenerationBackendOptions:
    """The generation backend a stage samples with, mixed into a dataclass config (pydantic configs subclass
    :class:`GenerationBackendFields`, the same two fields). ``recipe check`` refuses an unknown ``backend``."""

    backend: str = dataclasses.field(default="transformers", metadata={
        "help": "generation backend for the sampling (a registered name: transformers, openai, vllm, openvino)"})
    backend_config: dict[str, Any] = dataclasses.field(default_factory=dict, metadata={
        "help": "the backend's own options"})


class GenerationBackendFields(BaseModel):
    """:class:`GenerationBackendOptions` for a pydantic config: subclass it instead of ``BaseModel``."""

    backend: str = Field("transformers", description="generation backend for the sampling (a registered name)")
    backend_config: dict[str, Any] = Field(default_factory=dict, description="the backend's own options")


#: The config types whose ``backend`` the recipe checks (:func:`load_recipe`).
GENERATION_BACKEND_CONFIGS = (GenerationBackendOptions, GenerationBackendFields)


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
    #: generation speed on CPUs with AVX512-BF16/AMX, where training must stay in float32, and is tens of times
    #: slower where it is emulated (AVX2-only CPUs); ``bfloat16_if_native``: bfloat16 where the device computes it
    #: in hardware, else float32 (:mod:`alpacafarm.hardware`).
    inference_dtype: Literal["float32", "float16", "bfloat16", "bfloat16_if_native"] | None = None
    #: dtype of the full weights a training stage writes (``null``: ``dtype``, resolved as for loading).
    #: Trainable weights always train as float32 master copies; LoRA adapters are always saved in float32.
    save_dtype: Literal["float32", "float16", "bfloat16"] | None = None
    device: str = "auto"
    lora: LoraSpec | None = None
    quantization: Literal["4bit", "8bit"] | None = None
    merge_adapters: bool = False
    trust_remote_code: bool = False
    prompt_format: Literal["alpaca", "chat_template"] = "alpaca"


    def for_inference(self) -> ModelSpec:
        """This block as used to sample and score: ``dtype`` replaced by ``inference_dtype`` when one is set
        (``bfloat16_if_native`` resolved on this machine: bfloat16 or float32)."""
        if self.inference_dtype is None:
            return self
        dtype = self.inference_dtype
        if dtype == "bfloat16_if_native":
            from alpacafarm.hardware import native_bfloat16

            dtype = "bfloat16" if native_bfloat16(self.device) else "float32"
        return self.model_copy(update={"dtype": dtype, "inference_dtype": dtype})

    def for_training(self) -> ModelSpec:
        """This block as used to load a model whose weights all train: ``dtype`` float32 (the master copy).

        ``dtype`` then only says what the frozen copies (reference, reward model, generation) and the compute
        (bf16 autocast where the hardware has it, via the trainer's ``bf16``) use: AdamW updates at the paper's
        learning rates (1e-6 to 1e-5) are mostly below bfloat16's resolution and round away on bf16 weights.
        With ``lora`` or ``quantization`` the base is frozen and keeps ``dtype``; the adapters (and any other
        trainable tensor) are made float32 by :func:`alpacafarm.training.fp32_master_weights`.
        """
        if self.lora is not None or self.quantization is not None or self.dtype == "float32":
            return self
        return self.model_copy(update={"dtype": "float32"})


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
    #: this stage's annotator, instead of the recipe's, for the role its method labels in (e.g. two preference
    #: stages, one with the paper's label noise and one without)
    annotator: PluginRef | None = None

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
    #: explicit wiring of the evaluator's other inputs (e.g. which of two reward models scores the outputs)
    inputs: dict[str, str] = Field(default_factory=dict)


def _check_input_names(given: dict[str, str], accepted: tuple[str, ...], owner: str, doc: Any,
                       where: tuple[Any, ...], note: str = "") -> None:
    """Every name in a stage's (or the evaluation's) ``inputs:`` must be an input its class declares."""
    for requirement in given:
        if requirement not in accepted:
            raise doc.error((*where, "inputs", requirement),
                            f"{owner} has no input {requirement!r} (inputs: {', '.join(accepted) or 'none'}{note})")


def run_name_problem(name: str) -> str | None:
    """Why ``name`` cannot be a run's folder name (one path component under the runs folder), or None."""
    if not name or not name.strip():
        return "must not be empty (it names the run folder runs/<name>)"
    if any(ord(c) < 32 or ord(c) == 127 for c in name):
        return "must not hold control characters (it names the run folder runs/<name>)"
    if "/" in name or "\\" in name:
        return "must be one folder name, without '/' or '\\' (use --output-dir to choose another folder)"
    if name in (".", "..") or name != name.strip():
        return "must be a folder name, not '.', '..' or space-padded (use --output-dir to choose another folder)"
    return None


class LaunchSpec(_Strict):
    """How ``alpacafarm run`` launches the recipe when the command line does not say: processes and the
    accelerate config (a packaged name: ``ddp``, ``fsdp2``, ``zero2``, ``zero3``, or a YAML file)."""

    num_processes: int = Field(1, ge=1)
    accelerate_config: str | None = None


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
    launch: LaunchSpec | None = None  # launch defaults; not part of any stage's fingerprint (outputs do not depend)

    @field_validator("name")
    @classmethod
    def _name_is_one_path_component(cls, value: str) -> str:
        """The name becomes the folder ``runs/<name>``: a separator, ``..`` or an absolute path would put the run
        somewhere else (``--output-dir`` is the way to choose another folder)."""
        problem = run_name_problem(value)
        if problem is not None:
            raise ValueError(problem)
        return value

    def annotator_for(self, role: str, stage: str | None = None) -> PluginRef | None:
        """The annotator for ``role``: stage ``stage``'s own ``annotator`` if it has one; for ``evaluation``,
        ``evaluation.annotator`` if set; otherwise ``annotator``."""
        own = next((s.annotator for s in self.stages if s.name == stage and s.annotator is not None), None)
        if own is not None:
            return own
        if role == "evaluation" and self.evaluation is not None and self.evaluation.annotator is not None:
            return self.evaluation.annotator
        return self.annotator


def stage_annotator_key(stage: str) -> str:
    """The key of a stage's own annotator config in :attr:`LoadedRecipe.annotator_configs`."""
    return f"stage:{stage}"


@dataclasses.dataclass
class LoadedRecipe:
    """A validated recipe, its source document (for error locations) and validated plugin configs."""

    recipe: Recipe
    source: SourcedDocument
    path: Path
    #: validated config objects: of each stage by name (the evaluation's as ``evaluate``) ...
    stage_configs: dict[str, Any] = dataclasses.field(default_factory=dict)
    #: ... and of the annotator of each role (``feedback``, ``evaluation``)
    annotator_configs: dict[str, Any] = dataclasses.field(default_factory=dict)

    def resolved(self) -> dict[str, Any]:
        """The recipe after includes and overrides, as plain data (written into the run directory)."""
        return self.recipe.model_dump(mode="json")


# --------------------------------------------------------------------------------------------- loading


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
    return " — note: plugin(s) not loaded: " + "; ".join(
        f"{f.name} ({f.error})" for f in failures)


def _check_backend(registry: Registry, config: Any, doc: SourcedDocument, path: Path_) -> None:
    """A stage config that samples (:data:`GENERATION_BACKEND_CONFIGS`) names a registered generation backend: an
    unknown one is an error now, not mid-run."""
    if isinstance(config, GENERATION_BACKEND_CONFIGS):
        _check_name(registry, "generation_backend", config.backend, doc, (*path, "backend"))


def load_recipe(path: str | Path, overrides: list[str] | tuple[str, ...] = (),
                registry: Registry | None = None) -> LoadedRecipe:
    """Load, merge includes, apply ``--set`` overrides, validate the schema and every plugin config block.

    Each plugin block is validated here, once, while its YAML positions are known; the config objects are kept
    in the :class:`LoadedRecipe` and handed to ``Registry.create`` when the stage runs.
    """
    doc = load_with_includes(Path(path), known_keys=frozenset(Recipe.model_fields))
    for text in overrides:
        apply_override(doc, text)
    try:
        recipe = Recipe.model_validate(doc.data)
    except ValidationError as exc:
        raise pydantic_error(exc, doc, (), doc.data, Recipe) from None
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
        entry = _check_name(registry, "method", stage.method, doc, ("stages", i, "method"))
        method_cls = registry.target_class("method", stage.method)
        if not method_cls.provides:
            raise doc.error(("stages", i, "method"), f"method {stage.method!r} of plugin {entry.plugin!r} declares no "
                            "'provides' (what its artifact is); the plugin must set it")
        loaded.stage_configs[stage.name] = registry.config("method", stage.method, stage.config, source=doc,
                                                           path=("stages", i, "config"))
        _check_backend(registry, loaded.stage_configs[stage.name], doc, ("stages", i, "config"))
        _check_input_names(stage.inputs, (*method_cls.requires, *method_cls.optional), f"method {stage.method!r}",
                           doc, ("stages", i))
    roles = [("feedback", recipe.annotator, ("annotator",))]
    for i, stage in enumerate(recipe.stages):
        if stage.annotator is not None:
            if registry.target_class("method", stage.method).annotator_role is None:
                raise doc.error(("stages", i, "annotator"),
                                f"method {stage.method!r} asks no annotator: this stage's annotator would be unused")
            roles.append((stage_annotator_key(stage.name), stage.annotator, ("stages", i, "annotator")))
    if recipe.evaluation is not None:
        evaluation = recipe.evaluation
        _check_name(registry, "evaluator", evaluation.evaluator, doc, ("evaluation", "evaluator"))
        loaded.stage_configs["evaluate"] = registry.config("evaluator", evaluation.evaluator, evaluation.config,
                                                           source=doc, path=("evaluation", "config"))
        _check_backend(registry, loaded.stage_configs["evaluate"], doc, ("evaluation", "config"))
        evaluator_cls = registry.target_class("evaluator", evaluation.evaluator)
        _check_input_names(evaluation.inputs,
                           (*(r for r in evaluator_cls.requires if r != "policy"), *evaluator_cls.optional),
                           f"evaluator {evaluation.evaluator!r}", doc, ("evaluation",),
                           note="; the systems it judges are evaluation.policy")
        if evaluation.annotator is not None:
            roles.append(("evaluation", evaluation.annotator, ("evaluation", "annotator")))
    for role, ref, at in roles:
        if ref is not None:
            _check_name(registry, "annotator", ref.name, doc, (*at, "name"))
            loaded.annotator_configs[role] = registry.config("annotator", ref.name, ref.config, source=doc,
                                                             path=(*at, "config"))
    if "evaluation" not in loaded.annotator_configs and "feedback" in loaded.annotator_configs:
        loaded.annotator_configs["evaluation"] = loaded.annotator_configs["feedback"]  # Recipe.annotator_for's rule
    for name, source in recipe.data.items():
        if source.path and not Path(source.path).is_file():
            raise doc.error(("data", name, "path"), f"file not found: {source.path}")
    return loaded
