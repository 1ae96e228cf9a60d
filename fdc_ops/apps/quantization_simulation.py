"""Quantized cache formats simulated on a compressed model, to choose a format before writing its kernels
(docs/design.md section 3, "Quantized caches"; bench/results/eval/README.md has what it measured).

While ``simulate_quantization(model, scheme, calibration_windows)`` is open, every row a compressed module writes to
its cache (FDC or Palu, fdc_ops.hf) is replaced by what a cache of ``scheme`` would give back: quantized, then
dequantized in float64 and rounded to the cache's float dtype. A prompt attends to its own rows as the real quantized
caches do (unquantized: they are the call's own), and every later call reads the cached rows as stored. Nothing is
stored smaller, so the simulation saves no memory: it measures accuracy only, and ``scheme.compression`` counts the
bytes the format would take.

Schemes: signed integer codes of ``key_bits`` bits for keys and ``value_bits`` for values (symmetric,
+-(2^(bits-1) - 1); 16: that half stored at 16 bits, unquantized), values always with one scale per (token, KV head)
(how the shipped int8 cache stores both); keys either the same (``keys="token"``) or with one scale
per (rotated channel, group of ``group`` consecutive tokens of a request) as KIVI quantizes keys (``keys="channel"``;
a request's last, incomplete group stays at full precision until it completes, as in KIVI; a group split across two
calls is left at full precision, which this module's users, the long-context metrics, never produce: their prompts
are multiples of the group). ``equalise`` divides the rotated key channels (``"keys"``) or the key and value
channels (``"both"``) by their RMS on calibration text before a per-token quantization and multiplies them back
after: a real cache gets this for free by folding the factors into the rotations (a key channel's 1/r into the key
rotation and r into the query rotation leaves every score unchanged). ``sinks``: each request's first tokens are
kept at full precision (16 bits). ``rotate`` ("keys" or "both") mixes each KV head's kept dims by the fixed random
orthogonal matrix of a real quantized cache (fdc_ops.artifact.mix_kept_columns, which hf.compress folds into the
weights) before a per-token quantization and unmixes them after (QuaRot's spreading of outlier channels).
"""

from __future__ import annotations

import contextlib
import dataclasses

import torch

from ..artifact import mix_kept_columns
from ..hf import modules

SCALE_BYTES = 4  # a float32 scale, as the shipped quantized caches store it


@dataclasses.dataclass(frozen=True)
class QuantizationScheme:
    key_bits: int = 4
    value_bits: int = 4
    keys: str = "token"  # "token": a scale per (token, KV head); "channel": per (rotated channel, token group)
    group: int = 32  # tokens sharing a key channel's scale (keys="channel")
    equalise: str = "none"  # "none", "keys" or "both": channels divided by their calibrated RMS before quantizing
    sinks: int = 0  # first tokens of each request kept at 16 bits
    rotate: str = "none"  # "none", "keys" or "both": kept dims mixed by a random orthogonal matrix per KV head

    def __post_init__(self):
        if {self.key_bits, self.value_bits} - {2, 3, 4, 5, 6, 8, 16}:
            raise ValueError(f"fdc_ops.apps.quantization_simulation: key_bits and value_bits must be 2..6, 8 or 16, "
                             f"got {self.key_bits} and {self.value_bits}")
        if self.keys not in ("token", "channel"):
            raise ValueError(f"fdc_ops.apps.quantization_simulation: keys must be 'token' or 'channel', got "
                             f"{self.keys!r}")
        if self.equalise not in ("none", "keys", "both"):
            raise ValueError(f"fdc_ops.apps.quantization_simulation: equalise must be 'none', 'keys' or 'both', got "
                             f"{self.equalise!r}")
        if self.rotate not in ("none", "keys", "both"):
            raise ValueError(f"fdc_ops.apps.quantization_simulation: rotate must be 'none', 'keys' or 'both', got "
                             f"{self.rotate!r}")
        if self.keys == "channel" and self.equalise != "none":
            raise ValueError("fdc_ops.apps.quantization_simulation: per-channel key scales make key equalisation "
                             "void; equalise='none' with keys='channel'")
        if self.group < 1 or self.sinks < 0:
            raise ValueError(f"fdc_ops.apps.quantization_simulation: group must be >= 1 and sinks >= 0, got "
                             f"{self.group} and {self.sinks}")

    def code_max(self, which: str) -> int:
        return 2 ** ((self.key_bits if which == "k" else self.value_bits) - 1) - 1

    def compression(self, qk_width: float, v_width: float, head_dim: int, tokens: int) -> float:
        """The share of a 16-bit cache's bytes this format removes for a request of ``tokens`` tokens whose KV heads
        keep ``qk_width`` and ``v_width`` dims on average: the codes, the scales' bytes, and the sinks' (and with
        per-channel keys the last incomplete group's) rows at 16 bits."""
        full = 2.0 * head_dim * 2  # K and V, 16 bits each, per token and KV head
        key_scales = SCALE_BYTES if self.keys == "token" else SCALE_BYTES * qk_width / self.group
        quantized = (qk_width * self.key_bits + v_width * self.value_bits) / 8
        quantized += (key_scales if self.key_bits < 16 else 0.0) + (SCALE_BYTES if self.value_bits < 16 else 0.0)
        exact = min(tokens, self.sinks + (tokens % self.group if self.keys == "channel" else 0))
        stored = (tokens - exact) * quantized + exact * (qk_width + v_width) * 2
        return 1.0 - stored / (tokens * full)


