"""The whole plugin contract: one registration hook per kind of thing a plugin provides.

Every hook receives a ``register`` callback (:class:`Register`); plugins never touch a global registry. Every
keyword a registration may carry is named there (an unknown one is an error naming the plugin and the keyword).
``target`` is the object itself or a lazy ``"package.module:attribute"`` string imported when the name is
first used (so ``alpacafarm --help`` never imports torch or trl). Duplicate names are an error naming both
plugins: a plugin registering a name another plugin registered stops every command with one line saying which
two clash (prefix your names: ``myorg_dpo``). Each hook is called once per plugin that implements it, when the
registry is first needed, through pluggy's hook caller (``pm.trace`` and hookwrappers see the calls), with keyword
arguments only; an implementation may accept fewer arguments than its spec, so specs only ever grow
(CONTRIBUTING.md).

Every registered target except commands is built by one function, ``Registry.create(kind, name, config,
**runtime)``: if the target has a ``config_class`` (a pydantic model or dataclass), the config block is
validated with it once (errors name the recipe's file, line and YAML path) and the target is called as
``target(config, **declared)``, where ``declared`` are exactly the runtime arguments its registration names in
``runtime=`` (a kind's runtime arguments are listed in its hook below; one the caller has not got is ``None``).
The registration is the declaration: nothing reads the target's signature. A declared argument the kind does not
offer is refused when the plugin registers; a target that cannot be called as declared (a ``TypeError`` out of the
call) is one line naming the plugin and the target. Without a ``config_class`` the block must be empty and
``config`` is ``None``. The result must be an instance of the kind's base class, named in each hook below.

What a built object offers beyond its base class's abstract methods is declared on that base class, with a
default, never an attribute the core looks for by name: an annotator's ``accepts_replicate`` and
``cli_config(options)`` (:class:`alpacafarm.annotation.Annotator`, :class:`alpacafarm.annotation.AnnotatorBuilder`
for a target that builds annotators); a stage config that samples through a generation backend subclasses
:class:`alpacafarm.recipe.GenerationBackendOptions` (dataclass configs) or
:class:`alpacafarm.recipe.GenerationBackendFields` (pydantic configs), so ``recipe check`` knows its ``backend``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

from alpacafarm import hookspec


class Register(Protocol):
    """The callback a registration hook receives: ``register(name, target, *, ...)``, keywords only after the target.

    - ``name``: the name recipes and commands use; unique per kind across all plugins.
    - ``target``: a ``"module:attr"`` string (imported on first use) or the object itself.
    - ``description``: what ``alpacafarm plugins`` and ``--help`` show.
    - ``identity``: annotators only: ``"module:function"``, called as ``function(registry, name)`` to say what the
      annotator's labels depend on beyond its config (fitted weights, a model file) as plain data. It joins the
      fingerprint of every stage that annotates with it, so a changed judge re-runs them
      (:func:`alpacafarm.annotation.label_identity`).
    - ``args``, ``kwargs``: the imported object is called once with them, on first use, and what it returns is the
      target, e.g. ``register("my_preset", "pkg.presets:Preset", args=("my_preset",))``; without them the imported
      object is the target.
    - ``runtime``: the runtime arguments of the kind that ``Registry.create`` passes to the target besides its
      config (annotators: ``registry``, ``cache``, ``budget``; generation backends: ``spec``, ``model_path``; other
      kinds: none). The target receives exactly these, as keywords.
    """

    def __call__(self, name: str, target: str | Callable[..., Any], *, description: str = "",
                 identity: str | None = None, args: Sequence[Any] = (), kwargs: Mapping[str, Any] | None = None,
                 runtime: Sequence[str] = ()) -> None:
        """Register ``target`` under ``name`` (see the class for each keyword)."""


@hookspec
def register_methods(register: Register) -> None:
    """Register learning methods and pipeline steps.

    Called when the registry is first needed (a recipe names a stage's ``method``). The target must be a
    :class:`alpacafarm.method.Method` subclass: it declares ``config_class``, ``requires``, ``optional`` and
    ``provides``, and the pipeline calls ``Method(config).run(context)`` to get an ``Artifact``.

    .. versionadded:: 0.1.0
    """


@hookspec
def register_annotators(register: Register) -> None:
    """Register pairwise annotators: single judges and pools (presets such as ``alpacafarm_ann``).

    Called when the registry is first needed (a recipe's ``annotator``, ``alpacafarm annotate --annotator``).
    The target is called as ``target(config, **declared)`` and must return an
    :class:`alpacafarm.annotation.Annotator`: the target is an ``Annotator`` subclass, an
    :class:`alpacafarm.annotation.AnnotatorBuilder` (a preset built from a data file), or a function. Runtime
    arguments (declare those it takes with ``runtime=``): ``registry`` lets a pool build its members, ``cache`` and
    ``budget`` let a pool share its annotation cache and spending cap with them (``None`` when the caller has
    none). ``cli_config(options: dict) -> dict`` (a classmethod of ``Annotator``, a method of ``AnnotatorBuilder``)
    maps the shared command-line options (``--base-url``, ``--model-map``, ``--max-cost-usd``, ``--seed``,
    ``--no-cache``, ``--set``) to the config block; the default takes them as the block. A registration may say
    ``identity=`` (:class:`Register`).

    .. versionadded:: 0.1.0
    .. versionchanged:: 0.1.0
       ``cli_config`` and ``accepts_replicate`` are declared on the base classes (with defaults) instead of being
       looked up by name; a target's signature is no longer read.
    """


@hookspec
def register_evaluators(register: Register) -> None:
    """Register evaluators (e.g. win-rate against reference outputs).

    Called when the registry is first needed (a recipe's ``evaluation.evaluator``). The target must be a
    :class:`alpacafarm.method.Method` subclass whose ``requires`` includes ``"policy"`` (the evaluated stage's
    output, or ``policy:<stage>`` inputs for several); it runs as the pipeline's final stage, ``evaluate``.

    .. versionadded:: 0.1.0
    """


@hookspec
def register_validators(register: Register) -> None:
    """Register validators that compare the simulator with human data (rank correlations, agreement).

    Called when the registry is first needed (``alpacafarm compare``). The target is called as
    ``target(config)`` and must return an :class:`alpacafarm.validation.Validator`, whose
    ``validate(*records)`` returns a result with ``to_json()``.

    .. versionadded:: 0.1.0
    """


@hookspec
def register_generation_backends(register: Register) -> None:
    """Register generation backends (transformers, vLLM, OpenAI-compatible servers).

    Called when the registry is first needed (a stage's ``backend``). The target is called as
    ``target(config, **declared)``; runtime arguments (declare those it takes with ``runtime=``): ``spec``, the
    recipe's :class:`~alpacafarm.recipe.ModelSpec`, and ``model_path``, the folder, hub ID or alias of the model to
    sample from. It must return an :class:`alpacafarm.generation.Generator` whose ``prompt_format`` is that
    model's (:meth:`alpacafarm.prompts.PromptFormat.for_model`), so prompt conditioning reaches every backend.

    .. versionadded:: 0.1.0
    """


@hookspec
def register_commands(register: Register) -> None:
    """Register CLI sub-commands: ``alpacafarm NAME ...``.

    Called when the CLI starts. The target must be ``main(argv: list[str]) -> int`` (it parses its own
    arguments, ``--help`` included); pass ``description=`` so ``alpacafarm --help`` lists the command without
    importing it.

    .. versionadded:: 0.1.0
    """
