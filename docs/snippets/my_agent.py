"""An agent for `--agent-function-path`: plain `openai` client code, pointed at the session's `base_url`."""

from __future__ import annotations

import openai

from slime.utils.types import Sample


async def agent(base_url: str, sample: Sample, sampling_params: dict) -> str | None:
    """Ask the question, ask once more for a number if the reply has none; return the last reply as the answer."""
    client = openai.AsyncOpenAI(base_url=base_url, api_key="slime")  # the proxy checks no key
    messages = [{"role": "user", "content": sample.prompt}]
    reply = None
    for _ in range(2):
        completion = await client.chat.completions.create(model="default", messages=messages, max_tokens=32)
        reply = completion.choices[0].message
        if reply.content and any(ch.isdigit() for ch in reply.content):
            break
        messages += [reply.model_dump(exclude_none=True), {"role": "user", "content": "Reply with a number."}]
    return reply.content if reply is not None else None


async def answer_reward(args, sample: Sample, **kwargs) -> float:
    """--custom-rm-path for this agent: 1.0 when the answer it returned (kept in metadata) holds the label."""
    answer = (sample.metadata or {}).get("agent_answer") or ""
    return float(str(sample.label) in answer)
