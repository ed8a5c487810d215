"""A fake OpenAI-compatible **batch** API on 127.0.0.1: ``/v1/files`` + ``/v1/batches``, next to the chat and
completion endpoints of :class:`~alpacafarm.testing.openai_server.FakeOpenAIServer` (which it extends), for tests
and benchmarks of ``mode: batch``::

    with FakeBatchServer(my_responder) as server:
        server.plan(BatchPlan(delay_s=2.0), BatchPlan(outcome="expired", answered=3))
        ...
        assert max(server.executions.values()) == 1     # no request body was ever answered (billed) twice

Each created batch takes the next queued :class:`BatchPlan` (default: complete at once). A batch stays
``validating`` then ``in_progress`` until ``delay_s`` has passed since its creation; it then ends as the plan says:
``completed`` (every line answered by the responder, but ``fail_lines`` lines that get a 500 in the error file),
``expired`` (only the first ``answered`` lines answered, the rest ``batch_expired`` in the error file) or
``failed`` (rejected, no output). ``POST /v1/batches/{id}/cancel`` makes it ``cancelling``, then ``cancelled``
with its first ``answered`` lines answered. Lines are answered when the batch ends, and each answered line is
counted in ``executions`` (by the SHA-256 of its canonical JSON body): what a provider bills.

Endpoints: ``POST /v1/files`` (multipart, ``purpose=batch``), ``GET /v1/files/{id}/content``, ``POST /v1/batches``,
``GET /v1/batches`` (newest first, ``limit``/``after``), ``GET /v1/batches/{id}``, ``POST /v1/batches/{id}/cancel``.
``create_delays`` holds back the answers to the next creations (the batch exists, the client times out).
"""

from __future__ import annotations

import collections
import email.parser
import email.policy
import hashlib
import json
import math
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any, Literal
from urllib.parse import parse_qs, urlsplit

from alpacafarm.testing.openai_server import FakeOpenAIServer, Fault, RecordedRequest, Responder

__all__ = ["BatchPlan", "FakeBatchServer", "body_hash"]


@dataclass
class BatchPlan:
    """How one batch behaves (see the module): ``delay_s`` before it ends (``inf``: never by itself), how it ends,
    how many lines fail with a 500 (``fail_lines``, the last ones), how many are answered before it expires or is
    cancelled (``answered``; default: half of them, rounded down, when it expires, none when it is cancelled)."""

    delay_s: float = 0.0
    outcome: Literal["completed", "expired", "failed"] = "completed"
    fail_lines: int = 0
    answered: int | None = None


def _error(message: str, type_: str) -> dict:
    return {"error": {"message": message, "type": type_, "code": None, "param": None}}


def body_hash(body: dict) -> str:
    """The SHA-256 of a request body's canonical JSON (sorted keys)."""
    return hashlib.sha256(json.dumps(body, sort_keys=True, ensure_ascii=False).encode("utf-8")).hexdigest()


