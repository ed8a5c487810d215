"""Pair a system's outputs with reference outputs, annotate the pairs, score them; shared by CLI and evaluator.

Instructions are matched on (instruction, input). AlpacaEval files merge the two as ``"{instruction}\\n\\n{input}"``
with an empty input, AlpacaFarm files keep them apart; both spellings are indexed, so either side may use either
form. An output whose instruction has no reference is counted as unmatched and skipped — never paired with a
wrong reference.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from alpacafarm.errors import UserError

DEFAULT_REFERENCES = "alpaca_eval_sample"
REFERENCE_FIELDS = ("reference", "output")


def merged_instruction(instruction: str, input_text: str) -> str:
    """AlpacaEval's single-string form of an instruction and its input."""
    return f"{instruction}\n\n{input_text}" if input_text else instruction


def _keys(instruction: str, input_text: str) -> list[tuple[str, str]]:
    """The lookup keys of one instruction: as given, then merged (AlpacaEval's form)."""
    keys = [(instruction, input_text)]
    if input_text:
        keys.append((merged_instruction(instruction, input_text), ""))
    return keys


def _text(record: dict[str, Any], key: str) -> str:
    value = record.get(key)
    return "" if value is None else str(value)


@dataclass
class ReferenceSet:
    """Reference records indexed by (instruction, input) in both spellings; ``name`` is what generated them."""

    records: list[dict[str, Any]]
    index: dict[tuple[str, str], dict[str, Any]] = field(default_factory=dict)
    name: str = "reference"

    @classmethod
    def build(cls, records: list[dict[str, Any]], field_name: str = "reference",
              label: str = "references") -> ReferenceSet:
        """Index records that have ``instruction`` and a reference text (``field_name``, else ``output``)."""
        fields = (field_name, *(f for f in REFERENCE_FIELDS if f != field_name))
        usable: list[dict[str, Any]] = []
        index: dict[tuple[str, str], dict[str, Any]] = {}
        for i, record in enumerate(records):
            text = next((record[f] for f in fields if isinstance(record.get(f), str)), None)
            if not isinstance(record.get("instruction"), str) or text is None:
                raise UserError(f"{label}: record {i} needs a string 'instruction' and '{field_name}' (or 'output')")
            entry = {"instruction": record["instruction"], "input": _text(record, "input"), "text": text,
                     "dataset": record.get("dataset"),
                     "generator": record.get("reference_generator") or record.get("generator")}
            usable.append(entry)
            for key in _keys(entry["instruction"], entry["input"]):
                index.setdefault(key, entry)  # the first reference of an instruction wins; later duplicates ignored
        generators = {e["generator"] for e in usable} - {None}
        return cls(usable, index, generators.pop() if len(generators) == 1 else "reference")

    def find(self, instruction: str, input_text: str) -> dict[str, Any] | None:
        for key in _keys(instruction, input_text):
            if key in self.index:
                return self.index[key]
        return None


def load_references(source: Any = None, field_name: str = "reference") -> ReferenceSet:
    """References from a recipe ``DataSource``, a file path or builtin name (str), or the bundled default."""
    from alpacafarm.data import builtin_datasets, load_source, read_records
    from alpacafarm.recipe import DataSource

    if source is None:
        source = DataSource(builtin=DEFAULT_REFERENCES)
    if isinstance(source, str | Path):
        path = Path(source)
        if path.is_file():
            return ReferenceSet.build(read_records(path), field_name, str(path))
        if str(source) in builtin_datasets():
            source = DataSource(builtin=str(source))
        else:
            raise UserError(f"references not found: {source} "
                            f"(a JSON/JSONL file, or a builtin: {', '.join(builtin_datasets())})")
    label = source.path or source.builtin or source.hub or "references"
    return ReferenceSet.build(load_source(source), field_name, str(label))


def pair_outputs(outputs: list[dict[str, Any]], references: ReferenceSet, max_instructions: int | None = None,
                 label: str = "outputs", generator: str = "system") -> tuple[list[dict[str, Any]], dict[str, int]]:
    """AlpacaEval-format pair records (output_1 = reference, output_2 = system) and counts of what was skipped:
    ``n_unmatched`` (no reference) and ``n_extra_samples`` (more outputs of an instruction already paired: a
    generation stage may sample several; the first is judged, as AlpacaEval judges one output per instruction).
    ``max_instructions`` keeps the first N matched instructions; ``generator`` names the system where a record
    has no ``generator`` field."""
    pairs: list[dict[str, Any]] = []
    unmatched = extra = 0
    seen: set[int] = set()
    for i, record in enumerate(outputs):
        if not isinstance(record.get("instruction"), str) or not isinstance(record.get("output"), str):
            raise UserError(f"{label}: record {i} needs string fields 'instruction' and 'output'")
        reference = references.find(record["instruction"], _text(record, "input"))
        if reference is None:
            unmatched += 1
            continue
        if id(reference) in seen:
            extra += 1
            continue
        if max_instructions is not None and len(pairs) >= max_instructions:
            continue
        pairs.append({
            "instruction": reference["instruction"], "input": reference["input"],
            "output_1": reference["text"], "output_2": record["output"],
            "generator_1": references.name, "generator_2": record.get("generator") or generator,
            "dataset": reference["dataset"] or record.get("dataset"),
        })
        seen.add(id(reference))
    return pairs, {"n_unmatched": unmatched, "n_extra_samples": extra}


def annotate_and_score(pairs: list[dict[str, Any]], annotator: Any, out_dir: Path,
                       extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """Annotate ``pairs`` with ``annotator``; write ``annotations.json`` and ``metrics.json`` into ``out_dir``.

    Returns the metrics (with ``extra`` merged in, e.g. the unmatched count and the annotator's name).
    """
    from alpacafarm.console import progress_bar
    from alpacafarm.data import write_json
    from alpacafarm.types import Pair
    from alpacafarm_evaluation.metrics import metrics_from_annotations

    if not pairs:
        raise UserError("no output matched a reference instruction: nothing to evaluate")
    items = [Pair(p["instruction"], p["output_1"], p["output_2"], p["input"]) for p in pairs]
    with progress_bar("judging", len(items)) as advance:
        annotations = annotator.annotate(items, lambda n, _cost: advance(n))
    name = getattr(annotator, "name", type(annotator).__name__)
    records = []
    for pair, annotation in zip(pairs, annotations, strict=True):
        records.append({**pair, "preference": annotation.preference, "annotator": annotation.annotator or name,
                        "price_per_example": annotation.price_usd, "time_per_example": annotation.latency_s})
    metrics = metrics_from_annotations(records)
    metrics.update({"annotator": name, "reference": pairs[0]["generator_1"], **(extra or {})})
    out_dir.mkdir(parents=True, exist_ok=True)
    write_json(out_dir / "annotations.json", records)
    write_json(out_dir / "metrics.json", metrics)
    return metrics
