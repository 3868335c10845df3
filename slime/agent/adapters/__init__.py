"""Upstream's agent adapters (`slime.agent.adapters`): an HTTP server per wire format that records the sessions of
agents it serves, with a session API for a custom generate function. Here both are the trajectory proxy
(slime/agent/trajectory_proxy.py) serving one wire format.
"""

from slime.agent.adapters.anthropic import AnthropicAdapter
from slime.agent.adapters.common import BaseAdapter
from slime.agent.adapters.openai import OpenAIAdapter

__all__ = ["AnthropicAdapter", "BaseAdapter", "OpenAIAdapter"]
