"""Stand-in for SGLang's disaggregation base interfaces.

Upstream: sgl-project/sglang, python/sglang/srt/disaggregation/base/conn.py at
commit 0094505d. Written here in our own words from the interface as the
engine uses it (names, arguments, call order), not copied: the engine fills a
KVArgs, builds one manager per rank with the class that
--disaggregation-transfer-backend selects, then one sender (prefill) or
receiver (decode) per request, keyed by the request's bootstrap_room, and polls
each of them once per scheduler step. After Failed it calls
failure_exception(); it frees a request's pages after Success or Failed.
"""
from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import List, Optional


class KVArgs:
    """Filled by the engine before it builds the manager."""
    engine_rank: int
    kv_data_ptrs: List[int]      # one per layer and K/V: device addresses
    kv_data_lens: List[int]      # bytes of each buffer
    kv_item_lens: List[int]      # bytes of one page of each buffer
    aux_data_ptrs: List[int]     # one slot per request in each
    aux_data_lens: List[int]
    aux_item_lens: List[int]
    state_types: List[str]
    state_data_ptrs: List[int]
    state_data_lens: List[int]
    state_item_lens: List[int]
    ib_device: str
    gpu_id: int
    page_size: int               # tokens per page
    kv_head_num: int
    total_kv_head_num: int
    pp_rank: int
    prefill_start_layer: int
    system_dp_rank: int
    dcp_size: int
    dcp_rank: int


class KVPoll(enum.IntEnum):
    Failed = 0
    Bootstrapping = 1
    WaitingForInput = 2
    Transferring = 3
    Success = 4


@dataclass
class KVTransferMetric:
    """What a sender reports about its transfer; any field may be None."""
    latency_s: Optional[float] = None
    transferred_bytes: Optional[int] = None


class BaseKVManager(ABC):
    @abstractmethod
    def __init__(self, args: KVArgs, disaggregation_mode, server_args,
                 is_mla_backend: Optional[bool] = False):
        ...

    @abstractmethod
    def register_to_bootstrap(self):
        ...


class BaseKVSender(ABC):
    @abstractmethod
    def __init__(self, mgr: BaseKVManager, bootstrap_addr: str, bootstrap_room: int,
                 dest_tp_ranks: List[int], pp_rank: int,
                 req_has_disagg_prefill_dp_rank: bool = False):
        ...

    @abstractmethod
    def init(self, num_kv_indices: int, aux_index: Optional[int] = None):
        ...

    @abstractmethod
    def send(self, kv_indices, state_indices=None, token_position_offset: int = 0):
        """Called once per prefill chunk; the call that covers the last of
        num_kv_indices completes the request."""

    @abstractmethod
    def poll(self) -> KVPoll:
        ...

    @abstractmethod
    def failure_exception(self):
        """Raises the reason of a Failed poll."""

    def get_transfer_metric(self) -> KVTransferMetric:
        return KVTransferMetric()

    def clear(self) -> None:
        pass

    def abort(self) -> None:
        pass


class BaseKVReceiver(ABC):
    @abstractmethod
    def __init__(self, mgr: BaseKVManager, bootstrap_addr: str,
                 bootstrap_room: Optional[int] = None):
        ...

    @abstractmethod
    def init(self, prefill_dp_rank: int):
        ...

    @abstractmethod
    def send_metadata(self, kv_indices, aux_index: Optional[int] = None, state_indices=None,
                      decode_prefix_len: Optional[int] = None):
        """Tells prefill where to write."""

    @abstractmethod
    def poll(self) -> KVPoll:
        ...

    @abstractmethod
    def failure_exception(self):
        ...

    def clear(self) -> None:
        pass

    def abort(self) -> None:
        pass


class BaseKVBootstrapServer(ABC):
    @abstractmethod
    def __init__(self, host: str, port: int):
        ...
