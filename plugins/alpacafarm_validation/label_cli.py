"""``alpacafarm label``: people label pairs in a browser; their labels validate the simulated annotators.

``alpacafarm label serve [PAIRS] [--outputs FILE ...] --dir DIR [--pairs N] [--overlap F] [--port 8765]``
    Samples the pairs (a pairs file as ``alpacafarm annotate`` takes, or systems' outputs files: each system
    against the reference answers and against each other, round-robin over the comparisons so each gets the same
    share), stores them in DIR/labels.sqlite and serves the labelling page on http://127.0.0.1:PORT/ until Ctrl-C.
    Each person signs in with their invite link (or, without invites, a name); sides are shuffled per person and
    system names hidden; ``--overlap`` is the fraction of pairs every labeller sees (default 10%, at least 20
    pairs: human-human agreement is measured on them), the others are labelled once. Every click is stored at
    once, an undo is a new event; ``alpacafarm label serve --dir DIR`` resumes a stopped (or killed) session, with
    every label and no pair shown twice to the same person. ``--guidelines FILE`` shows labelling guidelines.
    Listening beyond 127.0.0.1 (``--host``, whose printed link names this machine's address) needs invite links
    or an access token: ``--random-token`` (kept in the store, printed in the link) or ``--token-env VAR``.

``alpacafarm label invite NAME --dir DIR [--url http://HOST:PORT/]`` / ``alpacafarm label revoke NAME --dir DIR``
    A personal invite link for NAME (stored in the session, valid across restarts), or its revocation.

``alpacafarm label export --dir DIR -o HUMAN.json [--pairs-out PAIRS.json]``
    The human labels as records ``alpacafarm compare --agreement HUMAN.json`` reads (instruction, input, output_1,
    output_2, preference 1/2/0/null for a skip, labeller, choice, shown_first, reason, time, ...); ``--pairs-out``
    writes the session's pairs for ``alpacafarm annotate`` (to label them with any annotator).

``alpacafarm label report --dir DIR [--annotator NAME ...] [--annotator-labels SIM.json ...] [--plot OUT.png]``
    Agreement of each simulated annotator with the humans, human-human agreement, Cohen's kappa (each with a
    bootstrap interval), P(prefers longer), and with several systems the Spearman correlation of human and
    simulated win-rates (bootstrap interval); a warning below 20 shared pairs; printed, plotted (default
    DIR/report.png) and with ``--json`` as one object. ``--annotator`` runs a registered annotator on the labelled
    pairs (cached like any annotation; default: ``offline`` when no labels file is given); ``--annotator-labels``
    reads labels an earlier ``alpacafarm annotate`` wrote.
"""

from __future__ import annotations

import argparse
import datetime
import ipaddress
import json
import os
import secrets
import socket
from pathlib import Path
from typing import Any

from alpacafarm.errors import UserError


