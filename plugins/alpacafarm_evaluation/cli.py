"""``alpacafarm evaluate`` and ``alpacafarm leaderboard``.

* ``alpacafarm evaluate --annotations FILE [--json]``: win-rate metrics of judged pairs (AlpacaEval format).
* ``alpacafarm evaluate --outputs FILE --annotator NAME [--references SOURCE] [-o DIR] [--json]``: pair a
  system's outputs with reference outputs, judge them, write ``annotations.json`` and ``metrics.json``.
* ``alpacafarm leaderboard INPUTS... -o OUT_PREFIX``: gather results into CSV, JSON and a bar plot.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from alpacafarm.annotation import add_annotator_options
from alpacafarm.errors import UserError
from alpacafarm.paths import make_dir


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="alpacafarm evaluate", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    what = parser.add_mutually_exclusive_group(required=True)
    what.add_argument("--annotations", help="judged pairs (JSON list): preference, output_1 = reference, output_2")
    what.add_argument("--outputs", help="a system's outputs (JSON/JSONL): instruction, optional input, output")
    what.add_argument("--model", help="a model (hub ID, folder or offline alias): generate outputs for the "
                      "reference instructions, then evaluate them")
    parser.add_argument("--annotator", help="a registered annotator (see: alpacafarm plugins); needed with --outputs")
    parser.add_argument("--references", help="reference outputs: a JSON/JSONL file (instruction, input, "
                        "reference or output) or a builtin dataset name (default: builtin alpaca_eval_sample)")
    parser.add_argument("--reference-field", default="reference", help="field holding the reference text")
    parser.add_argument("-o", "--output-dir", help="where annotations.json and metrics.json go "
                        "(default: <outputs folder>/<annotator>/, AlpacaEval's layout)")
    parser.add_argument("--max-instructions", type=int, help="evaluate only the first N matched instructions")
    parser.add_argument("--max-unlabelled-fraction", type=float, default=0.05, metavar="F",
                        help="fail (exit 1) when more than this share of the pairs got no label from the judge "
                             "(failed or unparsed); what was answered is cached (default: 0.05)")
    parser.add_argument("--json", action="store_true", help="print exactly one JSON object on stdout")
    parser.add_argument("--prompt-format", default="chat_template", choices=["alpaca", "chat_template"],
                        help="with --model: how instructions become prompts")
    parser.add_argument("--max-new-tokens", type=int, default=256, help="with --model: answer length cap")
    parser.add_argument("--temperature", type=float, default=0.0, help="with --model: 0 = greedy")
    parser.add_argument("--backend", default="transformers", help="with --model: the generation backend")
    parser.add_argument("--backend-config", metavar="YAML", default="{}",
                        help="with --model: the backend's options as a YAML mapping, e.g. '{base_url: ...}'")
    add_annotator_options(parser)  # the same annotator options as ``alpacafarm annotate``
    args = parser.parse_args(argv)
    if args.max_instructions is not None and args.max_instructions < 1:
        parser.error("--max-instructions must be at least 1")
    from alpacafarm.sampling import generation_size_problem

    problem = generation_size_problem(1, args.max_new_tokens)  # the recipes' bound (SamplingConfig's)
    if problem is not None:
        raise UserError(f"--{problem.replace('_', '-', 2)}")
    return args


def _report(metrics: dict[str, Any], title: str, as_json: bool) -> None:
    """Print the metrics: one JSON object on stdout, or a rich table on stderr."""
    if as_json:
        print(json.dumps(metrics, sort_keys=True))
        return
    from alpacafarm.console import print_table
    from alpacafarm_evaluation.metrics import metrics_table

    table = metrics_table(metrics, title)
    print_table(table["title"], table["columns"], table["rows"])


def _read(path_text: str, what: str) -> list[dict[str, Any]]:
    from alpacafarm.data import read_records

    path = Path(path_text)
    if path.is_dir():
        raise UserError(f"{what} file {path} is a directory; give a file")
    if not path.is_file():
        raise UserError(f"{what} file not found: {path}")
    return read_records(path)


def evaluate_annotations(path_text: str) -> dict[str, Any]:
    """Metrics of a file of judged pairs; UserError naming the file for a bad record."""
    from alpacafarm_evaluation.metrics import metrics_from_annotations

    records = _read(path_text, "annotations")
    if not records:
        raise UserError(f"{path_text}: no annotations")
    try:
        return metrics_from_annotations(records)
    except ValueError as exc:
        raise UserError(f"{path_text}: {exc}") from None


def evaluate_outputs(args: argparse.Namespace) -> dict[str, Any]:
    """Pair, annotate and score an outputs file; returns the metrics (paths of the written files included)."""
    from alpacafarm_evaluation.pairing import annotate_and_score, load_references, pair_outputs

    if not args.annotator:
        raise UserError("--outputs needs --annotator NAME (e.g. --annotator offline)")
    from alpacafarm.annotation import annotator_from_options, check_unlabelled
    from alpacafarm.plugins import get_registry
    from alpacafarm_evaluation.evaluator import RecordingAnnotator

    registry = get_registry()
    registry.entry("annotator", args.annotator)  # fail on an unknown name before reading anything
    outputs = _read(args.outputs, "outputs")
    references = load_references(args.references, args.reference_field)
    pairs, skipped = pair_outputs(outputs, references, args.max_instructions, args.outputs,
                                  generator=Path(args.outputs).stem)
    if skipped["n_unmatched"] or skipped["n_extra_samples"]:
        from alpacafarm.console import console

        console().print(f"[yellow]skipped {skipped['n_unmatched']} of {len(outputs)} outputs without a reference "
                        f"instruction and {skipped['n_extra_samples']} extra samples of paired instructions[/yellow]")
    out_dir = Path(args.output_dir) if args.output_dir else Path(args.outputs).resolve().parent / args.annotator
    make_dir(out_dir, "output directory")  # before anything is judged (and paid for)
    annotator = RecordingAnnotator(annotator_from_options(registry, args.annotator, args))
    try:
        metrics = annotate_and_score(pairs, annotator, out_dir, {**skipped, "outputs": str(args.outputs)})
        outcomes = check_unlabelled(annotator.last, args.max_unlabelled_fraction, f"judge {annotator.name!r}")
        metrics["n_failed"] = outcomes.failed
    finally:
        annotator.close()
    metrics["annotations_path"] = str(out_dir / "annotations.json")
    metrics["metrics_path"] = str(out_dir / "metrics.json")
    return metrics


def generate_model_outputs(args: argparse.Namespace) -> str:
    """Sample ``args.model``'s answers to the reference instructions; returns the outputs file it wrote."""
    import yaml

    from alpacafarm.generation import SamplingConfig, generate_records, write_completions
    from alpacafarm.library_logs import name_deepspeed_accelerator
    from alpacafarm.plugins import get_registry
    from alpacafarm.recipe import ModelSpec
    from alpacafarm.yamlsource import yaml_value
    from alpacafarm_evaluation.pairing import load_references

    name_deepspeed_accelerator()  # stdout is --json's: DeepSpeed's "Setting accelerator to CPU" must not reach it

    if not args.annotator:
        raise UserError("--model needs --annotator NAME (e.g. --annotator offline)")
    references = load_references(args.references, args.reference_field)
    records = [{"instruction": r["instruction"], "input": r["input"], "dataset": r["dataset"]}
               for r in references.records[: args.max_instructions]]
    spec = ModelSpec(name=args.model, prompt_format=args.prompt_format)
    try:
        backend_config = yaml_value(args.backend_config, "--backend-config")  # bounded: no alias bomb
    except yaml.YAMLError as exc:
        raise UserError(f"--backend-config is not YAML: {str(exc).splitlines()[0]}") from None
    generator = get_registry().create("generation_backend", args.backend, backend_config or None, spec=spec,
                                      model_path=args.model, path=("--backend-config",))
    sampling = SamplingConfig(temperature=args.temperature, max_new_tokens=args.max_new_tokens)
    from alpacafarm.console import progress_bar

    with progress_bar(f"generating ({args.model})", len(records)) as advance:
        rows = generate_records(generator, records, sampling, progress=advance)
    generator.close()
    name = Path(args.model).name or args.model
    out_dir = Path(args.output_dir) if args.output_dir else Path("runs") / "evaluate" / name
    path = out_dir / "outputs.jsonl"
    write_completions(path, [{**row, "generator": name} for row in rows])
    if not args.output_dir:
        args.output_dir = str(out_dir / args.annotator)
    return str(path)


