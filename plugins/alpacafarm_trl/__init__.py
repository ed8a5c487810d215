"""Built-in plugin: the methods that wrap TRL trainers (SFT, reward model) and reward-model scoring.

Targets are lazy strings: TRL takes seconds to import, so it is loaded only when a recipe names one of these.
"""

from alpacafarm import hookimpl


@hookimpl
def register_methods(register):
    register("sft", "alpacafarm_trl.sft:SFT",
             description="supervised fine-tuning on demonstrations (TRL SFTTrainer, response-only loss)")
    register("reward_model", "alpacafarm_trl.reward_model:RewardModel",
             description="Bradley-Terry reward model on pairwise preferences, initialised from the SFT model")
