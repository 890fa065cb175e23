"""The local spool of MLflow writes made while the store was unavailable, and their replay.

When a write of a run fails with a store error (`is_store_error`: sqlite locked or unreadable, an HTTP tracking
server down or timing out, any `MlflowException`, an `OSError`), `Tracker` appends it to an append-only JSONL
file, `<spool dir>/mlflow-spool-<run id>.jsonl`, flushed and fsync'ed per append, and training goes on. While
that file holds unacknowledged records every later write of the run goes there too, in order; each step (and
the background writer every `flush_interval_s`) first tries to replay it, and once everything is in the store
the file is deleted. relax-train's spool dir is the run's checkpoint directory (`relax.runner.checkpoint`),
else the job's output directory.

One JSON object a line:
    {"relax_mlflow_spool": 1, "run_id": "...", "uri": "...", "created_ms": ...}        the first line
    {"seq": 7, "op": "metrics", "metrics": [[key, value, timestamp_ms, step], ...]}
    {"seq": 8, "op": "params" | "tags", "items": [[key, value], ...]}
    {"seq": 9, "op": "text", "text": "...", "artifact_file": "config.yaml"}
    {"seq": 10, "op": "artifact", "file": "10/name", "artifact_path": null}   a copy in mlflow-spool-<id>.files/
    {"seq": 11, "op": "inputs", "datasets": [{"name": ..., "digest": ..., ...}]}   relax.tracking.inputs.DatasetRecord
    {"seq": 12, "op": "terminate", "status": "FINISHED", "end_time": ms}
    {"ack": 9}                                   records up to seq 9 are in the store
Replay writes the unacknowledged records in order with their original steps and timestamps (consecutive
metrics records batched up to MLflow's 1000 per call) and appends an ack after each batch. A record that may
be partly in the store already, i.e. `"uncertain": true` (the direct write that failed may have committed some
of it) or the first unacknowledged record when a spool is opened (its replay may have been cut off before its
ack) or one whose replay failed midway, is compared with the store first: only the (key, step, timestamp) triples the
store lacks are written, so no value is ever written twice. Params, tags, artifacts, dataset inputs (the store
keeps one per name and digest) and the run status are idempotent writes. A record the store rejects for good
(`is_rejection`: an invalid value, a deleted run) or that cannot be applied is moved to
`mlflow-spool-<run id>.rejected.jsonl` and acknowledged, so that it cannot hold back the rest. A line torn by a
crash mid-append is skipped.

Replaying by hand, when the store was still down at the end of the run (the run says so, with the path):
    python -m relax.tracking.spool <dir>/mlflow-spool-<run id>.jsonl [--uri URI] [--attempts N]
`--uri` when the store has moved (default: the URI in the spool's first line). It exits 0 when everything is
in the store (the spool is then deleted), 1 when the store is still unavailable (run it again later), 2 when
the run is not in that store. Running it again, or after a partial replay, writes nothing twice. A job that
continues the run (`train.resume`) or starts another one with the same spool dir replays what it finds first.
"""

from __future__ import annotations

import json
import os
import shutil
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional, TypeVar

from relax.tracking.inputs import DatasetRecord

if TYPE_CHECKING:
    from mlflow import MlflowClient

SPOOL_FORMAT = 1
SPOOL_PREFIX = "mlflow-spool-"
SPOOL_SUFFIX = ".jsonl"
REJECTED_SUFFIX = ".rejected.jsonl"
FILES_SUFFIX = ".files"
REPLAY_COMMAND = "python -m relax.tracking.spool"

# MlflowException codes that mean "the store is up and refuses this write": replaying it cannot succeed.
REJECTED_CODES = frozenset(
    {"INVALID_PARAMETER_VALUE", "RESOURCE_ALREADY_EXISTS", "RESOURCE_DOES_NOT_EXIST", "INVALID_STATE", "BAD_REQUEST"}
)
_METRICS_PER_CALL = 1000  # MLflow's log_batch limits (relax.tracking.mlflow_run checks them against MLflow)
_PARAMS_TAGS_PER_CALL = 100

