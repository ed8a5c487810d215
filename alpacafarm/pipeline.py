"""The pipeline runner: a recipe → planned stages → artifacts in a run directory, with skip and resume.

The run directory's layout and checks are in :mod:`alpacafarm.run_directory`.

A stage is skipped when its manifest says ``complete``, its fingerprint (method, plugin version, the source code of
the plugin packages it runs (:mod:`alpacafarm.code_identity`), config, seed, model block, annotator, and the
identities of its inputs) is unchanged and its recorded output files are
intact (see :mod:`alpacafarm.manifest`: missing or changed files re-run the stage). Each completed stage gets a
fresh ``output_id``; downstream fingerprints include it, so re-running a stage (``--force``, changed config,
lost outputs) re-runs what depends on it. A stage interrupted mid-way is re-run with ``context.resuming = True``
(trainers resume their last readable checkpoint). Manifests store run-directory paths relative to it, so a copied
or moved run directory resumes in its new place. :meth:`Pipeline.plan_run` says what a run would do, and why.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import shutil
import time
import traceback
import uuid
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from alpacafarm.artifacts import Artifact, handoff_problem
from alpacafarm.code_identity import stage_code_identity
from alpacafarm.data import source_fingerprint, write_json
from alpacafarm.errors import UserError, did_you_mean, naming_stage
from alpacafarm.manifest import (
    MANIFEST_FORMAT,
    check_outputs,
    outside_run_path,
    record_outputs,
    recorded_output_id,
)
from alpacafarm.method import Ranks, StageContext
from alpacafarm.paths import make_dir
from alpacafarm.recipe import LoadedRecipe
from alpacafarm.registry import Registry
from alpacafarm.run_directory import (
    artifact_problem,
    check_run_directory,
    manifest_problem,
    package_versions,
    run_directory,
    run_lock,
)
from alpacafarm.seeding import stable_seed
from alpacafarm.stage_wiring import (  # noqa: F401  (re-exported: the pipeline's planning names)
    BASE_MODEL,
    EVALUATION_STAGE,
    FALLBACKS,
    PlannedStage,
    input_warnings,
    plan,
    policy_stages,
)

logger = logging.getLogger("alpacafarm")


@dataclass
class StageOutcome:
    name: str
    status: str  # "ran" | "skipped"
    seconds: float
    artifact: Artifact


@dataclass
class StageDecision:
    """What a run does with a stage (``run``, ``resume`` or ``skip``) and why, in words."""

    name: str
    action: str
    reason: str
    fingerprint: str | None = None  # None while an input is still to be produced (a plan's re-running upstream)
    previous: dict[str, Any] | None = None  # the stage's manifest, if it has one
    outputs: dict[str, Any] | None = None  # a skipped stage's output record, mtimes refreshed where content held


@dataclass(frozen=True)
class StageStart:
    """The main process's decision at a stage's start, which every rank follows: skip it (its recorded
    ``artifact``), or run or resume it with its ``seed`` under the running ``manifest`` just written."""

    action: str  # "run" | "resume" | "skip"
    artifact: Artifact | None = None  # a skipped stage's recorded artifact
    seed: int = 0
    manifest: dict[str, Any] | None = None  # the running manifest of a stage that runs

    @property
    def resuming(self) -> bool:
        return self.action == "resume"


def _digest(payload: Any) -> str:
    return hashlib.sha256(json.dumps(payload, sort_keys=True, default=str).encode()).hexdigest()


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


class Pipeline:
    """Runs planned stages in order inside one run directory."""

    def __init__(self, loaded: LoadedRecipe, registry: Registry, output_dir: str | Path | None = None) -> None:
        self.loaded = loaded
        self.recipe = loaded.recipe
        self.registry = registry
        self.stages = plan(loaded, registry)  # before anything is written: a bad recipe leaves no trace
        self.run_dir = run_directory(loaded, output_dir)

    def _input_identity(self, provider: str, outcomes: dict[str, StageOutcome]) -> tuple[str, Artifact]:
        if provider == BASE_MODEL:  # loaded with the recipe's model block, as every model folder is
            return _digest(self.recipe.model.model_dump(mode="json")), Artifact("model", self.recipe.model.name)
        if provider in self.recipe.data:
            source = self.recipe.data[provider]
            return source_fingerprint(source), Artifact("data_source", source.path, source=source)
        outcome = outcomes[provider]
        return outcome.artifact.output_id, outcome.artifact

    def _annotator_identity(self, stage: PlannedStage) -> Any:
        """The annotator a stage uses (by its ``annotator_role``), so that changing the judge re-runs it."""
        role = stage.method_cls.annotator_role
        if role is None:
            return None
        ref = self.recipe.annotator_for(role, stage.name)
        if ref is None:
            return None
        from alpacafarm.annotation import label_identity, without_run_limits

        labels = label_identity(self.registry, ref.name)  # e.g. the offline judge's weights
        judge = without_run_limits(ref.model_dump(mode="json"))  # a budget is not part of what a stage computes
        return judge if labels is None else {**judge, "labels": labels}

    def _check_force(self, force: tuple[str, ...] | list[str]) -> None:
        names = [s.name for s in self.stages]
        for name in force:
            if name != "all" and name not in names:
                raise UserError(f"--force {name}: no such stage{did_you_mean(name, names)} "
                                f"(stages: {', '.join(names)})")

    def _fingerprint_parts(self, stage: PlannedStage, identities: dict[str, str | None]) -> dict[str, Any]:
        """What a stage's fingerprint hashes (its digest is the fingerprint; the parts say what changed)."""
        return {
            "method": stage.method, "plugin": stage.plugin, "config": stage.raw_config, "seed": self.recipe.seed,
            "plugin_version": self.registry.plugin_versions.get(stage.plugin),
            "model": self.recipe.model.model_dump(mode="json") if self.recipe.model else None,
            "inputs": identities, "annotator": self._annotator_identity(stage),
            "code": stage_code_identity(stage.method_cls, self.recipe, self.registry, stage.name),
        }

    def _read_manifest(self, stage: PlannedStage) -> dict[str, Any] | None:
        path = self.run_dir / "stages" / stage.name / "manifest.json"
        try:
            manifest = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else None
        except (OSError, ValueError, RecursionError) as exc:  # write_json is atomic: only a hand edit lands here
            logger.warning("stage %s: unreadable manifest %s (%s): the stage runs again", stage.name, path, exc)
            return None
        if isinstance(manifest, dict) and manifest.get("format", MANIFEST_FORMAT) != MANIFEST_FORMAT:
            # another version's manifest: never read as this one's, never run over (its stage folder is deleted)
            raise UserError(f"{path} is of manifest format {json.dumps(manifest['format'])[:40]}, not "
                            f"{MANIFEST_FORMAT} (another alpacafarm version wrote it): delete {path.parent} to run "
                            "the stage again")
        problem = manifest_problem(manifest)
        if problem is not None:
            logger.warning("stage %s: manifest %s %s: the stage runs again", stage.name, path, problem)
            return None
        outside = outside_run_path(manifest, self.run_dir)
        if outside is not None:  # never "intact", never re-run over: the next stage would read a file no one checks
            where, value = outside
            raise UserError(f"{path}: {where} names {value[:200]!r}, outside the run folder {self.run_dir}; a "
                            "manifest's paths stay inside its run folder (an edited or copied-in manifest?): restore "
                            f"it, or delete {path.parent} to run the stage again")
        return manifest

    def _decide(self, stage: PlannedStage, parts: dict[str, Any], previous: dict[str, Any] | None,
                force: set[str]) -> StageDecision:
        """Whether a stage runs, resumes or is skipped, and why. Checks recorded outputs of a finished stage."""
        pending = [r for r, identity in parts["inputs"].items() if identity is None]
        fingerprint = None if pending else _digest(parts)

        def decision(action: str, reason: str, outputs: dict[str, Any] | None = None) -> StageDecision:
            return StageDecision(stage.name, action, reason, fingerprint, previous, outputs)

        if previous is None:
            return decision("run", "never run")
        if pending:
            return decision("run", "fingerprint changed: " + ", ".join(
                f"input {r} (stage {stage.inputs[r]!r} re-runs)" for r in pending))
        if previous.get("fingerprint") != fingerprint:
            return decision("run", "fingerprint changed: " + ", ".join(_changed_parts(previous, parts, stage)))
        if previous.get("status") == "running":
            return decision("resume", "interrupted earlier: resumes")
        if {"all", stage.name} & force:
            return decision("run", "forced (--force)")
        if previous.get("status") != "complete":
            return decision("run", f"status {previous.get('status')!r}")
        problems, outputs = check_outputs(previous["outputs"], self.run_dir)
        if problems:
            return decision("run", "outputs " + "; ".join(problems))
        return decision("skip", "unchanged, outputs intact", outputs)

    def plan_run(self, force: tuple[str, ...] | list[str] = ()) -> list[StageDecision]:
        """What :meth:`run` would do with each stage, and why; runs nothing and writes nothing."""
        self._check_force(force)
        decisions: list[StageDecision] = []
        manifests: dict[str, dict[str, Any] | None] = {}
        for stage in self.stages:
            identities: dict[str, str | None] = {}
            for requirement, provider in stage.inputs.items():
                if provider in manifests:  # an earlier stage: its recorded output, unless it will run again
                    earlier = next(d for d in decisions if d.name == provider)
                    identities[requirement] = (recorded_output_id(manifests[provider])
                                               if earlier.action == "skip" else None)
                else:
                    identities[requirement] = self._input_identity(provider, {})[0]
            manifests[stage.name] = self._read_manifest(stage)
            decisions.append(self._decide(stage, self._fingerprint_parts(stage, identities),
                                          manifests[stage.name], set(force)))
        return decisions

    def run(self, force: tuple[str, ...] | list[str] = ()) -> list[StageOutcome]:
        """Run the stages. Under several processes every rank calls this: the main process decides, writes and
        logs; every rank runs the stages whose method has ``ranks = Ranks.ALL``; ranks agree after each step (see
        :mod:`alpacafarm.distributed`: a failure on one rank stops every rank, naming it)."""
        from alpacafarm import distributed
        from alpacafarm.console import console
        from alpacafarm.hardware import precision_line

        distributed.init()
        self._check_force(force)
        self._check_processes()
        main = distributed.is_main()
        handler: logging.Handler | None = None
        try:
            with contextlib.ExitStack() as stack:
                with distributed.agree("run setup"):
                    if main:
                        check_run_directory(self.run_dir)
                        make_dir(self.run_dir, "run directory")
                        # The lock first: a run refused because another one holds the directory writes nothing
                        # into it (no run.log line, no error.log).
                        stack.enter_context(run_lock(self.run_dir))
                        history = self._read_run_info()
                        handler = logging.FileHandler(self.run_dir / "run.log", encoding="utf-8")
                        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
                        logger.addHandler(handler)
                        logger.setLevel(logging.INFO)
                        self._write_run_files(history)
                        if distributed.world_size() > 1:
                            logger.info("running on %d processes (world size %d); rank 0 writes the run directory",
                                        distributed.world_size(), distributed.world_size())
                        model = self.recipe.model
                        if model is not None:
                            line = precision_line(model.dtype, model.inference_dtype, model.device)
                            logger.info(line)
                            console().print(line, highlight=False, markup=False, soft_wrap=True)
                        for line in input_warnings(self.stages):
                            logger.warning(line)
                            console().print(f"warning: {line}", style="yellow", highlight=False, markup=False,
                                            soft_wrap=True)
                return self._run_stages(set(force))
        except BaseException as exc:
            if handler is not None:  # the main process, its run directory made and locked
                with contextlib.suppress(OSError):  # a full disk must not hide the error that stopped the run
                    (self.run_dir / "error.log").write_text(f"{_now()}\n{traceback.format_exc()}", encoding="utf-8")
                if isinstance(exc, KeyboardInterrupt):
                    logger.error("run interrupted (Ctrl-C): the stage that was running resumes on the next run")
                else:
                    logger.error("run failed: %s", str(exc) or type(exc).__name__)
            raise
        finally:
            if handler is not None:
                logger.removeHandler(handler)
                handler.close()

    def _check_processes(self) -> None:
        """Under several processes, refuse (on every rank alike, before anything runs) a stage whose method
        cannot run on them yet."""
        from alpacafarm import distributed

        world = distributed.world_size()
        for stage in self.stages:
            if world > 1 and stage.method_cls.ranks is Ranks.SINGLE_PROCESS:
                raise UserError(f"stage {stage.name!r} (method {stage.method}) does not run on {world} processes "
                                "yet; run this recipe without --num-processes")

    def _read_run_info(self) -> list[Any]:
        """The command history of ``run.json`` (empty for a new run directory); a damaged file is one line."""
        info_path = self.run_dir / "run.json"
        if not info_path.exists():
            return []
        try:
            info = json.loads(info_path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            problem = "empty" if info_path.is_file() and not info_path.stat().st_size else f"unreadable ({exc})"
            raise UserError(f"{info_path}: {problem}; it records this run directory: restore it, or delete it to "
                            "start its history again") from None
        if not isinstance(info, dict) or not isinstance(info.get("history", []), list):
            raise UserError(f"{info_path}: not a run record (expected a JSON object with a 'history' list); "
                            "restore it, or delete it to start its history again")
        return list(info.get("history", []))

    def _write_run_files(self, history: list[Any]) -> None:
        import yaml

        from alpacafarm.errors import redact_secrets

        info_path = self.run_dir / "run.json"  # first: run.json is what marks a run directory (see below)
        history.append({"started_at": _now(), "recipe": str(self.loaded.path)})
        plugins = sorted({s.plugin for s in self.stages})
        write_json(info_path, {"recipe": self.recipe.name, "seed": self.recipe.seed, "plugins": plugins,
                               "versions": package_versions(), "history": history})
        (self.run_dir / "recipe.yaml").write_text(
            yaml.safe_dump(redact_secrets(self.loaded.resolved()), sort_keys=False), encoding="utf-8")

    def _run_stages(self, force: set[str]) -> list[StageOutcome]:
        from alpacafarm import distributed

        outcomes: dict[str, StageOutcome] = {}
        for stage in self.stages:
            inputs, identities = {}, {}
            for requirement, provider in stage.inputs.items():
                identities[requirement], inputs[requirement] = self._input_identity(provider, outcomes)
            where = f"stage {stage.name!r}"
            # The main process decides (it reads the manifests) and every rank follows its decision.
            start = distributed.run_on_main(lambda s=stage, i=identities: self._start_stage(s, i, force), where)
            if start.action == "skip":
                assert start.artifact is not None
                outcomes[stage.name] = StageOutcome(stage.name, "skipped", 0.0, start.artifact)
                continue
            context = StageContext(stage=stage.name, stage_dir=self.run_dir / "stages" / stage.name,
                                   run_dir=self.run_dir, seed=start.seed, inputs=inputs, recipe=self.recipe,
                                   registry=self.registry, resuming=start.resuming, ranks=stage.method_cls.ranks,
                                   annotator_configs=dict(self.loaded.annotator_configs))
            started = time.perf_counter()
            if stage.method_cls.ranks is Ranks.ALL:
                artifact = None
                with distributed.agree(where):
                    artifact = self._run_method(stage, context)
            else:  # a method that knows nothing of ranks runs once; the others wait for its artifact
                artifact = distributed.run_on_main(lambda s=stage, c=context: self._run_method(s, c), where)
            seconds = time.perf_counter() - started
            artifact = distributed.run_on_main(
                lambda s=stage, a=artifact, m=start.manifest, t=seconds: self._finish_stage(s, a, m, t), where)
            outcomes[stage.name] = StageOutcome(stage.name, "ran", seconds, artifact)
        return list(outcomes.values())

    def _start_stage(self, stage: PlannedStage, identities: dict[str, str], force: set[str]) -> StageStart:
        """On the main process: skip the stage (its artifact) or prepare its folder and running manifest."""
        from alpacafarm import distributed
        from alpacafarm.console import console
        from alpacafarm.errors import redact_secrets

        stage_dir = self.run_dir / "stages" / stage.name
        manifest_path = stage_dir / "manifest.json"
        previous = self._read_manifest(stage)
        parts = self._fingerprint_parts(stage, identities)
        decision = self._decide(stage, parts, previous, force)
        fingerprint = decision.fingerprint
        if decision.action == "skip":
            assert previous is not None
            artifact = Artifact.from_json(previous["artifact"], self.run_dir)
            outputs = decision.outputs if decision.outputs is not None else record_outputs(artifact, self.run_dir)
            if outputs != previous.get("outputs"):  # new mtimes of intact files
                write_json(manifest_path, {**previous, "outputs": outputs, "artifact": artifact.to_json(self.run_dir)})
            console().print(f"[dim]• {stage.name}: unchanged, skipped[/dim]")
            logger.info("stage %s skipped (fingerprint %s)", stage.name, fingerprint[:12])
            return StageStart("skip", artifact=artifact)
        logger.info("stage %s: %s", stage.name, decision.reason)
        resuming = decision.action == "resume"
        if stage_dir.exists() and not resuming:
            shutil.rmtree(stage_dir)  # stale output of another configuration: never mix the two
        stage_dir.mkdir(parents=True, exist_ok=True)
        seed = stable_seed(self.recipe.seed, stage.name)
        manifest = {
            "format": MANIFEST_FORMAT, "stage": stage.name, "method": stage.method, "plugin": stage.plugin,
            "status": "running", "fingerprint": fingerprint,
            "fingerprint_parts": {k: _digest(v) for k, v in parts.items() if k != "inputs"},
            "seed": seed, "recipe_seed": self.recipe.seed, "config": redact_secrets(stage.raw_config),
            "inputs": {r: {"from": stage.inputs[r], "id": identities[r]} for r in stage.inputs},
            "versions": package_versions(), "recipe": redact_secrets(self.loaded.resolved()), "started_at": _now(),
            "world_size": distributed.world_size(),
            "ranks_ran": distributed.world_size() if stage.method_cls.ranks is Ranks.ALL else 1,
        }
        write_json(manifest_path, manifest)
        why = "" if decision.reason == "never run" else f" — {decision.reason}"
        console().print(f"[bold]▶ {stage.name}[/bold] ({stage.method}){why}", highlight=False, markup=True)
        logger.info("stage %s started (method %s, resuming=%s, on %d of %d processes)", stage.name, stage.method,
                    resuming, manifest["ranks_ran"], manifest["world_size"])
        return StageStart(decision.action, seed=seed, manifest=manifest)

    def _run_method(self, stage: PlannedStage, context: StageContext) -> Artifact:
        with naming_stage(stage.name):  # any error the method raises, a shared helper's included, names the stage
            artifact = self.registry.create(stage.kind, stage.method, stage.config).run(context)
        if not isinstance(artifact, Artifact):
            raise UserError(f"stage {stage.name!r}: method {stage.method!r} of plugin {stage.plugin!r} returned "
                            f"{type(artifact).__name__}, not an Artifact")
        return artifact

    def _finish_stage(self, stage: PlannedStage, artifact: Artifact, manifest: dict[str, Any],
                      seconds: float) -> Artifact:
        """On the main process: check the stage's declared outputs, record them and mark its manifest complete."""
        # never "complete" with outputs or hand-offs the next stage cannot read: refused here, in the stage's name
        problem = artifact_problem(artifact, self.run_dir) or handoff_problem(artifact, stage.method_cls.produces,
                                                                             self.run_dir)
        if problem is not None:
            raise UserError(f"stage {stage.name!r}: method {stage.method!r} of plugin {stage.plugin!r} returned "
                            f"a {artifact.kind} artifact whose {problem}; the stage is not recorded complete")
        artifact.output_id = uuid.uuid4().hex
        manifest.update(status="complete", finished_at=_now(), duration_s=round(seconds, 3),
                        artifact=artifact.to_json(self.run_dir), outputs=record_outputs(artifact, self.run_dir))
        write_json(self.run_dir / "stages" / stage.name / "manifest.json", manifest)
        logger.info("stage %s complete in %.1fs", stage.name, seconds)
        return artifact


def _changed_parts(previous: dict[str, Any], parts: dict[str, Any], stage: PlannedStage) -> list[str]:
    """Which parts of a fingerprint differ from those a manifest recorded."""
    stored = previous.get("fingerprint_parts")
    stored = stored if isinstance(stored, dict) else {}
    changed = [k for k in parts if k != "inputs" and stored.get(k) != _digest(parts[k])]
    recorded = {r: (i or {}).get("id") for r, i in (previous.get("inputs") or {}).items()}
    for requirement in sorted(set(recorded) | set(parts["inputs"])):
        if recorded.get(requirement) != parts["inputs"].get(requirement):
            changed.append(f"input {requirement}" + (f" (from {stage.inputs[requirement]!r})"
                                                     if requirement in stage.inputs else " (no longer wired)"))
    return changed or ["the recorded fingerprint (every recorded part matches: an edited manifest?)"]
