"""What a method is: a config class, declared inputs, and ``run(context) -> Artifact``.

Methods (and evaluators, which follow the same interface) are registered by plugins through
``register_methods`` / ``register_evaluators``. The pipeline wires their declared ``requires`` to the outputs
of earlier stages, data sources or the recipe's model, and gives them a :class:`StageContext`.
"""

from __future__ import annotations

import enum
import logging
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

# The hand-off types are part of the method contract: ``from alpacafarm.method import Artifact`` keeps working.
from alpacafarm.artifacts import (  # noqa: F401
    RUN_DIR_TOKEN,
    Artifact,
    JudgedSystem,
    Snapshot,
    System,
    Table,
    run_relative,
)

if TYPE_CHECKING:
    from collections.abc import Iterator

    from alpacafarm.annotation import Annotator
    from alpacafarm.generation import Generator, SamplingConfig
    from alpacafarm.recipe import PluginRef, Recipe
    from alpacafarm.registry import Registry
    from alpacafarm.rewards import RewardScorer


#: The conventional outputs file of a stage folder (``generate_outputs`` writes it).
OUTPUTS_FILE = "outputs.jsonl"


class Ranks(enum.Enum):
    """Where a method's stage runs under several processes (``alpacafarm run --num-processes N``):
    :attr:`Method.ranks`. With one process every choice runs the stage once, in that process."""

    #: On the main process only, the other ranks waiting for its artifact (the default: safe for any plugin).
    MAIN = "main"
    #: On every rank: the method shards its own work (TRL trainers through accelerate; sampling through
    #: :meth:`StageContext.generate_on_ranks`) and writes files only where ``context.is_main``.
    ALL = "all"
    #: Not under several processes at all (say, a trainer on the main process alone would wait forever for its
    #: partners): a run on several processes is refused before any stage starts.
    SINGLE_PROCESS = "single_process"


def _plain_names(names: Any) -> Any:
    """A name (a ``str``, an :class:`~alpacafarm.artifact_names.ArtifactName` among them) as a plain ``str``, a tuple of
    them as a tuple of plain ``str``; any other value unchanged."""
    if isinstance(names, str):
        return str(names)
    if isinstance(names, tuple):
        return tuple(str(n) if isinstance(n, str) else n for n in names)
    return names


