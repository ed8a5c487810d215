"""The ``openvino`` generation backend: the same batched, seeded sampling as the transformers backend, with the
model's forward pass run by OpenVINO (extra ``fast-cpu``; benchmarks/generation_throughput.py says how it
compares with transformers on your CPU).

The checkpoint (any Llama-family folder a trainer saves, peft adapters merged into their base) is traced once
from its transformers model into an OpenVINO graph whose key/value cache lives inside the compiled model (a
*stateful* graph, so the cache never crosses into Python) and whose ``beam_idx`` input picks, at every step,
which rows of that cache continue: one prefill per prompt feeds its ``n`` samples, and finished samples leave the
batch instead of being computed to the end. The graph is cached under ``<cache dir>/openvino/`` keyed by the
checkpoint's content fingerprint, written to a temporary folder and renamed into place.

Decoding follows :func:`alpacafarm.sampling.sample`: prompts tokenized by the model's own tokenizer, longest
first in batches of ``batch_size`` prompts, each batch seeded from ``seed`` and its position, temperature and
top-p applied by transformers' own logits warpers (``temperature: 0`` is greedy), each response cut after its
first stop token. Weights and activations stay float32 unless the model block's ``inference_dtype`` asks for
bfloat16, so greedy outputs match the transformers backend up to float rounding
(``benchmarks/generation_throughput.py`` measures the agreement).
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.util
import json
import os
import shutil
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from alpacafarm.errors import MissingPackageError, UserError
from alpacafarm.generation import GenerationProgress, Generator, SamplingConfig
from alpacafarm.models import resolve_model_path
from alpacafarm.paths import cache_dir
from alpacafarm.prompts import PromptFormat

#: Bump when the exported graph changes, so caches written by older code are not reused.
EXPORT_VERSION = 1
MODEL_FILE = "model.xml"
INFO_FILE = "export.json"
EXTRA = "pip install 'alpacafarm[fast-cpu]'"


class OpenVINOBackendConfig(BaseModel):
    """Options of the ``openvino`` backend."""

    model_config = ConfigDict(extra="forbid")

    threads: int | None = Field(None, ge=1, description="CPU threads for inference (default: all cores)")
    precision: str | None = Field(
        None, pattern="^(float32|bfloat16)$",
        description="compute precision (default: the model block's inference dtype; float32 unless bfloat16)")


def require_openvino() -> None:
    if importlib.util.find_spec("openvino") is None:
        raise MissingPackageError(f"the openvino generation backend needs OpenVINO: {EXTRA}")


def _weight_files(folder: Path) -> list[Path]:
    names = ("config.json", "adapter_config.json", "generation_config.json")
    return sorted(p for p in folder.iterdir()
                  if p.is_file() and (p.name in names or p.suffix in (".safetensors", ".bin")))


def checkpoint_fingerprint(location: str) -> str:
    """SHA-256 over the files that define the model's function (config, weights, adapters, and for an adapter
    folder its base model's fingerprint); the tokenizer is read from the checkpoint itself at every load."""
    folder = Path(location)
    if not folder.is_dir():
        raise UserError(f"the openvino backend needs a local model folder, got {location!r}")
    digest = hashlib.sha256(f"alpacafarm-openvino-{EXPORT_VERSION}".encode())
    files = _weight_files(folder)
    if not any(f.name == "config.json" or f.name == "adapter_config.json" for f in files):
        raise UserError(f"{location!r} holds no config.json: not a model folder")
    for file in files:
        digest.update(file.name.encode() + b"\0")
        with file.open("rb") as handle:
            while chunk := handle.read(1 << 24):
                digest.update(chunk)
    adapter = folder / "adapter_config.json"
    if adapter.is_file():
        base = json.loads(adapter.read_text(encoding="utf-8")).get("base_model_name_or_path")
        digest.update(checkpoint_fingerprint(resolve_model_path(base)).encode() if base else b"")
    return digest.hexdigest()[:32]


