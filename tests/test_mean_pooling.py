"""Answer-averaged features (``pooling: mean``): the frozen features, a head-only reward model fitted on them, and
the scorer every reward-using method calls (best-of-n, expert iteration, PPO, GRPO through ``RewardScorer``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from alpacafarm.errors import RecipeError
from alpacafarm.recipe import ModelSpec, load_recipe
from alpacafarm.testing import learnable_preferences, run_recipe, write_records

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def classifier_and_tokenizer(path: str):
    from alpacafarm.model_loading import load_classifier, load_tokenizer

    spec = ModelSpec(name=path)
    return load_classifier(spec, path).eval(), load_tokenizer(spec, path)


def test_answer_mean_features_average_the_answer_tokens_whatever_the_batch(tiny_model_dir: str):
    """Each row is the final hidden state averaged over the answer's tokens (not the prompt's, not the EOS pad), as
    one unpadded sequence computes it; batching and padding change nothing."""
    import torch

    from alpacafarm.rewards import answer_mean_features

    model, tokenizer = classifier_and_tokenizer(tiny_model_dir)
    prompts = ["Question: name a colour.\nAnswer:", "Q: two plus two?\nA:", "Say hi.\n"]
    answers = [" Blue, like the sky on a clear day.", " Four.", " Hello there, friend, how are you today?"]
    features = answer_mean_features(model, tokenizer, prompts, answers, batch_size=3, max_length=None)
    assert features.shape == (3, model.config.hidden_size) and features.dtype == torch.float32
    with torch.inference_mode():
        for row, (prompt, answer) in enumerate(zip(prompts, answers, strict=True)):
            start = len(tokenizer(prompt)["input_ids"])
            ids = tokenizer(prompt + answer + tokenizer.eos_token, return_tensors="pt")["input_ids"]
            hidden = model.base_model(input_ids=ids).last_hidden_state[0]
            # the EOS counts unless it is the pad token (then transformers' classifier rule skips it too)
            end = ids.shape[1] - (tokenizer.pad_token_id == tokenizer.eos_token_id)
            assert torch.allclose(features[row], hidden[start:end].mean(0), atol=1e-5)
            assert not torch.allclose(features[row], hidden[end - 1], atol=1e-3)  # not the last token alone
    one_by_one = answer_mean_features(model, tokenizer, prompts, answers, batch_size=1, max_length=None)
    assert torch.allclose(features, one_by_one, atol=1e-5)
    with pytest.raises(ValueError, match="3 prompts but 2 answers"):
        answer_mean_features(model, tokenizer, prompts, answers[:2], batch_size=2, max_length=None)


@pytest.mark.parametrize("pad_is_eos", [False, True])
def test_answers_to_one_prompt_share_its_pass_and_read_the_same_states(tiny_model_dir: str, pad_is_eos: bool):
    """Samples of one prompt (best-of-n's, a preference stage's) run the prompt once and attend to its keys and
    values (read once per batch of its answers, not once per answer): the rows equal each text computed alone,
    unpadded, whatever the answers' lengths and the batch; an empty answer is read at its EOS, as an answer,
    also where EOS is the pad token (SmolLM2's tokenizer: it was read at the prompt's last token)."""
    import torch

    from alpacafarm.rewards import answer_mean_features

    model, tokenizer = classifier_and_tokenizer(tiny_model_dir)
    if pad_is_eos:
        tokenizer.pad_token = tokenizer.eos_token
    prompts = ["Question: name a colour.\nAnswer:"] * 4 + ["Say hi.\n"] * 3 + ["Alone here.\n"]
    answers = [" Blue.", " Red, like a fire engine or a ripe tomato.", " Green", "", " Hello!",
               " Hi there, how are you doing on this fine day?", " Hey", " Just one answer."]
    rows_read: list[list[int]] = []
    hook = model.base_model.register_forward_pre_hook(
        lambda _, args, kwargs: rows_read.extend(kwargs["input_ids"].tolist()), with_kwargs=True)
    shared = answer_mean_features(model, tokenizer, prompts, answers, batch_size=3, max_length=None)
    hook.remove()
    first = tokenizer(prompts[0])["input_ids"]
    # the first prompt is read once per batch of its 4 answers (2 batches of 3), not once per answer
    assert sum(row[:len(first)] == first for row in rows_read) == 2
    with torch.inference_mode():
        for row, (prompt, answer) in enumerate(zip(prompts, answers, strict=True)):
            start = len(tokenizer(prompt)["input_ids"])
            ids = tokenizer(prompt + answer + tokenizer.eos_token, return_tensors="pt")["input_ids"]
            hidden = model.base_model(input_ids=ids).last_hidden_state[0]
            end = max(ids.shape[1] - (tokenizer.pad_token_id == tokenizer.eos_token_id), start + 1)
            start = min(start, end - 1)  # an empty answer: its EOS token, the one after the prompt
            assert torch.allclose(shared[row], hidden[start:end].mean(0), atol=1e-5), (prompt, answer)


def test_a_mean_pooled_head_only_reward_model_learns_and_scores_its_average(tiny_model_dir: str, tmp_path: Path):
    """``pooling: mean`` fits the head on averaged answer features, says so in the saved config, and the scorer
    applies that head to the same average: the saved folder scores what the head learned."""
    import torch

    from alpacafarm.rewards import POOLING_ATTRIBUTE, RewardScorer, answer_mean_features

    prefs = write_records(tmp_path / "prefs.jsonl", learnable_preferences(120))
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(
        "name: rm-mean\n"
        f"model: {{name: {tiny_model_dir}}}\n"
        f"data:\n  preferences: {{path: {prefs}}}\n"
        "stages:\n  - name: rm\n    method: reward_model\n"
        "    config: {trainable_layers: 0, pooling: mean, learning_rate: 1.0e-2, num_train_epochs: 2,"
        " weight_decay: 0.01, eval_fraction: 0.2}\n", encoding="utf-8")
    artifact = run_recipe(recipe, tmp_path / "run")["rm"]
    meta = artifact.metadata
    assert meta["head_only"] and meta["eval_accuracy"] > 0.9 and meta["train_accuracy"] > 0.9
    assert json.loads((Path(artifact.path) / "config.json").read_text())[POOLING_ATTRIBUTE] == "mean"

    spec = ModelSpec(name=tiny_model_dir)
    scorer = RewardScorer.from_path(artifact.path, spec)
    assert scorer.pooling == "mean"
    records = learnable_preferences(6)
    answers = [r["output_1"] for r in records]
    prompts = [scorer.prompt_of(r) for r in records]
    model, tokenizer = classifier_and_tokenizer(artifact.path)
    features = answer_mean_features(model, tokenizer, prompts, answers, batch_size=4, max_length=None)
    expected = (features @ model.score.weight.detach().reshape(-1)).tolist()
    assert scorer.score_records(records, answers, batch_size=2) == pytest.approx(expected, abs=1e-4)
    with pytest.raises(ValueError, match="score_answers"):
        scorer.score_texts([p + a for p, a in zip(prompts, answers, strict=True)])
    # a last-token reward model's saved config carries no pooling: folders written before it load as they did
    saved = RewardScorer(model, tokenizer)
    del model.config.alpacafarm_pooling
    assert RewardScorer(model, tokenizer).pooling == "last" and saved.pooling == "mean"
    assert torch.isfinite(torch.tensor(scorer.score_records(records, answers))).all()


def test_a_layout_that_shares_the_reward_models_backbone_refuses_mean_pooling(tiny_model_dir: str):
    """LoRA PPO scores through the critic's backbone with its adapter off (AdapterOffClassifier), which has no
    score head or backbone of its own to average over: a mean-pooled reward model there is one clear error, not a
    last-token reading of a head fitted on averages."""
    from alpacafarm.errors import UserError
    from alpacafarm.rewards import RewardScorer
    from alpacafarm_methods.ppo.models import AdapterOffClassifier

    model, tokenizer = classifier_and_tokenizer(tiny_model_dir)
    model.config.alpacafarm_pooling = "mean"
    assert RewardScorer(model, tokenizer).pooling == "mean"  # the classifier itself can
    with pytest.raises(UserError, match=r"pooling: mean .*LoRA PPO"):
        RewardScorer(AdapterOffClassifier(model, None), tokenizer)


@pytest.mark.parametrize(("config", "message"), [
    ("{pooling: mean}", "pooling: mean is a head on frozen features: set trainable_layers: 0"),
    ("{trainable_layers: 2, pooling: mean}", "set trainable_layers: 0"),
    ("{trainable_layers: 0, pooling: max}", "pooling must be one of last, mean, not 'max'"),
])
def test_pooling_errors_name_the_setting(tiny_model_dir: str, tmp_path: Path, config: str, message: str):
    prefs = write_records(tmp_path / "prefs.jsonl", learnable_preferences(8))
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(f"name: rm-bad\nmodel: {{name: {tiny_model_dir}}}\ndata:\n  preferences: {{path: {prefs}}}\n"
                      f"stages:\n  - name: rm\n    method: reward_model\n    config: {config}\n", encoding="utf-8")
    with pytest.raises(RecipeError, match=message):
        load_recipe(recipe)


def test_ppo_and_best_of_n_score_with_a_mean_pooled_reward_model(tiny_model_dir: str, tmp_path: Path):
    """The methods that climb or rerank by the reward model read its pooling from the saved folder: PPO's rollouts
    and best-of-n's samples are scored by the answer average (best-of-n's recorded reward is the scorer's)."""
    import math

    from alpacafarm.rewards import RewardScorer

    instructions = write_records(tmp_path / "instructions.jsonl",
                                 [{"instruction": f"Say something about item {i}.", "input": ""} for i in range(12)])
    prefs = write_records(tmp_path / "prefs.jsonl", learnable_preferences(24))
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(
        "name: mean-methods\n"
        f"model: {{name: {tiny_model_dir}}}\n"
        f"data:\n  instructions: {{path: {instructions}}}\n  preferences: {{path: {prefs}}}\n"
        "stages:\n"
        "  - {name: split, method: split_instructions, config: {eval_size: 4}}\n"
        "  - {name: rm, method: reward_model, config: {trainable_layers: 0, pooling: mean, learning_rate: 1.0e-2,"
        " num_train_epochs: 1, eval_fraction: 0.25}}\n"
        "  - {name: ppo, method: ppo, config: {max_steps: 2, warmup_steps: 0, rollout_batch_size: 4,"
        " mini_batch_size: 4, per_device_train_batch_size: 4, generation_batch_size: 4, max_new_tokens: 6,"
        " learning_rate: 1.0e-3, save_strategy: 'no', score_batch_size: 4}}\n"
        "  - {name: bon, method: best_of_n, config: {split: eval, n: 2, sampling: {max_new_tokens: 6, batch_size: 4},"
        " score_batch_size: 4}}\n", encoding="utf-8")
    artifacts = run_recipe(recipe, tmp_path / "run")
    history = json.loads((tmp_path / "run/stages/ppo/metrics.json").read_text())["log_history"]
    scores = [e["score"] for e in history if "score" in e]
    assert len(scores) == 2 and all(math.isfinite(s) for s in scores)
    scorer = RewardScorer.from_path(artifacts["rm"].path, ModelSpec(name=tiny_model_dir))
    rows = [json.loads(line) for line in (tmp_path / "run/stages/bon/samples.jsonl").read_text().splitlines()]
    assert len(rows) == 8 and scorer.pooling == "mean"
    rescored = scorer.score_records(rows, [r["output"] for r in rows])
    assert rescored == pytest.approx([r["reward"] for r in rows], abs=1e-3)
    # the last token's reading of the same head would have ranked them otherwise
    scorer.pooling = "last"
    assert scorer.score_records(rows, [r["output"] for r in rows]) != pytest.approx(rescored, abs=1e-3)


