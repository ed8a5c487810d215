"""The readings store (issue 65): a text read once by frozen weights is not read again by another part of the run.

On a CPU without native bfloat16 the quickstart's reward-model stage read, in float32, the 381 answers the gold had
just read in float32 with the same weights (61 s of a run that had to fit ten minutes), and the gold then read again
the best-of-n winners the reward model had read. These tests count the backbone's forward passes."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture
def tied(tiny_model_dir: str, tmp_path: Path):
    """The tiny model as a classifier whose language-model head is tied to its input embedding (as SmolLM2's),
    saved to a folder so that a second, equal copy can be loaded; its tokenizer (pad = EOS, as SmolLM2's)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

    config = AutoConfig.from_pretrained(tiny_model_dir)
    config.tie_word_embeddings = True
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "tied")
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    tokenizer.pad_token = tokenizer.eos_token
    tokenizer.save_pretrained(tmp_path / "tied")

    def load():
        return AutoModelForSequenceClassification.from_pretrained(tmp_path / "tied", num_labels=1).eval()

    return load, tokenizer


class Passes:
    """The tokens each forward pass of a backbone read (a hook on the real module, not a stand-in)."""

    def __init__(self, model) -> None:
        self.lengths: list[int] = []
        model.base_model.register_forward_hook(self._seen, with_kwargs=True)

    def _seen(self, _module, args, kwargs, _output) -> None:
        ids = kwargs.get("input_ids", args[0] if args else None)
        self.lengths.append(int(ids.shape[1]))


PROMPTS = ["Question: name a colour.\nAnswer:", "Question: name a colour.\nAnswer:", "Say hi.\n", "Say hi.\n"]
ANSWERS = [" Blue, like the sky on a clear day.", " Red.", "", " Hello there, my good friend, how are you?"]


def test_the_store_keeps_each_field_as_first_written(tmp_path: Path):
    import torch

    from alpacafarm.readings import Reading, ReadingStore

    store = ReadingStore(tmp_path / "r.sqlite")
    store.put({"a": Reading(features=torch.tensor([1.0, 2.0]))})
    store.put({"a": Reading(features=torch.tensor([9.0, 9.0]), log_probs=[-0.5, -1.25]), "b": Reading(log_probs=[0.0])})
    again = ReadingStore(tmp_path / "r.sqlite").get(["a", "b", "c"])  # another connection reads what was committed
    assert again["a"].features.tolist() == [1.0, 2.0]  # the first features stay
    assert again["a"].log_probs == [-0.5, -1.25]  # an empty field is filled
    assert again["b"].features is None and again["b"].log_probs == [0.0]
    assert "c" not in again


def test_a_new_store_opens_while_another_connection_holds_its_write_lock(tmp_path: Path):
    """Two ranks opening a new readings file together: the second's switch to WAL met the first's write lock and
    SQLite refused it at once (no busy wait), as it did the annotation cache; the store now waits as that does."""
    import sqlite3
    import threading

    from alpacafarm.readings import Reading, ReadingStore

    path = tmp_path / "r.sqlite"
    holder = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    holder.execute("CREATE TABLE first_writer (x)")  # the file exists, still in rollback mode
    holder.execute("BEGIN IMMEDIATE")  # the first opener, mid-write
    release = threading.Timer(0.5, lambda: holder.execute("COMMIT"))
    release.start()
    try:
        store = ReadingStore(path)
    finally:
        release.join()
        holder.close()
    store.put({"a": Reading(log_probs=[-1.0])})
    assert store.get(["a"])["a"].log_probs == [-1.0]


def test_a_folder_in_the_store_s_place_is_one_line_naming_it(tmp_path: Path):
    from alpacafarm.readings import ReadingStore, ReadingStoreError

    (tmp_path / "r.sqlite").mkdir()
    with pytest.raises(ReadingStoreError, match=r"r\.sqlite: is a directory"):
        ReadingStore(tmp_path / "r.sqlite").get(["a"])


def test_the_fingerprint_follows_the_weights_and_their_dtype(tied):
    import torch

    from alpacafarm.readings import fingerprint

    load, _ = tied
    first, second = load(), load()
    assert fingerprint(first.base_model) == fingerprint(second.base_model)  # two loads of one folder
    with torch.no_grad():
        second.base_model.norm.weight[0] += 1e-3  # in place: the cached fingerprint must notice
    assert fingerprint(first.base_model) != fingerprint(second.base_model)
    assert fingerprint(load().to(torch.bfloat16).base_model) != fingerprint(first.base_model)


def test_a_reward_model_reads_no_answer_the_same_weights_read_before(tied, tmp_path: Path):
    import torch

    from alpacafarm.readings import ReadingStore
    from alpacafarm.rewards import answer_mean_features

    load, tokenizer = tied
    store = ReadingStore(tmp_path / "r.sqlite")
    first = load()
    read = answer_mean_features(first, tokenizer, PROMPTS, ANSWERS, batch_size=2, max_length=64, store=store)
    plain = answer_mean_features(first, tokenizer, PROMPTS, ANSWERS, batch_size=2, max_length=64)
    assert torch.allclose(read, plain, atol=1e-6)  # the store changes where a row comes from, not what it is
    other = load()  # the reward-model stage loads its own copy of the SFT weights
    passes = Passes(other)
    again = answer_mean_features(other, tokenizer, PROMPTS, ANSWERS, batch_size=2, max_length=64, store=store)
    assert passes.lengths == [] and torch.equal(again, read)
    changed = load()
    with torch.no_grad():
        changed.base_model.norm.weight.mul_(2.0)
    passes = Passes(changed)
    answer_mean_features(changed, tokenizer, PROMPTS, ANSWERS, batch_size=2, max_length=64, store=store)
    assert passes.lengths  # other weights: every answer is read


def test_the_gold_takes_the_reward_model_s_features_and_reads_only_its_window(tied, tmp_path: Path):
    """The gold reads features and the first ``window`` log-probabilities; where a mean-pooled reward model with
    the same weights read the features (best-of-n's candidates), the gold reads each answer only as far as the
    window, and the numbers are those of a reading without any store."""
    import torch

    from alpacafarm.readings import ReadingStore
    from alpacafarm.rewards import answer_mean_features
    from alpacafarm_annotators.gold_relevance import read_answers

    load, tokenizer = tied
    store = ReadingStore(tmp_path / "r.sqlite")
    window = 3
    features = answer_mean_features(load(), tokenizer, PROMPTS, ANSWERS, batch_size=4, max_length=64, store=store)
    want_features, want_log_probs = read_answers(load(), tokenizer, PROMPTS, ANSWERS, batch_size=4, max_length=64,
                                                 window=window)
    gold = load()
    passes = Passes(gold)
    got_features, got_log_probs = read_answers(gold, tokenizer, PROMPTS, ANSWERS, batch_size=4, max_length=64,
                                               window=window, store=store)
    assert torch.equal(got_features, features)
    assert torch.allclose(got_features, want_features, atol=1e-5)
    for got, want in zip(got_log_probs, want_log_probs, strict=True):
        assert got == pytest.approx(want, abs=1e-4)
    # the prompts' pass, then every answer's pass after its prompt: no wider than the window, though " Blue, like
    # the sky on a clear day." is longer
    assert len(passes.lengths) == 2 and passes.lengths[1] == window
    passes.lengths.clear()
    again = read_answers(gold, tokenizer, PROMPTS, ANSWERS, batch_size=4, max_length=64, window=window, store=store)
    assert passes.lengths == [] and torch.equal(again[0], got_features) and again[1] == got_log_probs


def test_the_neutral_reading_is_kept_apart_from_the_own_one(tied, tmp_path: Path):
    from alpacafarm.readings import ReadingStore
    from alpacafarm_annotators.gold_relevance import read_answers

    load, tokenizer = tied
    store = ReadingStore(tmp_path / "r.sqlite")
    model = load()
    _, own = read_answers(model, tokenizer, PROMPTS, ANSWERS, batch_size=4, max_length=64, window=3, store=store)
    _, neutral = read_answers(model, tokenizer, ["Hi.\n"] * 4, ANSWERS, batch_size=4, max_length=64,
                              features=False, window=3, store=store)
    _, plain = read_answers(model, tokenizer, ["Hi.\n"] * 4, ANSWERS, batch_size=4, max_length=64, features=False,
                            window=3)
    assert neutral != own
    for got, want in zip(neutral, plain, strict=True):
        assert got == pytest.approx(want, abs=1e-4)


def test_smollm2_s_reward_model_reads_nothing_the_gold_read(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """The quickstart's case on a CPU without native bfloat16: the gold (SmolLM2 in float32) labels the preference
    samples, then the head-only reward model on the same SFT weights in float32 reads their features. The two must
    build the same text and the same weights' fingerprint, or the store would never be hit."""
    from alpacafarm.model_loading import load_classifier, load_tokenizer
    from alpacafarm.model_sources import resolve_model_path
    from alpacafarm.recipe import ModelSpec
    from alpacafarm.rewards import POOLING_ATTRIBUTE, RewardScorer
    from alpacafarm_annotators.gold_head import helpful_head

    monkeypatch.setenv("ALPACAFARM_CACHE_DIR", str(tmp_path))
    from alpacafarm.readings import default_store

    records = [{"instruction": "Name a primary colour, readings test.", "input": ""},
               {"instruction": "Name a primary colour, readings test.", "input": ""},
               {"instruction": "Give a synonym for quick, readings test.", "input": ""}]
    answers = ["Red is a primary colour.", "Blue.", "Fast, or rapid."]
    helpful_head(records, answers)
    spec = ModelSpec(name="smollm2-135m-instruct", dtype="float32", device="cpu", prompt_format="chat_template")
    path = resolve_model_path(spec.name)
    model = load_classifier(spec, path).eval()
    setattr(model.config, POOLING_ATTRIBUTE, "mean")
    scorer = RewardScorer(model, load_tokenizer(spec, path), prompt_format="chat_template", max_length=192,
                          readings=default_store())
    passes = Passes(model)
    scores = scorer.score_records(records, answers)
    assert passes.lengths == [] and len(scores) == 3


@pytest.mark.parametrize("reader", ["reward model", "gold"])
def test_several_prompts_answers_are_read_in_one_batch_as_if_whole(tied, reader: str):
    """Answers grouped by prompt used one pass per prompt and one per group (the gold's preference stage: 96 prompts
    of 4 answers, 192 small passes). Now several prompts of different lengths go in one padded pass and all their
    answers in one more, each after its own prompt's keys and values at its own positions; the numbers are those
    of reading each text whole."""
    import torch

    from alpacafarm.rewards import answer_mean_features
    from alpacafarm_annotators.gold_relevance import read_answers

    load, tokenizer = tied
    model = load()
    prompts = ["Question: name a colour you like.\nAnswer:"] * 2 + ["Hi.\n"] * 3 + ["Say something kind.\n"] * 2
    answers = [" Blue.", " Green, like grass in spring.", " Hello!", " Hey there, friend.", " Hi.", " You matter.",
               " Thank you for being here."]
    passes = Passes(model)
    if reader == "gold":
        features, log_probs = read_answers(model, tokenizer, prompts, answers, batch_size=16, max_length=64)
        shared_passes = list(passes.lengths)
        whole, whole_log_probs = read_answers(model, tokenizer, prompts, answers, batch_size=16, max_length=64,
                                              share_prompts=False)
        for got, want in zip(log_probs, whole_log_probs, strict=True):
            assert got == pytest.approx(want, abs=1e-4)
    else:
        features = answer_mean_features(model, tokenizer, prompts, answers, batch_size=16, max_length=64)
        shared_passes = list(passes.lengths)
        whole = answer_mean_features(model, tokenizer, prompts, answers, batch_size=16, max_length=64,
                                     share_prompts=False)
    longest_prompt = len(tokenizer("Question: name a colour you like.\nAnswer:")["input_ids"])
    assert len(shared_passes) == 2 and shared_passes[0] == longest_prompt  # the prompts' pass, the answers' pass
    assert torch.allclose(features, whole, atol=1e-5)


def test_groups_pack_into_batches_by_prompt_length_and_split_when_too_big():
    from alpacafarm.rewards import pack_groups

    groups = [["long"] * 3, ["a"] * 5, ["mid"] * 2]
    batches = pack_groups(groups, 4, len)
    assert batches == [[["a"] * 4], [["a"], ["mid"] * 2], [["long"] * 3]]
