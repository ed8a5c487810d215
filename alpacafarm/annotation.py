"""The annotator interface: ``annotate(pairs) -> annotations``, sync and async.

Implementations (prompted API judges, pools, the offline judge, local transformers judges) live in plugins and
subclass :class:`Annotator`; they implement :meth:`Annotator.aannotate`. Identical outputs are a tie and are
never sent anywhere (:func:`identical_tie`).
"""

from __future__ import annotations

import argparse
import asyncio
import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from alpacafarm.types import Annotation, Pair

if TYPE_CHECKING:
    from alpacafarm.registry import Registry

#: ``progress(n_done, cost_usd)`` is called as annotations complete (drives progress bars).
ProgressCallback = Callable[[int, float], None]


def identical_tie(pair: Pair, annotator: str) -> Annotation | None:
    """A tie for two identical outputs (whitespace-insensitive), else None."""
    if pair.output_1.strip() == pair.output_2.strip():
        return Annotation(0, annotator, metadata={"reason": "identical outputs"})
    return None


class Annotator:
    """Base class. ``name`` identifies the annotator in outputs, the cache and the ledger."""

    name: str = "annotator"

    async def aannotate(self, pairs: Sequence[Pair], progress: ProgressCallback | None = None) -> list[Annotation]:
        raise NotImplementedError

    def annotate(self, pairs: Sequence[Pair], progress: ProgressCallback | None = None) -> list[Annotation]:
        """Annotate ``pairs`` (one annotation each, in order). Works inside and outside a running event loop."""
        coroutine_factory = lambda: self.aannotate(list(pairs), progress)  # noqa: E731
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

    def close(self) -> None:
        """Release clients, files and models (called by the CLI and the pipeline when done)."""


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

    from alpacafarm.errors import UserError

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
            raise UserError(f"--set expects KEY=VALUE, got {setting!r}")
        options[key] = yaml.safe_load(raw)
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
    """Build annotator ``name`` from the command line: the target's ``cli_config(options)`` maps the options to
    its config block (without one, the options are the block), then ``registry.create`` validates and builds."""
    from alpacafarm.errors import RecipeError, UserError

    options = annotator_options(args)
    target = registry.get("annotator", name)
    to_config = getattr(target, "cli_config", None)
    if callable(to_config):
        block = to_config(options)
    else:  # the options are the config block: name the flag of one the annotator does not take
        allowed = _config_fields(getattr(target, "config_class", None))
        for key in options:
            if key not in allowed:
                flag = _FLAGS.get(key, f"--set {key}=...")
                listing = ", ".join(sorted(allowed)) or "none"
                raise UserError(f"annotator {name!r} takes no {flag} (its config fields: {listing})")
        block = options
    try:
        return registry.create("annotator", name, block, path=("options",))
    except RecipeError as exc:
        raise UserError(f"annotator {name!r}: {exc}") from None
