"""What the engine backends (kvfence.sglang, kvfence.vllm) share: how an
engine's KV buffers become ONE kvfence pool of several buffers (memory.py:
register_kv_memory; host shm or CUDA memory by IPC handle) and the small
loopback rendezvous through which a prefill and a decode rank find each other
(rendezvous.py).
"""
from .memory import KvMemory, buffer_address, kv_buffer, register_kv_memory, shm_region
from .rendezvous import Rendezvous, RendezvousServer

__all__ = ["KvMemory", "register_kv_memory", "kv_buffer", "shm_region", "buffer_address",
           "Rendezvous", "RendezvousServer"]
