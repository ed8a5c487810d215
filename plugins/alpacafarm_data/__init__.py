"""Built-in plugin: data preparation steps (instruction splits, pairwise preference data)."""

from alpacafarm import hookimpl


@hookimpl
def register_methods(register):
    register(
        "split_instructions",
        "alpacafarm_data.split:SplitInstructions",
        description="deduplicate instruction records and split them into train / eval files (seeded)",
    )
    register(
        "preference_data",
        "alpacafarm_data.preferences:PreferenceData",
        description="sample k outputs per instruction from the SFT model, pair them, label them with the annotator",
    )
