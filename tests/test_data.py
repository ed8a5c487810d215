"""Records in and out: JSON / JSONL / CSV files, the bundled dataset, hub IDs offline, fingerprints."""

from __future__ import annotations

import json
import sys
import time

import pytest

from alpacafarm.data import BUILTIN_DIR, builtin_datasets, load_source, read_records, source_fingerprint, write_jsonl
from alpacafarm.errors import UserError
from alpacafarm.recipe import DataSource

RECORDS = [{"instruction": "Name a colour.", "input": ""}, {"instruction": "Translate", "input": "bonjour, ça va"}]


def test_read_json_list_and_column_dict(tmp_path):
    listed = tmp_path / "list.json"
    listed.write_text(json.dumps(RECORDS), encoding="utf-8")
    assert read_records(listed) == RECORDS
    columns = tmp_path / "columns.json"
    columns.write_text(json.dumps({"instruction": [r["instruction"] for r in RECORDS],
                                   "input": [r["input"] for r in RECORDS]}), encoding="utf-8")
    assert read_records(columns) == RECORDS


def test_read_jsonl_skips_blank_lines(tmp_path):
    path = tmp_path / "r.JSONL"
    path.write_text("\n".join(json.dumps(r, ensure_ascii=False) for r in RECORDS) + "\n\n   \n", encoding="utf-8")
    assert read_records(path) == RECORDS


def test_read_csv(tmp_path):
    path = tmp_path / "r.csv"
    path.write_text('instruction,input\nName a colour.,\nTranslate,"bonjour, ça va"\n', encoding="utf-8")
    assert read_records(path) == RECORDS


@pytest.mark.parametrize(("name", "content", "expected"), [
    ("broken.json", '[{"instruction": "x",}]', "broken.json:1: not valid JSON"),
    ("broken.jsonl", '{"instruction": "x"}\n{oops\n', "broken.jsonl:2: not valid JSON"),
    ("scalars.json", "[1, 2]", "scalars.json: expected a list of records"),
    ("mixed.jsonl", '{"a": 1}\n[1, 2]\n', "mixed.jsonl: expected a list of records"),
    ("notes.txt", "instruction\n", "notes.txt: unsupported data file type '.txt'"),
])
def test_read_errors_name_the_file(tmp_path, name, content, expected):
    path = tmp_path / name
    path.write_text(content, encoding="utf-8")
    with pytest.raises(UserError) as info:
        read_records(path)
    assert expected in str(info.value)
    assert str(tmp_path) in str(info.value)


def test_read_pandas_default_to_json(tmp_path):
    path = tmp_path / "frame.json"
    path.write_text(json.dumps({"instruction": {"0": "a", "1": "b"}, "input": {"0": "", "1": "x"}}), encoding="utf-8")
    assert read_records(path) == [{"instruction": "a", "input": ""}, {"instruction": "b", "input": "x"}]


def test_read_single_object_json_is_an_error(tmp_path):
    path = tmp_path / "one.json"
    path.write_text(json.dumps({"instruction": "hello"}), encoding="utf-8")
    with pytest.raises(UserError, match=r"one\.json"):
        read_records(path)


def test_write_jsonl_round_trip_is_atomic(tmp_path):
    path = tmp_path / "out" / "records.jsonl"
    assert write_jsonl(path, iter(RECORDS)) == 2
    assert read_records(path) == RECORDS
    assert "ça va" in path.read_text(encoding="utf-8")  # written as UTF-8, not \u escapes
    assert sorted(p.name for p in path.parent.iterdir()) == ["records.jsonl"]
    assert write_jsonl(path, RECORDS[:1]) == 1
    assert read_records(path) == RECORDS[:1]
    assert sorted(p.name for p in path.parent.iterdir()) == ["records.jsonl"]


def test_write_jsonl_failure_keeps_the_old_file(tmp_path):
    path = tmp_path / "records.jsonl"
    write_jsonl(path, RECORDS)

    def failing():
        yield RECORDS[0]
        raise RuntimeError("generator failed")

    with pytest.raises(RuntimeError):
        write_jsonl(path, failing())
    assert read_records(path) == RECORDS


def test_load_source_path_with_limit(tmp_path):
    path = tmp_path / "r.jsonl"
    write_jsonl(path, [{"instruction": f"task {i}"} for i in range(5)])
    assert [r["instruction"] for r in load_source(DataSource(path=str(path), limit=2))] == ["task 0", "task 1"]
    assert len(load_source(DataSource(path=str(path)))) == 5


def test_builtin_alpaca_eval_sample():
    assert "alpaca_eval_sample" in builtin_datasets()
    records = load_source(DataSource(builtin="alpaca_eval_sample"))
    assert len(records) == 256
    for record in records:
        assert {"instruction", "input", "dataset", "reference"} <= set(record)
        assert record["instruction"].strip() and record["reference"].strip()
    assert len(load_source(DataSource(builtin="alpaca_eval_sample", limit=10))) == 10


def test_the_whole_alpacafarm_evaluation_set_ships_with_davinci003_references():
    records = load_source(DataSource(builtin="alpaca_eval"))
    assert len(records) == 805
    assert len({(r["instruction"], r["input"]) for r in records}) == 805
    counts = {}
    for record in records:
        assert record["instruction"].strip() and record["reference"].strip()
        assert record["reference_generator"] == "text_davinci_003"
        counts[record["dataset"]] = counts.get(record["dataset"], 0) + 1
    # the paper's five sources (AlpacaFarm Table: 252 self-instruct, 188 OASST, 156 Koala, 129 Anthropic HH, 80 Vicuna)
    assert counts == {"selfinstruct": 252, "oasst": 188, "koala": 156, "helpful_base": 129, "vicuna": 80}
    assert sum(bool(r["input"]) for r in records) == 208
    sample = load_source(DataSource(builtin="alpaca_eval_sample"))
    assert all(r in records for r in sample)  # the sample is a subset, record for record
    assert "CC BY-NC 4.0" in (BUILTIN_DIR / "SOURCES.md").read_text(encoding="utf-8")


def test_unknown_builtin_suggests_the_closest():
    with pytest.raises(UserError) as info:
        load_source(DataSource(builtin="alpaca_eval_sampel"))
    message = str(info.value)
    assert "unknown builtin dataset 'alpaca_eval_sampel'" in message and "did you mean 'alpaca_eval_sample'?" in message


def test_source_fingerprint_follows_file_content(tmp_path):
    path = tmp_path / "r.jsonl"
    write_jsonl(path, RECORDS)
    source = DataSource(path=str(path))
    first = source_fingerprint(source)
    assert source_fingerprint(DataSource(path=str(path))) == first
    assert source_fingerprint(DataSource(path=str(path), limit=1)) != first
    write_jsonl(path, RECORDS[::-1])
    assert source_fingerprint(source) != first
    builtin = source_fingerprint(DataSource(builtin="alpaca_eval_sample"))
    assert builtin == source_fingerprint(DataSource(builtin="alpaca_eval_sample")) and builtin != first


def test_hub_dataset_offline_fails_fast_and_names_the_local_alternative(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    if "datasets" in sys.modules:  # datasets reads the variables once, at import
        import datasets.config

        monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
        monkeypatch.setattr(datasets.config, "HF_DATASETS_OFFLINE", True)
    started = time.monotonic()
    with pytest.raises(UserError) as info:
        load_source(DataSource(hub="alpacafarm-tests/no-such-dataset", split="train"))
    assert time.monotonic() - started < 30
    message = str(info.value)
    assert "alpacafarm-tests/no-such-dataset" in message and "offline" in message
    assert "path:" in message and "\n" not in message
