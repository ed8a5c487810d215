"""The names stages hand artifacts on under: one list (``alpacafarm.artifact_names``), the one CONTRIBUTING shows,
the one every built-in stage uses."""

from __future__ import annotations

import re

from conftest import REPO_ROOT

from alpacafarm.artifact_names import MEANINGS, ArtifactName
from alpacafarm.method import Method


def test_contributings_table_names_exactly_the_artifact_names_each_with_a_meaning():
    text = (REPO_ROOT / "CONTRIBUTING.md").read_text(encoding="utf-8")
    table = text[text.index("| name | what the artifact is | provided by |"):]
    table = table[:table.index("\n\n")]
    named = re.findall(r"^\| `(\w+)` \|", table, flags=re.M)
    assert sorted(named) == sorted(name.value for name in ArtifactName)
    assert set(MEANINGS) == set(ArtifactName) and all(MEANINGS.values())


def test_every_built_in_stage_requires_and_provides_artifact_names_only():
    from alpacafarm.plugins import get_plugins

    registry = get_plugins().registry
    known = {name.value for name in ArtifactName}
    used = {}
    for kind in ("method", "evaluator"):
        for entry in registry.entries(kind):
            cls = registry.target_class(kind, entry.name)
            if not cls.__module__.startswith("alpacafarm"):  # the built-ins: the core and alpacafarm_* plugins
                continue
            used[entry.name] = {*cls.requires, *cls.optional, cls.provides}
    assert len(used) >= 20 and {"dpo", "ppo", "win_rate", "generate_outputs"} <= set(used)
    assert {name: sorted(names - known) for name, names in used.items() if names - known} == {}


def test_names_declared_as_members_are_kept_as_plain_strings():
    class Uses(Method):
        requires = (ArtifactName.SFT_MODEL, "my_own_data")
        optional = (ArtifactName.REWARD_MODEL,)
        provides = ArtifactName.POLICY_OUTPUTS

    assert Uses.requires == ("sft_model", "my_own_data") and Uses.provides == "policy_outputs"
    assert {type(name) for name in (*Uses.requires, *Uses.optional, Uses.provides)} == {str}
    assert repr(Uses.requires[0]) == "'sft_model'"  # messages quote the name, not the enum member
