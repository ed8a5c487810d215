"""The whole plugin contract.

Every hook hands the plugin a ``register`` callback; plugins never touch a global registry::

    register(name: str, target: str | object, *, description: str = "", **metadata) -> None

``target`` is either the object itself or a lazy ``"package.module:attribute"`` string that is imported only
when the name is first used (so ``alpacafarm --help`` never imports torch or trl). Registering a name that
another plugin already registered is an error that names both plugins.

Hooks are called once per process, when the registry is first needed, with keyword arguments only.
Implementations may accept fewer arguments than the spec; specs only ever grow (see CONTRIBUTING.md).
"""

from __future__ import annotations

from alpacafarm import hookspec


@hookspec
def register_methods(register):
    """Register learning methods and pipeline steps (``alpacafarm.method.Method`` subclasses).

    Called when a recipe names a stage's ``method``. The target must resolve to a ``Method`` subclass.
    """


@hookspec
def register_annotators(register):
    """Register pairwise annotators: single judges and pools (presets such as ``alpacafarm_ann``).

    Called when a recipe's ``annotator`` (or ``evaluation.annotator``) names one. The target must resolve to a
    callable ``(config) -> annotator`` (a class or factory); if it has a ``config_class`` attribute, the recipe's
    config block is validated with it first and passed as that object, otherwise as a dict.
    """


@hookspec
def register_evaluators(register):
    """Register evaluators (e.g. win-rate against reference outputs).

    Called when a recipe's ``evaluation.evaluator`` names one. The target must resolve to a ``Method``
    subclass whose ``requires`` includes ``"policy"`` (the evaluated stage's output); it runs as the
    pipeline's final stage, ``evaluate``.
    """


@hookspec
def register_validators(register):
    """Register validators that compare the simulator with human data (rank correlations, agreement).

    The target must resolve to a callable ``(config: dict) -> validator``.
    """


@hookspec
def register_generation_backends(register):
    """Register generation backends (transformers, vLLM, OpenAI-compatible servers).

    The target must resolve to a callable ``(config: dict) -> generator``.
    """


@hookspec
def register_commands(register):
    """Register CLI sub-commands: ``alpacafarm NAME ...``.

    The target must resolve to ``main(argv: list[str]) -> int``; pass ``description=`` so ``--help``
    can list the command without importing it.
    """
