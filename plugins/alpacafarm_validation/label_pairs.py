"""The pairs a labelling session shows: read from a pairs file, or built from systems' answers, then sampled.

A pairs file is what ``alpacafarm annotate`` takes: records with ``instruction``, optional ``input``,
``output_1``, ``output_2`` and, optionally, the systems that wrote them (``generator_1``, ``generator_2``, as in
AlpacaEval's annotation files). Outputs files (``instruction``, optional ``input``, ``output``, optional
``generator`` and ``reference``; what ``generate_outputs`` writes in a run) give pairs of each system against the
reference answer (when the records carry one) and of every two systems on the instructions they share.

Sampling keeps coverage comparable: pairs are grouped by the two systems they compare and drawn round-robin over
the groups (seeded), so with N pairs and G groups each group gets N/G, give or take one.
"""

from __future__ import annotations

import hashlib
import json
import random
from dataclasses import dataclass
from itertools import combinations
from pathlib import Path
from typing import Any

from alpacafarm.errors import UserError

#: The system name given to the ``reference`` answers of outputs files.
REFERENCE = "reference"


@dataclass(frozen=True)
class LabelPair:
    """One pair to label, in canonical orientation; ``id`` is a hash of its text (stable across restarts)."""

    instruction: str
    input: str
    output_1: str
    output_2: str
    generator_1: str | None = None
    generator_2: str | None = None

    @property
    def id(self) -> str:
        text = json.dumps([self.instruction, self.input, self.output_1, self.output_2], ensure_ascii=False)
        return hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]

    @property
    def group(self) -> tuple[str, ...]:
        """The systems compared (sorted), or () when the input does not name them."""
        names = [g for g in (self.generator_1, self.generator_2) if g]
        return tuple(sorted(names)) if len(names) == 2 else ()


def _text(record: dict[str, Any], key: str, where: str, required: bool) -> str | None:
    value = record.get(key)
    if value is None and not required:
        return None
    if not isinstance(value, str) or (required and key != "input" and not value.strip()):
        raise UserError(f"{where}: field {key!r} must be a non-empty string, got {value!r:.60}")
    return value


def _records(path: Path, what: str) -> list[dict[str, Any]]:
    from alpacafarm.data import read_records

    if not path.is_file():
        raise UserError(f"{what} not found: {path}")
    records = read_records(path)
    if not records:
        raise UserError(f"{path}: no records")
    return records


def read_pairs(path: Path) -> list[LabelPair]:
    """The pairs of a pairs file, first occurrence of each kept (a repeated pair would be labelled twice)."""
    out: dict[str, LabelPair] = {}
    for number, record in enumerate(_records(path, "pairs file"), start=1):
        where = f"{path}: record {number}"
        if not isinstance(record, dict):
            raise UserError(f"{where}: expected an object with instruction, output_1, output_2")
        pair = LabelPair(
            _text(record, "instruction", where, True), _text(record, "input", where, False) or "",  # type: ignore[arg-type]
            _text(record, "output_1", where, True), _text(record, "output_2", where, True),  # type: ignore[arg-type]
            _text(record, "generator_1", where, False), _text(record, "generator_2", where, False))
        out.setdefault(pair.id, pair)
    return list(out.values())


def _system_name(path: Path, records: list[dict[str, Any]]) -> str:
    names = {r.get("generator") for r in records}
    if len(names) == 1 and isinstance(next(iter(names)), str) and next(iter(names)):
        return str(next(iter(names)))
    return path.parent.name if path.stem == "outputs" else path.stem


def pairs_from_outputs(paths: list[Path]) -> list[LabelPair]:
    """Pairs of each system against the reference answers and of every two systems, from outputs files."""
    systems: dict[str, dict[tuple[str, str], str]] = {}
    references: dict[tuple[str, str], str] = {}
    for path in paths:
        records = _records(path, "outputs file")
        name = _system_name(path, records)
        if name in systems or name == REFERENCE:
            raise UserError(f"{path}: system name {name!r} is taken (by another outputs file, or the reference); "
                            "give each file its own 'generator' field or file name")
        answers: dict[tuple[str, str], str] = {}
        for number, record in enumerate(records, start=1):
            where = f"{path}: record {number}"
            key = (_text(record, "instruction", where, True), _text(record, "input", where, False) or "")
            answers[key] = _text(record, "output", where, True)  # type: ignore[index,assignment]
            reference = _text(record, "reference", where, False)
            if reference:
                references.setdefault(key, reference)  # type: ignore[arg-type]
        systems[name] = answers
    pairs = []
    for name, answers in systems.items():
        pairs += [LabelPair(key[0], key[1], references[key], answer, REFERENCE, name)
                  for key, answer in answers.items() if key in references]
    for a, b in combinations(sorted(systems), 2):
        pairs += [LabelPair(key[0], key[1], systems[a][key], systems[b][key], a, b)
                  for key in systems[a] if key in systems[b]]
    pairs = [p for p in pairs if p.output_1 != p.output_2]  # identical answers teach nothing
    if not pairs:
        raise UserError("the outputs files give no pairs: give two systems' answers to the same instructions, "
                        "or records with a 'reference' answer")
    return pairs


def sample(pairs: list[LabelPair], n: int | None, seed: int) -> list[LabelPair]:
    """``n`` pairs (all when None or more than there are), round-robin over the groups of compared systems, each
    group shuffled with ``seed``: every comparison gets the same share, give or take one."""
    if n is not None and n < 1:
        raise UserError(f"--pairs must be at least 1, got {n}")
    groups: dict[tuple[str, ...], list[LabelPair]] = {}
    for pair in pairs:
        groups.setdefault(pair.group, []).append(pair)
    rng = random.Random(seed)
    queues = []
    for key in sorted(groups):
        members = groups[key][:]
        rng.shuffle(members)
        queues.append(members)
    wanted = len(pairs) if n is None else min(n, len(pairs))
    out: list[LabelPair] = []
    while len(out) < wanted:
        for queue in queues:
            if queue and len(out) < wanted:
                out.append(queue.pop(0))
    return out
