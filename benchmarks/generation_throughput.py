"""Tokens/s of the ``openvino`` generation backend vs the ``transformers`` backend, in one run, same prompts and
same sampling settings, with the agreement of their outputs.

    python benchmarks/generation_throughput.py [--model smollm2-135m-instruct] [--prompts 32]
        [--max-new-tokens 96] [--dtype bfloat16|float32] [--workloads outputs,best_of_n,greedy] [--chunks 1]

Workloads (the quickstart's sampling settings): ``outputs`` (n 1, temperature 0.7, 32 prompts a batch, as
``generate_outputs``), ``best_of_n`` (n 8, temperature 1.0, 4 prompts a batch, as ``best_of_n`` and
``preference_data``) and ``greedy`` (temperature 0, 32 prompts a batch). Each engine gets the prompts as the stage
gives them, in one call (the transformers sampler forms its batches of ``batch`` prompts; the openvino backend
keeps ``batch * n`` sequences running, refilling a finished one's slot at once); tokenizing, decoding and stopping
at EOS are included, and tokens/s counts the tokens each engine generated. The two engines take turns (who goes
first alternates between workloads and between the ``--chunks`` the prompts are cut into), so other load on the
machine hits both alike; CPU seconds are printed too, a figure less sensitive to such load.

Prints, per workload: tokens/s of each engine and the speed-up; for ``greedy`` the share of identical outputs and
of identical tokens before the first difference; for sampling workloads the mean response length and the mean
per-token log-likelihood (at the sampling temperature) of each engine's samples under the transformers model,
with standard errors: equal output distributions give equal figures up to noise.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import time
from typing import Any

WORKLOADS = {  # name: (n, temperature, prompts per batch)
    "outputs": (1, 0.7, 32),
    "best_of_n": (8, 1.0, 4),
    "greedy": (1, 0.0, 32),
}


def mean_se(values: list[float]) -> tuple[float, float]:
    se = statistics.stdev(values) / math.sqrt(len(values)) if len(values) > 1 else float("nan")
    return statistics.fmean(values), se


def log_likelihoods(model: Any, prompt_ids: list[list[int]], responses: list[list[int]],
                    temperature: float) -> list[float]:
    """Mean log-probability per token of each response given its prompt, logits divided by ``temperature``."""
    import torch

    scores = []
    with torch.no_grad():
        for prompt, response in zip(prompt_ids, responses, strict=True):
            if not response:
                continue
            ids = torch.tensor([prompt + response])
            logits = model(input_ids=ids).logits[0, len(prompt) - 1:-1].float() / temperature
            picked = torch.log_softmax(logits, -1).gather(1, torch.tensor(response)[:, None])
            scores.append(picked.mean().item())
    return scores


def main() -> None:
    import torch

    from alpacafarm.data import BUILTIN_DIR, read_records
    from alpacafarm.generation import SamplingConfig, TransformersGenerator
    from alpacafarm.recipe import ModelSpec
    from alpacafarm.sampling import sample, tokenize_prompts
    from alpacafarm_generation.openvino_backend import OpenVINOBackendConfig, openvino_backend

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--prompt-format", default="chat_template")
    parser.add_argument("--prompts", type=int, default=32, help="AlpacaEval instructions (the first N)")
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"],
                        help="inference dtype of both engines (the quickstart samples in bfloat16)")
    parser.add_argument("--workloads", default="outputs,best_of_n,greedy")
    parser.add_argument("--best-of-n-prompts", type=int, default=8,
                        help="prompts for the best_of_n workload (n 8 each)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--chunks", type=int, default=1,
                        help="calls per engine and workload (the engines alternate between them)")
    parser.add_argument("--threads", type=int, default=None,
                        help="CPU threads of both engines (default: each engine's own, all cores)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    spec = ModelSpec(name=args.model, dtype="float32", inference_dtype=args.dtype, device="cpu",
                     prompt_format=args.prompt_format)
    started = time.perf_counter()
    engines = {"transformers": TransformersGenerator.from_spec(spec),
               "openvino": openvino_backend(OpenVINOBackendConfig(threads=args.threads), spec, args.model)}
    print(f"model {args.model}, {args.dtype}, {torch.get_num_threads()} CPU threads; engines ready in "
          f"{time.perf_counter() - started:.1f}s (the OpenVINO export happens once per checkpoint)")
    hf = engines["transformers"]
    scorer = hf.model if args.dtype == "float32" else TransformersGenerator.from_spec(
        spec.model_copy(update={"inference_dtype": "float32"})).model
    records = read_records(BUILTIN_DIR / "alpaca_eval_sample.jsonl")[: args.prompts]
    prompts = hf.prompt_format.records(records)

    for position, name in enumerate(args.workloads.split(",")):
        n, temperature, batch = WORKLOADS[name]
        chosen = prompts[: args.best_of_n_prompts] if name == "best_of_n" else prompts
        sampling = SamplingConfig(n=n, temperature=temperature, max_new_tokens=args.max_new_tokens,
                                  batch_size=batch, seed=args.seed)
        seconds = dict.fromkeys(engines, 0.0)
        cpu = dict.fromkeys(engines, 0.0)
        tokens: dict[str, list[list[int]]] = {e: [] for e in engines}
        texts: dict[str, list[str]] = {e: [] for e in engines}
        queries: list[list[int]] = []
        size = math.ceil(len(chosen) / max(1, args.chunks))
        for turn, start in enumerate(range(0, len(chosen), size)):
            part = chosen[start:start + size]
            part_ids = tokenize_prompts(hf.tokenizer, part)
            queries += [q for q in part_ids for _ in range(n)]
            order = list(engines) if (turn + position) % 2 == 0 else list(reversed(engines))
            for engine in order:
                config = sampling.model_copy(update={"seed": args.seed + turn})
                began, began_cpu = time.perf_counter(), time.process_time()
                if engine == "transformers":  # TransformersGenerator.generate, keeping the token ids
                    samples = sample(hf.model, hf.tokenizer, part_ids, n=n, temperature=temperature,
                                     max_new_tokens=args.max_new_tokens, batch_size=batch, seed=config.seed)
                    ids = [s.response_ids for group in samples for s in group]
                    out = [s.text for group in samples for s in group]
                else:
                    out = [t for group in engines[engine].generate(part, config) for t in group]
                    ids = [r for group in engines[engine].last_token_ids for r in group]
                seconds[engine] += time.perf_counter() - began
                cpu[engine] += time.process_time() - began_cpu
                tokens[engine] += ids
                texts[engine] += out
        rate = {e: sum(map(len, tokens[e])) / seconds[e] for e in engines}
        print(f"\n[{name}] {len(chosen)} prompts x n {n}, temperature {temperature}, batch {batch} prompts, "
              f"max_new_tokens {args.max_new_tokens}")
        for engine in engines:
            print(f"  {engine:12s}: {sum(map(len, tokens[engine])):6d} tokens in {seconds[engine]:7.1f}s = "
                  f"{rate[engine]:7.1f} tokens/s ({cpu[engine]:7.1f} CPU s)")
        per_cpu = {e: sum(map(len, tokens[e])) / cpu[e] for e in engines}
        print(f"  speed-up    : {rate['openvino'] / rate['transformers']:.2f}x "
              f"(per CPU second {per_cpu['openvino'] / per_cpu['transformers']:.2f}x); load average "
              f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
        if temperature == 0:
            same = sum(a == b for a, b in zip(tokens["transformers"], tokens["openvino"], strict=True))
            prefix = [next((k for k, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
                      for a, b in zip(tokens["transformers"], tokens["openvino"], strict=True)]
            total = sum(len(a) for a in tokens["transformers"])
            print(f"  greedy agreement: {same}/{len(queries)} outputs identical; "
                  f"{sum(prefix)}/{total} transformers tokens before the first difference")
        else:
            for engine in engines:
                length = mean_se([float(len(t)) for t in tokens[engine]])
                ll = mean_se(log_likelihoods(scorer, queries, tokens[engine], temperature))
                print(f"  {engine:12s} samples: length {length[0]:6.1f} ± {length[1]:4.1f} tokens, "
                      f"log-likelihood/token {ll[0]:7.3f} ± {ll[1]:.3f} (under transformers float32, T={temperature})")


if __name__ == "__main__":
    main()
