"""A fake provider that gets its numbers and its batch files wrong the ways real ones do (issue 61): a real HTTP
server on 127.0.0.1, :class:`~alpacafarm.testing.batch_server.FakeBatchServer` with a few faults switched on.

- ``usage``: fields merged into the ``usage`` of every completion, live and in batches (``{"prompt_tokens":
  "lots"}``, ``-1e6``, ``1e9``, ``True``).
- ``listing``: how a finished batch's files list a ``custom_id`` more than once: ``"answered_and_failed"`` (the
  first answered line also in the error file), ``"twice_same"`` (the first answered line twice in the output
  file) or ``"twice_conflicting"`` (a second copy with the other verdict). A listed copy is billed: it is counted
  in ``executions``.
- ``rebought``: request bodies submitted again after the provider had answered them (what a client paid twice).
- :meth:`forget`: the provider no longer knows a batch (404 for it, as after a deletion or an account change);
  :meth:`lose_output`: it knows the batch but its output file is gone (404).

Used by ``tests/test_provider_numbers.py``, ``tests/test_batch_faults.py`` and ``benchmarks/batch_faults.py``.
"""

from __future__ import annotations

import collections
import json
from typing import Any, Literal

from alpacafarm.testing.batch_server import FakeBatchServer, body_hash

Listing = Literal["answered_and_failed", "twice_same", "twice_conflicting"]


def _error(message: str) -> dict:
    return {"error": {"message": message, "type": "invalid_request_error", "code": None, "param": None}}


def flipped(text: str) -> str:
    """The other verdict: every 1 a 2 and every 2 a 1 (a different answer to the same request)."""
    return text.translate(str.maketrans("12", "21"))


class FaultyBatchServer(FakeBatchServer):
    """:class:`FakeBatchServer` with the faults of the module switched on by attributes (changeable any time)."""

    def __init__(self, responder: Any = None, *, usage: dict[str, Any] | None = None,
                 listing: Listing | None = None, **kwargs: Any) -> None:
        super().__init__(responder, **kwargs)
        self.usage_fields = usage
        self.listing = listing
        self.gone: set[str] = set()  # batch and file ids answered with 404
        #: body hash -> times it was submitted again after the provider had answered (billed) it: a second payment
        self.rebought: collections.Counter[str] = collections.Counter()

    def forget(self, batch_id: str) -> None:
        """From now on, the batch is a 404 (its files too)."""
        with self._batch_lock:
            batch = self.batches[batch_id]
            self.gone |= {batch_id, batch["output_file_id"] or "", batch["error_file_id"] or ""} - {""}

    def lose_output(self, batch_id: str) -> None:
        """End the batch now (as its plan says) and make its output file a 404: the batch is known, its answers
        are not."""
        with self._batch_lock:
            batch = self.batches[batch_id]
            batch["plan"].delay_s = 0.0
            self._step(batch)
            if batch["output_file_id"]:
                self.gone.add(batch["output_file_id"])

    # ------------------------------------------------------------------------------------------------ faults
    def _completion(self, path: str, body: dict, text: str) -> dict:
        payload = super()._completion(path, body, text)
        if self.usage_fields is not None and "usage" in payload:
            payload["usage"] = {**payload["usage"], **self.usage_fields}
        return payload

    def _create(self, body: dict) -> dict:
        source = self.files.get(body.get("input_file_id", ""), {}).get("data", b"")
        answered = [h for h in (body_hash(json.loads(x)["body"]) for x in source.decode().splitlines() if x.strip())
                    if self.executions[h]]  # before the batch is created: a plan without delay answers at once
        view = super()._create(body)
        self.rebought.update(answered)
        return view

    def _route(self, method: str, parts: list[str], raw: bytes, headers: dict[str, str],
               full_path: str) -> tuple[int, dict | bytes]:
        if len(parts) >= 2 and parts[1] in self.gone:
            kind = "batch" if parts[0] == "batches" else "file"
            return 404, _error(f"No {kind} {parts[1]}")
        return super()._route(method, parts, raw, headers, full_path)

    def _end(self, batch: dict, status: str, answered: int) -> None:
        super()._end(batch, status, answered)
        if self.listing is None or not batch["output_file_id"]:
            return
        output = self.files[batch["output_file_id"]]
        rows = [json.loads(line) for line in output["data"].decode().splitlines() if line.strip()]
        first = rows[0]
        if self.listing == "answered_and_failed":
            failed = {"id": "batch_req_again", "custom_id": first["custom_id"], "error": None,
                      "response": {"status_code": 500, "request_id": "again", "body": _error("Fake 500")}}
            if batch["error_file_id"] is None:
                batch["error_file_id"] = f"file-errors-{batch['id']}"
                self.files[batch["error_file_id"]] = {"data": b"", "filename": "errors.jsonl",
                                                      "purpose": "batch_output"}
            self.files[batch["error_file_id"]]["data"] += (json.dumps(failed) + "\n").encode()
            return
        copy = json.loads(json.dumps(first))
        if self.listing == "twice_conflicting":
            for choice in copy["response"]["body"]["choices"]:
                if "message" in choice:
                    choice["message"]["content"] = flipped(choice["message"]["content"])
                else:
                    choice["text"] = flipped(choice["text"])
        line = next(x for x in batch["lines"] if x["custom_id"] == first["custom_id"])
        self.executions[body_hash(line["body"])] += 1  # a listed answer is a billed one
        output["data"] += (json.dumps(copy) + "\n").encode()