def parse_args(argv: list[str]) -> argparse.Namespace:
    from alpacafarm.annotation import add_annotator_options

    parser = argparse.ArgumentParser(prog="alpacafarm label", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", metavar="{serve,invite,revoke,export,report}")
    serve = commands.add_parser("serve", help="sample pairs and serve the labelling page")
    serve.add_argument("pairs_file", nargs="?", metavar="PAIRS",
                       help="pairs (instruction, input, output_1, output_2, optional generator_1/generator_2)")
    serve.add_argument("--outputs", nargs="+", metavar="FILE", help="systems' outputs files instead of PAIRS")
    serve.add_argument("--pairs", type=int, metavar="N", help="how many pairs to sample (default: all)")
    serve.add_argument("--overlap", type=float, default=None,
                       help="fraction of pairs every labeller sees (default: 10%%, and at least the report's "
                            "minimum of 20 shared pairs)")
    serve.add_argument("--labels-per-pair", type=int, default=1, help="labels wanted on each non-overlap pair")
    serve.add_argument("--lease", type=float, default=120.0, metavar="SECONDS",
                       help="how long a shown pair stays its labeller's unless their page renews it (it does while "
                            "open) before others may get it")
    serve.add_argument("--guidelines", metavar="FILE", help="labelling guidelines (markdown) shown on the page")
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on (default: this machine only)")
    serve.add_argument("--port", type=int, default=8765, help="port (0: any free one)")
    token = serve.add_mutually_exclusive_group()
    token.add_argument("--random-token", action="store_true",
                       help="require a random access token (made once, kept in the store, printed in the link)")
    token.add_argument("--token-env", metavar="VAR", help="require the access token held in environment variable VAR")
    invite = commands.add_parser("invite", help="make a personal invite link for one labeller")
    invite.add_argument("name", metavar="NAME", help="the labeller's name (their labels are stored under it)")
    invite.add_argument("--url", default="http://127.0.0.1:8765/",
                        help="the address the server prints (the link is URL?token=...)")
    revoke = commands.add_parser("revoke", help="revoke a labeller's invite link (their labels stay)")
    revoke.add_argument("name", metavar="NAME")
    export = commands.add_parser("export", help="write the human labels for alpacafarm compare --agreement")
    export.add_argument("-o", "--output", required=True, help="HUMAN.json to write")
    export.add_argument("--pairs-out", metavar="PAIRS.json", help="also write the session's pairs (for annotate)")
    report = commands.add_parser("report", help="agreement of simulated annotators with the humans")
    report.add_argument("--annotator", action="append", default=[], metavar="NAME",
                        help="run this registered annotator on the labelled pairs; repeatable")
    report.add_argument("--annotator-labels", action="append", default=[], metavar="SIM.json",
                        help="labels an annotator already gave the same pairs (alpacafarm annotate -o); repeatable")
    report.add_argument("--plot", metavar="OUT.png", help="where to draw the report (default DIR/report.png)")
    report.add_argument("--n-bootstrap", type=int, default=2000, help="bootstrap resamples of the Spearman interval")
    report.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    add_annotator_options(report)
    for sub in (serve, invite, revoke, export, report):
        sub.add_argument("--dir", required=True, type=Path, help="the session's folder (holds labels.sqlite)")
        if sub in (serve, export):  # report's --seed is the annotator options' (pool seed); the session keeps its own
            sub.add_argument("--seed", type=int, default=0, help="seed of sampling, overlap, sides and order")
    args = parser.parse_args(argv)
    if args.command is None:
        raise UserError("alpacafarm label needs a command: serve, invite, revoke, export or report (see --help)")
    return args


def main(argv: list[str]) -> int:
    """Entry point of ``alpacafarm label``."""
    args = parse_args(list(argv))
    from alpacafarm_validation.label_team_cli import cmd_invite, cmd_revoke

    commands = {"serve": cmd_serve, "invite": cmd_invite, "revoke": cmd_revoke, "export": cmd_export,
                "report": cmd_report}
    return commands[args.command](args)


# ------------------------------------------------------------------------------------------------ serve


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _token(args: argparse.Namespace, store: Any, invites: bool) -> str | None:
    """The shared access token: ``--random-token``'s (made once, kept in the store: a restart serves the same link),
    ``--token-env``'s, or none (refused beyond loopback unless the session labels by invite links)."""
    if args.random_token:
        return str(store.set_meta_once("access_token", secrets.token_urlsafe(24)))
    if args.token_env:
        value = os.environ.get(args.token_env, "")
        if len(value) < 16:
            raise UserError(f"--token-env {args.token_env}: the variable is unset or shorter than 16 characters")
        return value
    if not _is_loopback(args.host) and not invites:
        raise UserError(f"--host {args.host} shares the page beyond this machine: make invite links (alpacafarm label "
                        "invite NAME), or add --random-token or --token-env VAR, so only people with a link can label")
    return None


def _shown_host(host: str) -> str:
    """A host name teammates can open: the machine's own non-loopback address for a wildcard address."""
    if host in ("0.0.0.0", "::", ""):
        address = None
        try:  # the address this machine would use to reach the network (no packet is sent)
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
                probe.connect(("192.0.2.1", 9))
                address = probe.getsockname()[0]
        except OSError:
            pass
        if not address or ipaddress.ip_address(address).is_loopback:
            try:
                address = socket.gethostbyname(socket.gethostname())
            except OSError:
                address = None
        if address and not ipaddress.ip_address(address).is_loopback:
            return address
        return socket.gethostname()
    return f"[{host}]" if ":" in host else host


def _guidelines(path: str | None) -> str | None:
    """The guidelines file's text: UTF-8, at most 64 KB; one line naming the file otherwise."""
    if path is None:
        return None
    from alpacafarm.paths import user_path

    if not Path(path).is_file():
        raise UserError(f"--guidelines {path}: no such file")
    with user_path(Path(path), "read"):
        data = Path(path).read_bytes()
    if len(data) > 65_536:
        raise UserError(f"--guidelines {path}: {len(data)} bytes, more than 64 KB")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise UserError(f"--guidelines {path}: not UTF-8 (byte {exc.start})") from None


def _listen(host: str, port: int) -> socket.socket:
    """A listening socket bound before the server starts, so a taken port is one clear line and port 0 works."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
        sock.listen(128)  # connections made as soon as the address is printed wait here for the server
    except (OSError, OverflowError) as exc:
        sock.close()
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise UserError(f"cannot listen on {host}:{port}: {reason}") from None
    return sock


def cmd_serve(args: argparse.Namespace) -> int:
    """``alpacafarm label serve``: create or resume the session, then serve the page until Ctrl-C."""
    import uvicorn

    from alpacafarm_validation import label_identity
    from alpacafarm_validation.label_pairs import pairs_from_outputs, read_pairs, sample
    from alpacafarm_validation.label_server import make_app
    from alpacafarm_validation.label_store import LabelStore, Settings

    if args.pairs_file and args.outputs:
        raise UserError("give PAIRS or --outputs FILE ..., not both")
    if args.labels_per_pair < 1 or args.lease <= 0:
        raise UserError("--labels-per-pair must be >= 1 and --lease > 0")
    guidelines = _guidelines(args.guidelines)
    pairs = None
    source = args.pairs_file or " ".join(args.outputs or [])
    if args.pairs_file:
        pairs = sample(read_pairs(Path(args.pairs_file)), args.pairs, args.seed)
    elif args.outputs:
        pairs = sample(pairs_from_outputs([Path(p) for p in args.outputs]), args.pairs, args.seed)
    settings = Settings(seed=args.seed, overlap=args.overlap, labels_per_pair=args.labels_per_pair,
                        lease_s=args.lease, source=source)
    store = LabelStore.create_or_resume(args.dir, pairs, settings)
    invites = store.run("read it", label_identity.invite_mode, write=False)
    token = _token(args, store, invites)
    sock = _listen(args.host, args.port)
    port = sock.getsockname()[1]
    hosts = ["127.0.0.1", "localhost"] if _is_loopback(args.host) else ["*"]  # beyond loopback the token guards
    app = make_app(store, token, hosts, guidelines)
    stored = store.pairs()
    overlap = sum(p["overlap"] for p in stored)
    base = f"http://{_shown_host(args.host)}:{port}/"
    url = base + (f"?token={token}" if args.random_token else "")
    print(f"labelling {len(stored)} pairs ({overlap} shown to every labeller); labels go to "
          f"{store.path}", flush=True)
    if invites:
        print(f"labellers sign in with their invite links (`alpacafarm label invite NAME --dir {args.dir} --url "
              f"{base}` makes one); the team page is {base}team?token=<an invite token>", flush=True)
    if args.token_env:
        print(f"the page needs ?token=<value of ${args.token_env}> after the address", flush=True)
    print(f"open {url}   (Ctrl-C stops; `alpacafarm label serve --dir {args.dir}` resumes)", flush=True)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off"))
    server.run(sockets=[sock])
    return 0


# ------------------------------------------------------------------------------------------------ export


def export_records(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Stored labels as the records ``compare --agreement`` reads (canonical orientation; a skip has no label)."""
    return [{"instruction": r["instruction"], "input": r["input"], "output_1": r["output_1"],
             "output_2": r["output_2"], "generator_1": r["generator_1"], "generator_2": r["generator_2"],
             "preference": r["preference"], "labeller": r["labeller"], "pair_id": r["pair_id"],
             "choice": r["choice"], "shown_first": "output_2" if r["swapped"] else "output_1",
             "reason": r["reason"], "overlap": bool(r["overlap"]),
             "time": datetime.datetime.fromtimestamp(r["created"], datetime.timezone.utc).isoformat()}
            for r in rows]


def cmd_export(args: argparse.Namespace) -> int:
    from alpacafarm.data import write_json
    from alpacafarm.paths import check_output_file
    from alpacafarm_validation.label_store import LabelStore

    store = LabelStore.open(args.dir)
    check_output_file(args.output, "-o")
    records = export_records(store.labels())
    write_json(Path(args.output), records)
    if args.pairs_out:
        check_output_file(args.pairs_out, "--pairs-out")
        write_json(Path(args.pairs_out), [{k: p[k] for k in ("instruction", "input", "output_1", "output_2",
                                                             "generator_1", "generator_2")} | {"pair_id": p["id"]}
                                          for p in store.pairs()])
    print(json.dumps({"labels": len(records), "skipped": sum(r["preference"] is None for r in records),
                      "labellers": len({r["labeller"] for r in records}), "output": args.output}))
    return 0


# ------------------------------------------------------------------------------------------------ report


def _run_annotator(name: str, args: argparse.Namespace, rows: list[dict[str, Any]]) -> dict[Any, list[float]]:
    """Labels of annotator ``name`` on every pair the humans labelled (annotation cache as usual)."""
    from alpacafarm.annotation import AnnotationFailed, annotator_from_options
    from alpacafarm.plugins import get_registry
    from alpacafarm.types import Pair
    from alpacafarm_validation.agreement import parse_label

    unique: dict[str, dict[str, Any]] = {r["pair_id"]: r for r in rows if r["preference"] is not None}
    pairs = [Pair(r["instruction"], r["output_1"], r["output_2"], r["input"]) for r in unique.values()]
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from alpacafarm.console import console

    annotator = annotator_from_options(get_registry(), name, args)
    try:
        with Progress(TextColumn(f"{name} on the labelled pairs"), BarColumn(), MofNCompleteColumn(),
                      TimeElapsedColumn(), console=console()) as progress:
            task = progress.add_task(name, total=len(pairs))
            annotations = annotator.annotate(pairs, lambda n, cost: progress.update(task, advance=n))
    finally:
        annotator.close()
    failed = [a for a in annotations if a.outcome == "failed"]
    if failed:
        raise AnnotationFailed(f"annotator {name}: {len(failed)} of {len(pairs)} pairs failed: "
                               f"{failed[0].metadata.get('error')}")
    out: dict[Any, list[float]] = {}
    for pair, annotation in zip(pairs, annotations, strict=True):
        label = parse_label(annotation.preference, f"annotator {name}") if annotation.has_label else None
        if label is not None:
            out[(pair.instruction, pair.output_1, pair.output_2)] = [label]
    return out


def _fmt(value: float | None, scale: float = 100.0, digits: int = 1) -> str:
    return "-" if value is None else f"{value * scale:.{digits}f}"


def cmd_report(args: argparse.Namespace) -> int:
    from alpacafarm.paths import check_output_file, user_path
    from alpacafarm_validation.label_report import build_report, labels_from_file, plot
    from alpacafarm_validation.label_store import LabelStore

    store = LabelStore.open(args.dir)
    plot_path = Path(args.plot) if args.plot else args.dir / "report.png"
    check_output_file(str(plot_path), "--plot")
    rows = store.labels()
    names = args.annotator or ([] if args.annotator_labels else ["offline"])
    sims = {Path(p).name: labels_from_file(Path(p)) for p in args.annotator_labels}
    if not any(r["preference"] is not None for r in rows):
        raise UserError(f"{args.dir}: no human labels yet (skips are not labels): label some pairs first")
    for name in names:
        sims[name] = _run_annotator(name, args, rows)
    report = build_report(rows, sims, seed=store.settings().seed, n_bootstrap=args.n_bootstrap)
    with user_path(plot_path, "write"):
        plot(report, plot_path)
    report["plot"] = str(plot_path)
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    print_report(report)
    return 0


def _interval(values: list[float] | None, scale: float = 100.0, digits: int = 1) -> str:
    return "-" if not values else f"[{_fmt(values[0], scale, digits)}, {_fmt(values[1], scale, digits)}]"


def print_report(report: dict[str, Any]) -> None:
    """The report as tables, each under a line of its own (a table's own title wraps to the table's width), within
    80 columns; the 95% bootstrap intervals in a table of their own."""
    from alpacafarm.console import console, print_table

    humans, pair_rows, interval_rows = report["humans"], [], []
    human_human = report["human_human"]
    if human_human:
        pair_rows.append(["humans (held-out majority)", _fmt(human_human["agreement"]),
                          _fmt(human_human["kappa"], 1, 3), _fmt(human_human.get("p_prefer_longer")),
                          human_human["labels"]])
        interval_rows.append(["humans (held-out majority)", _interval(human_human.get("agreement_interval")),
                              _interval(human_human.get("kappa_interval"), 1, 3), human_human["pairs"]])
    else:
        pair_rows.append(["humans", "-", "-", _fmt(humans["p_prefer_longer"]), humans["labels"]])
    for name, row in report["simulators"].items():
        pair_rows.append([name, _fmt(row["agreement"]), _fmt(row["kappa"], 1, 3), _fmt(row["p_prefer_longer"]),
                          row["n_human_labels"]])
        interval_rows.append([name, _interval(row.get("agreement_interval")),
                              _interval(row.get("kappa_interval"), 1, 3), row["pairs"]])
    console().print(f"agreement with {len(humans['labellers'])} labeller(s): {humans['pairs']} pairs, "
                    f"{humans['labels']} labels, {humans['skipped']} skipped", soft_wrap=True)
    print_table("", ["annotator", "agreement %", "Cohen's κ", "P(longer) %", "labels"], pair_rows)
    if interval_rows:
        console().print("95% bootstrap intervals (resampling pairs)", soft_wrap=True)
        print_table("", ["annotator", "agreement %", "Cohen's κ", "pairs"], interval_rows)
    note = (f"human-human agreement on {human_human['pairs']} overlap pairs" if human_human
            else "no pair has labels from 2 people yet: human-human agreement needs --overlap > 0 and 2 labellers")
    console().print(f"{note}; the paper's crowd workers agreed {report['paper_human_agreement'] * 100:.1f}%",
                    soft_wrap=True)
    for warning in report.get("warnings", []):
        console().print(f"warning: {warning}")
    rates = report["win_rates"]
    if rates:
        for name, entry in rates["simulators"].items():
            interval = entry.get("spearman_interval") or [None, None]
            rho = "-" if entry["spearman"] is None else f"{entry['spearman']:.2f}"
            lo, hi = (f"{v:.2f}" if v is not None else "-" for v in interval)
            why = f" ({entry['why']})" if entry.get("why") else ""
            console().print(f"{name}: Spearman of win-rates {rho} [95% {lo}, {hi}] over {entry['n_systems']} "
                            f"systems{why}", soft_wrap=True)
        console().print("win-rates (%)" + (f", {', '.join(rates['left_out'])} left out (in every pair)"
                                           if rates["left_out"] else ""), soft_wrap=True)
        print_table("", ["system", "humans", *rates["simulators"]],
                    [[s, f"{r:.1f}", *(_fmt(e["win_rates"].get(s), 1) for e in rates["simulators"].values())]
                     for s, r in rates["humans"].items()])
    console().print(f"plot: {report['plot']}", soft_wrap=True)
