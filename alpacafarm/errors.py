"""Exceptions the CLI turns into one clear line and exit status 2 (no traceback unless ``--debug``)."""

from __future__ import annotations

import contextlib
import difflib
import functools
import itertools
import math
import re
from collections import Counter
from collections.abc import Iterable, Iterator
from typing import Any

from alpacafarm.exit_status import USER_ERROR


class UserError(Exception):
    """Something the user can fix: a bad recipe, an unknown name, a missing file or package.

    The message must name the culprit (file and YAML path, plugin, name) in one line.
    """

    exit_code = USER_ERROR


@contextlib.contextmanager
def naming_stage(stage: str) -> Iterator[None]:
    """Puts ``stage '<stage>':`` in front of any :class:`UserError` raised inside, unless its message names the
    stage already. The pipeline runs every stage's method inside it, so a shared helper (the method helpers such as
    ``alpacafarm.policy_training``, the model loaders) never has to know, or guess, which stage called it."""
    try:
        yield
    except UserError as error:
        message = str(error)
        if not re.search(rf"(?<![\w.-]){re.escape(stage)}(?![\w-])", message):
            error.args = (f"stage {stage!r}: {message}", *error.args[1:])
        raise


class RecipeError(UserError):
    """A recipe that does not parse or does not validate."""


class UnknownNameError(UserError):
    """A method, annotator, evaluator, ... name that no plugin registered."""


class PluginError(UserError):
    """A plugin that cannot be loaded or that conflicts with another plugin."""


class MissingPackageError(UserError):
    """An optional package is needed; the message carries the exact ``pip install`` command."""


def did_you_mean(name: str, choices: list[str]) -> str:
    """A suffix such as ``"; did you mean 'offline'?"`` (empty when nothing is close)."""
    close = difflib.get_close_matches(name, choices, n=3, cutoff=0.6)
    if not close:
        return ""
    # Only the near-best: 'split_instruction' suggests 'split_instructions', not also 'expert_iteration'.
    best = difflib.SequenceMatcher(None, name, close[0]).ratio()
    close = [c for c in close if difflib.SequenceMatcher(None, name, c).ratio() >= best - 0.05]
    return "; did you mean " + " or ".join(repr(c) for c in close) + "?"


# ----------------------------------------------------------------------------------------------- secrets
# A key pasted where a name was expected must never be echoed back (terminals, CI logs and bug reports keep it).

#: Prefixes of the common API key and token formats (OpenAI, Anthropic, Hugging Face, GitHub, GitLab, Slack, AWS,
#: Google), each followed by enough key characters that ordinary words do not match.
_KEY_PATTERN = re.compile(
    r"(?<![A-Za-z0-9])(?:(?:sk|pk|rk)-[A-Za-z0-9_\-]{8,}|sk_(?:live|test)_[A-Za-z0-9]{8,}|hf_[A-Za-z0-9]{16,}"
    r"|gh[pousr]_[A-Za-z0-9]{16,}|github_pat_[A-Za-z0-9_]{16,}|glpat-[A-Za-z0-9_\-]{16,}"
    r"|xox[abpr]-[A-Za-z0-9\-]{10,}|AKIA[0-9A-Z]{16}|AIza[0-9A-Za-z_\-]{30,})"
)
#: The pieces of an identifier: words (snake, kebab, camel or upper case) and runs of digits.
_PIECES = re.compile(r"[A-Z]+(?![a-z])|[A-Z]?[a-z]+|\d+")
_SECRET_WORDS = {"key", "apikey", "token", "secret", "password", "passwd", "credential", "credentials"}
REDACTED = "<redacted>"
SECRET_IN_NAME_FIELD = ("looks like a key itself; put the key in an environment variable and give its name "
                        "(value not shown)")


def _entropy(text: str) -> float:
    """Shannon entropy in bits per character."""
    counts = Counter(text)
    return -sum(n / len(text) * math.log2(n / len(text)) for n in counts.values())