def _export(spec: Any, location: str, target: Path) -> None:
    """Trace the causal LM at ``location`` into a stateful OpenVINO graph saved as ``target/model.xml``."""
    import openvino as ov
    import torch
    from openvino import opset13
    from openvino._offline_transformations import apply_make_stateful_transformation
    from transformers.cache_utils import DynamicCache

    from alpacafarm.modeling import load_merged_causal_lm

    spec = spec.model_copy(update={"dtype": "float32", "inference_dtype": None, "quantization": None,
                                   "device": "cpu", "lora": None})
    model = load_merged_causal_lm(spec, location).eval()
    config = model.config.get_text_config(decoder=True)
    n_layers = config.num_hidden_layers
    n_kv = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads

    class Step(torch.nn.Module):
        """One forward step over (new tokens, the cache so far): last position's logits and the grown cache."""

        def __init__(self) -> None:
            super().__init__()
            self.model = model

        def forward(self, input_ids: Any, attention_mask: Any, position_ids: Any, *past: Any) -> tuple[Any, ...]:
            cache = DynamicCache(config=config)
            for i, layer in enumerate(cache.layers):
                layer.dtype, layer.device = past[2 * i].dtype, past[2 * i].device
                layer.keys, layer.values, layer.is_initialized = past[2 * i], past[2 * i + 1], True
            out = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                             past_key_values=cache, use_cache=True, logits_to_keep=1)
            grown = [t for layer in out.past_key_values.layers[:n_layers] for t in (layer.keys, layer.values)]
            return (out.logits, *grown)

    batch, past_len, new_len = 2, 3, 4  # any sizes: every dimension of the graph stays dynamic
    past = [torch.zeros(batch, n_kv, past_len, head_dim) for _ in range(2 * n_layers)]
    example = (torch.ones(batch, new_len, dtype=torch.long), torch.ones(batch, past_len + new_len, dtype=torch.long),
               torch.arange(past_len, past_len + new_len).repeat(batch, 1), *past)
    with torch.no_grad(), warnings.catch_warnings():
        # The tracer warns about shape-dependent branches; the ones it fixes hold for every call this backend
        # makes (the mask always covers cache + new tokens), and the tests check prefill and decode shapes.
        # OpenVINO traces with torch.jit (deprecated in torch, still working): not the user's concern.
        for category in (torch.jit.TracerWarning, DeprecationWarning, FutureWarning):
            warnings.simplefilter("ignore", category)
        graph = ov.convert_model(Step(), example_input=example)
    names = ["input_ids", "attention_mask", "position_ids"] + [
        f"past.{i}.{kind}" for i in range(n_layers) for kind in ("key", "value")]
    for port, name in zip(graph.inputs, names, strict=True):
        port.get_tensor().set_names({name})
    outputs = ["logits"] + [f"present.{i}.{kind}" for i in range(n_layers) for kind in ("key", "value")]
    for port, name in zip(graph.outputs, outputs, strict=True):
        port.get_tensor().set_names({name})
    apply_make_stateful_transformation(graph, {f"past.{name[8:]}": name for name in outputs[1:]})
    # beam_idx: which rows of the cache the next step continues (prefill rows repeated for n samples, finished
    # rows dropped) -- a Gather between every cache read and its users.
    beam_idx = opset13.parameter([-1], ov.Type.i32, name="beam_idx")
    beam_idx.output(0).get_tensor().set_names({"beam_idx"})
    # A reset cache starts as (batch of input_ids, heads, 0 positions, head_dim) zeros.
    input_ids = next(p for p in graph.get_parameters() if p.output(0).get_names() == {"input_ids"})
    batch_size = opset13.gather(opset13.shape_of(input_ids, "i64"), opset13.constant([0]), opset13.constant(0))
    empty_shape = opset13.concat([batch_size, opset13.constant([n_kv, 0, head_dim], ov.Type.i64)], 0)
    empty = opset13.broadcast(opset13.constant(0.0, ov.Type.f32), empty_shape)
    variables = {variable.info.variable_id: variable for variable in graph.get_variables()}
    for op in graph.get_ops():
        if op.get_type_name() == "ReadValue":
            users = list(op.output(0).get_target_inputs())
            read = ov.op.read_value(empty.output(0), variables[op.get_variable_id()])
            picked = opset13.gather(read, beam_idx, opset13.constant(0))
            for user in users:
                user.replace_source_output(picked.output(0))
    graph.add_parameters([beam_idx])
    graph.validate_nodes_and_infer_types()
    target.mkdir(parents=True)
    ov.save_model(graph, target / MODEL_FILE, compress_to_fp16=False)
    stops = getattr(model.generation_config, "eos_token_id", None)  # the model's own stop tokens (see sampling)
    info = {"checkpoint": location, "export_version": EXPORT_VERSION, "openvino": ov.__version__,
            "eos_token_id": stops if isinstance(stops, list) else [stops] if stops is not None else []}
    (target / INFO_FILE).write_text(json.dumps(info, indent=2) + "\n", encoding="utf-8")