T = TypeVar("T")


def spool_path(spool_dir: str | os.PathLike[str], run_id: str) -> Path:
    """Where the spool of `run_id` lives in `spool_dir`."""
    return Path(spool_dir) / f"{SPOOL_PREFIX}{run_id}{SPOOL_SUFFIX}"


def is_store_error(exc: BaseException) -> bool:
    """True for a failure of the tracking store rather than of the caller: spool the write, keep training.

    OSError (connection refused, timeouts, `requests` errors, disk), any MlflowException (MLflow wraps sqlite's
    "database is locked" and HTTP failures in one), SQLAlchemy's database and pool errors, urllib3's errors.
    """
    if isinstance(exc, OSError):
        return True
    try:
        from mlflow.exceptions import MlflowException

        if isinstance(exc, MlflowException):
            return True
    except ImportError:  # pragma: no cover - MLflow is a dependency
        pass
    try:
        import sqlalchemy.exc as sa_exc

        if isinstance(exc, (sa_exc.DBAPIError, sa_exc.TimeoutError, sa_exc.DisconnectionError)):
            return True
    except ImportError:  # pragma: no cover
        pass
    try:
        import urllib3.exceptions

        if isinstance(exc, urllib3.exceptions.HTTPError):
            return True
    except ImportError:  # pragma: no cover
        pass
    return False


def is_rejection(exc: BaseException) -> bool:
    """True when the store answered and refuses the write for good (see REJECTED_CODES)."""
    return getattr(exc, "error_code", None) in REJECTED_CODES and is_store_error(exc)


def short_error(exc: BaseException, limit: int = 300) -> str:
    """`Type: first line of the message`, cut to `limit` characters (SQLAlchemy's messages carry whole SQL)."""
    text = str(getattr(exc, "message", None) or exc).strip().splitlines()
    first = text[0] if text else ""
    if len(first) > limit:
        first = first[:limit] + "..."
    return f"{type(exc).__name__}: {first}" if first else type(exc).__name__


def _chunks(items: Sequence[T], size: int) -> Iterator[Sequence[T]]:
    for i in range(0, len(items), size):
        yield items[i : i + size]


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # pragma: no cover - platforms without directory fds
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@dataclass
class ReplayResult:
    """What one `Spool.replay` call did."""

    records: int = 0  # records acknowledged by this call (written, already in the store, or set aside)
    metrics: int = 0  # metric values written
    duplicates: int = 0  # metric values the store already held, not written again
    set_aside: int = 0  # records the store rejected, moved to the .rejected.jsonl file
    pending: int = 0  # records still waiting in the spool
    attempts: int = 0
    error: Optional[BaseException] = None  # the store error that stopped the last attempt

    @property
    def done(self) -> bool:
        return self.pending == 0


