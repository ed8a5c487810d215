"""Built-in plugin: model inspection steps."""

from alpacafarm import hookimpl


@hookimpl
def register_methods(register):
    register(
        "inspect_model",
        "alpacafarm_models.inspect_model:InspectModel",
        description="load the recipe's model, record its size and answer a few instructions greedily",
    )
