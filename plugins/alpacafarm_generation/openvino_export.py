"""A checkpoint exported for OpenVINO GenAI, once, cached by content (no optimum: our own trace).

The causal LM (any Llama-family folder a trainer saves, peft adapters merged into their base) is traced from its
transformers model with ``openvino.convert_model`` into the layout GenAI's pipelines read from a folder:

- ``openvino_model.xml``: inputs ``input_ids``, ``attention_mask``, ``position_ids``, ``beam_idx``; output
  ``logits`` for every input position (GenAI inserts its own gather of the positions it samples from); the
  key/value cache kept inside the graph as state (*stateful*), each read of it followed by a gather by
  ``beam_idx``, which is the pattern GenAI's paged-attention rewrite expects;
- ``openvino_tokenizer.xml`` / ``openvino_detokenizer.xml``: the checkpoint's tokenizer converted by
  ``openvino_tokenizers`` (GenAI's pipeline needs one; the backend itself tokenizes and decodes with the
  checkpoint's own transformers tokenizer, so prompts and texts are exactly the transformers backend's);
- ``config.json``, and ``generation_config.json`` holding only the model's stop tokens (nothing else of a
  checkpoint's generation config is inherited, as in :mod:`alpacafarm.sampling`).

The folder lives under ``<cache dir>/openvino/`` named by the checkpoint's content fingerprint, written to a
temporary folder and renamed into place under a lock.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import warnings
from pathlib import Path
from typing import Any

from alpacafarm.errors import UserError
from alpacafarm.model_sources import resolve_model_path
from alpacafarm.paths import cache_dir

#: Bump when the exported layout changes, so caches written by older code are not reused.
#: 2: GenAI's layout (openvino_model.xml with logits at every position, converted tokenizer, configs).
EXPORT_VERSION = 2
MODEL_FILE = "openvino_model.xml"
INFO_FILE = "export.json"


def _weight_files(folder: Path) -> list[Path]:
    names = ("config.json", "adapter_config.json", "generation_config.json")
    return sorted(p for p in folder.iterdir()
                  if p.is_file() and (p.name in names or p.suffix in (".safetensors", ".bin")))


def checkpoint_fingerprint(location: str) -> str:
    """SHA-256 over the files that define the model's function (config, weights, adapters, and for an adapter
    folder its base model's fingerprint) and the tokenizer files (the export holds a converted tokenizer)."""
    folder = Path(location)
    if not folder.is_dir():
        raise UserError(f"the openvino backend needs a local model folder, got {location!r}")
    digest = hashlib.sha256(f"alpacafarm-openvino-{EXPORT_VERSION}".encode())
    files = _weight_files(folder)
    if not any(f.name == "config.json" or f.name == "adapter_config.json" for f in files):
        raise UserError(f"{location!r} holds no config.json: not a model folder")
    tokenizer_files = sorted(p for p in folder.iterdir() if p.is_file() and p.name.startswith(("tokenizer", "vocab",
                                                                                                "merges", "special")))
    for file in files + tokenizer_files:
        digest.update(file.name.encode() + b"\0")
        with file.open("rb") as handle:
            while chunk := handle.read(1 << 24):
                digest.update(chunk)
    adapter = folder / "adapter_config.json"
    if adapter.is_file():
        base = json.loads(adapter.read_text(encoding="utf-8")).get("base_model_name_or_path")
        digest.update(checkpoint_fingerprint(resolve_model_path(base)).encode() if base else b"")
    return digest.hexdigest()[:32]


