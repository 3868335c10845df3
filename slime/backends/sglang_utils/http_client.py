"""Typed client for one engine's control plane: SGLang's native HTTP API, also served by the CPU engine.

The router forwards only /generate, /v1/* and /flush_cache, so every control call (weight updates,
pause/continue, memory release) goes straight to each engine through this client. Request fields are
spelled exactly as SGLang's request structs (`UpdateWeightsFromTensorReqInput`, `AbortReq`, ...).
An engine started with `--api-key` (slime: `--sglang-api-key`) gets it on every call as
`Authorization: Bearer <key>`. A refused call raises `HTTPRequestError`, whose message carries the
engine's own explanation.
"""

from __future__ import annotations

import time
from typing import Any

from slime.utils.http_utils import HTTPRequestError, bearer_headers, get_json, post_json

DEFAULT_GROUP_NAME = "weight_update_group"


class EngineClient:
    """Calls one engine server's HTTP endpoints.

    Args:
        base_url: e.g. "http://127.0.0.1:30000" (no trailing slash needed).
        timeout: Seconds to wait for any one call; weight loads on a large model can take minutes.
        api_key: The engine's `--api-key`, sent as a bearer token; None for an engine without one.
    """

    def __init__(self, base_url: str, timeout: float | None = 600.0, api_key: str | None = None):
        self.base_url = base_url.rstrip("/")
        self.timeout = timeout
        self._headers = bearer_headers(api_key)

    def __repr__(self) -> str:  # never print the key
        return f"{type(self).__name__}({self.base_url!r})"

    def _get(self, endpoint: str) -> Any:
        return get_json(f"{self.base_url}/{endpoint}", timeout=self.timeout, headers=self._headers)

    def _post(self, endpoint: str, payload: dict[str, Any] | None = None) -> Any:
        body = payload if payload is not None else {}
        result = post_json(f"{self.base_url}/{endpoint}", body, timeout=self.timeout, headers=self._headers)
        # Weight-sync endpoints report failure as {"success": false, "message": ...}; never let one pass silently.
        if isinstance(result, dict) and result.get("success") is False:
            raise RuntimeError(f"{endpoint} on {self.base_url} failed: {result.get('message', result)}")
        return result

    def _is_ok(self, endpoint: str, timeout: float) -> bool:
        try:
            get_json(f"{self.base_url}/{endpoint}", timeout=timeout, max_retries=0, headers=self._headers)
        except (HTTPRequestError, ConnectionError, TimeoutError):
            return False
        return True

    def health(self, timeout: float = 5.0) -> bool:
        """True when GET /health answers 200 (the server is up)."""
        return self._is_ok("health", timeout)

    def answers(self, timeout: float = 5.0) -> bool:
        """True when GET /health gets any HTTP answer (a 503 of an engine whose memory is released included)."""
        try:
            get_json(f"{self.base_url}/health", timeout=timeout, max_retries=0, headers=self._headers)
        except HTTPRequestError:
            return True
        except (ConnectionError, TimeoutError):
            return False
        return True

    def health_generate(self, timeout: float = 60.0) -> bool:
        """True when GET /health_generate answers 200 (the server can run a one-token generation)."""
        return self._is_ok("health_generate", timeout)

    def get_model_info(self) -> dict[str, Any]:
        """GET /get_model_info: `model_path`, `tokenizer_path`, `is_generation`, ..."""
        return self._get("get_model_info")

    def get_server_info(self) -> dict[str, Any]:
        """GET /get_server_info: the server's arguments and runtime state."""
        return self._get("get_server_info")

    def weight_memory_gb(self) -> float | None:
        """The weights' memory as the server reports it (`internal_states[0].memory_usage.weight`, GB); None when it
        reports none. The CPU engine reports its live storage (0 while released); SGLang the size at load."""
        states = self.get_server_info().get("internal_states") or [{}]
        return (states[0].get("memory_usage") or {}).get("weight")

    def flush_cache(self, wait: float = 0.0) -> Any:
        """POST /flush_cache: drop the prefix (KV) cache.

        The engine refuses (400) while requests are running. SGLang's scheduler ends the requests an abort pause
        aborted a moment after the pause has answered, so a flush right after a pause gives them `wait` seconds:
        refusals within it are retried every 0.1 s, and the last one is raised (HTTPRequestError).
        """
        deadline = time.monotonic() + wait
        while True:
            try:
                return self._post("flush_cache")
            except HTTPRequestError as error:
                if error.status != 400 or time.monotonic() >= deadline:
                    raise
            time.sleep(0.1)

    def abort_request(self, rid: str | None = None, abort_all: bool = False) -> Any:
        """POST /abort_request: abort the request `rid`, or every running request with `abort_all=True`."""
        if rid is None and not abort_all:
            raise ValueError("abort_request needs a request id `rid` or abort_all=True")
        return self._post("abort_request", {"rid": rid or "", "abort_all": abort_all})

    def pause_generation(self, mode: str | None = None) -> Any:
        """POST /pause_generation: stop scheduling (before a weight update).

        Args:
            mode: SGLang's pause mode ("abort", "retract" or "in_place"); None uses the server's default.
        """
        return self._post("pause_generation", {"mode": mode} if mode is not None else {})

    def continue_generation(self) -> Any:
        """POST /continue_generation: resume scheduling after `pause_generation`."""
        return self._post("continue_generation")

    def update_weights_from_tensor(
        self,
        serialized_named_tensors: list[str],
        load_format: str | None = None,
        flush_cache: bool = True,
        weight_version: str | None = None,
    ) -> Any:
        """POST /update_weights_from_tensor: load weights passed in the request (colocated engines).

        Args:
            serialized_named_tensors: One serialized list of (name, tensor) per TP rank of the engine.
            load_format: How the payload is packed, e.g. "flattened_bucket"; None for the server's default.
            flush_cache: Drop the prefix cache after loading (old KV entries came from the old weights).
            weight_version: Label reported back in every later response's meta_info.weight_version.
        """
        payload = {"serialized_named_tensors": serialized_named_tensors, "flush_cache": flush_cache}
        payload |= _present(load_format=load_format, weight_version=weight_version)
        return self._post("update_weights_from_tensor", payload)

    def init_weights_update_group(
        self,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        group_name: str = DEFAULT_GROUP_NAME,
        backend: str = "nccl",
    ) -> Any:
        """POST /init_weights_update_group: join a process group with the trainer for broadcast weight sync.

        Args:
            master_address: Address of rank 0 (the trainer's sending rank).
            master_port: Port of rank 0's store.
            rank_offset: This engine's first rank in the group (the trainer is rank 0).
            world_size: 1 + total engine ranks in the group.
            group_name: Name later calls use to refer to the group.
            backend: "nccl" on GPU, "gloo" on CPU.
        """
        return self._post(
            "init_weights_update_group",
            {
                "master_address": master_address,
                "master_port": master_port,
                "rank_offset": rank_offset,
                "world_size": world_size,
                "group_name": group_name,
                "backend": backend,
            },
        )

    def update_weights_from_distributed(
        self,
        names: list[str],
        dtypes: list[str],
        shapes: list[list[int]],
        group_name: str = DEFAULT_GROUP_NAME,
        flush_cache: bool = True,
        weight_version: str | None = None,
    ) -> Any:
        """POST /update_weights_from_distributed: receive the listed tensors by broadcast from group rank 0.

        Args:
            names: HF parameter names, in the order the trainer broadcasts them.
            dtypes: Torch dtype names without the "torch." prefix, e.g. "bfloat16".
            shapes: One shape per name.
            group_name: The group created by `init_weights_update_group`.
            flush_cache: Drop the prefix cache after loading.
            weight_version: Label reported back in later responses' meta_info.weight_version.
        """
        payload = {
            "names": names,
            "dtypes": dtypes,
            "shapes": shapes,
            "group_name": group_name,
            "flush_cache": flush_cache,
        }
        payload |= _present(weight_version=weight_version)
        return self._post("update_weights_from_distributed", payload)

    def destroy_weights_update_group(self, group_name: str = DEFAULT_GROUP_NAME) -> Any:
        """POST /destroy_weights_update_group: leave and free the weight-sync process group."""
        return self._post("destroy_weights_update_group", {"group_name": group_name})

    def update_weights_from_disk(
        self, model_path: str, load_format: str | None = None, weight_version: str | None = None
    ) -> Any:
        """POST /update_weights_from_disk: reload weights from an HF checkpoint directory the engine can read."""
        payload = {"model_path": model_path} | _present(load_format=load_format, weight_version=weight_version)
        return self._post("update_weights_from_disk", payload)

    def release_memory_occupation(self, tags: list[str] | None = None) -> Any:
        """POST /release_memory_occupation: free weights and/or KV cache ("weights", "kv_cache"; None = all)."""
        return self._post("release_memory_occupation", _present(tags=tags))

    def resume_memory_occupation(self, tags: list[str] | None = None) -> Any:
        """POST /resume_memory_occupation: re-allocate what `release_memory_occupation` freed."""
        return self._post("resume_memory_occupation", _present(tags=tags))

    def update_weight_version(self, new_version: str, abort_all_requests: bool = False) -> Any:
        """POST /update_weight_version: label the engine's live weights `new_version` (later meta_info.weight_version)."""
        return self._post(
            "update_weight_version", {"new_version": new_version, "abort_all_requests": abort_all_requests}
        )

    def load_lora_adapter(self, lora_name: str, lora_path: str) -> Any:
        """POST /load_lora_adapter: load the PEFT adapter folder `lora_path` (on the engine's host) as `lora_name`.

        Returns:
            {"success", "error_message", "loaded_adapters": {name: path}}. A name already loaded is refused:
            unload it first.
        """
        return self._post("load_lora_adapter", {"lora_name": lora_name, "lora_path": lora_path})

    def load_lora_adapter_from_tensors(
        self, lora_name: str, config_dict: dict[str, Any], serialized_tensors: str, load_format: str | None = None
    ) -> Any:
        """POST /load_lora_adapter_from_tensors: load an adapter sent in the request as `lora_name`.

        Args:
            lora_name: The name requests give in `lora_path`.
            config_dict: The adapter's `adapter_config.json` contents.
            serialized_tensors: `serialize_named_tensors` of its (PEFT saved name, tensor) pairs.
            load_format: How `serialized_tensors` is packed; None for the server's default.
        """
        payload = {"lora_name": lora_name, "config_dict": config_dict, "serialized_tensors": serialized_tensors}
        return self._post("load_lora_adapter_from_tensors", payload | _present(load_format=load_format))

    def unload_lora_adapter(self, lora_name: str) -> Any:
        """POST /unload_lora_adapter: drop the adapter `lora_name` (requests in flight that use it are aborted)."""
        return self._post("unload_lora_adapter", {"lora_name": lora_name})

    def generate(self, payload: dict[str, Any]) -> Any:
        """POST /generate with SGLang's request body (input_ids or text, sampling_params, return_logprob, ...).

        Returns:
            {"text", "output_ids", "meta_info"} for one prompt, a list of those for a batch.
        """
        return self._post("generate", payload)


def _present(**fields: Any) -> dict[str, Any]:
    """The fields that are not None, so older servers never see optional fields they do not know."""
    return {name: value for name, value in fields.items() if value is not None}
