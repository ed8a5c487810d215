"""Plugin config blocks → config objects: one validation, errors that name the YAML file, line and path.

A plugin declares ``config_class`` on what it registers: a pydantic model, a dataclass (TRL's and transformers'
configs are dataclasses: each field is type-checked and coerced, ``__post_init__`` errors are reported at the
block's path), or ``None`` (it takes no config: the block must be empty and the plugin receives ``None``).
:meth:`alpacafarm.registry.Registry.create` is the one caller that builds objects; the recipe loader calls
:func:`validate_plugin_config` to validate every block once, while the YAML positions are at hand.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any

from pydantic import BaseModel, TypeAdapter, ValidationError

from alpacafarm.errors import (
    REDACTED,
    SECRET_IN_NAME_FIELD,
    RecipeError,
    did_you_mean,
    is_env_name_field,
    is_secret_field,
    looks_like_secret,
    shown_value,
)
from alpacafarm.yamlsource import Path_, SourcedDocument


def is_config_object(config_class: Any, value: Any) -> bool:
    """Whether ``value`` is already a validated instance of ``config_class`` (nothing to validate again)."""
    return isinstance(config_class, type) and isinstance(value, config_class)


def _unwrap_model(annotation: Any) -> Any:
    """The pydantic model class inside ``X | None``, ``list[X]`` or ``dict[str, X]`` (for key suggestions)."""
    for arg in typing.get_args(annotation) or ():
        inner = _unwrap_model(arg)
        if inner is not None:
            return inner
    return annotation if isinstance(annotation, type) and issubclass(annotation, BaseModel) else None


def _known_keys(root: type[BaseModel], loc: tuple) -> list[str]:
    model: Any = root
    for part in loc:
        if isinstance(part, int) or model is None:
            continue
        field = model.model_fields.get(part)
        model = _unwrap_model(field.annotation) if field is not None else None
    return sorted(model.model_fields) if model is not None else []


def _data_path(loc: tuple, data: Any) -> Path_:
    """Drop pydantic's union/validator tags from an error location, keeping the real path into ``data``."""
    path: list[str | int] = []
    node = data
    for part in loc:
        if ((isinstance(node, dict) and part in node)
                or (isinstance(node, list) and isinstance(part, int) and 0 <= part < len(node))):
            path.append(part)
            node = node[part]
    return tuple(path)


def pydantic_error(exc: ValidationError, doc: SourcedDocument, root_path: Path_, data: Any, root: Any) -> RecipeError:
    # An unknown key explains a "missing" one next to it (a misspelling), so it is reported first.
    errors = sorted(exc.errors(), key=lambda e: e["type"] != "extra_forbidden")
    first = errors[0]
    loc = tuple(first["loc"])
    path = (*root_path, *_data_path(loc, data))
    if first["type"] == "extra_forbidden":
        key = loc[-1]
        known = _known_keys(root, loc[:-1]) if isinstance(root, type) and issubclass(root, BaseModel) else []
        message = f"unknown key {key!r}{did_you_mean(str(key), known)}"
        if known:
            message += f" (allowed: {', '.join(known)})"
    elif first["type"] == "missing":
        path = (*root_path, *_data_path(loc[:-1], data))
        message = f"missing required key {loc[-1]!r}"
    elif first.get("input", "") is None and path:
        # ``config:`` with nothing after it (the commonest YAML slip) reads as null
        expected = _EXPECTED.get(first["type"], first["msg"].replace("Input should be ", ""))
        message = f"has no value (nothing after '{path[-1]}:'); give {expected}"
    else:
        message = _redacted(first["msg"].removeprefix("Value error, "), first.get("input"), loc)
    if len(errors) > 1:
        message += f" (and {len(errors) - 1} more error{'s' if len(errors) > 2 else ''})"
    return doc.error(path, message)


_EXPECTED = {"dict_type": "a mapping (e.g. {})", "list_type": "a list (e.g. [])", "string_type": "a string",
             "int_type": "an integer", "float_type": "a number", "bool_type": "true or false",
             "model_type": "a mapping (e.g. {})", "dataclass_type": "a mapping (e.g. {})"}


def _redacted(message: str, value: Any, loc: tuple) -> str:
    """``message`` without ``value`` when the value is (or looks like) a secret."""
    field = next((part for part in reversed(loc) if isinstance(part, str)), None)
    if isinstance(value, str) and value and (looks_like_secret(value) or is_secret_field(field)):
        return message.replace(value, REDACTED)
    return message


