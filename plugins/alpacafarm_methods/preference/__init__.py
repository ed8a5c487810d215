"""Learning from preference pairs directly: DPO, and online (iterative) DPO with simulated feedback."""
