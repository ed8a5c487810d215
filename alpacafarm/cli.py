"""The ``alpacafarm`` command line.

Core commands: ``run``, ``plugins``, ``recipe check``, ``plugin new``. Plugins add more through ``register_commands``.
User errors (bad recipe, unknown name, missing file or package) print one line and exit 2; ``--debug`` adds
the traceback. Every exit status follows :mod:`alpacafarm.exit_status`. Importing this module must stay cheap: no
torch, trl or pydantic before a command needs them.
"""

from __future__ import annotations

import argparse
import json
import sys
import traceback
from collections.abc import Sequence

from alpacafarm import __version__
from alpacafarm.errors import UserError


def _add_recipe_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("recipe", help="recipe YAML file, e.g. recipes/quickstart.yaml")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override a recipe value, e.g. --set seed=3 --set stages.sft.config.learning_rate=1e-5")


def build_parser(plugin_commands: dict[str, str]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="alpacafarm",
        description="Simulate pairwise feedback, learn from it, evaluate by win-rate (AlpacaFarm on TRL).",
    )
    parser.add_argument("--version", action="version", version=f"alpacafarm {__version__}")
    parser.add_argument("--debug", action="store_true", help="show tracebacks for errors")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")

    run = commands.add_parser("run", help="run a recipe's pipeline (finished stages are skipped)")
    _add_recipe_args(run)
    run.add_argument("--output-dir", help="run directory (default: the recipe's output_dir or runs/<name>)")
    run.add_argument("--force", action="append", default=[], metavar="STAGE",
                     help="re-run STAGE (and what depends on it) even if unchanged; 'all' re-runs everything")
    run.add_argument("--plan", action="store_true",
                     help="show which stages would run, resume or be skipped, and why; run nothing")
    run.add_argument("-v", "--verbose", action="store_true",
                     help="also show library logs, warnings and progress bars (they always go to the run's run.log)")
    run.add_argument("--num-processes", type=int, metavar="N",
                     help="run on N processes through accelerate (default: the recipe's launch.num_processes or 1)")
    run.add_argument("--accelerate-config", metavar="NAME|FILE",
                     help="accelerate config: ddp (default), fsdp2, zero2, zero3, or a YAML file")

    plugins = commands.add_parser("plugins", help="list installed plugins and what each registers")
    plugins.add_argument("--json", action="store_true", help="print JSON")

    recipe = commands.add_parser("recipe", help="work with recipes")
    recipe_commands = recipe.add_subparsers(dest="recipe_command", metavar="SUBCOMMAND", required=True)
    recipe_check = recipe_commands.add_parser("check", help="validate a recipe without running it")
    _add_recipe_args(recipe_check)

    plugin = commands.add_parser("plugin", help="write a new plugin repository")
    plugin_commands_parser = plugin.add_subparsers(dest="plugin_command", metavar="SUBCOMMAND", required=True)
    plugin_new = plugin_commands_parser.add_parser(
        "new", help="scaffold a plugin: a method built from the public method helpers, its test, a benchmark "
                    "recipe and the CI gate workflow")
    plugin_new.add_argument("name", help="the plugin's distribution name, e.g. my-rerank (package my_rerank)")
    plugin_new.add_argument("--dir", default=".", help="where to create the folder NAME (default: here)")
    from alpacafarm.scaffold import KINDS as PLUGIN_TEMPLATE_KINDS  # light: no torch, no plugin loaded

    plugin_new.add_argument("--kind", default="rerank", choices=tuple(PLUGIN_TEMPLATE_KINDS),
                            help="the method it starts from: rerank (best-of-n with the reward model) or "
                                 "direct-alignment (a DPO variant on the preference pairs); default rerank")

    for name, description in sorted(plugin_commands.items()):
        # listed for --help only: main() hands a plugin command its arguments before argparse sees them
        commands.add_parser(name, help=description or f"(plugin command {name})", add_help=False)
    return parser


