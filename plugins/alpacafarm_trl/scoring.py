"""Scoring with a trained reward model: the surrogate reward that best-of-n, expert iteration, Quark and PPO use.

A reward model here is a sequence classifier with one output, trained by ``reward_model`` on
``format_prompt(instruction, input) + response + EOS``. :class:`RewardScorer` scores texts built exactly the
same way; the score is the classifier's scalar at the last real token, which is what training optimised.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from alpacafarm.prompts import format_prompt


def is_adapter_folder(path: str | Path) -> bool:
    """A folder holding peft adapters (``adapter_config.json``) rather than full weights."""
    return (Path(path) / "adapter_config.json").is_file()


def load_classifier(spec: Any, path: str) -> Any:
    """A one-output sequence classifier from ``path``: full weights, or peft adapters merged into their base.

    An adapter folder (an un-merged LoRA SFT or reward model) names its base model; the classifier is built on
    that base and the adapters (and a saved ``score`` head, if any) are merged in, so callers get plain weights.
    """
    from alpacafarm.modeling import load_sequence_classifier

    if not is_adapter_folder(path):
        return load_sequence_classifier(spec, path)
    from peft import PeftConfig, PeftModel

    config = PeftConfig.from_pretrained(path)
    if config.task_type != "SEQ_CLS":
        # Causal-LM adapters (an SFT stage) would wrap the classifier in a generation wrapper it cannot serve;
        # the plain wrapper applies the same layer adapters (module names agree below the task head).
        config.task_type = None
    model = load_sequence_classifier(spec, config.base_model_name_or_path)
    return PeftModel.from_pretrained(model, path, config=config).merge_and_unload()


class RewardScorer:
    """Batched, gradient-free reward scores for (instruction record, completion) pairs or full texts."""

    def __init__(self, model: Any, tokenizer: Any, *, prompt_format: str = "alpaca", max_length: int | None = None) -> None:
        import torch

        self.model = model.eval()
        self.tokenizer = tokenizer
        self.tokenizer.padding_side = "right"  # the classifier finds the last real token from the pad id
        self.prompt_format = prompt_format
        self.max_length = max_length
        self.device = next(model.parameters()).device
        self._torch = torch
        if model.config.pad_token_id is None:
            model.config.pad_token_id = tokenizer.pad_token_id

    @classmethod
    def from_path(cls, path: str, spec: Any, *, max_length: int | None = None) -> RewardScorer:
        """Load a reward model folder (a ``reward_model`` stage's ``model/``) with the recipe's model block
        (in its ``inference_dtype``, if it sets one)."""
        from alpacafarm.modeling import load_tokenizer

        spec = spec.for_inference()
        return cls(load_classifier(spec, path), load_tokenizer(spec, path), prompt_format=spec.prompt_format,
                   max_length=max_length)

    def full_text(self, record: dict[str, Any], completion: str) -> str:
        """``format_prompt(record) + completion + EOS``: the text layout ``reward_model`` trains on."""
        prompt = format_prompt(record["instruction"], record.get("input") or None, style=self.prompt_format,
                               tokenizer=self.tokenizer)
        return with_eos(prompt + completion, self.tokenizer.eos_token)

    def score_records(self, records: Sequence[dict[str, Any]], completions: Sequence[str], *, batch_size: int = 8) -> list[float]:
        """Rewards of ``completions[i]`` as answers to ``records[i]`` (records carry ``instruction``/``input``)."""
        if len(records) != len(completions):
            raise ValueError(f"{len(records)} records but {len(completions)} completions")
        return self.score_texts([self.full_text(r, c) for r, c in zip(records, completions, strict=True)],
                                batch_size=batch_size)

    def score(self, records: Sequence[dict[str, Any]], completions: Sequence[str], *, batch_size: int = 8) -> list[float]:
        """Alias of :meth:`score_records`."""
        return self.score_records(records, completions, batch_size=batch_size)

    def score_texts(self, texts: Sequence[str], *, batch_size: int = 8) -> list[float]:
        """Rewards of already formatted full texts (prompt + response; EOS is appended when missing)."""
        torch = self._torch
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
        return scores


def with_eos(text: str, eos: str | None) -> str:
    """``text`` ending with the EOS token text (as TRL's RewardTrainer appends it to chosen/rejected)."""
    return text if not eos or text.endswith(eos) else text + eos
