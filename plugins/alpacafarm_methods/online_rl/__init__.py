"""Online RL on TRL's trainers: GRPO and RLOO, rewarded by the reward model, rules or the annotator."""
