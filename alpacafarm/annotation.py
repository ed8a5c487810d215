"""The annotator interface: ``annotate(pairs) -> annotations``, sync and async.

Implementations (prompted API judges, pools, the offline judge, local transformers judges) live in plugins and
subclass :class:`Annotator`; they implement :meth:`Annotator.aannotate`. Identical outputs are a tie and are
never sent anywhere (:func:`identical_tie`).

Replicates: annotating the same pair twice gives the same label (the cache and every seeded draw are keyed on
the pair), so an annotator's variance would read 0. ``annotate(pairs, replicate=k)`` asks for the k-th
independent annotation instead: replicate 0 is the ordinary annotation; replicate k > 0 is a separate draw of
everything random (a pool's member, order and label noise; an API judge's sampling, with its own cache key and
request seed), cached and paid for once like any label. A deterministic annotator (the offline judge, a local
judge, a greedy API judge) gives the same label for every replicate, which is its true variance of 0. An annotator
says it takes the ``replicate`` keyword with :attr:`Annotator.accepts_replicate`; one that does not (written before
replicates existed) is called without it and cannot be asked for replicate k > 0 (:func:`aannotate_replicate`).

What a registered annotator target may offer besides building an annotator is declared here, with defaults:
:meth:`Annotator.cli_config` (a classmethod) or :meth:`AnnotatorBuilder.cli_config` for a target that builds
annotators from data (a preset file) maps the shared command-line options to its config block.

Failing loudly: every annotation has an ``outcome`` (labelled, tie, unparsed, failed; see
:class:`~alpacafarm.types.Annotation`). :func:`summarize` counts them and names the first failure and its
endpoint; :func:`check_unlabelled` is the tolerance a pipeline stage applies (``max_unlabelled_fraction``): more
pairs without a label (failed or unparsed; a tie is a label) than the tolerance raise :class:`AnnotationFailed`,
one line, exit status 1, so the stage is never recorded complete and a re-run asks only for what is missing
(failed pairs; unparsed pairs up to the judge's ``reask_unparsed`` more times, after which they stay unparsed).
"""

from __future__ import annotations

import argparse
import asyncio
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

from alpacafarm.annotation_cache import LedgerTotals
from alpacafarm.errors import UserError
from alpacafarm.exit_status import FAILED
from alpacafarm.types import OUTCOMES, Annotation, Pair

if TYPE_CHECKING:
    from alpacafarm.registry import Registry

#: ``progress(n_done, cost_usd)`` is called as annotations complete (drives progress bars).
ProgressCallback = Callable[[int, float], None]


class AnnotationFailed(UserError):
    """Annotation work failed (pairs without a label past the tolerance, an endpoint that never answered): one line
    naming the endpoint and the first error, exit status 1 ("the work failed"; 2 stays "the user's input is wrong")."""

    exit_code = FAILED


class AnnotationPending(UserError):
    """Annotation work sent as a batch (``mode: batch``) is not finished yet: "batch pending, re-run to collect".
    Exit status 75 (EX_TEMPFAIL, "try again later"): nothing failed and nothing is lost; the batches are recorded
    in the annotation cache, so a re-run polls them and never submits their pairs again."""

    exit_code = 75


@dataclass
class OutcomeSummary:
    """Counts of the outcomes of a list of annotations, and the first failure (error text and endpoint)."""

    n: int = 0
    counts: dict[str, int] = field(default_factory=lambda: dict.fromkeys(OUTCOMES, 0))
    first_error: str | None = None
    endpoint: str | None = None

    @property
    def failed(self) -> int:
        return self.counts["failed"]

    @property
    def unparsed(self) -> int:
        return self.counts["unparsed"]

    @property
    def unlabelled(self) -> int:
        """Pairs without a usable label: failed (no answer) plus unparsed (an answer that could not be read)."""
        return self.failed + self.unparsed

    def cause(self) -> str:
        """``first error: ... (endpoint URL)``, or '' when nothing failed."""
        if self.first_error is None:
            return ""
        where = f" at {self.endpoint}" if self.endpoint else ""
        return f"first error{where}: {self.first_error}"

    def to_json(self) -> dict[str, Any]:
        return {"n": self.n, **self.counts, "first_error": self.first_error, "endpoint": self.endpoint}


