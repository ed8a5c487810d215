"""The reward function: scores answers to instructions with a trained reward model.

Best-of-n, expert iteration, Quark, PPO, GRPO, RLOO and the evaluation's proxy-reward column all score with this
one piece, so they optimise and report the same model. A reward model is a sequence classifier with one output,
trained by the ``reward_model`` method on ``format_prompt(instruction, input) + response + EOS``;
:class:`RewardScorer` builds texts exactly the same way and reads the classifier's scalar at the last real token,
which is what training optimised. Any folder layout loads (full weights, adapters, adapters on an
adapter-trained base: see :func:`alpacafarm.model_loading.load_classifier`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from alpacafarm.prompts import format_prompt

if TYPE_CHECKING:
    from alpacafarm.recipe import ModelSpec

#: ``reward(records, completions) -> scores``: one score per completion; ``records[i]`` carries the instruction
#: (and ``input``) that ``completions[i]`` answers. A reward model, a rule, or any callable in tests.
RewardFunction = Callable[[Sequence[dict[str, Any]], Sequence[str]], list[float]]


def with_eos(text: str, eos: str | None) -> str:
    """``text`` ending with the EOS token text (as TRL's RewardTrainer appends it to chosen/rejected)."""
    return text if not eos or text.endswith(eos) else text + eos


class RewardScorer:
    """Batched, gradient-free reward-model scores; calling it is a :data:`RewardFunction`."""

    def __init__(self, model: Any, tokenizer: Any, *, prompt_format: str = "alpaca", max_length: int | None = None,
                 batch_size: int = 8) -> None:
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.tokenizer.padding_side = "right"  # the classifier finds the last real token from the pad id
        self.prompt_format = prompt_format
        self.max_length = max_length
        self.batch_size = batch_size
        self.device = next(model.parameters()).device
        if model.config.pad_token_id is None:
            model.config.pad_token_id = tokenizer.pad_token_id

    @classmethod
    def from_path(cls, path: str, spec: ModelSpec, *, max_length: int | None = None,
                  batch_size: int = 8) -> RewardScorer:
        """Load a reward model folder (a ``reward_model`` stage's ``model/``) with the recipe's model block
        (in its ``inference_dtype``, if it sets one)."""
        from alpacafarm.model_loading import load_classifier, load_tokenizer

        spec = spec.for_inference()
        return cls(load_classifier(spec, path), load_tokenizer(spec, path), prompt_format=spec.prompt_format,
                   max_length=max_length, batch_size=batch_size)

    def __call__(self, records: Sequence[dict[str, Any]], completions: Sequence[str]) -> list[float]:
        return self.score_records(records, completions)

    def full_text(self, record: dict[str, Any], completion: str) -> str:
        """``format_prompt(record) + completion + EOS``: the text layout ``reward_model`` trains on."""
        prompt = format_prompt(record["instruction"], record.get("input") or None, style=self.prompt_format,
                               tokenizer=self.tokenizer)
        return with_eos(prompt + completion, self.tokenizer.eos_token)

    def score_records(self, records: Sequence[dict[str, Any]], completions: Sequence[str], *,
                      batch_size: int | None = None) -> list[float]:
        """Rewards of ``completions[i]`` as answers to ``records[i]`` (records carry ``instruction``/``input``)."""
        if len(records) != len(completions):
            raise ValueError(f"{len(records)} records but {len(completions)} completions")
        return self.score_texts([self.full_text(r, c) for r, c in zip(records, completions, strict=True)],
                                batch_size=batch_size)

    def score_texts(self, texts: Sequence[str], *, batch_size: int | None = None) -> list[float]:
        """Rewards of already formatted full texts (prompt + response; EOS is appended when missing)."""
        import torch

        batch_size = batch_size or self.batch_size
        eos = self.tokenizer.eos_token
        texts = [with_eos(t, eos) for t in texts]
        # Longest first: batches of similar lengths waste less compute on padding.
        order = sorted(range(len(texts)), key=lambda i: -len(texts[i]))
        scores = [0.0] * len(texts)
        with torch.inference_mode():
            for start in range(0, len(order), batch_size):
                chunk = order[start:start + batch_size]
                batch = self.tokenizer([texts[i] for i in chunk], padding=True, return_tensors="pt",
                                       truncation=self.max_length is not None, max_length=self.max_length)
                batch = {k: v.to(self.device) for k, v in batch.items()}
                logits = self.model(**batch).logits.squeeze(-1).float().tolist()
                for i, value in zip(chunk, logits if isinstance(logits, list) else [logits], strict=True):
                    scores[i] = float(value)
        bad = sum(not math.isfinite(s) for s in scores)
        if bad:  # a reward model trained to NaN would otherwise rank every candidate alike, silently
            from alpacafarm.errors import UserError

            raise UserError(f"the reward model scored {bad} of {len(scores)} texts NaN or infinite: its weights are "
                            "broken (a diverged training); retrain it with a lower learning_rate")
        return scores
