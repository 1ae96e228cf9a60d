"""Defaults that the library and the command line share, in a module that imports nothing: ``python -m fdc_ops``
parses and checks its arguments before torch is imported (fdc_ops/apps/cli.py)."""

# Calibration windows' length by default. Post-RoPE keys at positions calibration never saw turn further in their
# low-frequency RoPE planes, into directions the basis ranks low: on SmolLM2, 8 windows of 1024 tokens kept 0.930 of the
# score of 256 tokens after a 1536-token prompt at 0.1 compression, 4 windows of 2048 kept 0.975, and on 512-token
# text both kept 99% to the same compression (0.062 and 0.060, one refinement step apart; bench/results/eval/README.md).
DEFAULT_SEQ_LEN = 2048

PERPLEXITY_WINDOW = 512  # tokens per perplexity window: the shortest stream fdc_ops.apps.metrics.perplexity takes
