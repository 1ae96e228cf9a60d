"""The main job (README's first command): FDC on the bundled SmolLM2-135M-Instruct, end to end on this machine.

1. load the model (its GGUF is converted to safetensors once and cached);
2. calibrate it (cached after the first run): R from the post-RoPE queries and keys, V bases from the values;
3. find the removal rate that keeps 99% of the uncompressed model's perplexity score (exp(-NLL), so 99% allows
   about 1% more perplexity) on held-out Wikipedia text, by bisection (cached too);
4. compress the model in place with fdc_ops.hf.compress and print, before and after: the KV compression rate and the
   bytes of a generation's cache, perplexity, prefill and decode speed, and a generated sample.

Calibration text: Wikipedia by default, because on this model the V bases from random tokens lose far more accuracy
than those from real text (bench/results/calibration/README.md); ``--text random`` gives the paper's setting.
"""

from __future__ import annotations

import json
import time

import torch

from . import calibration, datasets, evaluation, hf, models

SEARCH_TOKENS = 4096  # held-out tokens per perplexity evaluation inside the search: about 5 s each on 2 cores
REPORT_TOKENS = 8192
PROMPT = "Explain in two sentences why the sky is blue."


def _sample(model, tokenizer, max_new_tokens: int = 48):
    """(text, cache bytes, tokens generated) of a greedy chat completion."""
    from transformers import DynamicCache

    messages = [{"role": "user", "content": PROMPT}]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    cache = DynamicCache()
    with torch.inference_mode():
        output = model.generate(**ids, max_new_tokens=max_new_tokens, do_sample=False, past_key_values=cache,
                                pad_token_id=tokenizer.eos_token_id)
    new = output[0, ids["input_ids"].shape[1]:]
    return tokenizer.decode(new, skip_special_tokens=True).strip(), hf.kv_cache_nbytes(cache), output.shape[1] - 1


def run(target: float = 0.99, text: str = "wikipedia", method: str = "fdc") -> dict:
    begin = time.time()
    torch.manual_seed(0)
    model, tokenizer = models.load_model()
    shape = models.attention_shape(model)
    print(f"model: {models.model_id(model)}: {shape.num_layers} layers, {shape.num_heads} query / "
          f"{shape.num_kv_heads} KV heads of {shape.head_dim}; {torch.get_num_threads()} CPU threads")
    artifact = calibration.load_or_calibrate(model, tokenizer, text=text)
    held_out = datasets.text_tokens(tokenizer, "wikipedia")[-REPORT_TOKENS:]
    search_tokens = held_out[-SEARCH_TOKENS:]

    cache_file = models.cache_dir() / "artifacts" / (
        f"search-{models.fingerprint(model)[:16]}-{text}-{method}-{target}.json")
    base_search = evaluation.perplexity(model, search_tokens, progress=False)
    if cache_file.is_file() and json.loads(cache_file.read_text()).get("base_perplexity") == base_search:
        found = json.loads(cache_file.read_text())
    else:
        def relative(rate: float) -> float:
            hf.compress(model, artifact, removal_rate=rate, method=method)
            try:
                return base_search / evaluation.perplexity(model, search_tokens, description=f"search r={rate:.4f}")
            finally:
                hf.restore(model)

        rate, score, tried = evaluation.search_removal_rate(relative, target)
        found = {"base_perplexity": base_search, "removal_rate": rate, "relative_score": score, "tried": tried}
        cache_file.parent.mkdir(parents=True, exist_ok=True)
        cache_file.write_text(json.dumps(found, indent=1))
    rate = found["removal_rate"]
    print(f"removal rate at {target:.0%} of the uncompressed perplexity score: {rate:.4f} "
          f"(bisection over {len(found['tried'])} evaluations of {SEARCH_TOKENS} held-out Wikipedia tokens)")

    rows = {}
    for label in ("uncompressed", "FDC"):
        if label == "FDC":
            allocation = hf.compress(model, artifact, removal_rate=rate, method=method)
        perplexity = evaluation.perplexity(model, held_out, description=f"{label} perplexity")
        speed = evaluation.latency(model, prompt_tokens=512, new_tokens=24)
        sample, cache_bytes, cached_tokens = _sample(model, tokenizer)
        rows[label] = {"perplexity": perplexity, **speed, "sample": sample, "cache_bytes": cache_bytes,
                       "cached_tokens": cached_tokens}
    hf.restore(model)

    full, fdc = rows["uncompressed"], rows["FDC"]
    full_per_token = 2 * shape.num_layers * shape.num_kv_heads * shape.head_dim * 4
    print(f"\nKV compression rate {allocation.compression_rate:.3f}: mean qk dim {allocation.qk_dims.double().mean():.1f}, "
          f"mean v dim {allocation.v_dims.double().mean():.1f} (of {shape.head_dim}); KV cache per token in fp32: "
          f"{full_per_token} B -> {allocation.kv_bytes_per_token(4)} B")
    print(f"{'':<34}{'uncompressed':>14}{'FDC':>14}")
    lines = [("KV cache of the sample (bytes)", "cache_bytes", "{:,.0f}"),
             (f"perplexity ({REPORT_TOKENS} Wikipedia tokens)", "perplexity", "{:.3f}"),
             ("prefill, 512 tokens (ms)", "ttft_ms", "{:.1f}"), ("decode, per token (ms)", "tbt_ms", "{:.2f}")]
    for title, key, form in lines:
        print(f"{title:<34}{form.format(full[key]):>14}{form.format(fdc[key]):>14}")
    for label, row in rows.items():
        print(f"\n{label} sample ({PROMPT!r}, greedy):\n  {row['sample']}")
    print(f"\ndone in {time.time() - begin:.0f} s (calibration and search are cached in {models.cache_dir()})")
    return {"removal_rate": rate, "compression_rate": allocation.compression_rate, **rows}
