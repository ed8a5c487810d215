"""The public kit of helpers a method needs, the built-in methods' own: a plugin imports these, never a built-in.

What two methods share lives here, in the core (a plugin never imports another plugin's modules); each helper is
what the built-in methods call themselves, so a third-party method built from them behaves as the built-ins do.

Rows for trainers
    :func:`prompt_completion_rows` — instruction records → ``{"prompt", "completion"}`` rows (completion + EOS) for
    TRL's ``SFTTrainer``; :func:`response_of` — a demonstration's answer; :func:`training_rows` — tokenized rows
    whose completion ends with EOS only when the sample ``finished`` (a sample cut at ``max_new_tokens`` must not
    be trained to stop there).
Scoring and selecting
    :func:`sample_and_score` — ``n`` samples per record, each with its reward; :func:`score_groups` — rows scored by
    the reward model (``context.reward_function()``) and grouped per record, in batches that do not depend on the
    number of processes (:func:`score_rows`, :func:`score_batches`); :func:`best_index` and :func:`select` — the
    winner among the first ``n`` samples (the earliest on a tie); :func:`mark_finished` — which samples were cut at
    ``max_new_tokens`` (from :attr:`alpacafarm.generation.Generator.last_finished`); :func:`mean`.
Training and saving
    :func:`build_sft_trainer_on_rows` — a TRL ``SFTTrainer`` on rows, starting from the SFT model (LoRA and
    quantization from the model block, fp32 master weights); :func:`train_and_save_policy` — train (resuming an
    interrupted attempt), save ``model/`` with :func:`alpacafarm.training.save_policy`, write ``metrics.json``.
    The rest of what trainer-based methods share is :mod:`alpacafarm.training` (config defaults, stage arguments).

An SFT stage trained with LoRA and ``merge_adapters: false`` leaves an *adapter folder*. Loading such a folder with
``load_causal_lm`` attaches the adapters through transformers' peft integration, and a trainer given a
``peft_config`` then replaces them with fresh (zero) adapters: training would silently start from the base model
instead of the SFT model. :func:`alpacafarm.model_loading.load_merged_causal_lm` merges the SFT adapters first, so new
adapters sit on top of the SFT weights, and TRL's DPO reference (the model with its adapters disabled) is the SFT
model; :func:`alpacafarm.training.save_policy` saves adapters trained that way merged, so the folder reloads as the
model that was trained (policies and reward models alike).

Under several processes the helpers that split work across ranks (:func:`score_rows`, :func:`score_groups` with a
``batch_size``) are collectives that every rank must call, as :meth:`~alpacafarm.method.StageContext.generate_on_ranks`
is: a method that uses them sets ``ranks = Ranks.ALL`` (:class:`alpacafarm.method.Ranks`), as the built-in ones and
the ``alpacafarm plugin new`` template do.

Heavy imports (torch, transformers, TRL, datasets) happen inside functions: importing the kit is cheap.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from alpacafarm.errors import UserError
from alpacafarm.generation import Generator, SamplingConfig, generate_records
from alpacafarm.model_loading import load_merged_causal_lm
from alpacafarm.prompts import format_prompt
from alpacafarm.rewards import RewardFunction
from alpacafarm.training import fp32_master_weights

#: Where an answer may live in a demonstration record, in order of preference after ``response_field``.
FALLBACK_RESPONSE_FIELDS = ("output", "reference")
#: The label of a token the loss ignores (the prompt's, in :func:`training_rows`).
IGNORE_INDEX = -100

# ------------------------------------------------------------------------------------------ rows for trainers


def response_of(record: dict[str, Any], response_field: str) -> str:
    """The answer of a demonstration: ``response_field``, else ``output``, else ``reference``."""
    for name in (response_field, *FALLBACK_RESPONSE_FIELDS):
        value = record.get(name)
        if isinstance(value, str):
            return value
    raise UserError(f"an SFT record has no {response_field!r} field (fields: {', '.join(sorted(record))}); "
                    f"set stages.<name>.config.response_field")


def prompt_completion_rows(records: list[dict[str, Any]], *, response_field: str, style: str,
                           tokenizer: Any) -> list[dict[str, str]]:
    """Records → ``{"prompt", "completion"}`` rows; the completion ends with EOS so the model learns to stop."""
    eos = tokenizer.eos_token or ""
    rows = []
    for record in records:
        if not record.get("instruction"):
            raise UserError(f"an SFT record has no 'instruction' (fields: {', '.join(sorted(record))})")
        prompt = format_prompt(record["instruction"], record.get("input") or None, style=style, tokenizer=tokenizer)
        response = response_of(record, response_field)
        rows.append({"prompt": prompt, "completion": response if response.endswith(eos) else response + eos})
    return rows


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def training_rows(demonstrations: list[dict[str, Any]], tokenizer: Any, style: str) -> list[dict[str, list[int]]]:
    """Tokenized SFT rows (``input_ids``, ``labels`` with the prompt ignored) of the demonstrations.

    Tokenized as TRL tokenizes a prompt/completion row (prompt + completion as one text; the completion starts
    where the tokenized prompt stops being a prefix), but the completion ends with EOS only when the demonstration
    ``finished``: a response cut at the token limit is trained on as it is, without an end.
    """
    eos = tokenizer.eos_token or ""
    rows = []
    for d in demonstrations:
        prompt = format_prompt(d["instruction"], d.get("input") or None, style=style, tokenizer=tokenizer)
        finished = bool(d.get("finished", True))
        prompt_ids = list(tokenizer(text=prompt)["input_ids"])
        ids = list(tokenizer(text=prompt + d["output"] + (eos if finished else ""))["input_ids"])
        if not finished and ids and ids[-1] == tokenizer.eos_token_id:  # a tokenizer that appends EOS itself
            ids = ids[:-1]
        start = _common_prefix(prompt_ids, ids)
        rows.append({"input_ids": ids, "labels": [IGNORE_INDEX] * start + ids[start:]})
    return rows



# ------------------------------------------------------------------------------------- scoring and selecting


def best_index(rewards: Sequence[float], n: int) -> int:
    """Index of the highest reward among the first ``n`` samples; the earliest wins a tie (deterministic)."""
    window = list(rewards[:n])
    if not window:
        raise ValueError("no samples to choose from")
    return max(range(len(window)), key=lambda i: (window[i], -i))


def sample_and_score(generator: Generator, reward: RewardFunction, records: Sequence[dict[str, Any]],
                     sampling: SamplingConfig, *, progress: Callable[[int], None] | None = None
                     ) -> list[list[dict[str, Any]]]:
    """``sampling.n`` samples per record, each with its ``reward``; one list of samples per record, in order."""
    rows = generate_records(generator, list(records), sampling, progress=progress)
    return score_groups(reward, records, rows, sampling.n)


def score_batches(reward: RewardFunction, rows: Sequence[dict[str, Any]], batch_size: int) -> list[list[int]]:
    """The scoring batches of ``rows`` (lists of row indices): longest text first, ``batch_size`` a batch.

    The same batches whatever the number of processes, so that a batch's scores do not depend on it (the reward
    model pads a batch to its longest text). With a reward model's scorer the order is the one it sorts by itself
    (its full text), so one process scores exactly as it would all rows at once."""
    full_text = getattr(reward, "full_text", None)
    lengths = [len(full_text(row, row["output"])) if full_text is not None
               else len(row["instruction"]) + len(row.get("input") or "") + len(row["output"]) for row in rows]
    order = sorted(range(len(rows)), key=lambda i: -lengths[i])
    return [order[start:start + batch_size] for start in range(0, len(order), batch_size)]


def score_rows(reward: RewardFunction, rows: Sequence[dict[str, Any]], batch_size: int, where: str = "") -> list[float]:
    """The reward of every row, its :func:`score_batches` split across ranks (batch ``b`` on rank ``b mod world``)
    and gathered on every rank: the same scores as one process."""
    from alpacafarm import distributed

    batches, world = score_batches(reward, rows, batch_size), distributed.world_size()
    mine = batches[distributed.rank()::world]
    scored = [reward([rows[i] for i in batch], [rows[i]["output"] for i in batch]) for batch in mine]
    scores: list[float] = [0.0] * len(rows)
    for rank_, values in enumerate(distributed.all_gather_object(scored, where)):
        for batch, batch_scores in zip(batches[rank_::world], values, strict=True):
            for i, value in zip(batch, batch_scores, strict=True):
                scores[i] = float(value)
    return scores


def score_groups(reward: RewardFunction, records: Sequence[dict[str, Any]], rows: Sequence[dict[str, Any]],
                 n: int, batch_size: int | None = None, where: str = "") -> list[list[dict[str, Any]]]:
    """``rows`` (``n`` samples per record, in order) scored and grouped per record; with ``batch_size``, in the
    batches of :func:`score_rows` across ranks (every rank gets every score)."""
    rewards = (reward(list(rows), [row["output"] for row in rows]) if batch_size is None
               else score_rows(reward, rows, batch_size, where))
    grouped: list[list[dict[str, Any]]] = [[] for _ in records]
    for i, (row, value) in enumerate(zip(rows, rewards, strict=True)):
        grouped[i // n].append({**row, "reward": float(value)})
    return grouped


def select(samples: Sequence[Sequence[dict[str, Any]]], n: int) -> list[dict[str, Any]]:
    """The best of the first ``n`` samples of every instruction (a copy carrying ``n``)."""
    chosen = []
    for group in samples:
        best = group[best_index([s["reward"] for s in group], n)]
        chosen.append({**best, "n": n})
    return chosen


def mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else float("nan")


def mark_finished(samples: list[list[dict[str, Any]]], generator: Any, backend: str) -> None:
    """Set ``finished`` on every sample: False when it was cut at ``max_new_tokens``.

    ``samples`` are grouped per instruction as :func:`sample_and_score` returns them,
    right after the one ``generate`` call that made them, whose :attr:`~alpacafarm.generation.Generator.last_finished`
    they match (a stop token for transformers, ``finish_reason`` for OpenAI-compatible servers and vLLM).
    """
    finished = getattr(generator, "last_finished", None) or ()
    if len(finished) != len(samples) or any(len(f) != len(g) for f, g in zip(finished, samples, strict=True)):
        raise UserError(f"the generation backend {backend!r} does not report which completions "
                        "were cut at max_new_tokens (Generator.last_finished); a cut winner must not be trained "
                        "to stop there")
    for flags, group in zip(finished, samples, strict=True):
        for flag, sample in zip(flags, group, strict=True):
            sample["finished"] = bool(flag)



# ------------------------------------------------------------------------------------- training and saving


def build_sft_trainer_on_rows(
    config: Any, spec: Any, model_path: str, rows: list[dict[str, Any]], *, callbacks: list[Any] | None = None
) -> Any:
    """A ready TRL ``SFTTrainer`` on rows built by the caller, starting from the SFT model in ``model_path``.

    Rows are ``{"prompt", "completion"}`` texts (TRL tokenizes them; loss on the completion only) or already
    tokenized ``{"input_ids", "labels"}`` (expert iteration, which decides itself where EOS goes). Like
    the built-in ``sft`` method: the same LoRA and quantization from the model block, and the
    trainable weights as float32 master copies.
    """
    from datasets import Dataset
    from transformers import set_seed
    from trl import SFTTrainer

    from alpacafarm.model_loading import load_tokenizer, lora_config

    if not rows:
        raise UserError("there is nothing to train on: no training rows")
    set_seed(config.seed)  # fresh LoRA adapters are drawn before the Trainer seeds itself
    trainer = SFTTrainer(
        model=load_merged_causal_lm(spec, model_path, trainable=True),
        args=config,
        train_dataset=Dataset.from_list(rows),
        processing_class=load_tokenizer(spec, model_path),
        peft_config=lora_config(spec),
        callbacks=callbacks,
    )
    fp32_master_weights(trainer.model)
    return trainer


def train_and_save_policy(context: Any, trainer: Any, spec: Any, model_path: str, dropped: int,
                          extra: dict[str, Any] | None = None, before_metrics: Any = None) -> Any:
    """Train ``trainer`` (resuming an interrupted attempt), save the policy to ``model/``, write ``metrics.json``.

    The common ending of the SFT-style pairwise methods (binary FeedME, reward conditioning). ``before_metrics``
    is called with the model folder after saving (e.g. to add the conditioning file). Under several processes
    every rank trains (accelerate) and only the main process saves and writes.
    """
    from alpacafarm.data import write_json
    from alpacafarm.method import Artifact
    from alpacafarm.training import resume_checkpoint, save_policy, train_summary
    from alpacafarm.training_progress import training_progress

    with training_progress(trainer, context):
        result = trainer.train(resume_from_checkpoint=resume_checkpoint(context))
    model_dir = Path(context.stage_dir) / "model"
    merged = save_policy(trainer, spec, model_path, model_dir, context.logger)  # every rank; the main one writes
    if not context.is_main:
        return Artifact("model", str(model_dir))
    if before_metrics is not None:
        before_metrics(model_dir)
    metrics = {**train_summary(trainer, result), "n_examples": len(trainer.train_dataset),
               "n_dropped_no_preference": dropped, **(extra or {}), "lora": spec.lora is not None, "merged": merged}
    write_json(Path(context.stage_dir) / "metrics.json", {**metrics, "log_history": trainer.state.log_history})
    return Artifact("model", str(model_dir), metrics)