def cmd_run(args: argparse.Namespace) -> int:
    from alpacafarm import distributed

    if not args.plan:  # before anything is imported or loaded: library chatter goes to run.log, not the console
        from alpacafarm.library_logs import route_library_output

        route_library_output(verbose=args.verbose)
    main = True
    try:
        if not args.plan:  # one of a launcher's ranks joins the group before the recipe loads (distributed.init)
            distributed.init()
        main = distributed.is_main()
        return _run(args, main)
    except Exception as exc:
        if main:
            raise
        if args.debug:  # the main process reports every rank's failure in one line; --debug shows this rank's
            traceback.print_exc()
        return getattr(exc, "exit_code", 1)
    finally:
        distributed.shutdown()


def _run(args: argparse.Namespace, main: bool) -> int:
    from alpacafarm.console import console, print_table
    from alpacafarm.pipeline import Pipeline
    from alpacafarm.plugins import get_registry
    from alpacafarm.recipe import load_recipe

    registry = get_registry()
    loaded = load_recipe(args.recipe, args.overrides, registry)
    pipeline = Pipeline(loaded, registry, args.output_dir)
    if args.plan:
        return print_plan(pipeline, args.force)
    from alpacafarm.launch_configs import launch_settings, relaunch

    processes, config = launch_settings(args, loaded.recipe)
    if processes is not None:  # several processes asked for and not yet launched: re-launch through accelerate
        return relaunch(processes, config, sys.argv[1:] if args.argv is None else args.argv)
    outcomes = pipeline.run(force=args.force)
    if not main:
        return 0
    rows = [[o.name, o.status, f"{o.seconds:.1f}s", o.artifact.kind, o.artifact.path or ""] for o in outcomes]
    print_table(f"{loaded.recipe.name}: {pipeline.run_dir}", ["stage", "status", "time", "artifact", "path"], rows)
    console().print(f"run directory: {pipeline.run_dir} (log: run.log)", highlight=False)
    for outcome in outcomes:  # the results come last, where the eye lands
        table = outcome.artifact.table
        if table is not None:  # a stage may publish a results table (alpacafarm.artifacts.Table)
            print_table(table.title or outcome.name, table.columns, table.rows)
    return 0


def print_plan(pipeline: object, force: list[str]) -> int:
    """``run --plan``: one line per stage (name, run / resume / skip, why) on stdout; nothing runs or is written."""
    from alpacafarm.stage_wiring import input_warnings

    decisions = pipeline.plan_run(force=force)
    width = max(len(d.name) for d in decisions)
    print(f"plan for recipe {pipeline.recipe.name!r} in {pipeline.run_dir} (nothing is run):")
    for line in input_warnings(pipeline.stages):
        print(f"  warning: {line}")
    for d in decisions:
        print(f"  {d.name:<{width}}  {d.action:<6}  {d.reason}")
    running = sum(d.action != "skip" for d in decisions)
    print(f"{running} of {len(decisions)} stage(s) would run" if running else "nothing to do: every stage is skipped")
    return 0


def cmd_recipe_check(args: argparse.Namespace) -> int:
    from alpacafarm.plugins import get_registry
    from alpacafarm.recipe import load_recipe
    from alpacafarm.stage_wiring import input_warnings, plan

    registry = get_registry()
    loaded = load_recipe(args.recipe, args.overrides, registry)
    stages = plan(loaded, registry)
    print(f"ok: {args.recipe}: recipe {loaded.recipe.name!r}, {len(stages)} stage(s)")
    for stage in stages:
        wiring = ", ".join(f"{k} <- {v}" for k, v in stage.inputs.items()) or "no inputs"
        print(f"  {stage.name}: {stage.method} ({stage.plugin}); {wiring}")
    for line in input_warnings(stages):
        print(f"warning: {line}")
    return 0


def cmd_plugin_new(args: argparse.Namespace) -> int:
    from alpacafarm.scaffold import new_plugin

    root = new_plugin(args.name, args.dir, args.kind)
    print(f"plugin written: {root} (cd {root} && pip install -e '.[test]' && pytest; README.md says what is next)")
    return 0


