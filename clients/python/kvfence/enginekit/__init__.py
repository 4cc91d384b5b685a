"""What the engine backends (kvfence.sglang, kvfence.vllm) share: how an
engine's KV buffers become a kvfence pool (memory.py: register_kv_memory, the
one place that changes when multi-buffer and CUDA pools land) and the small
loopback rendezvous through which a prefill and a decode rank find each other
(rendezvous.py).
"""
from .memory import KvMemory, buffer_address, register_kv_memory, shm_region
from .rendezvous import Rendezvous, RendezvousServer

__all__ = ["KvMemory", "register_kv_memory", "shm_region", "buffer_address", "Rendezvous",
           "RendezvousServer"]
