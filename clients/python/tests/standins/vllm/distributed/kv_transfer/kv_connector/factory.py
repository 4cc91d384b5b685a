"""Stand-in for vLLM's connector factory (vllm-project/vllm,
vllm/distributed/kv_transfer/kv_connector/factory.py at commit 003df29), in
our words: a connector that is not built in is loaded from
kv_transfer_config.kv_connector_module_path, and the class named by
kv_connector is taken from that module."""
import importlib

from .v1.base import KVConnectorBase_V1


class KVConnectorFactory:
    @staticmethod
    def create_connector(config, role, kv_cache_config=None):
        ktc = config.kv_transfer_config
        if not ktc.kv_connector_module_path:
            raise ValueError("kv_connector %r is not built in and no kv_connector_module_path "
                             "is given" % ktc.kv_connector)
        module = importlib.import_module(ktc.kv_connector_module_path)
        cls = getattr(module, ktc.kv_connector)
        if not issubclass(cls, KVConnectorBase_V1):
            raise TypeError("%s is not a KVConnectorBase_V1" % ktc.kv_connector)
        return cls(config, role, kv_cache_config)
