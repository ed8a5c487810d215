"""``alpacafarm plugin new NAME [--kind KIND]``: a plugin repository that works at once.

It writes, from the templates in ``alpacafarm/plugin_template/`` (shipped in the package):

* ``pyproject.toml`` — the distribution ``NAME`` and its entry point of group ``alpacafarm``;
* ``<package>/__init__.py`` and ``<package>/method.py`` — the hooks and a method with its config class, registered
  as ``<package>``: by :data:`KINDS`, ``rerank`` (best-of-n reranking with the reward model, built from
  :mod:`alpacafarm.reward_selection`) or ``direct-alignment`` (a DPO variant, robust DPO for a known label-flip
  rate, built from :mod:`alpacafarm.preference_training`; its templates are in ``plugin_template/direct_alignment/``);
* ``tests/test_method.py`` — its test on tiny random-init models (:mod:`alpacafarm.testing`);
* ``benchmarks/bench.yaml`` — a benchmark recipe for ``alpacafarm bench`` (``include: alpacafarm:offline``);
* ``.github/workflows/benchmark.yml`` — the CI gate; ``README.md``; ``.gitignore``.

``<package>`` is ``NAME`` with dashes as underscores. The folder must not exist yet (or be empty): nothing is
ever overwritten.
"""

from __future__ import annotations

import keyword
import re
import sys
from pathlib import Path

from alpacafarm import __version__
from alpacafarm.errors import UserError
from alpacafarm.paths import make_dir, user_path

TEMPLATE_DIR = Path(__file__).parent / "plugin_template"
NAME_PATTERN = re.compile(r"^[a-z][a-z0-9]*(?:[-_][a-z0-9]+)*$")

#: template file → where it goes in the new repository (``{package}`` is the package name)
FILES = {
    "pyproject.toml.tmpl": "pyproject.toml",
    "README.md.tmpl": "README.md",
    "gitignore.tmpl": ".gitignore",
    "__init__.py.tmpl": "{package}/__init__.py",
    "method.py.tmpl": "{package}/method.py",
    "test_method.py.tmpl": "tests/test_method.py",
    "bench.yaml.tmpl": "benchmarks/bench.yaml",
    "benchmark-workflow.yml": ".github/workflows/benchmark.yml",
}

#: kind → (the template folder of its kind-specific files, what its method is, where to start changing it)
KINDS = {
    "rerank": ("", "best-of-n reranking with the reward model, built from `alpacafarm.reward_selection`",
               "change `Rerank.run` to make it yours"),
    "direct-alignment": ("direct_alignment", "a DPO variant (robust DPO for a known label-flip rate), built from "
                         "`alpacafarm.preference_training`",
                         "change `RobustDPOConfig` or `RobustDPO` to make it yours"),
}
#: the templates each kind has its own copy of (the others are shared)
KIND_FILES = ("__init__.py.tmpl", "method.py.tmpl", "test_method.py.tmpl", "bench.yaml.tmpl")


def package_name(name: str) -> str:
    """The importable package of plugin ``name`` (dashes become underscores); a bad name is a one-line error."""
    if not NAME_PATTERN.match(name):
        raise UserError(f"plugin name {name!r}: use lower-case letters, digits and single dashes or underscores, "
                        "starting with a letter (e.g. my-rerank)")
    package = name.replace("-", "_")
    if keyword.iskeyword(package) or package == "alpacafarm":
        raise UserError(f"plugin name {name!r}: {package!r} cannot be a package name; pick another")
    taken = name_in_use(name, package)
    if taken:  # once installed, one of the two would shadow the other: the plugin would silently never load
        raise UserError(f"plugin name {name!r}: {taken}; pick another (e.g. {name}-plugin)")
    return package


def _normalized(name: str) -> str:
    """A distribution name as packaging compares them (PEP 503): case and runs of -_. do not matter."""
    return re.sub(r"[-_.]+", "-", name).lower()


def name_in_use(name: str, package: str) -> str | None:
    """Why ``name`` (distribution) or ``package`` (module) is already taken here, or None: an installed
    distribution of that name, a standard-library or built-in module, or any importable top-level module."""
    import importlib.metadata
    import importlib.util

    wanted = {_normalized(name), _normalized(package)}
    for dist in importlib.metadata.distributions():
        dist_name = dist.metadata["Name"] or ""
        if _normalized(dist_name) in wanted:
            return f"the installed distribution {dist_name!r} already has that name"
    if package in sys.stdlib_module_names or package in sys.builtin_module_names:
        return f"{package!r} is a standard-library module"
    try:
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError):
        spec = None
    if spec is not None:
        where = f" ({spec.origin})" if spec.origin and spec.origin not in ("built-in", "frozen") else ""
        return f"an importable module {package!r} already exists{where}"
    return None


def new_plugin(name: str, parent: str | Path = ".", kind: str = "rerank") -> Path:
    """Write the plugin repository ``parent/name`` with a method of ``kind`` (:data:`KINDS`); return its folder."""
    if kind not in KINDS:
        raise UserError(f"plugin new: unknown kind {kind!r}; choose one of {', '.join(KINDS)}")
    folder, what, start = KINDS[kind]
    package = package_name(name)
    root = Path(parent) / name
    if root.exists() and (not root.is_dir() or any(root.iterdir())):
        raise UserError(f"plugin new: {root} already exists and is not an empty folder; nothing was written")
    values = {"__PACKAGE__": package, "__DIST__": name, "__ALPACAFARM_VERSION__": __version__, "__WHAT__": what,
              "__START__": start}
    for template, target in FILES.items():
        source = TEMPLATE_DIR / folder / template if template in KIND_FILES else TEMPLATE_DIR / template
        text = source.read_text(encoding="utf-8")
        if template.endswith(".tmpl"):  # the workflow is copied as it is: its ${{ }} are GitHub's
            for key, value in values.items():
                text = text.replace(key, value)
        path = root / target.format(package=package)
        make_dir(path.parent, "plugin folder")
        with user_path(path, "write plugin file"):
            path.write_text(text, encoding="utf-8")
    return root