class Spool:
    """One run's spool file: durable appends from the training side, in-order replay with acknowledgements.

    Thread-safe. Opening an existing file reads its state (what is acknowledged, where replay resumes) and
    repairs a line torn by a crash. The file is created by the first `append`, and `remove_if_done` deletes it
    once every record is acknowledged.
    """

    def __init__(self, path: str | os.PathLike[str], *, run_id: Optional[str] = None,
                 uri: Optional[str] = None) -> None:
        self.path = Path(path)
        base = self.path.name[: -len(SPOOL_SUFFIX)] if self.path.name.endswith(SPOOL_SUFFIX) else self.path.name
        self.files_dir = self.path.with_name(base + FILES_SUFFIX)
        self.rejected_path = self.path.with_name(base + REJECTED_SUFFIX)
        self.run_id = run_id
        self.uri = uri
        self.torn_lines = 0
        self._lock = threading.RLock()
        self._fh: Any = None  # append handle (binary)
        self._last_seq = 0
        self._acked = 0
        self._read_pos = 0  # byte offset from which the next unacknowledged record is searched
        self._suspect: set[int] = set()  # records that may be partly in the store already
        if self.path.exists():
            self._load()
        if self.run_id is None and base.startswith(SPOOL_PREFIX):
            self.run_id = base[len(SPOOL_PREFIX):]

    # ------------------------------------------------------------------ state
    @property
    def pending(self) -> int:
        """Records appended and not acknowledged yet."""
        return self._last_seq - self._acked

    def _load(self) -> None:
        data = self.path.read_bytes()
        if data and not data.endswith(b"\n"):  # torn by a crash mid-append: close the line so appends stay whole
            with open(self.path, "ab") as fh:
                fh.write(b"\n")
                fh.flush()
                os.fsync(fh.fileno())
            data += b"\n"
        positions: dict[int, int] = {}
        pos = 0
        for raw in data.split(b"\n")[:-1]:
            line_pos, pos = pos, pos + len(raw) + 1
            entry = self._parse(raw)
            if entry is None:
                self.torn_lines += bool(raw.strip())
                continue
            if "relax_mlflow_spool" in entry:
                self.run_id = self.run_id or entry.get("run_id")
                self.uri = self.uri or entry.get("uri")
            elif "ack" in entry:
                self._acked = max(self._acked, int(entry["ack"]))
            elif "seq" in entry:
                seq = int(entry["seq"])
                self._last_seq = max(self._last_seq, seq)
                positions[seq] = line_pos
        self._acked = min(self._acked, self._last_seq)
        if self.pending:
            first = min(s for s in positions if s > self._acked)
            self._read_pos = positions[first]
            self._suspect.add(first)  # its replay may have been cut off between the write and the ack
        else:
            self._read_pos = len(data)

    def _parse(self, raw: bytes) -> Optional[dict[str, Any]]:
        if not raw.strip():
            return None
        try:
            entry = json.loads(raw)
        except ValueError:  # a line torn by a crash
            return None
        return entry if isinstance(entry, dict) else None

    def _write_line(self, entry: dict[str, Any]) -> None:
        if self._fh is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            new = not self.path.exists() or self.path.stat().st_size == 0
            self._fh = open(self.path, "ab")  # noqa: SIM115 - kept open for the run's appends
            if new:
                header = {"relax_mlflow_spool": SPOOL_FORMAT, "run_id": self.run_id, "uri": self.uri,
                          "created_ms": int(time.time() * 1000)}
                self._fh.write(json.dumps(header).encode() + b"\n")
                _fsync_dir(self.path.parent)
        self._fh.write(json.dumps(entry, separators=(",", ":")).encode() + b"\n")
        self._fh.flush()
        os.fsync(self._fh.fileno())

    # ------------------------------------------------------------------ appends
    def append(self, op: str, payload: dict[str, Any], *, uncertain: bool = False) -> int:
        """Append one record durably (flushed and fsync'ed before returning); returns its sequence number."""
        with self._lock:
            seq = self._last_seq + 1
            entry: dict[str, Any] = {"seq": seq, "op": op, **payload}
            if uncertain:
                entry["uncertain"] = True
            self._write_line(entry)
            self._last_seq = seq
            return seq

    def append_artifact(self, local_path: str, artifact_path: Optional[str]) -> int:
        """Copy a file or directory into the spool's files directory and append a record naming the copy."""
        with self._lock:
            seq = self._last_seq + 1
            src = Path(local_path)
            target = self.files_dir / str(seq) / src.name
            target.parent.mkdir(parents=True, exist_ok=True)
            if src.is_dir():
                shutil.copytree(src, target, dirs_exist_ok=True)
            else:
                shutil.copy2(src, target)
            return self.append("artifact", {"file": f"{seq}/{src.name}", "artifact_path": artifact_path})

    def ack(self, seq: int, next_pos: int) -> None:
        """Record durably that every record up to `seq` is in the store; replay resumes at byte `next_pos`."""
        with self._lock:
            self._write_line({"ack": seq})
            self._acked = max(self._acked, seq)
            self._read_pos = max(self._read_pos, next_pos)
            self._suspect = {s for s in self._suspect if s > seq}

    def set_aside(self, record: dict[str, Any], exc: BaseException, next_pos: int) -> None:
        """Move a record the store refuses to the .rejected.jsonl file, then acknowledge it."""
        with self._lock:
            self.rejected_path.parent.mkdir(parents=True, exist_ok=True)
            with open(self.rejected_path, "ab") as fh:
                fh.write(json.dumps({**record, "error": short_error(exc)}).encode() + b"\n")
                fh.flush()
                os.fsync(fh.fileno())
            self.ack(int(record["seq"]), next_pos)

    def remove_if_done(self) -> bool:
        """Delete the spool file (and its copied files) when every record is acknowledged; True if it is gone."""
        with self._lock:
            if self.pending:
                return False
            if self._fh is not None:
                self._fh.close()
                self._fh = None
            if self.path.exists():
                self.path.unlink()
            shutil.rmtree(self.files_dir, ignore_errors=True)
            self._last_seq = self._acked = self._read_pos = 0
            self._suspect.clear()
            return True

    def close(self) -> None:
        with self._lock:
            if self._fh is not None:
                self._fh.close()
                self._fh = None

    def describe(self) -> str:
        """What the pending records hold, e.g. `41 records: metrics of steps 12-50, run status FINISHED`."""
        steps: list[int] = []
        ops: set[str] = set()
        status = None
        for record in self._read_pending()[0]:
            ops.add(record.get("op", "?"))
            if record.get("op") == "metrics":
                steps.extend(int(m[3]) for m in record.get("metrics", ()))
            elif record.get("op") == "terminate":
                status = record.get("status")
        parts = []
        if steps:
            parts.append(f"metrics of steps {min(steps)}-{max(steps)}")
        parts.extend(sorted(op for op in ops if op not in ("metrics", "terminate")))
        if status:
            parts.append(f"run status {status}")
        return f"{self.pending} records" + (": " + ", ".join(parts) if parts else "")

    # ------------------------------------------------------------------ replay
    def _read_pending(self, limit: Optional[Callable[[list[dict[str, Any]], dict[str, Any]], bool]] = None
                      ) -> tuple[list[dict[str, Any]], int]:
        """Unacknowledged records from the replay position, in order, and the byte offset after the last one.

        `limit(taken, next)` True stops before `next`. A line without its newline (being written) ends the read.
        """
        taken: list[dict[str, Any]] = []
        with self._lock:
            end = self._read_pos
            if not self.path.exists():
                return taken, end
            with open(self.path, "rb") as fh:
                fh.seek(self._read_pos)
                while True:
                    raw = fh.readline()
                    if not raw.endswith(b"\n"):
                        break
                    entry = self._parse(raw)
                    if entry is None or "seq" not in entry or int(entry["seq"]) <= self._acked:
                        continue
                    if limit is not None and taken and limit(taken, entry):
                        break
                    taken.append(entry)
                    end = fh.tell()
        return taken, end

    def _next_group(self, single: bool) -> tuple[list[dict[str, Any]], int]:
        """The next records to write in one go: one record, or consecutive metrics records up to 1000 values."""

        count = [0]  # metric values taken so far (but the first record's)

        def full(taken: list[dict[str, Any]], record: dict[str, Any]) -> bool:
            if single or record.get("op") != "metrics" or taken[0].get("op") != "metrics":
                return True
            if len(taken) == 1:
                count[0] = len(taken[0].get("metrics", ()))
            n = len(record.get("metrics", ()))
            if count[0] + n > _METRICS_PER_CALL:
                return True
            count[0] += n
            return False

        return self._read_pending(full)

    def replay(self, client: MlflowClient, run_id: Optional[str] = None, *, attempts: Optional[int] = 1,
               backoff_s: float = 0.5, max_backoff_s: float = 5.0, deadline_s: Optional[float] = None,
               sleep: Callable[[float], None] = time.sleep) -> ReplayResult:
        """Write the unacknowledged records to the store in order; stop at the first store error.

        Up to `attempts` passes (None: no limit but `deadline_s`; with `deadline_s`, no pass starts after that
        many seconds), waiting
        `backoff_s`, doubling up to `max_backoff_s`, between them. Never raises for a store error: the
        result says what is left (`pending`) and why (`error`).
        """
        run_id = run_id or self.run_id
        if run_id is None:
            raise ValueError(f"{self.path}: no run id in the spool; pass one")
        if attempts is None and deadline_s is None:
            raise ValueError("replay without an attempt limit needs a deadline")
        result = ReplayResult()
        t0 = time.monotonic()
        delay = backoff_s
        while True:
            result.attempts += 1
            result.error = self._replay_pass(client, run_id, result)
            if result.error is None or (attempts is not None and result.attempts >= attempts):
                break
            if deadline_s is not None and time.monotonic() - t0 + delay > deadline_s:
                break
            sleep(delay)
            delay = min(max_backoff_s, delay * 2)
        result.pending = self.pending
        return result

    def _replay_pass(self, client: MlflowClient, run_id: str, result: ReplayResult) -> Optional[BaseException]:
        single = False
        while True:
            group, end = self._next_group(single)
            if not group:
                return None
            seqs = [int(r["seq"]) for r in group]
            dedup = any(r.get("uncertain") or int(r["seq"]) in self._suspect for r in group)
            writing: list[bool] = []  # becomes [True] once a write call is made
            try:
                written, duplicates = _apply(client, run_id, group, self.files_dir, dedup=dedup, writing=writing)
            except Exception as exc:
                if writing:
                    with self._lock:
                        self._suspect.update(seqs)  # a part may be in the store now
                if is_store_error(exc) and not is_rejection(exc):
                    return exc
                if len(group) > 1:  # find the record the store refuses: one at a time
                    single = True
                    continue
                self.set_aside(group[0], exc, end)
                result.records += 1
                result.set_aside += 1
                continue
            self.ack(seqs[-1], end)
            result.records += len(group)
            result.metrics += written
            result.duplicates += duplicates
            single = False