def summarize(annotations: Sequence[Annotation]) -> OutcomeSummary:
    """Outcome counts; the first error is the first failed annotation's (else the first unparsed one's)."""
    summary = OutcomeSummary(n=len(annotations))
    for outcome in ("failed", "unparsed"):
        for annotation in annotations:
            if annotation.outcome == outcome and summary.first_error is None:
                summary.first_error = str(annotation.metadata.get("error") or outcome)
                summary.endpoint = annotation.metadata.get("endpoint")
    for annotation in annotations:
        summary.counts[annotation.outcome or "unparsed"] += 1
    return summary


def check_unlabelled(annotations: Sequence[Annotation], max_fraction: float, what: str) -> OutcomeSummary:
    """Raise :class:`AnnotationFailed` when more than ``max_fraction`` of ``annotations`` have no label (failed or
    unparsed); ``what`` names the work (e.g. ``"stage 'prefs' (annotator 'gpt4_b5')"``). Returns the summary."""
    summary = summarize(annotations)
    if summary.n and summary.unlabelled > max_fraction * summary.n:
        raise AnnotationFailed(
            f"{what}: {summary.unlabelled} of {summary.n} pairs have no label ({summary.failed} failed, "
            f"{summary.unparsed} unparsed; tolerance max_unlabelled_fraction={max_fraction:g}); {summary.cause()}; "
            f"the answers received are cached: a re-run asks only for the missing pairs (failed pairs are asked "
            f"again; unparsed ones again up to the judge's reask_unparsed times, then they stay unparsed)")
    return summary


def identical_tie(pair: Pair, annotator: str) -> Annotation | None:
    """A tie for two identical outputs (whitespace-insensitive), else None."""
    if pair.output_1.strip() == pair.output_2.strip():
        return Annotation(0, annotator, metadata={"reason": "identical outputs"})
    return None


async def aannotate_replicate(annotator: Annotator, pairs: Sequence[Pair], progress: ProgressCallback | None = None,
                              replicate: int = 0) -> list[Annotation]:
    """``annotator.aannotate(pairs, progress, replicate=replicate)``; replicate 0 is the plain call, so annotators
    written before replicates existed keep working. Raises UserError for replicate k > 0 when the annotator does
    not declare :attr:`Annotator.accepts_replicate` (its repeats would silently be copies: a variance of 0)."""
    if isinstance(replicate, bool) or not isinstance(replicate, int) or replicate < 0:
        raise UserError(f"replicate must be an integer >= 0, got {replicate!r}")
    if replicate == 0:
        return await annotator.aannotate(pairs, progress)
    if not annotator.accepts_replicate:
        raise UserError(f"annotator {annotator.name!r} cannot draw replicate annotations: its class "
                        f"{type(annotator).__qualname__} does not declare accepts_replicate = True (a deterministic "
                        "annotator can accept the 'replicate' keyword and ignore it)")
    return await annotator.aannotate(pairs, progress, replicate=replicate)


class Annotator:
    """Base class. ``name`` identifies the annotator in outputs, the cache and the ledger."""

    name: str = "annotator"
    #: the pydantic model or dataclass its config block is validated with (None: it takes no config block)
    config_class: ClassVar[Any] = None
    #: True when :meth:`aannotate` takes the ``replicate`` keyword (the k-th independent repeat; a deterministic
    #: annotator takes it and gives the same label). False, the default of annotators written before replicates
    #: existed: it is called without the keyword, and asking it for replicate k > 0 is an error naming it.
    accepts_replicate: ClassVar[bool] = False

    @classmethod
    def cli_config(cls, options: dict[str, Any]) -> dict[str, Any]:
        """The config block for the shared command-line options (:func:`annotator_options`, only those given).
        By default the options are the block; a config field they set that the annotator lacks is refused by
        :func:`annotator_from_options`, naming the flag."""
        return dict(options)

    async def aannotate(self, pairs: Sequence[Pair], progress: ProgressCallback | None = None, *,
                        replicate: int = 0) -> list[Annotation]:
        """One annotation per pair, in order; ``replicate`` k > 0 is the k-th independent repeat (see the module)."""
        raise NotImplementedError

    def annotate(self, pairs: Sequence[Pair], progress: ProgressCallback | None = None, *,
                 replicate: int = 0) -> list[Annotation]:
        """Annotate ``pairs`` (one annotation each, in order; ``replicate``: which independent repeat, 0 = the
        ordinary annotation). Works inside and outside a running event loop."""
        coroutine_factory = lambda: aannotate_replicate(self, list(pairs), progress, replicate)  # noqa: E731
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return asyncio.run(coroutine_factory())
        result: dict[str, Any] = {}

        def runner() -> None:  # a notebook already runs a loop: use a private one on a thread
            try:
                result["value"] = asyncio.run(coroutine_factory())
            except BaseException as exc:
                result["error"] = exc

        thread = threading.Thread(target=runner)
        thread.start()
        thread.join()
        if "error" in result:
            raise result["error"]
        return result["value"]

    def usage(self) -> LedgerTotals:
        """Requests, tokens and dollars this annotator paid for since it was built (its run's share of the ledger;
        zeros for a judge that costs nothing)."""
        return LedgerTotals(0, 0, 0, 0.0)

    def close(self) -> None:
        """Release clients, files and models (called by the CLI and the pipeline when done)."""


