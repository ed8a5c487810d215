"""The Bradley-Terry reward model: the method and its scoring head."""