def main(argv: list[str]) -> int:
    """``alpacafarm evaluate``: returns the exit status."""
    args = parse_args(argv)
    if args.output_dir and not args.annotations:  # a file in the way fails now, not after generating and judging
        make_dir(args.output_dir, "output directory")
    if args.model:
        args.outputs = generate_model_outputs(args)
    if args.annotations:
        metrics = evaluate_annotations(args.annotations)
        title = f"{metrics.get('generator') or Path(args.annotations).parent.name}: win-rate vs reference"
    else:
        metrics = evaluate_outputs(args)
        title = f"{metrics.get('generator') or 'system'} vs {metrics['reference']} (judge: {metrics['annotator']})"
    if metrics["n_total"] == 0:
        raise UserError("no parsed preference: every annotation is unparsed, no win-rate")
    _report(metrics, title, args.json)
    return 0


def leaderboard_main(argv: list[str]) -> int:
    """``alpacafarm leaderboard INPUTS... -o OUT_PREFIX``: returns the exit status."""
    from alpacafarm_evaluation.leaderboard import build_leaderboard, show_leaderboard, write_leaderboard

    parser = argparse.ArgumentParser(prog="alpacafarm leaderboard", description="gather evaluation results "
                                     "(metrics.json, run directories, AlpacaEval annotations.json) into one table")
    parser.add_argument("inputs", nargs="+", help="metrics.json / annotations.json files or run directories "
                        "(a run that evaluated several systems gives one row per system)")
    parser.add_argument("-o", "--output", required=True, metavar="OUT_PREFIX",
                        help="writes OUT_PREFIX.csv, OUT_PREFIX.json and OUT_PREFIX.png")
    parser.add_argument("--json", action="store_true", help="print the rows as one JSON object on stdout")
    args = parser.parse_args(argv)
    rows = build_leaderboard(args.inputs)
    written = write_leaderboard(rows, args.output)
    if args.json:
        print(json.dumps({"rows": rows, "files": written}))
    else:
        show_leaderboard(rows, written)
    return 0
