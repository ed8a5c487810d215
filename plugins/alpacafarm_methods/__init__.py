"""Built-in plugin: the learning methods, one folder per kind of method.

- ``supervised/``: supervised fine-tuning on demonstrations (``sft``) and on preference data turned into
  demonstrations (``binary_feedme``, ``binary_reward_conditioning``); TRL's ``SFTTrainer``.
- ``reward_model/``: the Bradley-Terry reward model (TRL's ``RewardTrainer``) that the reward-driven methods use.
- ``preference/``: direct alignment on the preference data, one TRL trainer each: ``dpo`` and its online,
  iterative form ``online_dpo`` (``DPOTrainer``), ``ipo`` (``DPOTrainer``'s IPO loss), ``simpo`` (``CPOTrainer``,
  no reference model), ``orpo`` (``ORPOTrainer``, no reference model) and ``kto`` (``KTOTrainer``, on each output
  labelled desirable or not); the stage they share is the core's public
  :mod:`alpacafarm.preference_training`, which a plugin's DPO variant subclasses too.
- ``sampling/``: methods that sample and keep what the reward model prefers: ``best_of_n`` (at decoding time),
  ``expert_iteration`` (then SFT on the winners) and ``reward_pairs`` (the best against the worst sample: preference
  pairs for the direct-alignment methods).
- ``ppo/`` and ``quark/``: the paper's RL methods as released (our own trainers on one accelerate Accelerator).
- ``online_rl/``: TRL's ``GRPOTrainer`` and ``RLOOTrainer``, rewarded by the reward model, rules or the annotator.
- The preference pairs every pairwise method reads are the core's :mod:`alpacafarm.preference_rows`.

Targets are lazy strings: TRL takes seconds to import, so it is loaded only when a recipe names one of these.
"""

from alpacafarm import hookimpl


@hookimpl
def register_methods(register):
    register("sft", "alpacafarm_methods.supervised.sft:SFT",
             description="supervised fine-tuning on demonstrations (TRL SFTTrainer, response-only loss)")
    register("reward_model", "alpacafarm_methods.reward_model.method:RewardModel",
             description="Bradley-Terry reward model on pairwise preferences, initialised from the SFT model")
    register("best_of_n", "alpacafarm_methods.sampling.best_of_n:BestOfN",
             description="best-of-n sampling with the reward model; one run evaluates every n <= N on prefixes")
    register("reward_pairs", "alpacafarm_methods.sampling.reward_pairs:RewardPairs",
             description="preference pairs labelled by the reward model: the best and the worst of n samples each")
    register("expert_iteration", "alpacafarm_methods.sampling.expert_iteration:ExpertIteration",
             description="expert iteration: best-of-n on unlabeled instructions, then SFT on the best samples")
    register("ppo", "alpacafarm_methods.ppo.method:PPO",
             description="PPO against the reward model with a per-token KL penalty to the SFT model (our trainer)")
    register("dpo", "alpacafarm_methods.preference.dpo:DPO",
             description="Direct Preference Optimization on pairwise preferences, reference = the SFT model")
    register("ipo", "alpacafarm_methods.preference.ipo:IPO",
             description="IPO: DPO's data and reference, a squared loss that holds the log-ratio margin at 1/(2 tau)")
    register("simpo", "alpacafarm_methods.preference.simpo:SimPO",
             description="SimPO: length-normalised log-likelihood margin above a target gamma, no reference model")
    register("orpo", "alpacafarm_methods.preference.orpo:ORPO",
             description="ORPO: NLL on the preferred output plus a log-odds-ratio penalty, no reference model")
    register("kto", "alpacafarm_methods.preference.kto:KTO",
             description="KTO: binary feedback (each output desirable or not, from the pairs or acceptable_1/2 labels)")
    register("binary_feedme", "alpacafarm_methods.supervised.feedme:BinaryFeedME",
             description="binary FeedME: supervised fine-tuning on the preferred output of each pair")
    register("binary_reward_conditioning", "alpacafarm_methods.supervised.conditioning:BinaryRewardConditioning",
             description="SFT on both outputs behind good/bad control tokens; generation conditioned on good")
    register("grpo", "alpacafarm_methods.online_rl.grpo:GRPO",
             description="GRPO (TRL GRPOTrainer): group-relative advantages, reward from the reward model and/or rules")
    register("rloo", "alpacafarm_methods.online_rl.rloo:RLOO",
             description="RLOO (TRL RLOOTrainer): leave-one-out baselines, reward from the reward model and/or rules")
    register("online_dpo", "alpacafarm_methods.preference.online_dpo:OnlineDPO",
             description="online / iterative DPO: rounds of sampling the policy, annotating the pairs, DPO steps")
    register("quark", "alpacafarm_methods.quark.method:Quark",
             description="Quark (best quantile, fresh pool per round): top-reward rollouts, NLL + KL to the SFT model")
