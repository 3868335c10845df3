"""slime: RL post-training for LLMs."""
