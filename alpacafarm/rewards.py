"""The reward function: scores answers to instructions with a trained reward model.

Best-of-n, expert iteration, Quark, PPO, GRPO, RLOO and the evaluation's proxy-reward column all score with this
one piece, so they optimise and report the same model. A reward model is a sequence classifier with one output,
trained by the ``reward_model`` method on ``format_prompt(instruction, input) + response + EOS``;
:class:`RewardScorer` builds texts exactly the same way and reads the classifier's scalar at the last real token,
which is what training optimised. Any folder layout loads (full weights, adapters, adapters on an
adapter-trained base: see :func:`alpacafarm.model_loading.load_classifier`).

A classifier with ``k`` outputs is an ensemble of ``k`` reward models sharing one backbone (the ``reward_model``
method's ``ensemble_size``); :func:`combine_members` turns its members' scores into one reward by the consumer's
``ensemble`` rule.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, get_args

from alpacafarm.prompts import format_prompt

if TYPE_CHECKING:
    from alpacafarm.readings import ReadingStore
    from alpacafarm.recipe import ModelSpec

#: ``reward(records, completions) -> scores``: one score per completion; ``records[i]`` carries the instruction
#: (and ``input``) that ``completions[i]`` answers. A reward model, a rule, or any callable in tests.
#: The config attribute a head-only reward model fitted on averaged answer features carries (``pooling: mean``).
POOLING_ATTRIBUTE = "alpacafarm_pooling"
POOLINGS = ("last", "mean")

RewardFunction = Callable[[Sequence[dict[str, Any]], Sequence[str]], list[float]]


#: How an ensemble's member scores become one reward, as Coste et al. (2024, "Reward Model Ensembles Help Mitigate
#: Overoptimization", ICLR, Section 3) define them: ``mean``; ``worst`` (worst-case optimisation, WCO: the lowest
#: member); ``uncertainty_weighted`` (UWO: the mean minus ``coefficient`` times the members' variance).
EnsembleRule = Literal["mean", "worst", "uncertainty_weighted"]
ENSEMBLE_RULES: tuple[str, ...] = get_args(EnsembleRule)


def check_ensemble(rule: str, coefficient: float) -> None:
    """Refuse an unknown rule or a negative coefficient, as a ``ValueError`` naming the field."""
    if rule not in ENSEMBLE_RULES:
        raise ValueError(f"ensemble must be one of {', '.join(ENSEMBLE_RULES)}, not {rule!r}")
    if not (coefficient >= 0.0 and math.isfinite(coefficient)):
        raise ValueError(f"ensemble_coefficient must be a finite number >= 0, not {coefficient!r}")


#: The default ``ensemble_coefficient`` (UWO's lambda). Coste et al. tune it per setting and report UWO robust to
#: its value; 0.5 is this toolkit's choice, not the paper's: tune it on validation instructions.
DEFAULT_ENSEMBLE_COEFFICIENT = 0.5


@dataclass
class EnsembleOptions:
    """The two fields of every config that scores with the reward model (mixed into dataclass configs; pydantic
    configs declare the same two). With a single reward model they change nothing."""

    ensemble: str = field(default="mean", metadata={
        "help": "how an ensemble reward model's members combine: mean | worst | uncertainty_weighted (Coste et al.)"})
    ensemble_coefficient: float = field(default=DEFAULT_ENSEMBLE_COEFFICIENT, metadata={
        "help": "uncertainty_weighted: the mean minus this times the members' variance"})


def combine_members(members: Sequence[Sequence[float]], rule: str = "mean", coefficient: float = 0.0) -> list[float]:
    """One reward per text from ``members[i]`` (the ensemble members' scores of text ``i``) by ``rule``
    (:data:`ENSEMBLE_RULES`). The variance is the population variance over the members (``1/k``), as in Coste et
    al.'s Eq. for UWO; with one member every rule returns its score."""
    check_ensemble(rule, coefficient)
    out = []
    for scores in members:
        k = len(scores)
        mean = sum(scores) / k
        if rule == "mean":
            out.append(mean)
        elif rule == "worst":
            out.append(min(scores))
        else:
            out.append(mean - coefficient * sum((s - mean) ** 2 for s in scores) / k)
    return out


def with_eos(text: str, eos: str | None) -> str:
    """``text`` ending with the EOS token text (as TRL's RewardTrainer appends it to chosen/rejected)."""
    return text if not eos or text.endswith(eos) else text + eos


class RewardScorer:
    """Batched, gradient-free reward-model scores; calling it is a :data:`RewardFunction`."""

    def __init__(self, model: Any, tokenizer: Any, *, prompt_format: str = "alpaca", max_length: int | None = None,
                 batch_size: int = 8, ensemble: str = "mean", ensemble_coefficient: float = 0.0,
                 readings: ReadingStore | None = None) -> None:
        check_ensemble(ensemble, ensemble_coefficient)
        self.model = model.eval()
        #: where a mean-pooled reward model's features are looked up and kept (:mod:`alpacafarm.readings`); None:
        #: every answer is read
        self.readings = readings
        self.ensemble = ensemble
        self.ensemble_coefficient = ensemble_coefficient
        self.tokenizer = tokenizer
        self.tokenizer.padding_side = "right"  # the classifier finds the last real token from the pad id
        self.prompt_format = prompt_format
        self.max_length = max_length
        self.batch_size = batch_size
        self.device = next(model.parameters()).device
        if model.config.pad_token_id is None:
            model.config.pad_token_id = tokenizer.pad_token_id
        #: where the score head reads the backbone: the last real token (a transformers sequence classifier) or the
        #: average over the answer's tokens (a head-only reward model fitted with ``pooling: mean``)
        self.pooling = getattr(model.config, POOLING_ATTRIBUTE, "last")
        if self.pooling not in POOLINGS:
            raise ValueError(f"the reward model's {POOLING_ATTRIBUTE} is {self.pooling!r}: one of "
                             f"{', '.join(POOLINGS)}")
        if self.pooling == "mean" and not (hasattr(model, "score") and hasattr(model, "base_model")):
            from alpacafarm.errors import UserError

            raise UserError("a reward model with pooling: mean is scored through its own backbone and score head; "
                            "this layout shares them (LoRA PPO): use a full-parameter policy or pooling: last")
        if ensemble != "mean" and self.members == 1:
            from alpacafarm.errors import UserError

            raise UserError(f"ensemble: {ensemble} needs an ensemble reward model (reward_model ensemble_size > 1); "
                            "this one has a single member, so the rule would change nothing")

    @classmethod
    def from_path(cls, path: str, spec: ModelSpec, *, max_length: int | None = None, batch_size: int = 8,
                  ensemble: str = "mean", ensemble_coefficient: float = 0.0,
                  readings: ReadingStore | None = None) -> RewardScorer:
        """Load a reward model folder (a ``reward_model`` stage's ``model/``) with the recipe's model block
        (in its ``inference_dtype``, if it sets one); ``readings``: see :class:`RewardScorer`."""
        from alpacafarm.model_loading import load_classifier, load_tokenizer

        spec = spec.for_inference()
        return cls(load_classifier(spec, path), load_tokenizer(spec, path), prompt_format=spec.prompt_format,
                   max_length=max_length, batch_size=batch_size, ensemble=ensemble,
                   ensemble_coefficient=ensemble_coefficient, readings=readings)

    @property
    def members(self) -> int:
        """How many reward models the classifier holds (its outputs; 1 for a single reward model)."""
        return int(self.model.config.num_labels)

    def __call__(self, records: Sequence[dict[str, Any]], completions: Sequence[str]) -> list[float]:
        return self.score_records(records, completions)

    def prompt_of(self, record: dict[str, Any]) -> str:
        """``format_prompt(record)``: the prompt layout ``reward_model`` trains on."""
        return format_prompt(record["instruction"], record.get("input") or None, style=self.prompt_format,
                             tokenizer=self.tokenizer)

    def full_text(self, record: dict[str, Any], completion: str) -> str:
        """``format_prompt(record) + completion + EOS``: the text layout ``reward_model`` trains on."""
        return with_eos(self.prompt_of(record) + completion, self.tokenizer.eos_token)

    def score_records(self, records: Sequence[dict[str, Any]], completions: Sequence[str], *,
                      batch_size: int | None = None) -> list[float]:
        """Rewards of ``completions[i]`` as answers to ``records[i]`` (records carry ``instruction``/``input``)."""
        if len(records) != len(completions):
            raise ValueError(f"{len(records)} records but {len(completions)} completions")
        return self.score_answers([self.prompt_of(r) for r in records], completions, batch_size=batch_size)

    def score_answers(self, prompts: Sequence[str], answers: Sequence[str], *,
                      batch_size: int | None = None) -> list[float]:
        """Rewards of ``answers[i]`` after the already formatted ``prompts[i]``, whatever the pooling."""
        if self.pooling == "last":
            return self.score_texts([p + a for p, a in zip(prompts, answers, strict=True)], batch_size=batch_size)
        features = answer_mean_features(self.model, self.tokenizer, prompts, answers,
                                        batch_size=batch_size or self.batch_size, max_length=self.max_length,
                                        store=self.readings)
        import torch

        with torch.inference_mode():
            head = self.model.score
            logits = head(features.to(device=head.weight.device, dtype=head.weight.dtype)).float()
        return combine_members(self._checked(logits.reshape(len(answers), -1).tolist()), self.ensemble,
                               self.ensemble_coefficient)

    def score_texts(self, texts: Sequence[str], *, batch_size: int | None = None) -> list[float]:
        """Rewards of already formatted full texts (prompt + response; EOS is appended when missing): an
        ensemble's members combined by the scorer's ``ensemble`` rule. Last-token reward models only (a
        mean-pooled one needs to know where the answer starts: :meth:`score_answers`)."""
        return combine_members(self.member_scores(texts, batch_size=batch_size), self.ensemble,
                               self.ensemble_coefficient)

    def member_scores(self, texts: Sequence[str], *, batch_size: int | None = None) -> list[list[float]]:
        """Every member's score of each full text: ``[len(texts)][members]`` (last-token reward models)."""
        import torch

        if self.pooling != "last":
            raise ValueError("a mean-pooled reward model scores (prompt, answer) pairs: use score_answers")
        batch_size = batch_size or self.batch_size
        eos = self.tokenizer.eos_token
        texts = [with_eos(t, eos) for t in texts]
        # Longest first: batches of similar lengths waste less compute on padding.
        order = sorted(range(len(texts)), key=lambda i: -len(texts[i]))
        scores: list[list[float]] = [[]] * len(texts)
        with torch.inference_mode():
            for start in range(0, len(order), batch_size):
                chunk = order[start:start + batch_size]
                batch = self.tokenizer([texts[i] for i in chunk], padding=True, return_tensors="pt",
                                       truncation=self.max_length is not None, max_length=self.max_length)
                batch = {k: v.to(self.device) for k, v in batch.items()}
                logits = self.model(**batch).logits.float().reshape(len(chunk), -1).tolist()
                for i, values in zip(chunk, logits, strict=True):
                    scores[i] = [float(v) for v in values]
        return self._checked(scores)

    @staticmethod
    def _checked(scores: list[list[float]]) -> list[list[float]]:
        """``scores``, or a one-line error when any is NaN or infinite."""
        bad = sum(not all(math.isfinite(v) for v in s) for s in scores)
        if bad:  # a reward model trained to NaN would otherwise rank every candidate alike, silently
            from alpacafarm.errors import UserError

            raise UserError(f"the reward model scored {bad} of {len(scores)} texts NaN or infinite: its weights are "
                            "broken (a diverged training); retrain it with a lower learning_rate")
        return scores


def last_token_features(model: Any, tokenizer: Any, texts: Sequence[str], *, batch_size: int, max_length: int | None,
                        progress: Any = None) -> Any:
    """The backbone's final hidden state where the classifier reads it, as a float32 ``[len(texts), hidden]``.

    That is the rightmost token that is not the pad token (transformers' rule for sequence classifiers; with
    a tokenizer whose pad token is its EOS, the last token before the trailing EOS).
    """
    return _final_states(model, tokenizer, texts, None, batch_size=batch_size, max_length=max_length,
                         progress=progress)


def answer_mean_features(model: Any, tokenizer: Any, prompts: Sequence[str], answers: Sequence[str], *,
                         batch_size: int, max_length: int | None, progress: Any = None,
                         share_prompts: bool = True, store: ReadingStore | None = None) -> Any:
    """The backbone's final hidden states averaged over each answer's tokens, as a float32 ``[len(answers), hidden]``.

    The text read is ``prompt + answer + EOS`` (as the reward model reads it); the average runs from the first token
    after the prompt up to the last token that is not the pad token (the EOS too where EOS is not the pad token).
    Unlike :func:`last_token_features` this barely moves when an answer loses its last token (measured by
    ``benchmarks/gold_token_stability.py``: over the top 32 principal directions, correlation 0.998 against 0.69).
    An empty answer is read at its EOS token (the one after the prompt), never at the prompt's. Answers to one
    prompt (best-of-n's samples, a preference stage's k samples) share one pass over the prompt: its keys and
    values are computed once and reused (``share_prompts=False``: each text whole, what
    ``benchmarks/feature_sharing.py`` compares it with). With a ``store`` (:mod:`alpacafarm.readings`), an answer
    whose reading by these weights it holds is not read again (the gold's reading of the same text, another stage's).
    """
    if len(prompts) != len(answers):
        raise ValueError(f"{len(prompts)} prompts but {len(answers)} answers")
    texts = [with_eos(p + a, tokenizer.eos_token) for p, a in zip(prompts, answers, strict=True)]
    prompt_ids = {p: tokenizer(p, add_special_tokens=True)["input_ids"] for p in dict.fromkeys(prompts)}
    return _final_states(model, tokenizer, texts, [prompt_ids[p] for p in prompts], batch_size=batch_size,
                         max_length=max_length, progress=progress, share_prompts=share_prompts, store=store)


def _final_states(model: Any, tokenizer: Any, texts: Sequence[str], prompt_ids: Sequence[list[int]] | None, *,
                  batch_size: int, max_length: int | None, progress: Any, share_prompts: bool = True,
                  store: ReadingStore | None = None) -> Any:
    """Each text's final hidden state at its last non-pad token (``prompt_ids`` None), or averaged from the token
    after its prompt's (``prompt_ids[i]``) to that token. Texts that share a prompt with at least one other answer
    run as one pass over the prompt and then its answers (``share_prompts``; several prompts' answers packed in
    one batch, :func:`pack_groups`); the rest batch longest first, right-padded. A text that occurs twice is
    computed once. The rows depend only on the texts given (not on any earlier call) and, with a ``store`` (mean
    features only), on what it holds: a text it has is not read again, and what is read is stored
    (:mod:`alpacafarm.readings`), so a stage's scores are the same whether its run resumed or not."""
    import torch

    tokenizer.padding_side = "right"
    backbone = model.base_model
    pad_id = tokenizer.pad_token_id
    ids = tokenizer(list(texts), truncation=max_length is not None, max_length=max_length)["input_ids"]
    starts = [-1] * len(texts) if prompt_ids is None else [len(p) for p in prompt_ids]
    keys = [(tuple(i), s) for i, s in zip(ids, starts, strict=True)]
    todo = list(dict.fromkeys(keys))
    computed: dict[tuple[tuple[int, ...], int], Any] = {}
    stored_keys: dict[tuple[tuple[int, ...], int], str] = {}
    if store is not None and prompt_ids is not None:  # mean features only: a last-token state is not a reading
        from alpacafarm.readings import fingerprint, reading_key

        model_print = fingerprint(backbone)
        stored_keys = {k: reading_key(model_print, k[0], k[1]) for k in todo}
        found = store.get(stored_keys.values())
        for key in todo:
            row = found.get(stored_keys[key])
            if row is not None and row.features is not None:
                computed[key] = row.features
        todo = [k for k in todo if k not in computed]
    by_prompt: dict[tuple[int, ...], list[tuple[tuple[int, ...], int]]] = {}
    for text_ids, start in todo:
        if start >= 0 and any(t != pad_id for t in text_ids[start:]):  # read in the answer: the prompt's pass is shared
            by_prompt.setdefault(text_ids[:start], []).append((text_ids, start))
    shared = [group for group in by_prompt.values() if len(group) > 1 and share_prompts]
    alone = set(todo).difference(k for group in shared for k in group)
    device = next(model.parameters()).device
    with torch.inference_mode():
        for batch in pack_groups(shared, batch_size, lambda key: key[1]):
            chunk = [key for group in batch for key in group]
            computed.update(zip(chunk, _answers_after_prompts(backbone, batch, pad_id, device), strict=True))
            if progress is not None:
                progress(len(chunk))
        order = sorted(alone, key=lambda k: (-len(k[0]), k))
        for begin in range(0, len(order), batch_size):
            chunk = order[begin:begin + batch_size]
            computed.update(zip(chunk, _whole_texts(backbone, tokenizer, chunk, pad_id, device), strict=True))
            if progress is not None:
                progress(len(chunk))
    if progress is not None and len(keys) > len(todo):
        progress(len(keys) - len(todo))
    if stored_keys:
        from alpacafarm.readings import Reading

        store.put({stored_keys[k]: Reading(features=computed[k]) for k in todo})
    return torch.stack([computed[k] for k in keys])


def _whole_texts(backbone: Any, tokenizer: Any, keys: Sequence[tuple[Any, ...]], pad_id: int, device: Any) -> list:
    """The rows of whole texts in one right-padded batch (see :func:`_final_states`)."""
    import torch

    batch = tokenizer.pad({"input_ids": [list(k[0]) for k in keys]}, return_tensors="pt").to(device)
    hidden = backbone(**batch).last_hidden_state
    real = (batch["input_ids"] != pad_id).int() * batch["attention_mask"]
    positions = torch.arange(real.shape[1], device=device)
    last = (positions * real).argmax(dim=-1)
    if all(k[1] < 0 for k in keys):
        picked = hidden[torch.arange(len(keys), device=device), last].float()
    else:
        # an empty answer is read at its EOS (the first token after the prompt), as an answer, not at the prompt's
        # last token; an answer cut away by max_length is read at the text's last token
        final = batch["attention_mask"].sum(dim=1) - 1
        first = torch.minimum(torch.tensor([k[1] for k in keys], device=device), final)
        last = torch.maximum(last, first)
        start = torch.minimum(first, last)
        span = ((positions >= start[:, None]) & (positions <= last[:, None])).float()
        picked = (hidden.float() * span[..., None]).sum(1) / span.sum(1, keepdim=True)
    return [row.clone() for row in picked.cpu()]


def states_after_prompts(backbone: Any, prompts: Sequence[Sequence[int]], owners: Sequence[int],
                         answers: Sequence[Sequence[int]], pad_id: int, device: Any) -> tuple[Any, Any]:
    """One pass over the prompts (right-padded, the padding masked out), then every answer (right-padded with
    ``pad_id``) read after the keys and values of its prompt ``prompts[owners[j]]``, at the positions that follow
    that prompt's own length: the same states as reading each text whole, to float rounding. Returns ``(each
    answer's prompt's last final state [len(answers), hidden], the answers' final states [len(answers), width,
    hidden])``; a prompt's last state is what predicts an answer's first token (the gold's relevance reads it)."""
    import torch

    # transformers renamed past_key_values to cache (argument and output) within 5.x: take the name this one has
    name = "cache" if "cache" in inspect.signature(type(backbone).forward).parameters else "past_key_values"
    lengths = torch.tensor([len(p) for p in prompts], device=device)
    span = int(lengths.max())
    prompt_ids = torch.tensor([list(p) + [pad_id] * (span - len(p)) for p in prompts], device=device)
    prompt_mask = (torch.arange(span, device=device)[None, :] < lengths[:, None]).long()
    prompt = backbone(input_ids=prompt_ids, attention_mask=prompt_mask, use_cache=True)
    cache = getattr(prompt, name)
    index = torch.tensor(list(owners), device=device)
    cache.batch_select_indices(index)  # each answer's row: its prompt's keys and values
    width = max(len(a) for a in answers)
    input_ids = torch.tensor([list(a) + [pad_id] * (width - len(a)) for a in answers], device=device)
    mask = torch.tensor([[1] * len(a) + [0] * (width - len(a)) for a in answers], device=device)
    attention = torch.cat([prompt_mask[index].to(mask.dtype), mask], dim=1)
    positions = lengths[index][:, None] + torch.arange(width, device=device)[None, :]
    hidden = backbone(input_ids=input_ids, attention_mask=attention, position_ids=positions, use_cache=True,
                      **{name: cache}).last_hidden_state
    last = prompt.last_hidden_state[torch.arange(len(prompts), device=device), lengths - 1]
    return last[index], hidden


def pack_groups(groups: Sequence[Sequence[Any]], batch_size: int, prompt_length: Callable[[Any], int]) -> list:
    """Batches of at most ``batch_size`` answers, each a list of groups (the answers of one prompt; a batch's
    ``g``-th group belongs to its ``g``-th prompt): groups sorted by their prompt's length (less padding), split
    where one holds more than ``batch_size``, packed in that order. Depends only on the groups given."""
    pieces = [group[k:k + batch_size] for group in sorted(groups, key=lambda g: (prompt_length(g[0]), g[0]))
              for k in range(0, len(group), batch_size)]
    batches: list[list[Any]] = []
    filled = batch_size
    for piece in pieces:
        if filled + len(piece) > batch_size:
            batches.append([])
            filled = 0
        batches[-1].append(list(piece))
        filled += len(piece)
    return batches


def _answers_after_prompts(backbone: Any, groups: Sequence[Sequence[tuple[Any, ...]]], pad_id: int,
                           device: Any) -> list:
    """The averaged answer rows of texts grouped by their shared prompt, every group in one batch
    (:func:`states_after_prompts`); the same states as :func:`_whole_texts` reads, to float rounding."""
    import torch

    prompts = [group[0][0][:group[0][1]] for group in groups]
    owners = [g for g, group in enumerate(groups) for _ in group]
    answers = [list(k[0][k[1]:]) for group in groups for k in group]
    _, hidden = states_after_prompts(backbone, prompts, owners, answers, pad_id, device)
    width = hidden.shape[1]
    mask = torch.tensor([[1] * len(a) + [0] * (width - len(a)) for a in answers], device=device)
    input_ids = torch.tensor([a + [pad_id] * (width - len(a)) for a in answers], device=device)
    local = torch.arange(width, device=device)
    last = (local * ((input_ids != pad_id).int() * mask)).argmax(dim=-1)
    span = (local <= last[:, None]).float()
    picked = (hidden.float() * span[..., None]).sum(1) / span.sum(1, keepdim=True)
    return [row.clone() for row in picked.cpu()]
