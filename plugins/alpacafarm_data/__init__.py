"""Built-in plugin: data preparation steps (instruction splits)."""

from alpacafarm import hookimpl


@hookimpl
def register_methods(register):
    register(
        "split_instructions",
        "alpacafarm_data.split:SplitInstructions",
        description="deduplicate instruction records and split them into train / eval files (seeded)",
    )