@dataclass(kw_only=True)
class StageContext:
    """Everything a running stage may use. Its files go under ``stage_dir``. Built by keyword (the pipeline builds
    it; a test builds one with ``StageContext(stage=..., stage_dir=..., ...)``)."""

    stage: str
    stage_dir: Path
    run_dir: Path
    seed: int
    inputs: dict[str, Artifact]
    recipe: Recipe
    registry: Registry
    resuming: bool = False
    #: where the stage's method runs (its :attr:`Method.ranks`): on every rank, or on the main process alone
    ranks: Ranks = Ranks.MAIN
    #: the recipe's annotator config objects by role (``feedback``, ``evaluation``), validated when it loaded
    annotator_configs: dict[str, Any] = field(default_factory=dict)
    logger: logging.Logger = field(default_factory=lambda: logging.getLogger("alpacafarm"))

    @property
    def is_main(self) -> bool:
        """Whether this process writes the stage's files (always, for one process)."""
        from alpacafarm import distributed

        return distributed.is_main()

    def input(self, name: str) -> Artifact:
        try:
            return self.inputs[name]
        except KeyError:
            raise KeyError(f"stage {self.stage!r} has no input {name!r}; inputs: {sorted(self.inputs)}") from None

    def records(self, name: str, file: str | None = None) -> list[dict[str, Any]]:
        """The records of an input: a recipe data source, or a dataset file written by an earlier stage.

        For a stage output that is a folder, ``file`` is one of the artifact's named :attr:`~Artifact.files`
        (e.g. ``"train"``) or a file name inside the folder (e.g. ``"train.jsonl"``).
        """
        from alpacafarm.data import load_source, read_records

        artifact = self.input(name)
        if artifact.kind == "data_source":
            return load_source(artifact.source)
        if artifact.path is None:
            raise ValueError(f"input {name!r} of stage {self.stage!r} has no file")
        path = Path(artifact.path)
        if file is not None and file in artifact.files:
            return read_records(Path(artifact.files[file]))
        if path.is_dir():
            if file is None:
                raise ValueError(f"input {name!r} is a folder; say which file to read")
            path = path / file
        return read_records(path)

    def outputs(self, name: str) -> list[dict[str, Any]]:
        """The answers an input holds (records with ``instruction``, optional ``input``, ``output``): a data source
        or an outputs file as it is; a folder's ``outputs.jsonl``. What an evaluator reads from a ``policy`` input
        that lists no :attr:`~Artifact.systems` (one that does: read each ``System.outputs``)."""
        from alpacafarm.errors import UserError

        artifact = self.input(name)
        if artifact.kind == "data_source":
            return self.records(name)
        path = Path(artifact.path) if artifact.path else None
        hint = "add a generate_outputs stage for it (inputs: {sft_model: <stage>})"
        if path is None or not path.exists():
            raise UserError(f"stage {self.stage!r}: input {name!r} ({artifact.kind}) has no outputs file; {hint}")
        if not path.is_dir():
            return self.records(name)
        if (path / OUTPUTS_FILE).is_file():
            return self.records(name, OUTPUTS_FILE)
        listed = f"; it lists {len(artifact.systems)} systems (read each System.outputs)" if artifact.systems else ""
        raise UserError(f"stage {self.stage!r}: input {name!r} is a folder ({path}) without {OUTPUTS_FILE}"
                        f"{listed}; to evaluate a model, {hint}")

    def annotator_ref(self, role: str = "feedback") -> PluginRef:
        """The recipe's annotator for ``role``: ``feedback`` (training labels) or ``evaluation``."""
        from alpacafarm.errors import RecipeError

        ref = self.recipe.annotator_for(role, self.stage)
        if ref is None:
            raise RecipeError(f"stage {self.stage!r} needs an annotator: set 'annotator:' in the recipe")
        return ref

    def make_annotator(self, role: str = "feedback") -> Annotator:
        """Build the annotator for ``role`` (the stage's own, else the recipe's) through the registry, from the
        config validated at load time."""
        from alpacafarm.recipe import stage_annotator_key

        ref = self.annotator_ref(role)
        own = stage_annotator_key(self.stage)
        config = self.annotator_configs[own] if own in self.annotator_configs else self.annotator_configs.get(
            role, ref.config)
        return self.registry.create("annotator", ref.name, config)

    def generator(self, backend: str = "transformers", backend_config: Any = None, *,
                  model_input: str = "sft_model", model_path: str | Path | None = None) -> Generator:
        """The generation backend ``backend`` for the model of input ``model_input`` (the recipe's model block
        says how to load it and how to write its prompts); ``model_path``: another folder of that input's model
        (e.g. one of its snapshots) instead of the one the input points at."""
        return self.registry.create("generation_backend", backend, backend_config, spec=self.recipe.model,
                                    model_path=str(model_path) if model_path else self.input(model_input).path,
                                    path=("stages", self.stage, "config", "backend_config"))

    def generate_on_ranks(self, backend: str, backend_config: Any, records: list[dict[str, Any]],
                          sampling: SamplingConfig, description: str, *,
                          model_path: str | Path | None = None) -> tuple[list[dict[str, Any]], int]:
        """``(rows, tokens generated)`` for ``records`` on every rank, the same whatever the number of processes
        (rows as :func:`alpacafarm.generation.generate_records` writes them; the generator is closed before this
        returns, so the policy's memory is free for what comes next).

        The ``transformers`` backend shards its batches across ranks (:attr:`TransformersGenerator.sharded
        <alpacafarm.generation.TransformersGenerator.sharded>`: the same batches and seeds as one process); any other
        backend (a server, vLLM) runs on the main process only and its rows reach the others. Under several
        processes it needs the method's ``ranks = Ranks.ALL``. ``model_path``: as in :meth:`generator`.
        """
        from alpacafarm import distributed
        from alpacafarm.errors import UserError
        from alpacafarm.generation import TransformersGenerator, generate_records

        if self.ranks is not Ranks.ALL and distributed.world_size() > 1:  # the other ranks wait for this stage's
            # artifact: they never join the sampling
            raise UserError(f"stage {self.stage!r}: context.generate_on_ranks needs every rank, but this stage's "
                            "method runs on the main process only; its plugin must set ranks = Ranks.ALL on the "
                            "method class (or sample with context.generator)")
        sharded = backend == "transformers"

        def generate() -> tuple[list[dict[str, Any]], int]:
            generator = self.generator(backend, backend_config, model_path=model_path)
            if sharded and isinstance(generator, TransformersGenerator):
                generator.sharded = True  # every rank samples its share of the batches; all get every row
            try:
                with self.progress(description, len(records)) as advance:
                    rows = generate_records(generator, records, sampling, progress=advance)
                return rows, sum(map(sum, generator.last_token_counts or [[0]]))
            finally:
                generator.close()

        if sharded:
            return generate()
        return distributed.run_on_main(generate, f"stage {self.stage!r}: generation ({backend})")

    def reward_function(self, *, batch_size: int = 8, max_length: int | None = None,
                        model_input: str = "reward_model", ensemble: str = "mean",
                        ensemble_coefficient: float = 0.0) -> RewardScorer:
        """The reward model of input ``model_input`` as a :data:`~alpacafarm.rewards.RewardFunction` (any folder
        layout; sampled and scored in the model block's ``inference_dtype``); an ensemble's members combined by
        ``ensemble`` (:func:`~alpacafarm.rewards.combine_members`). A mean-pooled reward model looks its features up
        in the machine's readings store (:mod:`alpacafarm.readings`): an answer read before is not read again."""
        from alpacafarm.readings import default_store
        from alpacafarm.rewards import RewardScorer

        return RewardScorer.from_path(self.input(model_input).path, self.recipe.model, max_length=max_length,
                                      batch_size=batch_size, ensemble=ensemble,
                                      ensemble_coefficient=ensemble_coefficient, readings=default_store())

    @contextmanager
    def progress(self, description: str, total: int | None) -> Iterator[Any]:
        """A rich progress bar; yields ``advance(n=1)``. Only the main process shows one (others: a no-op)."""
        from alpacafarm.console import progress_bar

        if not self.is_main:  # a line that shows nothing (advance and update alike)
            from types import SimpleNamespace

            from alpacafarm.console import ProgressLine

            yield ProgressLine(SimpleNamespace(update=lambda *args, **kwargs: None), None)
            return
        with progress_bar(description, total) as advance:
            yield advance


