"""kvfence as an SGLang disaggregation transfer backend (conn.py; how SGLang
selects it: docs/engines.md).

    from kvfence.sglang import KVManager, KVSender, KVReceiver, KVBootstrapServer, KVPoll
"""
from .conn import (QUIESCE_FEATURE, KVArgs, KVBootstrapServer, KVManager, KVPoll, KVReceiver,
                   KVSender, KVTransferError, KVTransferMetric)

# The names SGLang's backend table uses for other backends (Mooncake: MooncakeKVManager, ...).
KvfenceKVManager = KVManager
KvfenceKVSender = KVSender
KvfenceKVReceiver = KVReceiver
KvfenceKVBootstrapServer = KVBootstrapServer

__all__ = ["KVManager", "KVSender", "KVReceiver", "KVBootstrapServer", "KVPoll", "KVArgs",
           "KVTransferError", "KVTransferMetric", "QUIESCE_FEATURE", "KvfenceKVManager",
           "KvfenceKVSender", "KvfenceKVReceiver", "KvfenceKVBootstrapServer"]