def _apply(client: MlflowClient, run_id: str, group: list[dict[str, Any]], files_dir: Path, *,
           dedup: bool, writing: list[bool]) -> tuple[int, int]:
    """Write a group of records; returns (metric values written, metric values already in the store).

    Appends True to `writing` before the first write call (a failure before it wrote nothing).
    """
    from mlflow.entities import Metric, Param, RunTag

    op = group[0].get("op")
    if op == "metrics":
        values = [(str(k), float(v), int(ts), int(s)) for r in group for k, v, ts, s in r["metrics"]]
        duplicates = 0
        if dedup:
            held = {(m.key, int(m.step), int(m.timestamp))
                    for key in sorted({k for k, _, _, _ in values}) for m in client.get_metric_history(run_id, key)}
            kept = []
            for m in values:  # what the store holds, and a value spooled twice (two uncertain copies): once
                if (m[0], m[3], m[2]) not in held:
                    held.add((m[0], m[3], m[2]))
                    kept.append(m)
            duplicates = len(values) - len(kept)
            values = kept
        writing.append(True)
        for chunk in _chunks(values, _METRICS_PER_CALL):
            client.log_batch(run_id, metrics=[Metric(key=k, value=v, timestamp=ts, step=s) for k, v, ts, s in chunk],
                             synchronous=True)
        return len(values), duplicates
    (record,) = group
    writing.append(True)
    if op in ("params", "tags"):
        cls: Any = Param if op == "params" else RunTag
        items = [cls(str(k), str(v)) for k, v in record["items"]]
        for chunk in _chunks(items, _PARAMS_TAGS_PER_CALL):
            client.log_batch(run_id, **{op: list(chunk)}, synchronous=True)
    elif op == "text":
        client.log_text(run_id, record["text"], record["artifact_file"])
    elif op == "artifact":
        client.log_artifact(run_id, str(files_dir / record["file"]), record.get("artifact_path"))
    elif op == "inputs":
        client.log_inputs(run_id, datasets=[DatasetRecord.from_dict(d).to_mlflow() for d in record["datasets"]])
    elif op == "terminate":
        client.set_terminated(run_id, status=record["status"], end_time=record.get("end_time"))
    else:
        raise ValueError(f"unknown spool record op {op!r}")
    return 0, 0
