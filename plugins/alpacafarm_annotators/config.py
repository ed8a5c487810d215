"""Annotators are data: a YAML file per annotator (model, prompt template, batch size, decoding, parser).

``configs/<name>.yaml`` holds one :class:`PromptedAnnotatorConfig` (``kind: prompted``) or one
:class:`PoolConfig` (``kind: pool``). Every field can be overridden from a recipe's ``annotator.config`` block.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, field_validator

from alpacafarm_annotators import CONFIG_DIR

TEMPLATE_DIR = Path(__file__).parent / "templates"

class Price(BaseModel):
    """USD per million tokens: live requests (``input``, ``output``) and, for ``mode: batch``, the batch rate."""

    model_config = ConfigDict(extra="forbid")

    input: float = Field(0.0, ge=0)
    output: float = Field(0.0, ge=0)
    batch_input: float | None = Field(None, ge=0, description="USD per million input tokens sent in a batch")
    batch_output: float | None = Field(None, ge=0, description="USD per million output tokens of a batch")

    def batch_rate(self) -> Price | None:
        """The batch prices as a live-style price (None when this price has no batch rate)."""
        if self.batch_input is None or self.batch_output is None:
            return None
        return Price(input=self.batch_input, output=self.batch_output)


class PromptedAnnotatorConfig(BaseModel):
    """An LLM judge behind an OpenAI-compatible endpoint."""

    model_config = ConfigDict(extra="forbid")

    kind: Literal["prompted"] = "prompted"
    description: str = ""
    model: str = Field(description="model name sent to the endpoint (after model_map)")
    template: str = Field(description="prompt template: a file in templates/ (without .yaml) or a path")
    style: Literal["chat", "completion"] = "chat"
    batch_size: int = Field(1, ge=1, le=50, description="pairs per request")
    parser: str = Field("ranking", description="how to read the completion: see parsing.PARSERS")
    decoding: dict[str, Any] = Field(default_factory=lambda: {"temperature": 1.0, "top_p": 1.0, "max_tokens": 100})
    logprobs: bool = False
    base_url: str | None = Field(None, description="endpoint; default: $OPENAI_BASE_URL, else OpenAI")
    api_key_env: str | None = Field("OPENAI_API_KEY", description="name of the env variable holding the key")
    model_map: dict[str, str] = Field(default_factory=dict)
    price: Price | None = Field(None, description="default: the price table entry for the model")
    max_concurrency: int = Field(8, ge=1)
    requests_per_minute: float | None = Field(None, gt=0)
    timeout_s: float = Field(60.0, gt=0, description="deadline of one request as a whole (not per read)")
    max_retries: int = Field(6, ge=0)
    retry_backoff_s: float = Field(1.0, ge=0, description="first retry delay; doubles each time, with jitter")
    max_backoff_s: float = Field(30.0, ge=0, description="longest wait before a retry, a server's Retry-After "
                                 "included")
    connect_retries: int = Field(2, ge=0, description="retries when the endpoint cannot be reached at all "
                                 "(connection refused, unknown host); at most max_retries")
    timeout_retries: int = Field(1, ge=0, description="retries of a request that ran past timeout_s (a stalled "
                                 "endpoint); at most max_retries")
    reask_unparsed: int = Field(1, ge=0, description="how many later runs ask again for a pair whose answers could "
                                "not be read (each pays again); after that it is served from the cache as unparsed")
    cache_flush_wait_s: float = Field(30.0, ge=0, description="when the annotation cache cannot be written (a full "
                                      "disk), how long to keep retrying to store the answers already paid for")
    parse_retries: int = Field(1, ge=0, description="an answer that cannot be read is asked for again this many "
                               "times (the paper: once); a batch's pairs are then asked one by one")
    claim_wait_s: float = Field(900.0, gt=0, description="how long to wait for a pair another live process is "
                                "annotating (its answer is then shared, never paid twice); after that it fails")
    claim_stale_s: float = Field(120.0, gt=0, description="a claim whose owner's heartbeat is older than this is "
                                 "taken over (a dead process on this host is taken over at once)")
    claim_poll_s: float = Field(0.25, gt=0, description="how often a waiting process looks for the answer")
    max_cost_usd: float | None = Field(None, ge=0)
    cache: bool = True
    mode: Literal["live", "batch"] = Field("live", description="live: one request per batch of pairs, answered at "
                                           "once; batch: the same requests as a batch file (/v1/files + "
                                           "/v1/batches), at the batch rate, answered within hours")
    batch_wait_s: float = Field(600.0, ge=0, description="mode batch: how long one run polls its batches; then it "
                                "stops with 'batch pending, re-run to collect' (the batch is recorded in the cache)")
    batch_poll_s: float = Field(5.0, gt=0, description="mode batch: first poll interval; doubles up to "
                                "batch_max_poll_s")
    batch_max_poll_s: float = Field(60.0, gt=0, description="mode batch: longest interval between polls")
    batch_resubmits: int = Field(2, ge=0, description="mode batch: how often one run re-submits the pairs a batch "
                                 "returned no answer for (expired, cancelled, failed lines); a later run tries again")
    batch_max_requests: int = Field(50_000, ge=1, description="mode batch: most requests in one batch file")
    batch_completion_window: str = Field("24h", description="mode batch: the batch's completion window")


class PoolConfig(BaseModel):
    """A crowd: several annotators, one chosen per instruction, order randomised, optional label noise."""

    model_config = ConfigDict(extra="forbid")

    kind: Literal["pool"] = "pool"
    description: str = ""
    annotators: list[str] = Field(min_length=1)
    p_label_flip: float = Field(0.0, ge=0.0, le=0.5)
    randomize_order: bool = True
    seed: int = 0
    overrides: dict[str, Any] = Field(default_factory=dict, description="applied to every member's config")

    @field_validator("annotators")
    @classmethod
    def _distinct(cls, value: list[str]) -> list[str]:
        duplicates = sorted({name for name in value if value.count(name) > 1})
        if duplicates:  # a repeated member would silently get a larger share of the instructions
            raise ValueError(f"pool members must be distinct; repeated: {', '.join(duplicates)}")
        return value


def load_config_file(name: str) -> dict[str, Any]:
    path = CONFIG_DIR / f"{name}.yaml"
    with path.open(encoding="utf-8") as fh:
        return yaml.safe_load(fh)


def builtin_annotator_names() -> list[str]:
    return sorted(p.stem for p in CONFIG_DIR.glob("*.yaml"))