def exported_model(spec: Any, model_path: str) -> Path:
    """The OpenVINO graph of the checkpoint, exported on first use (atomically: a temporary folder renamed into
    place under a lock, so a crash leaves no half cache and two processes never export at once)."""
    location = resolve_model_path(model_path)
    root = cache_dir() / "openvino"
    target = root / checkpoint_fingerprint(location)
    if (target / MODEL_FILE).is_file():
        return target
    root.mkdir(parents=True, exist_ok=True)
    with (root / f".{target.name}.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (target / MODEL_FILE).is_file():
            from alpacafarm.console import console

            console().print(f"exporting {location} to OpenVINO (once) ...")
            tmp = root / f"{target.name}.tmp{os.getpid()}"
            shutil.rmtree(tmp, ignore_errors=True)
            try:
                _export(spec, location, tmp)
                shutil.rmtree(target, ignore_errors=True)  # a folder without its graph (should not happen)
                os.replace(tmp, target)
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
    return target


class OpenVINOGenerator(Generator):
    """Batched sampling with an exported stateful OpenVINO graph (see the module docstring)."""

    def __init__(self, compiled: Any, tokenizer: Any, stop_ids: Sequence[int],
                 prompt_format: PromptFormat | None = None) -> None:
        self.compiled = compiled
        self.request = compiled.create_infer_request()
        self.tokenizer = tokenizer
        self.stop_ids = sorted(set(stop_ids))
        self.prompt_format = prompt_format or PromptFormat(tokenizer=tokenizer)
        #: per completion of the last call, the token ids generated (the stop token kept, as the sampler does)
        self.last_token_ids: list[list[list[int]]] = []
        self.last_token_counts = []
        self.last_finished = []

    def _step(self, input_ids: Any, attention_mask: Any, position_ids: Any, beam_idx: Any) -> Any:
        import torch

        self.request.infer({"input_ids": input_ids.numpy(), "attention_mask": attention_mask.numpy(),
                            "position_ids": position_ids.numpy(), "beam_idx": beam_idx.numpy()})
        return torch.from_numpy(self.request.get_tensor("logits").data[:, -1, :].copy())

    def _batch(self, queries: list[list[int]], sampling: SamplingConfig, seed: int) -> list[list[list[int]]]:
        """``n`` token lists per query (each cut after its first stop token)."""
        import torch
        from transformers import TemperatureLogitsWarper, TopPLogitsWarper

        from alpacafarm.sampling import left_pad

        n, greedy = sampling.n, sampling.temperature == 0
        warpers = [] if greedy else [TemperatureLogitsWarper(sampling.temperature)]
        if not greedy and sampling.top_p < 1.0:
            warpers.append(TopPLogitsWarper(sampling.top_p))
        generator = torch.Generator().manual_seed(seed)
        pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.stop_ids[0]
        input_ids, mask = left_pad(queries, pad_id)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        self.request.reset_state()
        logits = self._step(input_ids, mask, positions, torch.arange(len(queries), dtype=torch.int32))
        rows = torch.arange(len(queries)).repeat_interleave(n)  # sample row -> its prompt's cache row
        logits, mask, position = logits[rows], mask[rows], positions[rows, -1]
        beam = rows.to(torch.int32)
        active = torch.arange(len(rows))  # sample rows still generating, in cache order
        tokens: list[list[int]] = [[] for _ in rows]
        stops = torch.tensor(self.stop_ids or [-1])
        for step in range(sampling.max_new_tokens):
            if greedy:
                chosen = logits.argmax(-1)
            else:
                for warper in warpers:
                    logits = warper(None, logits)
                chosen = torch.multinomial(torch.softmax(logits, -1), 1, generator=generator).squeeze(1)
            for row, token in zip(active.tolist(), chosen.tolist(), strict=True):
                tokens[row].append(token)
            going = ~torch.isin(chosen, stops)
            if step == sampling.max_new_tokens - 1 or not going.any():
                break
            keep = going.nonzero().squeeze(1)
            active, chosen, position = active[keep], chosen[keep], position[keep] + 1
            mask = torch.cat([mask[keep], torch.ones(len(keep), 1, dtype=mask.dtype)], dim=1)
            logits = self._step(chosen[:, None], mask, position[:, None], beam[keep])
            beam = torch.arange(len(keep), dtype=torch.int32)
        return [tokens[i * n:(i + 1) * n] for i in range(len(queries))]

    def generate(self, prompts: Sequence[str], sampling: SamplingConfig,
                 progress: GenerationProgress | None = None) -> list[list[str]]:
        from alpacafarm.sampling import tokenize_prompts
        from alpacafarm.seeding import stable_seed

        queries = tokenize_prompts(self.tokenizer, prompts)
        order = sorted(range(len(queries)), key=lambda i: len(queries[i]), reverse=True)
        responses: list[list[list[int]]] = [[] for _ in queries]
        for start in range(0, len(order), sampling.batch_size):
            indices = order[start:start + sampling.batch_size]
            batch = self._batch([queries[i] for i in indices], sampling, stable_seed(sampling.seed, start))
            for index, samples in zip(indices, batch, strict=True):
                responses[index] = samples
            if progress is not None:
                progress(len(indices))
        self.last_token_ids = responses
        self.last_token_counts = [[len(r) for r in group] for group in responses]
        self.last_finished = [[bool(r) and r[-1] in self.stop_ids for r in group] for group in responses]
        return [[self.tokenizer.decode(r, skip_special_tokens=True).strip() for r in group] for group in responses]

    def close(self) -> None:
        self.request = self.compiled = None


def openvino_backend(config: OpenVINOBackendConfig, spec: Any, model_path: str) -> Generator:
    """The ``openvino`` backend for the model block ``spec`` and the checkpoint ``model_path``."""
    require_openvino()
    import openvino as ov

    from alpacafarm.modeling import load_tokenizer

    config = config or OpenVINOBackendConfig()
    folder = exported_model(spec, model_path)
    precision = config.precision or spec.for_inference().dtype
    hint = "bf16" if precision == "bfloat16" else "f32"
    properties = {"INFERENCE_PRECISION_HINT": hint, "KV_CACHE_PRECISION": hint, "PERFORMANCE_HINT": "LATENCY",
                  "NUM_STREAMS": "1"}
    if config.threads:
        properties["INFERENCE_NUM_THREADS"] = str(config.threads)
    compiled = ov.Core().compile_model(str(folder / MODEL_FILE), "CPU", properties)
    tokenizer = load_tokenizer(spec, model_path, padding_side="left")
    info = json.loads((folder / INFO_FILE).read_text(encoding="utf-8"))
    stops = {tokenizer.eos_token_id, *info["eos_token_id"]} - {None}
    prompt_format = PromptFormat.for_model(spec.prompt_format, resolve_model_path(model_path), tokenizer)
    return OpenVINOGenerator(compiled, tokenizer, sorted(stops), prompt_format)


openvino_backend.config_class = OpenVINOBackendConfig  # type: ignore[attr-defined]
