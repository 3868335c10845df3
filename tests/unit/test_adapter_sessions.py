"""The adapters' session close (slime/agent/adapters/common.py): a session whose turn is still in flight is closed
after `wait_timeout`, with a warning, rather than waiting for the turn or raising the wait's timeout."""

import asyncio
import logging

from support.tiny_model import build_tokenizer

from slime.agent.adapters import OpenAIAdapter, common


def test_finish_session_closes_a_session_whose_turn_is_still_in_flight(caplog):
    adapter = OpenAIAdapter(tokenizer=build_tokenizer(), sglang_url="http://127.0.0.1:1")
    adapter.open_session("busy")
    caplog.set_level(logging.WARNING, logger=common.__name__)

    async def close_during_a_turn() -> list:
        async with adapter.proxy.get_session("busy").lock:  # a turn holds the session's lock
            return await adapter.finish_session("busy", wait_timeout=0.05)

    assert asyncio.run(close_during_a_turn()) == []
    assert adapter.proxy.get_session("busy") is None
    assert any("still had a turn in flight" in record.getMessage() for record in caplog.records)