def looks_like_secret(value: object) -> bool:
    """Whether ``value`` looks like a key or token: a known key prefix, or long, unbroken and random-looking.

    Names made of words and small numbers (``OPENAI_API_KEY``, ``myProjectKey``, ``team_key_2024``) are not;
    random text breaks into many one-character pieces (``aB3dE5...``), switches between digits and letters
    often (``a3f9c2e1...``) or has high entropy.
    """
    if not isinstance(value, str):
        return False
    text = value.strip()
    if _KEY_PATTERN.fullmatch(text):
        return True
    if len(text) < 20 or any(c.isspace() for c in text) or "://" in text:
        return False
    pieces = _PIECES.findall(text)
    tiny = sum((len(p) == 1 and p.isalpha()) or (p.isdigit() and len(p) > 4) for p in pieces)
    switches = sum(a.isdigit() != b.isdigit() for a, b in itertools.pairwise(text) if a.isalnum() and b.isalnum())
    entropy = _entropy(text)
    return entropy >= 3.0 and (tiny >= 0.3 * max(len(pieces), 1) or switches >= max(4, len(text) // 8)
                               or (len(text) >= 24 and entropy >= 4.25))


def is_secret_field(name: object) -> bool:
    """Whether a config field holds a secret or names one: ``api_key``, ``hf_token``, ``api_key_env``, ..."""
    if not isinstance(name, str):
        return False
    return bool(_SECRET_WORDS & set(re.split(r"[_\-.\s]+", name.lower())))


def is_env_name_field(name: object) -> bool:
    """Whether a config field expects the NAME of an environment variable holding a secret (``api_key_env``)."""
    return is_secret_field(name) and isinstance(name, str) and bool(re.search(r"(^|_)env(_?var(iable)?)?$", name))


def shown_value(field: object, value: object) -> str:
    """``repr(value)`` for a message, or ``<redacted>`` when it is (or looks like) a secret."""
    if looks_like_secret(value) or (is_secret_field(field) and not is_env_name_field(field)):
        return REDACTED
    return repr(value)


_QUOTED = re.compile(r"""(['"])([^'"\s/\\]{20,})\1""")


def scrub(message: str) -> str:
    """``message`` with key-shaped text replaced by ``<redacted>``: anything in a known key format, and quoted
    values that look like a key (last line of defence for messages that quote what the user typed)."""
    message = _KEY_PATTERN.sub(REDACTED, message)
    return _QUOTED.sub(lambda m: m[1] + REDACTED + m[1] if looks_like_secret(m[2]) else m[0], message)


#: Characters a server may put between a key's characters when it spaces or wraps it ("s k - t e s t").
_SPACER = r"[^A-Za-z0-9]{0,3}"
#: What a masked key's hidden middle looks like (``sk-te****wxyz``, ``sk-te...wxyz``, ``sk-te…wxyz``).
_MASK = r"(?:\*{2,}|\.{3,}|…|•{2,}|x{4,}|X{4,}|#{3,})"


def _base64_forms(secret: bytes) -> set[str]:
    """The base64 text of ``secret`` wherever it sits in an encoded string: for each of the 3 byte alignments,
    the characters that depend on the secret alone (standard and URL-safe alphabets)."""
    import base64

    forms = set()
    for offset in range(3):
        encoded = base64.b64encode(b"\0" * offset + secret).decode().rstrip("=")
        start, end = (8 * offset + 5) // 6, (8 * (offset + len(secret))) // 6
        piece = encoded[start:end]
        forms |= {piece, piece.replace("+", "-").replace("/", "_")}
    return {f for f in forms if len(f) >= 8}


@functools.lru_cache(maxsize=64)  # redact runs on every answer: compile a key's patterns once
def secret_patterns(secret: str) -> tuple[re.Pattern[str], ...]:
    """Patterns for ``secret`` and every transform of it a server or proxy might echo: as is, reversed, spaced out
    (either way), base64 (any alignment), URL-encoded, hex, and masked as prefix...suffix."""
    from urllib.parse import quote, quote_plus

    if not secret or len(secret) < 4:
        return ()
    patterns = [re.compile(_SPACER.join(re.escape(c) for c in text), re.IGNORECASE)
                for text in (secret, secret[::-1])]
    exact = {quote(secret, safe=""), quote_plus(secret), *_base64_forms(secret.encode())}
    patterns += [re.compile(re.escape(text)) for text in sorted(exact, key=len, reverse=True) if text != secret]
    patterns.append(re.compile(re.escape(secret.encode().hex()), re.IGNORECASE))
    if len(secret) >= 12:  # a masked key shows a few characters at each end; shorter ones would match words
        patterns.append(re.compile(re.escape(secret[:3]) + r"\S{0,40}?" + _MASK + r"\S{0,40}?"
                                   + re.escape(secret[-3:]), re.IGNORECASE))
    return tuple(patterns)


def redact(text: str, secrets: Iterable[str] = ()) -> str:
    """``text`` without the given ``secrets`` and their transforms (:func:`secret_patterns`: reversed, spaced,
    base64, URL-encoded, hex, masked), each replaced by ``<redacted>``, then :func:`scrub`-bed: for what a server
    sent back, which may quote the key it was given in any form."""
    for secret in secrets:
        for pattern in secret_patterns(secret):
            text = pattern.sub(REDACTED, text)
    return scrub(text)


_WORD = re.compile(r"[A-Za-z0-9+/=_\-.%]{20,}")


def scrub_tokens(text: str) -> str:
    """``text`` with every long unbroken token that looks like a key (:func:`looks_like_secret`) redacted: for
    text from outside (a provider's error message) that may carry a credential in a form no one can predict."""
    return _WORD.sub(lambda m: REDACTED if looks_like_secret(m[0]) else m[0], text)


def public_url(url: str) -> str:
    """``url`` without user:password, query or fragment (where keys hide), to be printed or logged."""
    from urllib.parse import urlsplit, urlunsplit

    parts = urlsplit(url)
    netloc = parts.hostname or ""
    if parts.port:
        netloc += f":{parts.port}"
    return urlunsplit((parts.scheme, netloc, parts.path, "", ""))


def redact_url(url: str) -> str:
    """``url`` with a password in its user info and every query value replaced by ``<redacted>`` (the rest kept,
    so a written recipe still says which endpoint it used)."""
    from urllib.parse import parse_qsl, urlsplit, urlunsplit

    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError:
        return REDACTED
    if not parts.scheme or not parts.netloc:
        return url
    netloc = parts.hostname or ""
    if port:
        netloc += f":{port}"
    if parts.username is not None:
        netloc = f"{REDACTED if parts.password is None else parts.username + ':' + REDACTED}@{netloc}"
    query = "&".join(f"{k}={REDACTED}" for k, _ in parse_qsl(parts.query, keep_blank_values=True))
    return urlunsplit((parts.scheme, netloc, parts.path, query, ""))


_URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")


def redact_secrets(value: Any, field: object = None) -> Any:
    """A copy of plain data (a resolved recipe, a config) fit to be written: URLs lose credentials and query
    values, fields that hold a secret (``api_key``, ``hf_token``; not ``api_key_env``, a variable name) and
    key-shaped strings become ``<redacted>``."""
    if isinstance(value, dict):
        return {k: redact_secrets(v, k) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [redact_secrets(v, field) for v in value]
    if isinstance(value, str):
        if is_secret_field(field) and not is_env_name_field(field):
            return REDACTED
        if _URL.match(value):
            return redact_url(value)
        return REDACTED if _KEY_PATTERN.fullmatch(value.strip()) else scrub(value)
    return value
