"""Supervised fine-tuning: on demonstrations (SFT), on preferred outputs (binary FeedME), behind good/bad
tokens (binary reward conditioning).
"""
