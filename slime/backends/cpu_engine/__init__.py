"""CPU inference engine: a HuggingFace causal LM behind SGLang's native HTTP API.

Run it with `python -m slime.backends.cpu_engine --model-path DIR --port N`, or in-process with
`launch_server(ServerArgs(...))`. Trainers push weights with `serialize_named_tensors` (same host,
shared memory) or `init_weight_update_group` + `broadcast_tensor` (gloo).
"""

from slime.backends.cpu_engine.engine import CpuEngine
from slime.backends.cpu_engine.server import ServerArgs, ServerHandle, launch_server, parse_args, run_server
from slime.backends.cpu_engine.weights import broadcast_tensor, init_weight_update_group, serialize_named_tensors

__all__ = [
    "CpuEngine",
    "ServerArgs",
    "ServerHandle",
    "broadcast_tensor",
    "init_weight_update_group",
    "launch_server",
    "parse_args",
    "run_server",
    "serialize_named_tensors",
]
