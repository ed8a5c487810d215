"""The validator interface: compare the simulator with human data (built-ins live in ``alpacafarm_validation``)."""

from __future__ import annotations

from typing import Any, ClassVar, Protocol


class ValidationResult(Protocol):
    def to_json(self) -> dict[str, Any]:
        """The result as plain data (printed by ``alpacafarm compare --json``)."""


class Validator:
    """Base class: ``Validator(config).validate(*records) -> result``; ``config_class`` validates the config."""

    config_class: ClassVar[Any] = None

    def __init__(self, config: Any = None) -> None:
        self.config = config

    def validate(self, *records: list[dict[str, Any]]) -> ValidationResult:
        raise NotImplementedError(f"{type(self).__name__}.validate")
