"""``inspect_model``: load the recipe's (SFT) model, record what it is, and answer a few instructions.

A cheap first stage that proves the model block resolves and the model generates, before hours of training.
"""

from __future__ import annotations

import time

from pydantic import BaseModel, ConfigDict, Field

from alpacafarm.artifact_names import ArtifactName
from alpacafarm.data import write_json
from alpacafarm.method import Artifact, Method, StageContext, Table


class InspectModelConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    n_prompts: int = Field(2, ge=0, description="how many instructions to answer greedily")
    max_new_tokens: int = Field(32, ge=1, description="answer length cap in tokens")
    split: str = Field("eval", description="which split of the instruction input to draw prompts from")


class InspectModel(Method):
    """Writes ``summary.json``: architecture, parameter count, dtype, vocabulary, load time, greedy answers."""

    config_class = InspectModelConfig
    produces = ("table",)
    requires = (ArtifactName.SFT_MODEL, ArtifactName.INSTRUCTION_SPLITS)
    provides = ArtifactName.MODEL_REPORT

    def run(self, context: StageContext) -> Artifact:
        import torch

        from alpacafarm.model_loading import load_causal_lm, load_tokenizer
        from alpacafarm.model_sources import resolve_model_path
        from alpacafarm.prompts import format_prompt

        config: InspectModelConfig = self.config
        spec = context.recipe.model
        path = resolve_model_path(context.input("sft_model").path)
        started = time.perf_counter()
        tokenizer = load_tokenizer(spec, path)
        model = load_causal_lm(spec, path).eval()
        load_seconds = time.perf_counter() - started
        torch.manual_seed(context.seed)

        prompts = context.records("instruction_splits", config.split)[: config.n_prompts]
        samples, new_tokens, gen_seconds = [], 0, 0.0
        with context.progress("answering", len(prompts)) as advance:
            for record in prompts:
                text = format_prompt(record["instruction"], record.get("input"), style=spec.prompt_format,
                                     tokenizer=tokenizer)
                encoded = tokenizer(text, return_tensors="pt")
                t0 = time.perf_counter()
                with torch.no_grad():
                    out = model.generate(**encoded, max_new_tokens=config.max_new_tokens, do_sample=False,
                                         pad_token_id=tokenizer.pad_token_id or tokenizer.eos_token_id)
                gen_seconds += time.perf_counter() - t0
                answer_ids = out[0, encoded["input_ids"].shape[1]:]
                new_tokens += int(answer_ids.numel())
                samples.append({"instruction": record["instruction"], "input": record.get("input", ""),
                                "output": tokenizer.decode(answer_ids, skip_special_tokens=True)})
                advance()

        summary = {
            "model": spec.name, "path": path, "architecture": type(model).__name__,
            "parameters": sum(p.numel() for p in model.parameters()), "dtype": str(model.dtype).removeprefix("torch."),
            "vocab_size": len(tokenizer), "has_chat_template": bool(getattr(tokenizer, "chat_template", None)),
            "prompt_format": spec.prompt_format, "load_seconds": round(load_seconds, 2),
            "greedy_tokens_per_second": round(new_tokens / gen_seconds, 1) if gen_seconds else None,
            "samples": samples,
        }
        write_json(context.stage_dir / "summary.json", summary)
        rows = [[s["instruction"][:60], s["output"][:80].replace("\n", " ")] for s in samples]
        table = Table(f"{spec.name}: {summary['parameters'] / 1e6:.1f}M parameters", ["instruction", "greedy answer"],
                      rows)
        return Artifact("report", str(context.stage_dir / "summary.json"),
                        {key: summary[key] for key in ("architecture", "parameters", "dtype", "load_seconds")},
                        table=table)
