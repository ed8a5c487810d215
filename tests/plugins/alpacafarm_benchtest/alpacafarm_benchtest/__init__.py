"""Hook implementations of the gate's test plugin: lazy targets, nothing imported until used."""

from alpacafarm import hookimpl


@hookimpl
def register_methods(register):
    register("worst_of_n", "alpacafarm_benchtest.methods:WorstOfN",
             description="a regressed best-of-n: keeps the lowest-reward sample (the gate must FAIL it)")
    register("best_of_n_refactored", "alpacafarm_benchtest.methods:RefactoredBestOfN",
             description="the built-in best-of-n under another name, same behaviour (the gate must PASS it)")
    register("fixed_reward_model", "alpacafarm_benchtest.methods:FixedRewardModel",
             description="provides the reward-model folder named in its config (no training)")


@hookimpl
def register_annotators(register):
    register("reward_judge", "alpacafarm_benchtest.judge:RewardJudge",
             description="prefers the output that a fixed reward-model folder scores higher (deterministic)")
