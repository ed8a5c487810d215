"""Tokens/s of the batched generator vs a naive one-sample-at-a-time loop, same prompts, same lengths.

    python benchmarks/generation_throughput.py [--model smollm2-135m-instruct] [--prompts 16] [--n 4]
                                               [--max-new-tokens 64] [--batch-size 16]

Both paths generate exactly ``max_new_tokens`` per sample (EOS is suppressed with ``min_new_tokens``) so the
token counts are equal and the comparison is fair. Prints tokens/s, the speed-up, and the device.
"""

from __future__ import annotations

import argparse
import time


def main() -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from alpacafarm.data import BUILTIN_DIR, read_records
    from alpacafarm.models import resolve_model_path
    from alpacafarm.prompts import format_prompt

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--n", type=int, default=4, help="samples per prompt")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=16, help="prompts per batch (each with n samples)")
    args = parser.parse_args()

    device = "cuda" if torch.cuda.is_available() else "cpu"
    path = resolve_model_path(args.model)
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16 if device == "cuda" else torch.float32)
    model = model.to(device).eval()
    records = read_records(BUILTIN_DIR / "alpaca_eval_sample.jsonl")[: args.prompts]
    prompts = [format_prompt(r["instruction"], r["input"], style="chat_template", tokenizer=tokenizer) for r in records]
    fixed = {"max_new_tokens": args.max_new_tokens, "min_new_tokens": args.max_new_tokens, "do_sample": True,
             "top_k": 0, "temperature": 1.0, "pad_token_id": tokenizer.pad_token_id or tokenizer.eos_token_id}
    total_tokens = len(prompts) * args.n * args.max_new_tokens

    from alpacafarm.generation import TransformersGenerator

    generator = TransformersGenerator(model, tokenizer)
    # warm-up (first-call allocations) outside the timings
    model.generate(**tokenizer(prompts[:1], return_tensors="pt").to(device), **{**fixed, "max_new_tokens": 4,
                                                                                  "min_new_tokens": 4})

    started = time.perf_counter()
    with torch.no_grad():
        for prompt in prompts:
            encoded = tokenizer(prompt, return_tensors="pt", add_special_tokens=False).to(device)
            for _ in range(args.n):
                model.generate(**encoded, **fixed)
    naive = time.perf_counter() - started

    from alpacafarm.generation import SamplingConfig

    model.generation_config.min_new_tokens = args.max_new_tokens  # same lengths as the naive loop
    sampling = SamplingConfig(n=args.n, max_new_tokens=args.max_new_tokens, batch_size=args.batch_size)
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    started = time.perf_counter()
    generator.generate(prompts, sampling)
    if device == "cuda":
        torch.cuda.synchronize()
    batched = time.perf_counter() - started
    produced = sum(map(sum, generator.last_token_counts))

    print(f"model {args.model} on {device} "
          f"({torch.cuda.get_device_name() if device == 'cuda' else f'{torch.get_num_threads()} CPU threads'})")
    print(f"{len(prompts)} prompts x {args.n} samples x {args.max_new_tokens} new tokens = {total_tokens} tokens")
    print(f"naive one-at-a-time : {naive:8.2f}s  {total_tokens / naive:9.1f} tokens/s")
    print(f"batched generator   : {batched:8.2f}s  {produced / batched:9.1f} tokens/s  "
          f"(batch {args.batch_size} x n {args.n})")
    print(f"speed-up            : {(produced / batched) / (total_tokens / naive):8.1f}x")
    if device == "cuda":
        print(f"peak GPU memory     : {torch.cuda.max_memory_allocated() / 2**30:.2f} GiB")


if __name__ == "__main__":
    main()
