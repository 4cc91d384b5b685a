"""Stand-in for vLLM's KV connector interface, V1.

Upstream: vllm-project/vllm, vllm/distributed/kv_transfer/kv_connector/v1/base.py
at commit 003df29. Written in our own words from how the engine calls a
connector: one instance in the scheduler (role SCHEDULER) and one in each
worker (role WORKER). Per scheduler step: get_num_new_matched_tokens and
update_state_after_alloc for newly scheduled requests, build_connector_meta,
which the worker receives with bind_connector_metadata before the forward
pass (start_load_kv, then per layer wait_for_layer_load / save_kv_layer, then
wait_for_save), get_finished and get_block_ids_with_load_errors after it,
clear_connector_metadata; the scheduler then gets update_connector_output.
request_finished returning True means: keep the blocks until get_finished
reports the request id.
"""
from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from typing import Any, Dict, Optional, Set, Tuple


class KVConnectorRole(enum.Enum):
    SCHEDULER = 0
    WORKER = 1


class KVConnectorMetadata(ABC):  # noqa: B024 - a marker base, as upstream
    """What the scheduler side sends the worker side each step."""


class KVConnectorBase_V1(ABC):
    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None):
        self._connector_metadata: Optional[KVConnectorMetadata] = None
        self._vllm_config = vllm_config
        self._role = role
        self._kv_cache_config = kv_cache_config

    @property
    def role(self) -> KVConnectorRole:
        return self._role

    # ---- worker side -------------------------------------------------------------
    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        self._connector_metadata = connector_metadata

    def clear_connector_metadata(self) -> None:
        self._connector_metadata = None

    def _get_connector_metadata(self) -> KVConnectorMetadata:
        assert self._connector_metadata is not None
        return self._connector_metadata

    def register_kv_caches(self, kv_caches: Dict[str, Any]) -> None:
        return

    @abstractmethod
    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None: ...

    @abstractmethod
    def wait_for_layer_load(self, layer_name: str) -> None: ...

    @abstractmethod
    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any,
                      **kwargs: Any) -> None: ...

    @abstractmethod
    def wait_for_save(self) -> None: ...

    def get_finished(self, finished_req_ids: Set[str]) -> Tuple[Optional[Set[str]],
                                                                 Optional[Set[str]]]:
        return None, None

    def get_block_ids_with_load_errors(self) -> Set[int]:
        return set()

    def shutdown(self) -> None:
        return None

    def get_handshake_metadata(self) -> Any:
        return None

    def set_xfer_handshake_metadata(self, metadata: Any) -> None:
        return None

    # ---- scheduler side ----------------------------------------------------------
    @abstractmethod
    def get_num_new_matched_tokens(self, request: Any,
                                   num_computed_tokens: int) -> Tuple[Optional[int], bool]: ...

    @abstractmethod
    def update_state_after_alloc(self, request: Any, blocks: Any,
                                 num_external_tokens: int) -> None: ...

    @abstractmethod
    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata: ...

    def update_connector_output(self, connector_output: Any) -> None:
        return

    def request_finished(self, request: Any,
                         block_ids: list) -> Tuple[bool, Optional[Dict[str, Any]]]:
        return False, None
