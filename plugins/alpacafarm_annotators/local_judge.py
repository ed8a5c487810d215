"""A local transformers judge: reads the next-token log-probabilities of the two answer labels.

The judge is shown the pair in both orders; the preference is the sign of the label log-odds averaged over the
two orders, so it is deterministic and order-independent by construction (position bias cancels out). Use it
with any causal LM you can load (a hub ID, a local folder, or an offline alias such as ``smollm2-135m-instruct``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from alpacafarm.annotation import Annotator, ProgressCallback, identical_tie
from alpacafarm.types import Annotation, Pair

DEFAULT_PROMPT = (
    "You compare two answers to the same request and pick the one a careful, demanding reader would prefer: "
    "correct, helpful, and to the point.\n\n"
    "Request:\n{instruction}{input_block}\n\n"
    "Answer 1:\n{output_1}\n\n"
    "Answer 2:\n{output_2}\n\n"
    "Reply with the number of the better answer only (1 or 2)."
)


class LocalJudgeConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str = Field(description="hub ID, local folder or offline alias of a causal LM")
    prompt: str = DEFAULT_PROMPT
    use_chat_template: bool = True
    labels: tuple[str, str] = ("1", "2")
    batch_size: int = Field(8, ge=1)
    max_length: int = Field(2048, ge=64, description="prompts are truncated from the left of the answers to fit")
    device: str = "cpu"
    tie_margin: float = Field(0.0, ge=0.0, description="|log-odds| at or below this is a tie")


class LocalJudge(Annotator):
    config_class = LocalJudgeConfig
    accepts_replicate = True  # deterministic: every replicate is the same label

    def __init__(self, config: LocalJudgeConfig, *, model: Any = None, tokenizer: Any = None) -> None:
        self.config = config
        self.name = f"local_judge:{self.config.model}"
        self._model, self._tokenizer = model, tokenizer

    def _load(self) -> tuple[Any, Any]:
        if self._model is None:
            from transformers import AutoModelForCausalLM, AutoTokenizer

            from alpacafarm.model_sources import resolve_model_path

            path = resolve_model_path(self.config.model)
            self._tokenizer = AutoTokenizer.from_pretrained(path)
            self._model = AutoModelForCausalLM.from_pretrained(path).to(self.config.device).eval()
        return self._model, self._tokenizer

    def _label_ids(self, tokenizer: Any) -> list[int]:
        ids = []
        for label in self.config.labels:
            encoded = tokenizer.encode(label, add_special_tokens=False)
            ids.append(encoded[0])  # the first token of the label is what the model would emit next
        if ids[0] == ids[1]:
            raise ValueError(f"labels {self.config.labels} start with the same token; choose distinct labels")
        return ids

    def _prompt(self, tokenizer: Any, pair: Pair) -> str:
        input_block = f"\n\nInput:\n{pair.input}" if pair.input else ""
        text = self.config.prompt.format(instruction=pair.instruction, input_block=input_block,
                                         output_1=pair.output_1, output_2=pair.output_2)
        if self.config.use_chat_template and getattr(tokenizer, "chat_template", None):
            return tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                                 add_generation_prompt=True)
        return text + "\nBetter answer:"

    def log_odds(self, pairs: Sequence[Pair]) -> list[float]:
        """log p(label 1) - log p(label 2) for each pair as shown (positive: the first answer is preferred)."""
        import torch

        model, tokenizer = self._load()
        label_ids = self._label_ids(tokenizer)
        tokenizer.padding_side = "left"  # the last position is then the next-token position for every row
        if tokenizer.pad_token is None:
            tokenizer.pad_token = tokenizer.eos_token
        out: list[float] = []
        for start in range(0, len(pairs), self.config.batch_size):
            texts = [self._prompt(tokenizer, p) for p in pairs[start:start + self.config.batch_size]]
            batch = tokenizer(texts, return_tensors="pt", padding=True, truncation=True,
                              max_length=self.config.max_length).to(self.config.device)
            with torch.no_grad():
                logits = model(**batch).logits[:, -1, :].float()
            logprobs = torch.log_softmax(logits, dim=-1)
            out.extend((logprobs[:, label_ids[0]] - logprobs[:, label_ids[1]]).tolist())
        return out

    async def aannotate(self, pairs: Sequence[Pair], progress: ProgressCallback | None = None, *,
                        replicate: int = 0) -> list[Annotation]:
        """``replicate`` is accepted and ignored: the judge is deterministic, so every replicate is the same label
        (a variance of 0). A pool with label noise around it has a variance."""
        results: list[Annotation | None] = [identical_tie(p, self.name) for p in pairs]
        todo = [i for i, r in enumerate(results) if r is None]
        shown = [pairs[i] for i in todo]
        forward = self.log_odds(shown)
        backward = self.log_odds([p.swapped() for p in shown])
        for i, a, b in zip(todo, forward, backward, strict=True):
            score = (a - b) / 2  # log-odds for output_1, averaged over both orders
            preference = 0 if abs(score) <= self.config.tie_margin else (1 if score > 0 else 2)
            results[i] = Annotation(preference, self.name, metadata={"log_odds": score})
        if progress:
            progress(len(pairs), 0.0)
        return [r for r in results if r is not None]
