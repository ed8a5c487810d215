"""An offline testing kit: tiny random-init models and a tokenizer, built in milliseconds without the hub.

Use these in unit tests of methods and plugins (see CONTRIBUTING.md)::

    from alpacafarm.testing import tiny_causal_lm, tiny_tokenizer, save_tiny_causal_lm

The tokenizer is a byte-level BPE trained once per process on the bundled instruction sample (2,048 tokens,
with a chat template), so tests never need a downloaded tokenizer. Models are Llama-shaped (2 layers,
hidden size 64): a training step takes milliseconds on a CPU.
"""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path
from typing import Any

TINY_VOCAB_SIZE = 2048
SPECIAL_TOKENS = ["<|endoftext|>", "<|pad|>", "<|user|>", "<|assistant|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'user' %}<|user|>{{ message['content'] }}\n"
    "{% else %}<|assistant|>{{ message['content'] }}<|endoftext|>\n{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


@cache
def _tokenizer_json() -> str:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from alpacafarm.data import BUILTIN_DIR, read_records

    records = read_records(BUILTIN_DIR / "alpaca_eval_sample.jsonl")
    corpus = [f"{r['instruction']}\n{r.get('input', '')}\n{r['reference']}" for r in records]
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=TINY_VOCAB_SIZE, special_tokens=SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(corpus, trainer=trainer)
    return tokenizer.to_str()


def tiny_tokenizer() -> Any:
    """A fresh ``PreTrainedTokenizerFast`` (byte-level BPE, 2,048 tokens, EOS = pad-able, chat template)."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(_tokenizer_json()),
        eos_token="<|endoftext|>", pad_token="<|pad|>", bos_token=None,
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def _llama_config(tokenizer: Any, hidden_size: int, num_layers: int, **overrides: Any) -> Any:
    from transformers import LlamaConfig

    params = {
        "vocab_size": len(tokenizer), "hidden_size": hidden_size, "intermediate_size": hidden_size * 2,
        "num_hidden_layers": num_layers, "num_attention_heads": 4, "num_key_value_heads": 2,
        "max_position_embeddings": 1024, "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id, "bos_token_id": None, "tie_word_embeddings": False,
    }
    params.update(overrides)
    return LlamaConfig(**params)


def tiny_causal_lm(tokenizer: Any = None, *, hidden_size: int = 64, num_layers: int = 2, seed: int = 0,
                   **config_overrides: Any) -> Any:
    """A random-init ``LlamaForCausalLM`` sized for unit tests (~0.3M parameters with the tiny tokenizer)."""
    import torch
    from transformers import LlamaForCausalLM

    tokenizer = tokenizer or tiny_tokenizer()
    torch.manual_seed(seed)
    return LlamaForCausalLM(_llama_config(tokenizer, hidden_size, num_layers, **config_overrides))


def tiny_sequence_classifier(tokenizer: Any = None, *, num_labels: int = 1, hidden_size: int = 64,
                             num_layers: int = 2, seed: int = 0, **config_overrides: Any) -> Any:
    """A random-init ``LlamaForSequenceClassification`` (a reward model with ``num_labels=1``)."""
    import torch
    from transformers import LlamaForSequenceClassification

    tokenizer = tokenizer or tiny_tokenizer()
    torch.manual_seed(seed)
    config = _llama_config(tokenizer, hidden_size, num_layers, num_labels=num_labels, **config_overrides)
    return LlamaForSequenceClassification(config)


def save_tiny_causal_lm(directory: str | Path, **kwargs: Any) -> str:
    """Save a tiny causal LM and its tokenizer as a model folder that any recipe's ``model.name`` can use."""
    directory = Path(directory)
    tokenizer = tiny_tokenizer()
    tiny_causal_lm(tokenizer, **kwargs).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return str(directory)


def offline_environment(hf_home: str | Path) -> dict[str, str]:
    """Environment variables that keep Hugging Face libraries off the network (a hub ID fails fast)."""
    return {
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "HF_HOME": str(hf_home),
        "HF_HUB_DISABLE_TELEMETRY": "1",
        "TOKENIZERS_PARALLELISM": "false",
    }


def write_records(path: str | Path, records: list[dict[str, Any]]) -> Path:
    """Write records as ``.json`` or ``.jsonl`` depending on the suffix (test data in one line)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix == ".jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    else:
        path.write_text(json.dumps(records), encoding="utf-8")
    return path


def run_recipe(recipe: str | Path, run_dir: str | Path, overrides: tuple[str, ...] | list[str] = ()) -> dict[str, Any]:
    """Run a recipe in-process through the pipeline, as ``alpacafarm run`` does; returns {stage name: artifact}."""
    from alpacafarm.pipeline import Pipeline
    from alpacafarm.plugins import get_registry
    from alpacafarm.recipe import load_recipe

    registry = get_registry()
    outcomes = Pipeline(load_recipe(recipe, list(overrides), registry), registry, run_dir).run()
    return {o.name: o.artifact for o in outcomes}


#: Topics of :func:`learnable_preferences`.
PREFERENCE_TOPICS = ("rivers", "baking", "chess", "planets", "gardens", "trains", "music", "history", "oceans",
                     "poetry")


def learnable_preferences(n: int) -> list[dict[str, Any]]:
    """``n`` preference records a tiny model can learn: the preferred output is a helpful on-topic answer, the
    other a curt refusal; the preferred side alternates (1, 2, 1, ...)."""
    records = []
    for i in range(n):
        topic = PREFERENCE_TOPICS[i % len(PREFERENCE_TOPICS)]
        good = f"Here is a clear and helpful answer about {topic}, with an example number {i}."
        bad = f"No. I refuse to talk about {topic}."
        winner = 1 + i % 2
        first, second = (good, bad) if winner == 1 else (bad, good)
        records.append({"instruction": f"Tell me something about {topic} (#{i}).", "input": "",
                        "output_1": first, "output_2": second, "preference": winner})
    return records


def tensorboard_scalars(folder: Any) -> dict[str, list[tuple[int, float]]]:
    """``(step, value)`` of every scalar tag in the TensorBoard event files under ``folder``, in file order (TFRecord
    framing: length, crc, an Event protobuf, crc; read with the protobuf definitions tensorboardX ships)."""
    import struct
    from pathlib import Path

    from tensorboardX.proto.event_pb2 import Event

    files = sorted(Path(folder).rglob("events.out.tfevents.*"))
    assert files, f"no event file under {folder}"
    scalars: dict[str, list[tuple[int, float]]] = {}
    for file in files:
        data, offset = file.read_bytes(), 0
        while offset < len(data):
            (length,) = struct.unpack("<Q", data[offset:offset + 8])
            event = Event.FromString(data[offset + 12:offset + 12 + length])
            offset += 12 + length + 4
            for value in event.summary.value:
                scalars.setdefault(value.tag, []).append((event.step, value.simple_value))
    return scalars
