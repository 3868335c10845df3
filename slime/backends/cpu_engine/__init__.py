"""CPU inference engine: a HuggingFace causal LM (or a Qwen-VL vision-language model, see vision.py) behind
SGLang's native HTTP API.

Run it with `python -m slime.backends.cpu_engine --model-path DIR --port N`, or in-process with
`launch_server(ServerArgs(...))`. Trainers push weights the way they push them to SGLang, with
`slime.utils.weight_transport` (same-host shared-memory payloads, or a gloo broadcast group).
"""

from slime.backends.cpu_engine.engine import CpuEngine
from slime.backends.cpu_engine.server import ServerArgs, ServerHandle, launch_server, parse_args, run_server

__all__ = [
    "CpuEngine",
    "ServerArgs",
    "ServerHandle",
    "launch_server",
    "parse_args",
    "run_server",
]
