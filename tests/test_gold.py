"""The gold-preference world: the ``gold`` annotator (Bradley-Terry in a known score, the paper's label noise), the
built-in rubric, and the evaluation's gold and KL columns, down to a user-written gold driving a whole run."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

import alpacafarm
from alpacafarm.errors import UserError
from alpacafarm.plugins import get_registry
from alpacafarm.types import Pair


def count_gold(records: list[dict[str, Any]], answers: list[str]) -> list[float]:
    """A user-written gold: 0.1 per letter 'x' (what a recipe names as ``test_gold:count_gold``)."""
    return [0.1 * answer.count("x") for answer in answers]


def distinct_words_gold(records: list[dict[str, Any]], answers: list[str]) -> list[float]:
    """Another user-written gold: 0.1 per distinct word (the tiny random model's answers differ in it)."""
    return [0.1 * len(set(answer.split())) for answer in answers]


GOLD_CALLS: list[list[str]] = []


def recording_gold(records: list[dict[str, Any]], answers: list[str]) -> list[float]:
    """:func:`count_gold`, recording the answers of each call."""
    GOLD_CALLS.append(list(answers))
    return count_gold(records, answers)


def wrong_length_gold(records: list[dict[str, Any]], answers: list[str]) -> list[float]:
    return [1.0]


def nan_gold(records: list[dict[str, Any]], answers: list[str]) -> list[float]:
    return [math.nan for _ in answers]


def gold(**config: Any):
    return get_registry().create("annotator", "gold", {"gold": "test_gold:count_gold", **config})


def pairs_with_difference(n: int, extra_x: int) -> list[Pair]:
    """``n`` distinct pairs whose second output has ``extra_x`` more 'x' than the first."""
    return [Pair(f"instruction {i}", f"answer {i} x", f"answer {i} x" + "x" * extra_x) for i in range(n)]


def sigmoid(z: float) -> float:
    return 1 / (1 + math.exp(-z))


def test_sampled_labels_follow_bradley_terry_in_the_gold_and_mirror():
    annotator = gold(temperature=0.1)
    pairs = pairs_with_difference(3000, 1)  # gold difference 0.1 at temperature 0.1: P(second wins) = sigmoid(1)
    labels = [a.preference for a in annotator.annotate(pairs)]
    share = labels.count(2) / len(labels)
    assert abs(share - sigmoid(1.0)) < 0.03, share  # 3000 draws: SE 0.008
    mirrored = [a.preference for a in annotator.annotate([p.swapped() for p in pairs])]
    assert mirrored == [3 - label for label in labels]  # the same draw, seen from the other side
    assert [a.preference for a in annotator.annotate(pairs)] == labels  # seeded: the same labels every time
    other_seed = [a.preference for a in gold(temperature=0.1, seed=1).annotate(pairs)]
    assert other_seed != labels


def test_threshold_continuous_ties_and_scores_in_the_metadata():
    pairs = [Pair("q", "x", "xxx"), Pair("q", "xxx", "x"), Pair("q", "ab", "cd"), Pair("q", "same", "same")]
    hard = gold(mode="threshold").annotate(pairs)
    assert [a.preference for a in hard] == [2, 1, 0, 0]  # equal scores and identical answers are ties
    assert hard[0].metadata == {"gold_1": pytest.approx(0.1), "gold_2": pytest.approx(0.3)}
    soft = gold(mode="continuous", temperature=0.2).annotate(pairs)
    assert soft[0].preference == pytest.approx(1 + sigmoid(1.0))
    assert soft[1].preference == pytest.approx(2 - sigmoid(1.0))
    assert [a.preference for a in soft[2:]] == [0, 0]


def test_label_noise_flips_as_the_pools_do():
    pairs = pairs_with_difference(4000, 5)  # a clear winner: the noiseless label is always 2
    annotations = gold(mode="threshold", noise=0.25).annotate(pairs)
    noisy = [a for a in annotations if a.noise]
    assert abs(len(noisy) / len(pairs) - 0.5) < 0.03  # a fair coin replaces the label with probability 2 x 0.25
    flipped = sum(a.preference == 1 for a in annotations) / len(pairs)
    assert abs(flipped - 0.25) < 0.03
    assert all(a.annotator == "noise" for a in noisy)
    assert all(a.preference == 2 for a in annotations if not a.noise)


@pytest.mark.parametrize(("target", "message"), [
    ("test_gold:wrong_length_gold", "returned 1 scores for 2 answers"),
    ("test_gold:nan_gold", "not a finite number"),
    ("no_such_module_xyz:gold", "cannot import 'no_such_module_xyz'"),
    ("test_gold:no_such_function", "has no attribute"),
    ("test_gold", "not of the form 'module:attr'"),
])
def test_a_broken_gold_fails_in_one_line_naming_it(target: str, message: str):
    with pytest.raises(UserError, match=message) as error:
        get_registry().create("annotator", "gold", {"gold": target}).annotate([Pair("q", "a", "b")] * 2)
    assert "\n" not in str(error.value)


def test_the_builtin_gold_gives_nothing_for_length_alone():
    """An answer made only shorter (its first half) or only longer (repeated, or padded with a neutral sentence)
    never scores higher than itself. Answers: the bundled Davinci003 references (long, many of them lists) and
    short answers of the kinds the SFT model writes."""
    from alpacafarm.data import load_source
    from alpacafarm.recipe import DataSource
    from alpacafarm_annotators.gold_functions import helpfulness, repeated_phrases

    records = load_source(DataSource(builtin="alpaca_eval_sample"))[:120]
    answers = [r["reference"] for r in records]
    records += [{"instruction": "Give three tips for staying healthy.", "input": ""}] * 3
    answers += ["1. Eat a balanced diet.\n2. Exercise regularly.\n3. Sleep well.",
                "Staying healthy means eating well, moving every day and sleeping enough hours.",
                "Tips for staying healthy: drink water. Tips for staying healthy: drink water."]
    full = helpfulness(records, answers)
    shorter = helpfulness(records, [" ".join(a.split(" ")[: max(1, len(a.split(" ")) // 2)]) for a in answers])
    doubled = helpfulness(records, [f"{a}\n{a}" for a in answers])
    padded = helpfulness(records, [f"{a} Thank you." for a in answers])
    for i, answer in enumerate(answers):
        if repeated_phrases(answer) == 0:  # cutting a loop away is an improvement, not length
            assert shorter[i] <= full[i] + 1e-12, answer
        assert doubled[i] <= full[i], answer
        assert padded[i] <= full[i] + 1e-12, answer
    assert sum(s < f for s, f in zip(shorter, full, strict=True)) > len(answers) / 4  # it does see content
    assert sum(d < f for d, f in zip(doubled, full, strict=True)) > len(answers) * 3 / 4  # and loops


def test_looping_is_a_share_so_a_long_answer_s_first_half_escapes_nothing():
    """The answer gold's loop penalty: 0 for an answer whose repeats are a list's natural few (whole or its first
    half alike), 1 for an answer written twice or stuck on a word; the count the rubric uses charges the whole
    answer and not its half (the 0.125 the first half of a long Davinci003 answer gained from the count alone)."""
    from alpacafarm_annotators.gold_functions import looping, repeated_phrases

    steps = [f"Step {k}: make sure that you {verb} the {thing} before the next one."
             for k, (verb, thing) in enumerate([("wash", "pan"), ("heat", "oil"), ("chop", "onion"), ("add", "salt"),
                                                ("stir", "sauce"), ("taste", "soup"), ("serve", "plates"),
                                                ("clean", "table")], 1)]
    whole = " ".join(steps)
    half = " ".join(whole.split(" ")[: len(whole.split(" ")) // 2])
    assert repeated_phrases(whole) > repeated_phrases(half)  # the count charges the whole more than its half
    assert looping(whole) == looping(half) == 0.0
    assert looping(f"{whole}\n{whole}") == 1.0
    assert looping("A friendly group is: " + "ellen. " * 20) == 1.0
    sample = ("Dance with a guitar. Shake the ceiling. Write a song.\n\nDance with a guitar. Boring song. "  # an SFT
              "Fangirl.\n\nDance with a guitar. Fangirl.\n\nDance with a guitar. Fangirl.\n\nDance with a guitar. F")
    assert 0.2 < looping(sample) < 0.6
    assert looping("") == looping("Too short.") == 0.0


def test_the_builtin_gold_prefers_on_topic_organised_answers_without_loops():
    from alpacafarm_annotators.gold_functions import helpfulness

    record = {"instruction": "List three red fruits.", "input": ""}
    on_topic_list = "Red fruits:\n1. Apple\n2. Cherry\n3. Strawberry"
    prose = "Apples, cherries and strawberries are red fruits."
    off_topic = "I like trains and long walks in the park."
    loop = "red fruits are red fruits are red fruits are red fruits are red fruits are red"
    scores = dict(zip(("list", "prose", "off", "loop"),
                      helpfulness([record] * 4, [on_topic_list, prose, off_topic, loop]), strict=True))
    assert scores["list"] > scores["prose"] > scores["off"] > scores["loop"]


def recipe_text(model_dir: str, annotator_gold: str) -> str:
    return f"""
name: gold-world
seed: 7
model: {{name: {model_dir}, dtype: float32, device: cpu}}
data:
  instructions: {{builtin: alpaca_eval_sample, limit: 24}}
annotator:
  name: gold
  config: {{gold: "{annotator_gold}", noise: 0.25}}
stages:
  - name: split
    method: split_instructions
    config: {{eval_size: 4}}
  - name: preferences
    method: preference_data
    config: {{k: 3, pairing: all, sampling: {{temperature: 1.0, max_new_tokens: 8, batch_size: 10}}}}
  - name: reward_model
    method: reward_model
    config: {{trainable_layers: 0, num_train_epochs: 1, eval_fraction: 0.2, score_batch_size: 4}}
  - name: outputs
    method: generate_outputs
    config: {{sampling: {{temperature: 0.7, max_new_tokens: 8, batch_size: 4}}}}
  - name: dpo
    method: dpo
    config: {{max_steps: 2, per_device_train_batch_size: 2, learning_rate: 1.0e-3, max_length: 256,
              logging_steps: 1, save_strategy: 'no'}}
  - name: dpo_outputs
    method: generate_outputs
    inputs: {{sft_model: dpo, kl_reference: base_model}}
    config: {{sampling: {{temperature: 0.7, max_new_tokens: 8, batch_size: 4}}}}
  - name: best_of_n
    method: best_of_n
    config: {{n: 4, n_values: [4], sampling: {{temperature: 0.7, max_new_tokens: 8, batch_size: 4}}}}
evaluation:
  annotator:
    name: gold
    config: {{gold: "{annotator_gold}", mode: continuous}}
  policy: [outputs, dpo_outputs, best_of_n]
"""


@pytest.mark.slow
def test_a_user_written_gold_drives_a_run_end_to_end(tmp_path: Path, tiny_model_dir: str):
    """Preferences labelled by the user's gold (with noise), a reward model and DPO trained on them, outputs with
    their log-probabilities, and an evaluation by the noiseless gold with gold and KL columns."""
    from alpacafarm.testing import run_recipe
    from alpacafarm_annotators.gold import GoldAnnotator, GoldAnnotatorConfig

    recipe = tmp_path / "gold.yaml"
    recipe.write_text(recipe_text(tiny_model_dir, "test_gold:distinct_words_gold"), encoding="utf-8")
    run_recipe(recipe, tmp_path / "run")
    stages = tmp_path / "run" / "stages"
    preferences = [json.loads(line) for line in (stages / "preferences" / "preferences.jsonl").open()]
    judged = [p for p in preferences if p["annotator"] == "gold"]
    assert judged and all(p["annotator"] in ("gold", "noise") for p in preferences)
    dpo_outputs = [json.loads(line) for line in (stages / "dpo_outputs" / "outputs.jsonl").open()]
    assert all(isinstance(r["logprob"], float) and isinstance(r["reference_logprob"], float) for r in dpo_outputs)
    assert any(r["logprob"] != r["reference_logprob"] for r in dpo_outputs)  # DPO moved the policy
    rows = {r["system"]: r for r in json.loads((stages / "evaluate" / "results.json").read_text())["rows"]}
    assert set(rows) == {"outputs", "dpo_outputs", "best_of_4"}
    # The gold column is the user's gold of each system's answers, averaged over the judged instructions.
    outputs = [json.loads(line) for line in (stages / "outputs" / "outputs.jsonl").open()]
    expected = sum(distinct_words_gold([], [r["output"] for r in outputs])) / len(outputs)
    assert rows["outputs"]["gold"] == pytest.approx(expected)
    assert rows["outputs"]["kl"] is None  # no kl_reference: not known
    assert rows["best_of_4"]["kl"] == pytest.approx(math.log(4) - 3 / 4)
    assert rows["dpo_outputs"]["kl"] is not None and rows["dpo_outputs"]["kl_se"] is not None
    assert rows["dpo_outputs"]["delta_gold_vs_system"] == pytest.approx(rows["dpo_outputs"]["gold"] - expected)
    assert rows["outputs"]["continuous_preferences"]
    # The win-rate is the noiseless gold's P(answer beats the reference), averaged.
    annotations = json.loads((stages / "evaluate" / "systems" / "outputs" / "annotations.json").read_text())
    judge = GoldAnnotator(GoldAnnotatorConfig(gold="test_gold:distinct_words_gold", mode="continuous"))
    first = annotations[0]
    expected_p = judge.probability(*distinct_words_gold([], [first["output_1"], first["output_2"]]))
    assert first["preference"] == pytest.approx(1 + expected_p)


def test_the_gold_gives_pointwise_verdicts_that_kto_learns_from(tmp_path: Path, tiny_model_dir: str):
    """``acceptable_above``: each output of a labelled pair is acceptable when its gold score reaches the bar —
    whatever the (noisy) preference says — and the preference records carry those verdicts to KTO, which trains on
    them instead of on 'preferred = desirable'."""
    from alpacafarm.testing import run_recipe

    recipe = tmp_path / "kto.yaml"
    recipe.write_text(f"""
name: gold-kto
seed: 3
model: {{name: {tiny_model_dir}, dtype: float32, device: cpu}}
data:
  instructions: {{builtin: alpaca_eval_sample, limit: 10}}
annotator:
  name: gold
  config: {{gold: "test_gold:distinct_words_gold", noise: 0.25, acceptable_above: 0.5}}
stages:
  - name: split
    method: split_instructions
    config: {{eval_size: 2}}
  - name: preferences
    method: preference_data
    config: {{k: 2, sampling: {{temperature: 1.0, max_new_tokens: 8, batch_size: 8}}}}
  - name: kto
    method: kto
    config: {{max_steps: 1, per_device_train_batch_size: 2, max_length: 256, save_strategy: 'no'}}
""", encoding="utf-8")
    artifacts = run_recipe(recipe, tmp_path / "run")
    preferences = [json.loads(line) for line in
                   (tmp_path / "run/stages/preferences/preferences.jsonl").open()]
    verdicts = [(p[f"acceptable_{k}"], distinct_words_gold([], [p[f"output_{k}"]])[0]) for p in preferences
                for k in (1, 2) if f"acceptable_{k}" in p]
    assert len(verdicts) == 2 * len(preferences) == 16
    assert all(verdict == (score >= 0.5) for verdict, score in verdicts)
    assert {v for v, _ in verdicts} == {True, False}  # both kinds, so the counts below can tell
    meta = artifacts["kto"].metadata
    desirable = sum(v for v, _ in verdicts)
    assert (meta["n_desirable"], meta["n_undesirable"]) == (desirable, len(verdicts) - desirable)


def test_each_answer_is_scored_once_and_the_evaluation_hands_every_system_at_once():
    """Issue 65: the evaluation judged system after system, so an instruction's prompt was read once per system
    (and again for the mean-gold column). The gold annotator keeps each (instruction, input, answer)'s score, and
    the evaluation first hands it every system's answers and the references in one call."""
    from alpacafarm_evaluation.evaluator import prefetch

    GOLD_CALLS.clear()
    judge = gold(gold="test_gold:recording_gold")
    systems = [[{"instruction": f"i{k}", "input": "", "output_1": f"ref {k}", "output_2": f"{name} {k} x"}
                for k in range(3)] for name in ("a", "b")]
    systems[1][0]["output_2"] = systems[0][0]["output_2"]  # two systems, one answer: scored once
    prefetch(judge, systems)
    assert len(GOLD_CALLS) == 1 and sorted(GOLD_CALLS[0]) == sorted(
        {p[side] for pairs in systems for p in pairs for side in ("output_1", "output_2")})
    assert len(GOLD_CALLS[0]) == 3 + 3 + 2
    annotations = judge.annotate([Pair(p["instruction"], p["output_1"], p["output_2"]) for p in systems[0]])
    assert len(GOLD_CALLS) == 1  # judging found every score ready
    assert [a.metadata["gold_2"] for a in annotations] == [pytest.approx(0.1)] * 3
    assert judge.score([{"instruction": "i0", "input": ""}] * 2, ["new x", "new x"]) == [pytest.approx(0.1)] * 2
    assert GOLD_CALLS[-1] == ["new x"]  # a new answer, once, even when asked twice
    # the same answer to another instruction is another score (a gold reads the instruction too)
    judge.score([{"instruction": "i9", "input": ""}], ["new x"])
    assert GOLD_CALLS[-1] == ["new x"] and len(GOLD_CALLS) == 3


class _FixedAnswers:
    """Stand-in policy stages: each answers the first four instructions of the bundled sample (the evaluation's
    default references) with ``x`` repeated by a per-stage factor."""

    @staticmethod
    def method(factor: int):
        from alpacafarm.data import load_source
        from alpacafarm.method import Artifact, Method
        from alpacafarm.recipe import DataSource
        from alpacafarm.testing import write_records

        class Answers(Method):
            requires = ()
            provides = "policy"

            def run(self, context):
                records = load_source(DataSource(builtin="alpaca_eval_sample"))[:4]
                path = context.stage_dir / "outputs.jsonl"
                write_records(path, [{"instruction": r["instruction"], "input": r.get("input") or "",
                                      "output": "x" * (factor * (k + 1)), "generator": f"s{factor}"}
                                     for k, r in enumerate(records)])
                return Artifact("dataset", str(path))

        return Answers

    @alpacafarm.hookimpl
    def register_methods(self, register):
        register("answers_one", self.method(1))
        register("answers_three", self.method(3))


def test_the_evaluation_reads_every_system_s_answers_in_one_call_to_the_gold(tmp_path: Path,
                                                                              register_test_plugin):
    """The evaluation's wiring of :func:`prefetch`: with two systems judged by the gold, the gold function is
    called once with both systems' answers and the references, and never again (the judging of each system and its
    mean-gold column find their scores kept)."""
    from alpacafarm.pipeline import Pipeline
    from alpacafarm.recipe import load_recipe

    register_test_plugin(_FixedAnswers(), "gold-prefetch-test")
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("name: prefetch\nstages:\n  - {name: one, method: answers_one}\n"
                      "  - {name: three, method: answers_three}\n"
                      "evaluation:\n  evaluator: win_rate\n  policy: [one, three]\n"
                      "  annotator: {name: gold, config: {gold: 'test_gold:recording_gold', mode: continuous}}\n",
                      encoding="utf-8")
    GOLD_CALLS.clear()
    outcomes = {o.name: o for o in Pipeline(load_recipe(recipe), get_registry(), tmp_path / "run").run()}
    assert outcomes["evaluate"].status == "ran"
    assert len(GOLD_CALLS) == 1, [len(c) for c in GOLD_CALLS]
    answers = GOLD_CALLS[0]
    assert {"x" * k for k in (1, 2, 3, 4)} <= set(answers) and {"x" * 3 * k for k in (1, 2, 3, 4)} <= set(answers)
    # 4 + 4 answers and the 4 references; "xxx" answers another instruction in each system, so it counts twice
    assert len(answers) == 12 and len(set(answers)) == 11
