"""AlpacaEval's evaluator configs, read from the installed ``alpaca-eval`` package (never imported: only its
``evaluators_configs/<config>/configs.yaml`` and prompt templates are read): each member of a config as a
:class:`Member`, checked field by field. A config field, completion option or parser this engine does not
implement is a one-line error naming it.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any

import yaml

from alpacafarm.errors import MissingPackageError, UserError, did_you_mean

PREFIX = "alpaca_eval:"
INSTALL = "pip install 'alpacafarm[alpaca-eval]'"

MEMBER_FIELDS = {"prompt_template", "fn_completions", "completions_kwargs", "fn_completion_parser",
                 "completion_parser_kwargs", "batch_size", "completion_key", "is_randomize_output_order",
                 "pretty_name", "link"}
COMPLETION_OPTIONS = {"model_name", "max_tokens", "temperature", "top_p", "tokens_to_avoid", "tokens_to_favor",
                      "is_skip_multi_tokens_to_avoid", "is_strip", "logprobs", "top_logprobs", "requires_chatml",
                      "price_per_token", "num_procs"}
PARSER_NAMES = ("regex_parser", "ranking_parser", "json_parser", "lmsys_parser", "logprob_parser",
                "pipeline_meta_parser")


# ------------------------------------------------------------------------------------------ the installed package
def package_dir() -> Path | None:
    """The installed ``alpaca_eval`` package's folder, found without importing it; None when not installed."""
    try:
        spec = importlib.util.find_spec("alpaca_eval")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def configs_dir() -> Path | None:
    found = package_dir()
    return found / "evaluators_configs" if found is not None else None


def package_version() -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("alpaca_eval")
    except PackageNotFoundError:
        return None


def config_names() -> list[str]:
    """The evaluator configs of the installed package (folders with a ``configs.yaml``); [] when not installed."""
    root = configs_dir()
    if root is None or not root.is_dir():
        return []
    return sorted(p.parent.name for p in root.glob("*/configs.yaml"))


def require_package(what: str) -> Path:
    """The configs folder, or a one-line error naming ``what`` needs the extra."""
    root = configs_dir()
    if root is None or not root.is_dir():
        raise MissingPackageError(f"{what} reads AlpacaEval's evaluator configs, which needs the optional extra: "
                                  f"{INSTALL}")
    return root


# ------------------------------------------------------------------------------------------ a config's members
@dataclass
class Member:
    """One annotator of an AlpacaEval config, as its ``configs.yaml`` entry describes it."""

    config: str
    key: str
    template_file: str
    template: str
    model: str
    chat: bool
    batch_size: int
    decoding: dict[str, Any]
    tokens_to_avoid: list[str] = field(default_factory=list)
    tokens_to_favor: list[str] = field(default_factory=list)
    skip_multi_token_avoid: bool = True
    strip: bool = True
    parser: str = "regex_parser"
    parser_kwargs: dict[str, Any] = field(default_factory=dict)
    completion_key: str = "completions"
    randomize_order: bool = True
    price_per_token: float | None = None

    @property
    def name(self) -> str:
        return f"{PREFIX}{self.config}/{self.key}"


def _requires_chat(model: str) -> bool:
    """Whether AlpacaEval sends this model's prompts as chat messages (everything but the completion models)."""
    completion_model = "instruct" in model or ("gpt-3" in model and "turbo" not in model) or model.startswith("text-")
    return not completion_model


def _unsupported(where: str, key: str, allowed: set[str] | Sequence[str]) -> UserError:
    return UserError(f"{where}: {key!r} is not supported by alpacafarm's AlpacaEval engine "
                     f"(supported: {', '.join(sorted(allowed))})")


def _read_template(root: Path, relative: str, where: str) -> str:
    path = (root / relative).resolve()
    if not path.is_relative_to(root.resolve()) or not path.is_file():
        raise UserError(f"{where}: prompt_template {relative!r} is not a file of the installed alpaca_eval configs")
    return path.read_text(encoding="utf-8")


@cache
def load_members(config: str) -> tuple[Member, ...]:
    """The members of AlpacaEval config ``config`` (its folder under ``evaluators_configs``), checked field by field."""
    root = require_package(f"annotator '{PREFIX}{config}'")
    path = root / config / "configs.yaml"
    if not path.is_file():
        known = config_names()
        raise UserError(f"unknown AlpacaEval config {config!r}{did_you_mean(config, known)} "
                        f"(installed alpaca_eval {package_version()} has {len(known)}: see `alpacafarm annotate "
                        f"--annotator {PREFIX}<config> --describe`, e.g. {PREFIX}alpaca_farm)")
    data = yaml.safe_load(path.read_text(encoding="utf-8"))
    if not isinstance(data, dict) or not data:
        raise UserError(f"{PREFIX}{config}: {path.name} holds no annotator")
    return tuple(_member(root, config, key, spec) for key, spec in data.items())


def _member(root: Path, config: str, key: str, spec: dict[str, Any]) -> Member:
    where = f"{PREFIX}{config} member {key!r}"
    for name in spec:
        if name not in MEMBER_FIELDS:
            raise _unsupported(where, name, MEMBER_FIELDS)
    if spec.get("fn_completions", "openai_completions") != "openai_completions":
        raise _unsupported(f"{where}: fn_completions", spec["fn_completions"], {"openai_completions"})
    options = dict(spec.get("completions_kwargs") or {})
    for name in options:
        if name not in COMPLETION_OPTIONS:
            raise _unsupported(f"{where}: completions_kwargs", name, COMPLETION_OPTIONS)
    parser = spec.get("fn_completion_parser") or "regex_parser"
    if parser not in PARSER_NAMES:
        raise _unsupported(f"{where}: fn_completion_parser", parser, PARSER_NAMES)
    parser_kwargs = dict(spec.get("completion_parser_kwargs") or {})
    if parser == "pipeline_meta_parser":
        for step in (parser_kwargs.get("parsers_to_kwargs") or {}):
            if step not in PARSER_NAMES or step == "pipeline_meta_parser":
                raise _unsupported(f"{where}: pipeline_meta_parser step", step,
                                   set(PARSER_NAMES) - {"pipeline_meta_parser"})
    completion_key = spec.get("completion_key", "completions")
    if completion_key not in ("completions", "completions_all"):
        raise _unsupported(f"{where}: completion_key", completion_key, {"completions", "completions_all"})
    model = str(options.pop("model_name"))
    decoding: dict[str, Any] = {"max_tokens": options.pop("max_tokens", 2048),
                                "temperature": options.pop("temperature", 0.7), "top_p": options.pop("top_p", 1.0)}
    for name in ("logprobs", "top_logprobs"):
        if name in options:
            decoding[name] = options.pop(name)
    price = options.pop("price_per_token", None)
    return Member(
        config=config, key=str(key), template_file=str(spec["prompt_template"]),
        template=_read_template(root, str(spec["prompt_template"]), where), model=model,
        chat=bool(options.pop("requires_chatml", _requires_chat(model))), batch_size=int(spec.get("batch_size", 1)),
        decoding=decoding, tokens_to_avoid=list(options.pop("tokens_to_avoid", None) or []),
        tokens_to_favor=list(options.pop("tokens_to_favor", None) or []),
        skip_multi_token_avoid=bool(options.pop("is_skip_multi_tokens_to_avoid", True)),
        strip=bool(options.pop("is_strip", True)), parser=parser, parser_kwargs=parser_kwargs,
        completion_key=completion_key, randomize_order=bool(spec.get("is_randomize_output_order", True)),
        price_per_token=float(price) if price is not None else None)
