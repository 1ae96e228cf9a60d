"""The command lines' argument types (``python -m fdc_ops`` and ``python -m fdc_ops.vllm``): each refuses a bad value
with argparse's one-line message and exit status 2, before anything is loaded. Imports nothing but the standard
library (the command lines parse their arguments before torch is imported)."""

import argparse
import math
import os


def _number(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{text!r} is not a finite number")
    return value


def share(low: float, high: float, high_included: bool):
    """A number in [low, high) or [low, high]: shares of a cache, rates, accuracy levels."""
    def parse(text: str) -> float:
        value = _number(text)
        if not (low <= value < high or (high_included and value == high)):
            raise argparse.ArgumentTypeError(f"{text} is not in [{low}, {high}{']' if high_included else ')'}")
        return value
    return parse


def whole(low: int):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"{value} is below {low}")
        return value
    return parse


#: The bundled models' names (fdc_ops.hf.loading.MODELS, which needs torch; tests/hf/test_loading.py checks they agree).
BUNDLED_MODELS = ("smollm2-135m", "qwen2.5-coder-1.5b")


def model_source(text: str) -> str:
    """A bundled model's name, a Hugging Face model directory, or a hub id (which only loading can check: no network
    is assumed)."""
    if text in BUNDLED_MODELS:
        return text
    looks_like_path = text.startswith(("/", ".", "~")) or os.path.exists(text) or text.count("/") != 1
    if looks_like_path:
        path = os.path.expanduser(text)
        if not os.path.isfile(os.path.join(path, "config.json")):
            raise argparse.ArgumentTypeError(f"{text} is not a Hugging Face model directory (it has no config.json)")
        return path
    return text


def output_directory(text: str) -> str:
    """A directory that exists or can be made, and can be written to."""
    if os.path.exists(text) and not os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"{text} exists and is not a directory")
    try:
        os.makedirs(text, exist_ok=True)
    except OSError as error:
        raise argparse.ArgumentTypeError(f"{text} cannot be made ({error.strerror})") from None
    if not os.access(text, os.W_OK | os.X_OK):
        raise argparse.ArgumentTypeError(f"{text} is not writable")
    return text
