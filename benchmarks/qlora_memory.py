"""Peak GPU memory and step time of PPO and DPO in 4-bit QLoRA on a 7B-shaped Llama (random weights).

The claim under test: with ``quantization: 4bit`` and ``lora:`` in the model block, PPO (one 4-bit base carrying
policy, value and reward adapters; reference = adapters off) and DPO (TRL's DPOTrainer; reference = adapters off)
train a LLaMA-7B-sized model on one 24 GB GPU.

    python benchmarks/qlora_memory.py                               # both methods, 3 steps each
    python benchmarks/qlora_memory.py --methods ppo --steps 5 --max-new-tokens 300
    python benchmarks/qlora_memory.py --model /path/to/llama-7b      # real weights instead of random ones

Without ``--model`` a random-init Llama with LLaMA-7B's shape (hidden 4096, 32 layers, 32 heads, intermediate
11008, vocabulary 32000) is written once in bfloat16 to ``--work-dir`` (about 13.5 GB of disk) with an offline
byte-level tokenizer padded to 32,000 tokens, and loaded in 4-bit NF4 from there, exactly as a recipe loads a
model. The PPO reward model is a LoRA reward adapter (zero-initialised adapters, random score head) on that base,
as a LoRA ``reward_model`` stage would leave it. Each method runs in its own process so that peak memory
(``torch.cuda.max_memory_allocated``) covers that method only; step time is the median wall time of the steps
after the first. Needs a CUDA GPU and bitsandbytes (``pip install 'alpacafarm[qlora]'``).

``--cpu-smoke`` runs the same code on the CPU with a tiny shape (no memory figures): a check that the program
works, for machines without a GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

SHAPE_7B = {"hidden": 4096, "layers": 32, "heads": 32, "intermediate": 11008, "vocab": 32000}
SHAPE_TINY = {"hidden": 64, "layers": 2, "heads": 4, "intermediate": 128, "vocab": 4096}
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
GIB = 1024 ** 3
BUDGET_GIB = 24.0


# ------------------------------------------------------------------------------------------------ model files


def padded_tokenizer(vocab: int) -> Any:
    """The offline test tokenizer, padded with placeholder tokens to ``vocab`` entries (a 32k-vocabulary stand-in)."""
    from alpacafarm.testing import tiny_tokenizer

    tokenizer = tiny_tokenizer()
    missing = vocab - len(tokenizer)
    if missing > 0:
        tokenizer.add_tokens([f"<tok{i}>" for i in range(missing)])
    return tokenizer


def write_random_model(directory: Path, shape: dict[str, int], device: str) -> Path:
    """A random-init Llama of ``shape`` in bfloat16 (reused when its config already matches)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config_file = directory / "config.json"
    if config_file.is_file():
        saved = json.loads(config_file.read_text())
        if (saved.get("hidden_size"), saved.get("num_hidden_layers"), saved.get("vocab_size")) == (
                shape["hidden"], shape["layers"], shape["vocab"]):
            print(f"reusing the random model in {directory}", flush=True)
            return directory
    tokenizer = padded_tokenizer(shape["vocab"])
    config = LlamaConfig(vocab_size=shape["vocab"], hidden_size=shape["hidden"],
                         intermediate_size=shape["intermediate"],
                         num_hidden_layers=shape["layers"], num_attention_heads=shape["heads"],
                         num_key_value_heads=shape["heads"], max_position_embeddings=2048,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, bos_token_id=None,
                         tie_word_embeddings=False)
    started = time.perf_counter()
    torch.manual_seed(0)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(previous)
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory, max_shard_size="2GB")
    tokenizer.save_pretrained(directory)
    n_params = sum(p.numel() for p in model.parameters())
    del model
    if device == "cuda":
        torch.cuda.empty_cache()
    print(f"wrote a random {n_params / 1e9:.2f}B-parameter Llama to {directory} in "
          f"{time.perf_counter() - started:.0f}s", flush=True)
    return directory


