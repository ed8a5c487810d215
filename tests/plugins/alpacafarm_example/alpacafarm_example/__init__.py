"""The example plugin's hook implementations: names, lazy targets and descriptions, nothing else.

Targets are ``"module:attr"`` strings, imported only when a recipe or a command uses the name, so
``alpacafarm --help`` and ``alpacafarm plugins`` never import this plugin's code (nor pydantic, torch...).
The entry point in ``pyproject.toml`` (``[project.entry-points.alpacafarm] example = "alpacafarm_example"``)
is all it takes for alpacafarm to call these hooks.
"""

from alpacafarm import hookimpl


@hookimpl
def register_methods(register):
    register("echo_longest", "alpacafarm_example.method:EchoLongest",
             description="toy policy: answer each instruction with the longest sentence of its reference")


@hookimpl
def register_annotators(register):
    register("prefer_longer", "alpacafarm_example.annotator:PreferLonger",
             description="length-bias baseline judge: prefers the longer output (ties within tie_margin)")


@hookimpl
def register_evaluators(register):
    register("length_win_rate", "alpacafarm_example.evaluator:LengthWinRate",
             description="win-rate against reference outputs, judged by the evaluation annotator; lengths")


@hookimpl
def register_commands(register):
    register("example-hello", "alpacafarm_example.command:main",
             description="say hello from the example plugin")