class AnnotatorBuilder:
    """A registered annotator target that is not an :class:`Annotator` class: it builds one from data (a preset
    file, an AlpacaEval config), called as ``builder(config, **runtime)`` like a class would be."""

    #: what the recipe's config block for it is validated with (None: no config block)
    config_class: Any = None

    def cli_config(self, options: dict[str, Any]) -> dict[str, Any]:
        """The config block for the shared command-line options; by default the options themselves."""
        return dict(options)

    def __call__(self, config: Any, **runtime: Any) -> Annotator:
        """The annotator, for a validated ``config`` and the runtime arguments the registration declares."""
        raise NotImplementedError


class ScoringAnnotator(Annotator):
    """An annotator whose preferences come from a pointwise score of each answer (a known gold function, as in a
    gold-preference world). :meth:`score` gives the scores themselves: the evaluation then reports each system's
    mean score, with its paired standard error against the first system, next to the win-rate."""

    def score(self, records: Sequence[dict[str, Any]], answers: Sequence[str]) -> list[float]:
        """One finite score per answer to its record's instruction (``instruction``, ``input``); higher is better."""
        raise NotImplementedError

    def prefetch(self, records: Sequence[dict[str, Any]], answers: Sequence[str]) -> None:
        """Score these answers ahead, in one call, so that later :meth:`score` calls find them ready (the
        evaluation hands every system's answers at once: a scorer that reads an instruction once for all its
        answers gains). The default does nothing; an annotator that keeps its scores overrides it."""


# ---------------------------------------------------------------------------------------- command-line options
# ``alpacafarm annotate`` and ``alpacafarm evaluate`` (in different plugins) take the same annotator options and
# build the annotator the same way, through the registry.


def add_annotator_options(parser: argparse.ArgumentParser) -> None:
    """The options every command that builds an annotator accepts."""
    parser.add_argument("--base-url", help="OpenAI-compatible endpoint for API annotators")
    parser.add_argument("--model-map", action="append", default=[], metavar="OLD=NEW",
                        help="send model OLD as NEW (e.g. gpt-4-0314=gpt-4.1); repeatable")
    parser.add_argument("--max-cost-usd", type=float, help="stop before spending more than this")
    parser.add_argument("--seed", type=int, help="pool seed (assignment, order, noise)")
    parser.add_argument("--no-cache", action="store_true", help="neither read nor write the annotation cache")
    parser.add_argument("--set", dest="settings", action="append", default=[], metavar="KEY=VALUE",
                        help="any annotator config field, e.g. --set max_concurrency=4 (pools: applied to members)")


def annotator_options(args: argparse.Namespace) -> dict[str, Any]:
    """The options given on the command line as one flat mapping (only those given)."""
    import yaml

    from alpacafarm.yamlsource import shown_override, yaml_value

    options: dict[str, Any] = {}
    if args.base_url:
        options["base_url"] = args.base_url
    if args.model_map:
        pairs = [m.split("=", 1) for m in args.model_map]
        if any(len(p) != 2 or not p[0] or not p[1] for p in pairs):
            raise UserError(f"--model-map expects OLD=NEW, got {args.model_map}")
        options["model_map"] = dict(pairs)
    if args.max_cost_usd is not None:
        options["max_cost_usd"] = args.max_cost_usd
    if args.seed is not None:
        options["seed"] = args.seed
    if args.no_cache:
        options["cache"] = False
    for setting in args.settings:
        key, sep, raw = setting.partition("=")
        if not sep or not key:
            raise UserError(f"--set expects KEY=VALUE, got {shown_override(setting)}")
        try:
            options[key] = yaml_value(raw, f"--set {key}")  # bounded: no alias bomb
        except yaml.YAMLError as exc:
            problem = getattr(exc, "problem", None) or type(exc).__name__
            raise UserError(f"--set {shown_override(setting)}: the value is not valid YAML ({problem})") from None
    return options


