"""PPO as released by AlpacaFarm: configuration, models (policy and critic), the maths, the trainer, the method."""
