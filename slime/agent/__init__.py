"""Agentic rollouts: the trajectory proxy (OpenAI endpoint that records token-in/token-out sessions),
multi-turn budgets, and the sandbox that runs model-written code.

It sits below `slime.rollout` (rollout functions and examples use it) and above `slime.utils`.
"""
