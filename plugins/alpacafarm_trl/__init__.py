"""Built-in plugin: the learning methods (TRL trainers, and our own PPO, Quark, best-of-n, expert iteration).

Targets are lazy strings: TRL takes seconds to import, so it is loaded only when a recipe names one of these.
"""

from alpacafarm import hookimpl


@hookimpl
def register_methods(register):
    register("sft", "alpacafarm_trl.sft:SFT",
             description="supervised fine-tuning on demonstrations (TRL SFTTrainer, response-only loss)")
    register("reward_model", "alpacafarm_trl.reward_model:RewardModel",
             description="Bradley-Terry reward model on pairwise preferences, initialised from the SFT model")
    register("best_of_n", "alpacafarm_trl.best_of_n:BestOfN",
             description="best-of-n sampling with the reward model; one run evaluates every n <= N on prefixes")
    register("expert_iteration", "alpacafarm_trl.expert_iteration:ExpertIteration",
             description="expert iteration: best-of-n on unlabeled instructions, then SFT on the best samples")
    register("ppo", "alpacafarm_trl.ppo:PPO",
             description="PPO against the reward model with a per-token KL penalty to the SFT model (our trainer)")
    register("dpo", "alpacafarm_trl.dpo:DPO",
             description="Direct Preference Optimization on pairwise preferences, reference = the SFT model")
    register("binary_feedme", "alpacafarm_trl.feedme:BinaryFeedME",
             description="binary FeedME: supervised fine-tuning on the preferred output of each pair")
    register("binary_reward_conditioning", "alpacafarm_trl.conditioning:BinaryRewardConditioning",
             description="SFT on both outputs behind good/bad control tokens; generation conditioned on good")
    register("grpo", "alpacafarm_trl.grpo:GRPO",
             description="GRPO (TRL GRPOTrainer): group-relative advantages, reward from the reward model and/or rules")
    register("rloo", "alpacafarm_trl.rloo:RLOO",
             description="RLOO (TRL RLOOTrainer): leave-one-out baselines, reward from the reward model and/or rules")
    register("online_dpo", "alpacafarm_trl.online_dpo:OnlineDPO",
             description="online / iterative DPO: rounds of sampling the policy, annotating the pairs, DPO steps")
    register("quark", "alpacafarm_trl.quark:Quark",
             description="Quark (best quantile, fresh pool per round): top-reward rollouts, NLL + KL to the SFT model")