def write_reward_adapter(directory: Path, shape: dict[str, int], base: Path, r: int, alpha: int) -> Path:
    """A LoRA reward-model folder for ``base``: zero adapters (B = 0), a random one-output ``score`` head."""
    import torch
    from peft import LoraConfig
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    generator = torch.Generator().manual_seed(1)
    hidden, inner = shape["hidden"], shape["intermediate"]
    dims = {"q_proj": (hidden, hidden), "k_proj": (hidden, hidden), "v_proj": (hidden, hidden),
            "o_proj": (hidden, hidden), "gate_proj": (hidden, inner), "up_proj": (hidden, inner),
            "down_proj": (inner, hidden)}
    tensors = {}
    for layer in range(shape["layers"]):
        for name, (fan_in, fan_out) in dims.items():
            group = "self_attn" if name.endswith(("q_proj", "k_proj", "v_proj", "o_proj")) else "mlp"
            prefix = f"base_model.model.model.layers.{layer}.{group}.{name}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(r, fan_in, generator=generator) / fan_in ** 0.5
            tensors[f"{prefix}.lora_B.weight"] = torch.zeros(fan_out, r)
    tensors["base_model.model.score.weight"] = torch.randn(1, hidden, generator=generator) / hidden ** 0.5
    save_file(tensors, str(directory / "adapter_model.safetensors"), metadata={"format": "pt"})
    LoraConfig(r=r, lora_alpha=alpha, target_modules=LORA_TARGETS, task_type="SEQ_CLS", modules_to_save=["score"],
               base_model_name_or_path=str(base)).save_pretrained(str(directory))
    padded_tokenizer(shape["vocab"]).save_pretrained(directory)
    return directory


# ------------------------------------------------------------------------------------------------ workers


def prompt_records(n: int) -> list[dict[str, Any]]:
    from alpacafarm.data import BUILTIN_DIR, read_records

    records = read_records(BUILTIN_DIR / "alpaca_eval_sample.jsonl")
    return [records[i % len(records)] for i in range(n)]


def model_spec(model: str, args: argparse.Namespace) -> Any:
    from alpacafarm.recipe import LoraSpec, ModelSpec

    return ModelSpec(name=model, dtype="bfloat16" if not args.cpu_smoke else "float32",
                     device="auto" if not args.cpu_smoke else "cpu", quantization="4bit",
                     lora=LoraSpec(r=args.lora_r, alpha=2 * args.lora_r, dropout=0.0))


def cuda_memory() -> dict[str, float]:
    import torch

    if not torch.cuda.is_available():
        return {}
    return {"allocated_gib": torch.cuda.memory_allocated() / GIB, "peak_gib": torch.cuda.max_memory_allocated() / GIB,
            "peak_reserved_gib": torch.cuda.max_memory_reserved() / GIB}