#: The config keys the shared options set, by flag (``--set KEY=VALUE`` sets any other key).
_FLAGS = {"base_url": "--base-url", "model_map": "--model-map", "max_cost_usd": "--max-cost-usd", "seed": "--seed",
          "cache": "--no-cache"}


def _config_fields(config_class: Any) -> set[str]:
    """The field names of a pydantic model or dataclass config class (none without one)."""
    import dataclasses

    if config_class is None:
        return set()
    if dataclasses.is_dataclass(config_class):
        return {f.name for f in dataclasses.fields(config_class) if f.init}
    return set(getattr(config_class, "model_fields", {}))


def annotator_from_options(registry: Registry, name: str, args: argparse.Namespace) -> Annotator:
    """Build annotator ``name`` from the command line: the target's ``cli_config(options)`` (an :class:`Annotator`
    class or an :class:`AnnotatorBuilder`; a function target takes the options as its block) maps the options to
    its config block, then ``registry.create`` validates and builds. A key of the block the target's config class
    has no field for is refused naming the flag that set it."""
    from alpacafarm.errors import RecipeError
    from alpacafarm.registry import config_class_of

    options = annotator_options(args)
    target = registry.get("annotator", name)
    if isinstance(target, AnnotatorBuilder) or (isinstance(target, type) and issubclass(target, Annotator)):
        block = target.cli_config(options)
    else:
        block = dict(options)
    allowed = _config_fields(config_class_of(target))
    for key in block:
        if key not in allowed:
            flag = _FLAGS.get(key, f"--set {key}=...")
            listing = ", ".join(sorted(allowed)) or "none"
            raise UserError(f"annotator {name!r} takes no {flag} (its config fields: {listing})")
    try:
        return registry.create("annotator", name, block, path=("options",))
    except RecipeError as exc:
        raise UserError(f"annotator {name!r}: {exc}") from None


def label_identity(registry: Any, name: str) -> Any:
    """What the labels of annotator ``name`` depend on beyond its recipe config (fitted weights, a model), as
    plain data, or None when its plugin says nothing. A plugin says it with ``identity="module:function"`` when it
    registers the annotator; the function gets ``(registry, name)``. The pipeline adds it to the fingerprint of
    every stage that annotates, so a changed judge re-runs them instead of reusing the old judge's labels."""
    from alpacafarm.registry import import_target

    if ("annotator", name) not in registry:
        return None
    hook = registry.entry("annotator", name).identity
    if hook is None:
        return None
    return import_target(hook, what=f"identity of annotator {name!r}")(registry, name)


#: Annotator settings that bound or pace a run but never change a label: a budget, concurrency, rate limits,
#: deadlines and retry policy. They are left out of a stage's fingerprint, so raising ``max_cost_usd`` (as the
#: budget's error message advises) resumes the stage where it stopped instead of starting it again.
RUN_LIMIT_KEYS = frozenset({
    "max_cost_usd", "max_concurrency", "requests_per_minute", "timeout_s", "max_retries", "retry_backoff_s",
    "max_backoff_s", "connect_retries", "timeout_retries", "claim_wait_s", "claim_stale_s", "claim_poll_s",
    "cache_flush_wait_s"})


def without_run_limits(config: Any) -> Any:
    """An annotator reference or config (plain data) without :data:`RUN_LIMIT_KEYS`, at any depth (a pool's
    ``overrides`` hold its members' budget)."""
    if isinstance(config, dict):
        return {k: without_run_limits(v) for k, v in config.items() if k not in RUN_LIMIT_KEYS}
    if isinstance(config, list):
        return [without_run_limits(v) for v in config]
    return config
