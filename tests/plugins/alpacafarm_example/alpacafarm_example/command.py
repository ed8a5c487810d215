"""``alpacafarm example-hello [NAME]``."""

from __future__ import annotations


def main(argv: list[str]) -> int:
    name = argv[0] if argv else "world"
    print(f"hello {name} from alpacafarm-example")
    return 0
