"""Hook implementations only: targets are lazy strings, so listing plugins never imports the heavy parts."""

from alpacafarm import hookimpl


@hookimpl
def register_methods(register):
    register("echo_longest", "alpacafarm_example.method:EchoLongest",
             description="toy policy: answer with the longest sentence of the reference")


@hookimpl
def register_annotators(register):
    register("prefer_longer", "alpacafarm_example.annotator:PreferLonger", description="prefers the longer output")


@hookimpl
def register_commands(register):
    register("example-hello", "alpacafarm_example.command:main", description="say hello from the example plugin")
