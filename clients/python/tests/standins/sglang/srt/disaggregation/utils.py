"""Stand-in for SGLang's DisaggregationMode (sgl-project/sglang,
python/sglang/srt/disaggregation/utils.py at commit 0094505d), in our words."""
import enum


class DisaggregationMode(enum.Enum):
    NULL = "null"
    PREFILL = "prefill"
    DECODE = "decode"
