"""`OpenAIAdapter`: the trajectory proxy's OpenAI chat route (`POST /v1/chat/completions`) as upstream's adapter."""

from __future__ import annotations

from slime.agent.adapters.common import BaseAdapter


class OpenAIAdapter(BaseAdapter):
    """Serves `POST /v1/chat/completions` and `GET /v1/models` for agents written against OpenAI's API (e.g. Codex);
    the session id is the request's API key. See `BaseAdapter`."""

    wire_formats = ("openai",)