def _per_token(x: torch.Tensor, bounds: list[int], code_max: int) -> torch.Tensor:
    """x (T, W) float64 with a scale per row and head (columns bounds[j]:bounds[j+1]): quantized and dequantized."""
    out = torch.empty_like(x)
    for j in range(len(bounds) - 1):
        part = x[:, bounds[j]:bounds[j + 1]]
        scale = (part.abs().amax(dim=1, keepdim=True) / code_max).float().double()
        codes = torch.where(scale > 0, (part / scale.clamp_min(1e-300)).round().clamp(-code_max, code_max), 0.0)
        out[:, bounds[j]:bounds[j + 1]] = codes * scale
    return out


def _per_channel(x: torch.Tensor, code_max: int) -> torch.Tensor:
    """x (G, W) float64, one group of tokens: a scale per column, quantized and dequantized."""
    scale = (x.abs().amax(dim=0, keepdim=True) / code_max).float().double()
    return torch.where(scale > 0, (x / scale.clamp_min(1e-300)).round().clamp(-code_max, code_max), 0.0) * scale


def _mixing(bounds: tuple[int, ...], layer: int, half: str) -> torch.Tensor:
    """(W, W) float64 block-diagonal: per KV head (columns bounds[j]:bounds[j+1]) the orthogonal matrix a real
    quantized cache's rows of that half are mixed by (fdc_ops.artifact.mix_kept_columns)."""
    widths = [stop - start for start, stop in zip(bounds, bounds[1:])]
    identity = torch.eye(max(widths), dtype=torch.float64).expand(len(widths), -1, -1)
    mixed = mix_kept_columns(identity, widths, half, layer)
    return torch.block_diag(*(mixed[j, :width, :width] for j, width in enumerate(widths)))


