"""fdc_ops: FDC KV-cache dimensionality compression operators for PyTorch (torch.ops.fdc)."""

from . import ops
from .ops import append_kv, decode_attention, decode_plan, prefill_attention, prefill_plan, rotate_compress

__all__ = ["ops", "rotate_compress", "prefill_plan", "prefill_attention", "decode_plan", "decode_attention",
           "append_kv"]
