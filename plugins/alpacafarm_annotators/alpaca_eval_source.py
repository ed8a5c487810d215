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
``tests/test_alpaca_eval_configs.py``, lives beside this module:

- **configs** (:mod:`~alpacafarm_annotators.alpaca_eval_members`): the installed package's configs and each
  member's fields; a config field, completion option or parser this engine does not implement is a one-line error.
- **prompts** (:mod:`~alpacafarm_annotators.alpaca_eval_render`): templates filled with a batch of pairs (a short
  batch padded), chat models' prompts split into messages, the logit bias of ``tokens_to_avoid``/``tokens_to_favor``
  (a server that does not speak OpenAI's vocabulary needs ``--set logit_bias=false``).
- **decoding** (here): ``max_tokens`` (default 2048), ``temperature``, ``top_p`` (default 1.0), ``logprobs`` and
  ``top_logprobs`` as configured, and the logit bias.
- **parsing** (:mod:`~alpacafarm_annotators.alpaca_eval_parsers`): the config's parser over the completion text or
  over the choice with its logprobs; the logprob parser gives continuous preferences, which flow into the weighted
  win-rate.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from alpacafarm.annotation import Annotator, AnnotatorBuilder
from alpacafarm.errors import MissingPackageError, UserError
from alpacafarm.types import Pair
from alpacafarm_annotators.alpaca_eval_members import (
    INSTALL,
    PREFIX,
    Member,
    configs_dir,
    load_members,
    package_version,
)
from alpacafarm_annotators.alpaca_eval_parsers import parse_values
from alpacafarm_annotators.alpaca_eval_render import PADDING, chat_messages, fill_template, logit_bias, pair_row
from alpacafarm_annotators.config import PoolConfig, Price, PromptedAnnotatorConfig
from alpacafarm_annotators.endpoint_requests import Completion
from alpacafarm_annotators.prompted import PromptedAnnotator

#: member settings a recipe or the command line may change (the rest is the config's, as AlpacaEval runs it)
MEMBER_SETTINGS = {"base_url", "api_key_env", "model_map", "price", "max_concurrency", "requests_per_minute",
                   "timeout_s", "max_retries", "retry_backoff_s", "connect_retries", "parse_retries", "claim_wait_s",
                   "claim_stale_s", "claim_poll_s", "max_cost_usd", "cache", "logit_bias", "mode", "batch_wait_s",
                   "batch_poll_s", "batch_max_poll_s", "batch_resubmits", "batch_max_requests",
                   "batch_completion_window"}


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


class AlpacaEvalSource(AnnotatorBuilder):
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

    def __call__(self, settings: BaseModel | None = None, *, cache: Any = None, budget: Any = None,
                 registry: Any = None) -> Annotator:
        """The pool of the config's members. ``registry`` goes unused: a preset file (``configs/*.yaml``) is
        registered with the runtime arguments of every preset, a pool's ``registry`` among them."""
        from alpacafarm.annotation_cache import AnnotationCache
        from alpacafarm_annotators.endpoint_requests import Budget
        from alpacafarm_annotators.pool import AnnotatorPool

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
                # AlpacaEval lists one price per token; batch endpoints charge half of it (OpenAI's Batch API)
                fields["price"] = Price(input=per_million, output=per_million, batch_input=per_million / 2,
                                        batch_output=per_million / 2)
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