def _trace(model: Any) -> Any:
    """The stateful OpenVINO graph of ``model`` (see the module docstring)."""
    import openvino as ov
    import torch
    from openvino import opset13
    from openvino._offline_transformations import apply_make_stateful_transformation
    from transformers.cache_utils import DynamicCache

    config = model.config.get_text_config(decoder=True)
    n_layers = config.num_hidden_layers
    n_kv = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads

    class Step(torch.nn.Module):
        """One forward step over (new tokens, the cache so far): logits at every new position, the grown cache."""

        def __init__(self) -> None:
            super().__init__()
            self.model = model

        def forward(self, input_ids: Any, attention_mask: Any, position_ids: Any, *past: Any) -> tuple[Any, ...]:
            cache = DynamicCache(config=config)
            for i, layer in enumerate(cache.layers):
                layer.dtype, layer.device = past[2 * i].dtype, past[2 * i].device
                layer.keys, layer.values, layer.is_initialized = past[2 * i], past[2 * i + 1], True
            out = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                             past_key_values=cache, use_cache=True)
            grown = [t for layer in out.past_key_values.layers[:n_layers] for t in (layer.keys, layer.values)]
            return (out.logits, *grown)

    batch, past_len, new_len = 2, 3, 4  # any sizes: every dimension of the graph stays dynamic
    past = [torch.zeros(batch, n_kv, past_len, head_dim) for _ in range(2 * n_layers)]
    example = (torch.ones(batch, new_len, dtype=torch.long), torch.ones(batch, past_len + new_len, dtype=torch.long),
               torch.arange(past_len, past_len + new_len).repeat(batch, 1), *past)
    with torch.no_grad(), warnings.catch_warnings():
        # The tracer warns about shape-dependent branches; the ones it fixes hold for every call GenAI makes
        # (the mask always covers cache + new tokens). OpenVINO traces with torch.jit (deprecated in torch,
        # still working): not the user's concern.
        for category in (torch.jit.TracerWarning, DeprecationWarning, FutureWarning):
            warnings.simplefilter("ignore", category)
        graph = ov.convert_model(Step(), example_input=example)
    names = ["input_ids", "attention_mask", "position_ids"] + [
        f"past_key_values.{i}.{kind}" for i in range(n_layers) for kind in ("key", "value")]
    for port, name in zip(graph.inputs, names, strict=True):
        port.get_tensor().set_names({name})
    outputs = ["logits"] + [f"present.{i}.{kind}" for i in range(n_layers) for kind in ("key", "value")]
    for port, name in zip(graph.outputs, outputs, strict=True):
        port.get_tensor().set_names({name})
    apply_make_stateful_transformation(graph, dict(zip(names[3:], outputs[1:], strict=True)))
    # beam_idx: which rows of the cache the next step continues -- a Gather between every cache read and its
    # users; a reset cache starts as (batch of input_ids, heads, 0 positions, head_dim) zeros.
    beam_idx = opset13.parameter([-1], ov.Type.i32, name="beam_idx")
    beam_idx.output(0).get_tensor().set_names({"beam_idx"})
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
    return graph


def _export(spec: Any, location: str, target: Path) -> None:
    """Write the GenAI folder of the causal LM at ``location`` into ``target``."""
    import openvino as ov
    from openvino_tokenizers import convert_tokenizer

    from alpacafarm.model_loading import load_merged_causal_lm, load_tokenizer

    spec = spec.model_copy(update={"dtype": "float32", "inference_dtype": None, "quantization": None,
                                   "device": "cpu", "lora": None})
    model = load_merged_causal_lm(spec, location).eval()
    graph = _trace(model)
    target.mkdir(parents=True)
    ov.save_model(graph, target / MODEL_FILE, compress_to_fp16=False)
    tokenizer = load_tokenizer(spec, location)
    encoder, decoder = convert_tokenizer(tokenizer, with_detokenizer=True, skip_special_tokens=True)
    ov.save_model(encoder, target / "openvino_tokenizer.xml")
    ov.save_model(decoder, target / "openvino_detokenizer.xml")
    model.config.to_json_file(target / "config.json")
    stops = getattr(model.generation_config, "eos_token_id", None)  # the model's own stop tokens (see sampling)
    stops = sorted({*(stops if isinstance(stops, list) else [stops]), tokenizer.eos_token_id} - {None})
    (target / "generation_config.json").write_text(json.dumps({"eos_token_id": stops}) + "\n", encoding="utf-8")
    info = {"checkpoint": location, "export_version": EXPORT_VERSION, "openvino": ov.__version__,
            "eos_token_id": stops}
    (target / INFO_FILE).write_text(json.dumps(info, indent=2) + "\n", encoding="utf-8")


def exported_model(spec: Any, model_path: str) -> Path:
    """The GenAI folder of the checkpoint, exported on first use (atomically: a temporary folder renamed into
    place under a lock, so a crash leaves no half cache and two processes never export at once)."""
    location = resolve_model_path(model_path)
    root = cache_dir() / "openvino"
    target = root / checkpoint_fingerprint(location)
    if (target / INFO_FILE).is_file():
        return target
    root.mkdir(parents=True, exist_ok=True)
    with (root / f".{target.name}.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (target / INFO_FILE).is_file():
            from alpacafarm.console import console

            console().print(f"exporting {location} to OpenVINO (once) ...")
            tmp = root / f"{target.name}.tmp{os.getpid()}"
            shutil.rmtree(tmp, ignore_errors=True)
            try:
                _export(spec, location, tmp)
                shutil.rmtree(target, ignore_errors=True)  # a folder without its info file (should not happen)
                os.replace(tmp, target)
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
    return target