class FakeBatchServer(FakeOpenAIServer):
    """:class:`FakeOpenAIServer` plus the batch endpoints. ``executions`` counts answered lines per body hash,
    ``submitted`` lines per body hash in created batches, ``created`` the batches created."""

    def __init__(self, responder: Responder | None = None, **kwargs: Any) -> None:
        super().__init__(responder, **kwargs)
        self.files: dict[str, dict[str, Any]] = {}
        self.batches: dict[str, dict[str, Any]] = {}
        self.executions: collections.Counter[str] = collections.Counter()
        self.submitted: collections.Counter[str] = collections.Counter()
        self._plans: collections.deque[BatchPlan] = collections.deque()
        #: seconds by which to delay the answer to the next batch creations (each created at once): a client that
        #: times out has created a batch without knowing it
        self.create_delays: collections.deque[float] = collections.deque()
        self._batch_lock = threading.RLock()

    def plan(self, *plans: BatchPlan) -> None:
        """Queue the behaviour of the next created batches (default: complete at once)."""
        with self._batch_lock:
            self._plans.extend(plans)

    @property
    def created(self) -> int:
        return len(self.batches)

    def finish(self, batch_id: str | None = None) -> None:
        """End the given (or every) running batch now, as its plan says (a slow batch that is done)."""
        with self._batch_lock:
            for batch in self.batches.values():
                if batch_id in (None, batch["id"]):
                    batch["plan"].delay_s = 0.0

    # -------------------------------------------------------------------------------------------- handling
    def _handle(self, h: Any, method: str) -> None:
        path = h.path.split("?", 1)[0].rstrip("/")
        if not path.startswith(("/v1/files", "/v1/batches")):
            return super()._handle(h, method)
        raw = h.rfile.read(int(h.headers.get("content-length") or 0))
        headers = {k.lower(): v for k, v in h.headers.items()}
        record = RecordedRequest(path=path, body={}, headers=headers)
        with self._lock:
            self.requests.append(record)
        parts = path.split("/")[2:]  # files | batches, [id], [content | cancel]
        with self._batch_lock:
            try:
                status, payload = self._route(method, parts, raw, headers, h.path)
            except ValueError as exc:
                status, payload = 400, _error(str(exc), "invalid_request_error")
        delayed = parts == ["batches"] and method == "POST" and status == 200 and bool(self.create_delays)
        if delayed and self._stopping.wait(self.create_delays.popleft()):
            return self._drop(h, record)
        if isinstance(payload, bytes):
            return self._send(h, record, status, None, {"Content-Type": "application/octet-stream"}, raw=payload)
        self._send(h, record, status, payload)

    def _route(self, method: str, parts: list[str], raw: bytes, headers: dict[str, str],
               full_path: str) -> tuple[int, dict | bytes]:
        if parts == ["files"] and method == "POST":
            return 200, self._upload(raw, headers.get("content-type", ""))
        if len(parts) == 3 and parts[0] == "files" and parts[2] == "content" and method == "GET":
            found = self.files.get(parts[1])
            return (200, found["data"]) if found else (404, _error(f"No file {parts[1]}", "invalid_request_error"))
        if parts == ["batches"] and method == "POST":
            return 200, self._create(json.loads(raw or b"{}"))
        if parts == ["batches"] and method == "GET":
            query = parse_qs(urlsplit(full_path).query)
            return 200, self._list(int(query.get("limit", ["20"])[0]), query.get("after", [None])[0])
        if len(parts) >= 2 and parts[0] == "batches":
            batch = self.batches.get(parts[1])
            if batch is None:
                return 404, _error(f"No batch {parts[1]}", "invalid_request_error")
            if len(parts) == 3 and parts[2] == "cancel" and method == "POST":
                if batch["status"] in ("validating", "in_progress", "finalizing"):
                    batch["status"], batch["cancelling_at"] = "cancelling", int(time.time())
                return 200, self._view(batch)
            if len(parts) == 2 and method == "GET":
                return 200, self._view(batch)
        return 404, _error(f"Unknown path {method} /v1/{'/'.join(parts)}", "invalid_request_error")

    def _upload(self, raw: bytes, content_type: str) -> dict:
        message = email.parser.BytesParser(policy=email.policy.HTTP).parsebytes(
            b"Content-Type: " + content_type.encode() + b"\r\n\r\n" + raw)
        fields: dict[str, Any] = {}
        for part in message.iter_parts():
            name = part.get_param("name", header="content-disposition")
            fields[name] = (part.get_filename(), part.get_payload(decode=True))
        if "file" not in fields:
            raise ValueError("multipart upload without a 'file' part")
        filename, data = fields["file"]
        purpose = (fields.get("purpose", (None, b""))[1] or b"").decode()
        file_id = f"file-{uuid.uuid4().hex[:24]}"
        self.files[file_id] = {"data": data, "filename": filename, "purpose": purpose}
        return self._file_view(file_id)

    def _file_view(self, file_id: str) -> dict:
        found = self.files[file_id]
        return {"id": file_id, "object": "file", "bytes": len(found["data"]), "created_at": int(time.time()),
                "filename": found["filename"], "purpose": found["purpose"], "status": "processed"}

    def _create(self, body: dict) -> dict:
        source = self.files.get(body.get("input_file_id", ""))
        if source is None:
            raise ValueError(f"input_file_id {body.get('input_file_id')!r} was not uploaded")
        lines = [json.loads(line) for line in source["data"].decode("utf-8").splitlines() if line.strip()]
        for line in lines:
            if line.get("url") != body.get("endpoint") or line.get("method") != "POST":
                raise ValueError(f"line {line.get('custom_id')!r}: url/method do not match the batch's endpoint")
            self.submitted[body_hash(line["body"])] += 1
        now = time.time()
        batch_id = f"batch_{uuid.uuid4().hex[:24]}"
        plan = self._plans.popleft() if self._plans else BatchPlan()
        self.batches[batch_id] = {
            "id": batch_id, "endpoint": body.get("endpoint"), "input_file_id": body["input_file_id"],
            "completion_window": body.get("completion_window"), "metadata": body.get("metadata"), "lines": lines,
            "plan": BatchPlan(plan.delay_s, plan.outcome, plan.fail_lines, plan.answered), "status": "validating",
            "created": now, "created_at": int(now), "in_progress_at": None, "finished_at": None,
            "cancelling_at": None, "output_file_id": None, "error_file_id": None, "counts": (len(lines), 0, 0),
            "errors": None}
        return self._view(self.batches[batch_id])

    def _list(self, limit: int, after: str | None) -> dict:
        ordered = sorted(self.batches.values(), key=lambda b: b["created"], reverse=True)
        if after is not None:
            ids = [b["id"] for b in ordered]
            ordered = ordered[ids.index(after) + 1:] if after in ids else []
        page = [self._view(b) for b in ordered[:limit]]
        return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
                "last_id": page[-1]["id"] if page else None, "has_more": len(ordered) > limit}

    # -------------------------------------------------------------------------------------------- life of a batch
    def _view(self, batch: dict) -> dict:
        self._step(batch)
        total, completed, failed = batch["counts"]
        status = batch["status"]
        ended = batch["finished_at"]
        return {"id": batch["id"], "object": "batch", "endpoint": batch["endpoint"], "errors": batch["errors"],
                "input_file_id": batch["input_file_id"], "completion_window": batch["completion_window"],
                "status": status, "output_file_id": batch["output_file_id"],
                "error_file_id": batch["error_file_id"], "created_at": batch["created_at"],
                "in_progress_at": batch["in_progress_at"], "expires_at": batch["created_at"] + 86400,
                "finalizing_at": ended if status == "completed" else None,
                "completed_at": ended if status == "completed" else None,
                "failed_at": ended if status == "failed" else None,
                "expired_at": ended if status == "expired" else None,
                "cancelling_at": batch["cancelling_at"], "cancelled_at": ended if status == "cancelled" else None,
                "request_counts": {"total": total, "completed": completed, "failed": failed},
                "metadata": batch["metadata"]}

    def _step(self, batch: dict) -> None:
        """Move a batch on, as time and its plan say (called whenever it is looked at)."""
        if batch["status"] in ("completed", "failed", "expired", "cancelled"):
            return
        plan: BatchPlan = batch["plan"]
        now = time.time()
        if batch["status"] == "cancelling":
            return self._end(batch, "cancelled", plan.answered or 0)
        if batch["status"] == "validating":
            batch["status"], batch["in_progress_at"] = "in_progress", int(now)
        if math.isinf(plan.delay_s) or now - batch["created"] < plan.delay_s:
            return
        n = len(batch["lines"])
        if plan.outcome == "failed":
            batch["errors"] = {"object": "list", "data": [{"code": "invalid_request", "message": "Fake rejection "
                                                           "of the batch", "param": None, "line": None}]}
            return self._end(batch, "failed", 0)
        if plan.outcome == "expired":
            return self._end(batch, "expired", plan.answered if plan.answered is not None else n // 2)
        self._end(batch, "completed", n)

    def _end(self, batch: dict, status: str, answered: int) -> None:
        """Answer the first ``answered`` lines (but the plan's failing ones) and write the output and error files."""
        lines, plan = batch["lines"], batch["plan"]
        failing = set(range(len(lines) - plan.fail_lines, len(lines))) if status == "completed" else set()
        output, errors = [], []
        for i, line in enumerate(lines):
            row: dict[str, Any] = {"id": f"batch_req_{uuid.uuid4().hex[:16]}", "custom_id": line["custom_id"]}
            if status == "failed":
                continue
            if i >= answered:
                code = "batch_expired" if status == "expired" else "batch_cancelled"
                errors.append({**row, "response": None, "error": {"code": code, "message": f"This line was not "
                                                                  f"executed before the batch was {status}."}})
            elif i in failing:
                errors.append({**row, "response": {"status_code": 500, "request_id": row["id"],
                                                   "body": _error("Fake 500 for this line", "server_error")},
                               "error": None})
            else:
                answer = self.responder(line["body"])
                if isinstance(answer, Fault):
                    errors.append({**row, "response": {"status_code": 500, "request_id": row["id"],
                                                       "body": _error(f"Fake {answer.kind}", "server_error")},
                                   "error": None})
                    continue
                self.executions[body_hash(line["body"])] += 1
                completion = self._completion(line["url"], line["body"], answer)
                output.append({**row, "response": {"status_code": 200, "request_id": row["id"], "body": completion},
                               "error": None})
        for kind, rows in (("output_file_id", output), ("error_file_id", errors)):
            if rows:
                file_id = f"file-{uuid.uuid4().hex[:24]}"
                data = "".join(json.dumps(r) + "\n" for r in rows).encode()
                self.files[file_id] = {"data": data, "filename": f"{batch['id']}_{kind[:-8]}.jsonl",
                                       "purpose": "batch_output"}
                batch[kind] = file_id
        batch["status"], batch["finished_at"] = status, int(time.time())
        batch["counts"] = (len(lines), len(output), len(lines) - len(output))
