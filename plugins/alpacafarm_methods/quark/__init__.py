"""Quark as released by AlpacaFarm: configuration, the trainer (reward-quantile tokens), the method."""
