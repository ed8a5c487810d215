"""The offline judge's weights file: its format, its fingerprint, reading it (the judge) and writing it (the fit).

A weights document is one JSON object: ``format`` (:data:`FORMAT_VERSION`), ``fit`` (the settings and data it
was fitted with), ``feature_names``, ``weights`` (the two linear heads, ``no_reference`` and ``reference``),
``ngrams`` (the fluency tables) and ``fingerprint``, the SHA-256 of everything else in canonical JSON. The judge
refuses a file whose fingerprint does not match, and the fingerprint is the ``offline`` annotator's label identity:
new weights re-judge every stage that annotates with it.

This module is all that the judge (:mod:`.judge`) and the maintainers' fit (``tools/fit_offline_judge.py``, outside
the package: it needs data that does not ship) share, so scoring never imports the fitting code.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any

__all__ = ["FORMAT_VERSION", "WEIGHTS_FILE", "fingerprint", "load_weights", "save_weights", "weights_identity"]

#: the shipped weights
WEIGHTS_FILE = Path(__file__).with_name("weights.json")
FORMAT_VERSION = "offline-judge-5"
REFIT = "refit it with tools/fit_offline_judge.py (in the source repository)"


def fingerprint(document: dict[str, Any]) -> str:
    """SHA-256 of the document without its ``fingerprint`` field (canonical JSON)."""
    body = {k: v for k, v in document.items() if k != "fingerprint"}
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def load_weights(path: str | Path = WEIGHTS_FILE) -> dict[str, Any]:
    """Read a weights document and check its format and fingerprint (a corrupted file fails loudly)."""
    from alpacafarm.errors import UserError
    from alpacafarm.paths import read_text

    path = Path(path)
    if not path.is_file():
        raise UserError(f"offline judge weights {path}: no such file")
    text = read_text(path, "offline judge weights", display=f"offline judge weights {path}")
    try:
        document = json.loads(text)
    except ValueError as exc:
        raise UserError(f"offline judge weights {path}: not JSON ({exc}); {REFIT}") from None
    if not isinstance(document, dict) or document.get("format") != FORMAT_VERSION:
        raise UserError(f"offline judge weights {path}: not a {FORMAT_VERSION} file; {REFIT}")
    if document.get("fingerprint") != fingerprint(document):
        raise UserError(f"offline judge weights {path}: content does not match its fingerprint (edited or "
                        f"corrupted); {REFIT}")
    return document


def save_weights(document: dict[str, Any], path: str | Path) -> None:
    """Write a weights document (canonical JSON, one line) atomically: it is written to a temporary file in the same
    folder and renamed over ``path``, so a fit that fails while writing (a value JSON cannot hold, a full disk, a
    kill) leaves the file that was there, never half a file."""
    path = Path(path)
    mode = path.stat().st_mode & 0o777 if path.is_file() else 0o644  # mkstemp's own is 0o600
    handle, temporary = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.chmod(temporary, mode)
        with os.fdopen(handle, "w", encoding="utf-8") as out:
            json.dump(document, out, sort_keys=True, separators=(",", ":"), allow_nan=False)
            out.write("\n")
        os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temporary)
        raise


def weights_identity(registry: Any, name: str) -> dict[str, str]:
    """What the ``offline`` annotator's labels depend on: the shipped weights' fingerprint (which also names the
    feature format and the language model); see :func:`alpacafarm.annotation.label_identity`."""
    document = load_weights(WEIGHTS_FILE)
    return {"weights": document["fingerprint"], "format": document["format"]}