def check_secrets(data: Any, doc: SourcedDocument, path: Path_ = ()) -> None:
    """Refuse a key pasted where the name of its environment variable is expected (``api_key_env: sk-...``).

    Walks nested mappings and lists (a pool's member overrides); the error names the path, never the value.
    """
    if isinstance(data, dict):
        for key, value in data.items():
            if is_env_name_field(key) and (looks_like_secret(value)
                                           or (isinstance(value, str) and value.startswith(("sk-", "sk_")))):
                raise doc.error((*path, key), SECRET_IN_NAME_FIELD)
            check_secrets(value, doc, (*path, key))
    elif isinstance(data, list):
        for i, item in enumerate(data):
            check_secrets(item, doc, (*path, i))


def number_not_bool(annotation: Any) -> bool:
    """Whether a field of this type takes a number but not true/false (YAML's ``k: true`` would read as 1)."""
    args = typing.get_args(annotation) if typing.get_origin(annotation) in (typing.Union, types.UnionType) else (
        annotation,)
    return bool({int, float} & set(args)) and bool not in args


def reject_bool_numbers(fields: dict[str, Any], data: dict[str, Any], doc: SourcedDocument, path: Path_) -> None:
    """Refuse ``true``/``false`` given for a number field (``fields``: name -> annotation)."""
    for key, value in data.items():
        if isinstance(value, bool) and key in fields and number_not_bool(fields[key]):
            raise doc.error((*path, key), f"expected a number, got {str(value).lower()}")


def validate_plugin_config(config_class: Any, data: Any, doc: SourcedDocument | None = None,
                           path: Path_ = ()) -> Any:
    """Validate a plugin's config block with the plugin's own config class and return the config object.

    ``data`` may be a mapping (``None`` counts as empty) or an already validated config object, returned as is.
    Errors name ``doc``'s file and line for ``path`` (just the path when the block did not come from a file).
    """
    if is_config_object(config_class, data):
        return data
    doc = doc if doc is not None else SourcedDocument(None)
    data = {} if data is None else data
    if not isinstance(data, dict):
        raise doc.error(path, f"must be a mapping, got {type(data).__name__}")
    check_secrets(data, doc, path)
    if config_class is None:
        if data:
            raise doc.error((*path, next(iter(data))), "unknown key: this plugin takes no config")
        return None
    if isinstance(config_class, type) and issubclass(config_class, BaseModel):
        reject_bool_numbers({k: f.annotation for k, f in config_class.model_fields.items()}, data, doc, path)
        try:
            return config_class.model_validate(data)
        except ValidationError as exc:
            raise pydantic_error(exc, doc, path, data, config_class) from None
    if dataclasses.is_dataclass(config_class):
        return _validate_dataclass(config_class, data, doc, path)
    raise RecipeError(f"{config_class!r} is not a pydantic model or dataclass; plugins must declare one")


def _validate_dataclass(cls: type, data: dict[str, Any], doc: SourcedDocument, path: Path_) -> Any:
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    for key in data:
        if key not in fields:
            allowed = f" (allowed: {', '.join(sorted(fields))})" if len(fields) <= 20 else ""
            raise doc.error((*path, key),
                            f"unknown key {key!r} for {cls.__name__}{did_you_mean(key, list(fields))}{allowed}")
    try:
        hints = typing.get_type_hints(cls)
    except Exception:  # unresolvable forward references: fall back to the constructor's own checks
        hints = {}
    reject_bool_numbers(hints, data, doc, path)
    values = {}
    for key, value in data.items():
        hint = hints.get(key)
        if hint is None:
            values[key] = value
            continue
        try:
            adapter = TypeAdapter(hint)
        except Exception:  # a type pydantic cannot describe: pass the value through unchanged
            values[key] = value
            continue
        try:
            values[key] = adapter.validate_python(value)
        except ValidationError as exc:
            message = _redacted(exc.errors()[0]["msg"], value, (key,))
            raise doc.error((*path, key), f"{message} (got {shown_value(key, value)})") from None
    try:
        return cls(**values)
    except (TypeError, ValueError) as exc:
        raise doc.error(path, f"{cls.__name__}: {exc}") from None


