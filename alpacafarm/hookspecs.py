"""The whole plugin contract: one registration hook per kind of thing a plugin provides.

Every hook receives a ``register`` callback (:class:`Register`); plugins never touch a global registry.
``target`` is the object itself or a lazy ``"package.module:attribute"`` string imported when the name is
first used (so ``alpacafarm --help`` never imports torch or trl). Duplicate names are an error naming both
plugins: a plugin registering a name another plugin registered stops every command with one line saying which
two clash (prefix your names: ``myorg_dpo``). Hooks are called once per process, when the registry is first
needed, with keyword arguments only; an implementation may accept fewer arguments than its spec, so specs only
ever grow (CONTRIBUTING.md).

Every registered target except commands is built by one function, ``Registry.create(kind, name, config,
**runtime)``: if the target has a ``config_class`` (a pydantic model or dataclass), the config block is
validated with it once (errors name the recipe's file, line and YAML path) and the target is called as
``target(config, **runtime)``, receiving only the runtime arguments its signature names; without a
``config_class`` the block must be empty and ``config`` is ``None``. The result must be an instance of the kind's
base class, named in each hook below.
"""

from __future__ import annotations

from typing import Any, Protocol

from alpacafarm import hookspec


class Register(Protocol):
    """The callback a registration hook receives."""

    def __call__(self, name: str, target: str | Any, *, description: str = "", **metadata: Any) -> None:
        """Register ``target`` under ``name``; ``description`` is what ``alpacafarm plugins`` and ``--help`` show."""


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
    The target is called as ``target(config, [registry=], [cache=], [budget=])`` and must return an
    :class:`alpacafarm.annotation.Annotator`; ``registry`` lets a pool build its members, ``cache`` and
    ``budget`` let a pool share its annotation cache and spending cap with them. A target may also define
    ``cli_config(options: dict) -> dict`` mapping the shared command-line options (``--base-url``,
    ``--model-map``, ``--max-cost-usd``, ``--seed``, ``--no-cache``, ``--set``) to its config block.

    .. versionadded:: 0.1.0
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
    ``target(config, [spec=ModelSpec], [model_path=str])`` — the recipe's model block and the folder, hub ID or
    alias of the model to sample from — and must return an :class:`alpacafarm.generation.Generator` whose
    ``prompt_format`` is that model's (:meth:`alpacafarm.prompts.PromptFormat.for_model`), so prompt
    conditioning reaches every backend.

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
