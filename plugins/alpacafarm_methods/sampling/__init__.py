"""Sampling from the SFT model and keeping what the reward model prefers: best-of-n, expert iteration."""