def test_best_of_n_scoring_batches_keep_a_prompt_s_samples_together(tiny_model_dir: str):
    """Issue 65: best-of-n's scoring batches were every sample sorted by length, so an instruction's 8 samples
    were spread over several batches and the mean-pooled scorer read its prompt again in each (measured: 5.6
    samples/s where the shared reading gives 10.6). Now each batch holds one prompt's answers where it can, and the
    prompt is read once per batch of them; the scores are those of scoring each text alone."""
    import random

    from alpacafarm.reward_selection import score_batches, score_rows
    from alpacafarm.rewards import POOLING_ATTRIBUTE, RewardScorer

    model, tokenizer = classifier_and_tokenizer(tiny_model_dir)
    setattr(model.config, POOLING_ATTRIBUTE, "mean")
    scorer = RewardScorer(model, tokenizer, batch_size=4)
    rng = random.Random(0)
    rows = [{"instruction": f"Tell me about topic number {i}.", "input": "",
             "output": " word" * rng.randint(1, 12)} for i in range(3) for _ in range(4)]
    batches = score_batches(scorer, rows, 4)
    assert sorted(i for b in batches for i in b) == list(range(12))
    assert all(len({rows[i]["instruction"] for i in batch}) == 1 for batch in batches)
    rows_read: list[list[int]] = []
    hook = model.base_model.register_forward_pre_hook(
        lambda _, args, kwargs: rows_read.extend(kwargs["input_ids"].tolist()), with_kwargs=True)
    try:
        scores = score_rows(scorer, rows, 4)
    finally:
        hook.remove()
    prompts = [tokenizer(scorer.prompt_of(rows[i]))["input_ids"] for i in (0, 4, 8)]
    assert sum(any(r[:len(p)] == p for p in prompts) for r in rows_read) == 3  # each prompt once
    alone = [scorer.score_records([row], [row["output"]])[0] for row in rows]
    assert scores == pytest.approx(alone, abs=1e-4)