def run_ppo(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    from alpacafarm_methods.ppo.config import PPOMethodConfig
    from alpacafarm_methods.ppo.method import build_ppo_trainer

    config = PPOMethodConfig(
        output_dir=str(work / "ppo"), max_steps=args.steps, rollout_batch_size=args.rollout_batch_size,
        mini_batch_size=args.mini_batch_size, per_device_train_batch_size=args.micro_batch_size,
        generation_batch_size=args.rollout_batch_size, max_new_tokens=args.max_new_tokens, learning_rate=1e-5,
        save_strategy="no", report_to="none", logging_steps=1, score_batch_size=args.micro_batch_size,
        bf16=not args.cpu_smoke, gradient_checkpointing=not args.cpu_smoke)
    trainer = build_ppo_trainer(config, model_spec(args.model, args), args.model, args.reward_model,
                                prompt_records(args.rollout_batch_size))
    loaded = cuda_memory()
    trainer.train()
    steps = [e for e in trainer.state.log_history if "score" in e]
    times = [e["rollout_time"] + e["update_time"] for e in steps]
    return {"method": "ppo", "steps": len(steps), "step_times": times, "after_load_gib": loaded.get("allocated_gib"),
            "response_length": statistics.mean(e["response_length"] for e in steps),
            "rollout_share": sum(e["rollout_time"] for e in steps) / sum(times), **cuda_memory()}


def run_dpo(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    from transformers import TrainerCallback

    spec = model_spec(args.model, args)
    records = prompt_records(args.dpo_batch_size * args.steps)
    rows = [{"prompt": r["instruction"], "chosen": r["reference"],
             "rejected": r["reference"][: len(r["reference"]) // 3]}
            for r in records]
    step_times: list[float] = []

    class Timer(TrainerCallback):
        def on_step_begin(self, *a: Any, **k: Any) -> None:
            self.started = time.perf_counter()

        def on_step_end(self, *a: Any, **k: Any) -> None:
            step_times.append(time.perf_counter() - self.started)

    settings = {"output_dir": str(work / "dpo"), "max_steps": args.steps,
                "per_device_train_batch_size": args.dpo_batch_size,
                "max_length": args.dpo_max_length, "learning_rate": 1e-6, "save_strategy": "no", "report_to": "none",
                "logging_steps": 1, "bf16": not args.cpu_smoke, "gradient_checkpointing": not args.cpu_smoke,
                "beta": 0.1}
    try:
        from alpacafarm.preference_training import DPOMethodConfig, build_dpo_trainer
    except ImportError:  # the dpo method is not there: TRL's trainer directly, configured the same way
        trainer = plain_dpo_trainer(spec, settings, rows, [Timer()])
        via = "trl.DPOTrainer"
    else:
        trainer = build_dpo_trainer(DPOMethodConfig(**settings), spec, args.model, rows, callbacks=[Timer()])
        via = "alpacafarm_methods.preference.dpo"
    loaded = cuda_memory()
    trainer.train()
    return {"method": "dpo", "steps": len(step_times), "step_times": step_times, "via": via,
            "after_load_gib": loaded.get("allocated_gib"), **cuda_memory()}


def plain_dpo_trainer(spec: Any, settings: dict[str, Any], rows: list[dict[str, str]], callbacks: list[Any]) -> Any:
    from datasets import Dataset
    from trl import DPOConfig, DPOTrainer

    from alpacafarm.model_loading import load_causal_lm, load_tokenizer, lora_config

    return DPOTrainer(model=load_causal_lm(spec, spec.name), args=DPOConfig(**settings),
                      train_dataset=Dataset.from_list(rows), processing_class=load_tokenizer(spec, spec.name),
                      peft_config=lora_config(spec), callbacks=callbacks)


def worker(args: argparse.Namespace) -> None:
    import torch

    if not args.cpu_smoke:
        torch.cuda.reset_peak_memory_stats()
    with tempfile.TemporaryDirectory(prefix="qlora-bench-") as work:
        result = (run_ppo if args.worker == "ppo" else run_dpo)(args, Path(work))
    print("RESULT " + json.dumps(result), flush=True)


# ------------------------------------------------------------------------------------------------ driver


def summarise(result: dict[str, Any]) -> dict[str, str]:
    times = result.get("step_times") or []
    timed = times[1:] or times
    peak = result.get("peak_gib")
    fits = "n/a" if peak is None else ("yes" if result.get("peak_reserved_gib", peak) < BUDGET_GIB else "NO")
    return {
        "method": result["method"],
        "steps": str(result.get("steps", 0)),
        "step s (median)": f"{statistics.median(timed):.2f}" if timed else "-",
        "after load GiB": "n/a" if result.get("after_load_gib") is None else f"{result['after_load_gib']:.2f}",
        "peak alloc GiB": "n/a" if peak is None else f"{peak:.2f}",
        "peak reserved GiB": "n/a" if result.get("peak_reserved_gib") is None else f"{result['peak_reserved_gib']:.2f}",
        f"fits {BUDGET_GIB:.0f} GB": fits,
        "note": result.get("error") or result.get("via", "")
        + (f" rollouts {result['rollout_share']:.0%} of step, {result['response_length']:.0f} tokens"
           if "rollout_share" in result else ""),
    }


def print_table(rows: list[dict[str, str]]) -> None:
    headers = list(rows[0])
    widths = [max(len(h), *(len(r[h]) for r in rows)) for h in headers]
    print(" | ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True)))
    print("-+-".join("-" * w for w in widths))
    for row in rows:
        print(" | ".join(row[h].ljust(w) for h, w in zip(headers, widths, strict=True)))


def forwarded(args: argparse.Namespace) -> list[str]:
    keys = ("steps", "rollout_batch_size", "mini_batch_size", "micro_batch_size", "max_new_tokens", "dpo_batch_size",
            "dpo_max_length", "lora_r")
    out = [f"--{k.replace('_', '-')}={getattr(args, k)}" for k in keys]
    return out + (["--cpu-smoke"] if args.cpu_smoke else [])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--methods", nargs="+", choices=("ppo", "dpo"), default=["ppo", "dpo"])
    parser.add_argument("--steps", type=int, default=3, help="training steps per method (the first is not timed)")
    parser.add_argument("--model", help="a model folder or hub ID (default: a random 7B-shaped Llama)")
    parser.add_argument("--reward-model", help="PPO's reward model folder (default: a LoRA reward adapter on --model)")
    parser.add_argument("--work-dir", default=str(Path(tempfile.gettempdir()) / "alpacafarm-qlora-bench"),
                        help="where the random model is written (and reused)")
    parser.add_argument("--rollout-batch-size", type=int, default=16, help="PPO rollouts per step")
    parser.add_argument("--mini-batch-size", type=int, default=8, help="PPO rollouts per optimizer step")
    parser.add_argument("--micro-batch-size", type=int, default=2, help="PPO sequences per forward pass")
    parser.add_argument("--max-new-tokens", type=int, default=300,
                        help="PPO response length (random weights rarely stop)")
    parser.add_argument("--dpo-batch-size", type=int, default=2, help="DPO pairs per step")
    parser.add_argument("--dpo-max-length", type=int, default=512)
    parser.add_argument("--lora-r", type=int, default=16)
    parser.add_argument("--cpu-smoke", action="store_true",
                        help="tiny shape on the CPU: checks the program, no figures")
    parser.add_argument("--worker", choices=("ppo", "dpo"), help=argparse.SUPPRESS)
    args = parser.parse_args()

    import importlib.util

    import torch

    if not args.cpu_smoke and not torch.cuda.is_available():
        print("qlora_memory: no CUDA device found. This benchmark measures GPU memory of 4-bit QLoRA training and "
              "needs an NVIDIA GPU (use --cpu-smoke to check the program itself on a CPU).", file=sys.stderr)
        return 2
    if importlib.util.find_spec("bitsandbytes") is None:
        print("qlora_memory: 4-bit loading needs bitsandbytes: pip install 'alpacafarm[qlora]'", file=sys.stderr)
        return 2
    if args.worker:
        worker(args)
        return 0

    shape = SHAPE_TINY if args.cpu_smoke else SHAPE_7B
    work = Path(args.work_dir) / ("tiny" if args.cpu_smoke else "llama-7b-random")
    if args.model is None:
        args.model = str(write_random_model(work / "model", shape, "cpu" if args.cpu_smoke else "cuda"))
    if args.reward_model is None and "ppo" in args.methods:
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(args.model)
        model_shape = {"hidden": config.hidden_size, "layers": config.num_hidden_layers,
                       "intermediate": config.intermediate_size, "vocab": config.vocab_size}
        args.reward_model = str(write_reward_adapter(work / "reward-adapter", model_shape, Path(args.model),
                                                     args.lora_r, 2 * args.lora_r))
    device = "CPU (smoke run)" if args.cpu_smoke else torch.cuda.get_device_name(0)
    print(f"model {args.model} in 4-bit NF4 + LoRA r={args.lora_r}; device {device}", flush=True)

    rows = []
    for method in args.methods:
        command = [sys.executable, __file__, "--worker", method, "--model", args.model, *forwarded(args)]
        if method == "ppo":
            command += ["--reward-model", args.reward_model]
        print(f"running {method} ...", flush=True)
        done = subprocess.run(command, capture_output=True, text=True)
        lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
        if done.returncode or not lines:
            tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
            oom = "OutOfMemoryError" in done.stderr or "out of memory" in done.stderr
            result = {"method": method, "error": ("out of memory: " if oom else "failed: ") + tail[0][:120]}
            print(done.stderr[-4000:], file=sys.stderr)
        else:
            result = json.loads(lines[-1][len("RESULT "):])
        rows.append(summarise(result))
    print()
    print_table(rows)
    return 0 if all("failed" not in r["note"] and "out of memory" not in r["note"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
