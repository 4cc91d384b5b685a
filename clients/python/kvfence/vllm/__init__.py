"""kvfence as a vLLM KV connector (V1), for kv_connector_module_path:
"kv_connector": "KvfenceConnector", "kv_connector_module_path": "kvfence.vllm"
(connector.py; docs/engines.md)."""
from .connector import (KvfenceConnector, KvfenceConnectorMetadata, kv_cache_buffers,
                        kv_cache_pool_buffers)

__all__ = ["KvfenceConnector", "KvfenceConnectorMetadata", "kv_cache_buffers", "kv_cache_pool_buffers"]
