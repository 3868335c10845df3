"""`AnthropicAdapter`: the trajectory proxy's Anthropic Messages route (`POST /v1/messages`) as upstream's adapter."""

from __future__ import annotations

from slime.agent.adapters.common import BaseAdapter


class AnthropicAdapter(BaseAdapter):
    """Serves `POST /v1/messages`, `POST /v1/messages/count_tokens` and `GET /v1/models` for agents written against
    Anthropic's API (e.g. Claude Code); the session id is the request's API key (`x-api-key` or a bearer token). See
    `BaseAdapter`."""

    wire_formats = ("anthropic",)
