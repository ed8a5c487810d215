"""``alpacafarm example-hello [NAME]``: a command is ``main(argv) -> exit status``; it parses its own argv."""

from __future__ import annotations


def main(argv: list[str]) -> int:
    name = argv[0] if argv else "world"
    print(f"hello {name} from alpacafarm-example")
    return 0