class _Simulation:
    def __init__(self, scheme: QuantizationScheme):
        self.scheme = scheme
        self.layer = None  # the module whose attention runs now
        self.recording = False  # collecting the calibration statistics: rows are stored as they are
        self.sums: dict[tuple[int, str], torch.Tensor] = {}  # (layer, "k" or "v") -> (width,) float64 sum of squares
        self.counts: dict[int, int] = {}
        self.mixings: dict[tuple, torch.Tensor] = {}  # (bounds, layer, half) -> _mixing's matrix, made once

    def rms(self, layer: int, which: str) -> torch.Tensor:
        rms = (self.sums[(layer, which)] / self.counts[layer]).sqrt()
        return rms.clamp_min(float(rms.max()) * 1e-4)  # a channel silent on the calibration text stays finite

    def mixing(self, bounds: list[int], layer: int, which: str) -> torch.Tensor:
        """The mixing of this layer's keys (``which="k"``: FDC's rotated keys or Palu's latent) or values."""
        half = "v" if which == "v" else "k latent" if isinstance(self.layer, modules.PaluAttention) else "qk"
        key = (tuple(bounds), layer, half)
        if key not in self.mixings:
            self.mixings[key] = _mixing(*key)
        return self.mixings[key]

    def rows(self, rows: torch.Tensor, offsets: torch.Tensor, positions: list[range], which: str) -> torch.Tensor:
        """rows (T, W): requests' rows back to back at ``positions`` (each request's tokens' indices)."""
        layer = self.layer.layer_idx
        x = rows.double()
        if self.recording:
            self.sums[(layer, which)] = self.sums.get((layer, which), 0.0) + (x * x).sum(0)
            if which == "k":
                self.counts[layer] = self.counts.get(layer, 0) + x.shape[0]
            return rows
        scheme = self.scheme
        bounds, code_max = offsets.tolist(), scheme.code_max(which)
        if code_max >= 2**15 - 1:  # stored at 16 bits
            out = x
        elif which == "k" and scheme.keys == "channel":
            out = x.clone()
            start = 0
            for span in positions:
                first = -(-span.start // scheme.group) * scheme.group  # the first group that begins in this call
                for begin in range(first, span.stop - scheme.group + 1, scheme.group):
                    rows_of = slice(start + begin - span.start, start + begin - span.start + scheme.group)
                    out[rows_of] = _per_channel(x[rows_of], code_max)
                start += len(span)
        else:
            equalised = scheme.equalise == "both" or (scheme.equalise == "keys" and which == "k")
            rotated = scheme.rotate == "both" or (scheme.rotate == "keys" and which == "k")
            factor = self.rms(layer, which) if equalised else None
            mixing = self.mixing(bounds, layer, which) if rotated else None
            y = x / factor if equalised else x
            out = _per_token(y @ mixing if rotated else y, bounds, code_max)
            if rotated:
                out = out @ mixing.T
            if equalised:
                out = out * factor
        if scheme.sinks:
            start = 0
            for span in positions:
                exact = max(0, min(span.stop, scheme.sinks) - span.start)
                out[start:start + exact] = x[start:start + exact]
                start += len(span)
        return out.to(rows.dtype)


@contextlib.contextmanager
def simulate_quantization(model, scheme: QuantizationScheme, calibration_windows: list[torch.Tensor]):
    """Routes the cache writes of ``model`` (compressed by fdc_ops.hf.compress with a float cache, no eviction, no
    sliding window) through the simulation of ``scheme`` while open. With equalisation, the channels' RMS is first
    measured on ``calibration_windows`` ((1, L) token ids each) through the same compressed model."""
    simulation = _Simulation(scheme)
    original_attend, original_append = modules._attend, modules.CompressedKVLayer.append

    def attend(module, *args, **kwargs):
        if module.eviction is not None or module.window_left >= 0 or module.kv_dtype is not None:
            raise ValueError("fdc_ops.apps.quantization_simulation: the simulation quantizes a float cache without "
                             "eviction or a sliding window")
        simulation.layer = module
        return original_attend(module, *args, **kwargs)

    def append(layer, k_rows, v_rows, rows, new_positions):
        positions = [range(length, length + count) for length, count in zip(layer.host_lengths or
                                                                              [0] * len(rows.host_counts),
                                                                              rows.host_counts)]
        k_rows = simulation.rows(k_rows, layer.k_offsets, positions, "k")
        v_rows = simulation.rows(v_rows, layer.v_offsets, positions, "v")
        return original_append(layer, k_rows, v_rows, rows, new_positions)

    modules._attend, modules.CompressedKVLayer.append = attend, append
    try:
        if scheme.equalise != "none":
            from transformers import DynamicCache

            from ..hf.compat import cache_keyword

            simulation.recording = True
            with torch.inference_mode():
                for window in calibration_windows:
                    model(input_ids=window, use_cache=True, logits_to_keep=1,
                          **{cache_keyword(model): DynamicCache()})
            simulation.recording = False
        yield simulation
    finally:
        modules._attend, modules.CompressedKVLayer.append = original_attend, original_append