def cmd_plugins(args: argparse.Namespace) -> int:
    from alpacafarm.plugins import load_plugins, report_failures

    loaded = load_plugins()  # not get_plugins: the listing shows a clash before the command stops on it
    report_failures(loaded)
    registers = loaded.registry.by_plugin()
    descriptions: dict[str, dict[str, dict[str, str]]] = {}
    for kind in loaded.registry.kinds():
        for entry in loaded.registry.entries(kind):
            descriptions.setdefault(entry.plugin, {}).setdefault(kind, {})[entry.name] = entry.description
    rows = [
        {"name": p.name, "distribution": p.distribution, "version": p.version, "module": p.module,
         "builtin": p.builtin, "error": p.error, "clash": p.clash, "registers": registers.get(p.name, {}),
         "descriptions": descriptions.get(p.name, {})}
        for p in loaded.plugins
    ]
    if args.json:
        print(json.dumps({"plugins": rows}, indent=2))
        return _stop_on_clash(loaded)
    from alpacafarm.console import print_table

    table_rows = []
    for row in rows:
        what = "; ".join(f"{kind}: {', '.join(names)}" for kind, names in sorted(row["registers"].items()))
        failed = f"{'CLASH' if row['clash'] else 'FAILED'}: {row['error']}"
        status = failed if row["error"] else ("built-in" if row["builtin"] else "")
        table_rows.append([row["name"], row["distribution"], row["version"], what or "-", status])
    print_table("alpacafarm plugins", ["plugin", "distribution", "version", "registers", "status"], table_rows)
    return _stop_on_clash(loaded)


def _stop_on_clash(loaded: object) -> int:
    from alpacafarm.plugins import clash_error

    clash = clash_error(loaded)
    if clash is not None:
        raise clash
    return 0


def _report_error(error: UserError, raised: BaseException, debug: bool) -> int:
    """``error: ...`` as exactly one line on stderr, key-shaped text redacted (traceback first with --debug)."""
    from alpacafarm.errors import scrub

    if debug:
        traceback.print_exception(raised)
    message = "; ".join(line.strip() for line in str(error).splitlines() if line.strip())
    print(f"error: {scrub(message)}", file=sys.stderr)
    return error.exit_code


def main(argv: Sequence[str] | None = None) -> int:
    code = _main(argv)
    from alpacafarm import distributed

    if distributed.joined_by_us():  # one of a launcher's ranks, done: exit now (see distributed.end_process)
        distributed.end_process(code)
    return code


def _main(argv: Sequence[str] | None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv
    try:
        from alpacafarm.plugins import get_registry

        rest = [a for a in argv if a != "--debug"]
        # ``plugins`` lists what is installed even when two plugins clash (it then stops on the clash itself)
        registry = get_registry() if rest[:1] != ["plugins"] else None
        plugin_commands = {e.name: e.description for e in registry.entries("command")} if registry else {}
        # plugin commands parse their own arguments, --help included
        if registry is not None and rest and rest[0] in plugin_commands:
            own = rest[1:]
            if own[:1] == ["--"]:  # ``alpacafarm compare -- --agreement ...``: the separator is not theirs
                own = own[1:]
            return int(registry.get("command", rest[0])(own) or 0)
        parser = build_parser(plugin_commands)
        args = parser.parse_args(argv)
        args.argv = argv
        if args.command is None:
            parser.print_help()
            return 0
        if args.command == "run":
            return cmd_run(args)
        if args.command == "plugins":
            return cmd_plugins(args)
        if args.command == "plugin":
            return cmd_plugin_new(args)
        return cmd_recipe_check(args)
    except UserError as exc:
        return _report_error(exc, exc, debug)
    except OSError as exc:
        # The file system's refusals (permission, read-only, disk full, a file where a folder should be) that
        # reached here without a boundary naming them: one line naming the path; anything else is a bug.
        from alpacafarm.paths import path_error

        error = path_error(exc, exc.filename, None) if exc.filename is not None else None
        if error is None:
            raise
        return _report_error(error, exc, debug)
    except KeyboardInterrupt:
        from alpacafarm.exit_status import INTERRUPTED

        print("interrupted", file=sys.stderr)
        return INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())