class Method:
    """Base class for methods and evaluators.

    Subclasses set ``config_class`` (a pydantic model or dataclass, or ``None``), ``requires`` (names of the
    inputs the pipeline must wire: ``base_model``, ``sft_model``, ``preferences``, ``reward_model``, a data name,
    ...; the built-in names are :class:`alpacafarm.artifact_names.ArtifactName`), ``provides`` (what the output
    is, so later stages find it), ``produces`` (the typed hand-offs its artifact always carries),
    ``annotator_role`` if they use an annotator, ``ranks`` (where the stage runs under several processes), and
    implement :meth:`run`. The pipeline builds the method as ``Method(config)``; ``self.config`` is the validated
    config object.
    """

    config_class: ClassVar[Any] = None
    requires: ClassVar[tuple[str, ...]] = ()
    #: Inputs wired when an earlier stage (or a data source) provides them and left out otherwise, e.g. the
    #: evaluator's ``reward_model`` (a proxy-reward column when the recipe trained one).
    optional: ClassVar[tuple[str, ...]] = ()
    #: what the stage's artifact is (``sft_model``, ``preferences``, ...): required, a recipe naming a method
    #: without it is an error (an evaluator provides ``evaluation``)
    provides: ClassVar[str] = ""
    #: ``"feedback"`` or ``"evaluation"`` when the method calls ``context.make_annotator(role)``: the recipe's
    #: annotator for that role is then part of the stage's fingerprint (changing the judge re-runs the stage).
    annotator_role: ClassVar[str | None] = None
    #: Where the stage runs under several processes (``alpacafarm run --num-processes N``): :class:`Ranks`
    #: ``MAIN`` (the default), ``ALL`` or ``SINGLE_PROCESS``.
    ranks: ClassVar[Ranks] = Ranks.MAIN
    #: The typed hand-offs (:mod:`alpacafarm.artifacts`) its artifact always carries, among ``files``,
    #: ``systems``, ``snapshots``, ``judged``, ``table``: a stage whose artifact lacks one fails when it ends
    #: (``best_of_n``: ``("systems",)``). Those it carries only sometimes are checked too, but not required.
    produces: ClassVar[tuple[str, ...]] = ()

    def __init_subclass__(cls, **kwargs: Any) -> None:
        """Refuse, when the class is defined, a ``produces`` naming an unknown hand-off and a ``ranks`` that is not a
        :class:`Ranks`: one line, never a silently ignored setting."""
        super().__init_subclass__(**kwargs)
        from alpacafarm.artifacts import HANDOFFS

        unknown = [p for p in cls.produces if p not in HANDOFFS] if isinstance(cls.produces, tuple) else [
            cls.produces]
        if unknown:
            raise TypeError(f"{cls.__module__}.{cls.__qualname__}.produces = {cls.produces!r}: it must be a tuple "
                            f"of {', '.join(HANDOFFS)}")
        # an ArtifactName is a str; kept as the plain string, so that messages, manifests and YAML see the name.
        # Only names are converted: anything else stays as declared, for the checks that refuse it (no provides)
        cls.requires, cls.optional = _plain_names(cls.requires), _plain_names(cls.optional)
        cls.provides = _plain_names(cls.provides)
        if not isinstance(cls.ranks, Ranks):
            raise TypeError(f"{cls.__module__}.{cls.__qualname__}.ranks is {cls.ranks!r}; it must be Ranks.MAIN, "
                            f"Ranks.ALL or Ranks.SINGLE_PROCESS (from alpacafarm.method import Ranks)")

    def __init__(self, config: Any = None) -> None:
        self.config = config

    def run(self, context: StageContext) -> Artifact:
        """Do the work, write files under ``context.stage_dir``, and return the artifact."""
        raise NotImplementedError(f"{type(self).__name__}.run")
