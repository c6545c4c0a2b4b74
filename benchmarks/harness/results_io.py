"""Benchmark records and the results file: one schema, written atomically after every record.

A results file is JSON::

    {"schema": 1,
     "header": {"device": ..., "versions": {...}, "date": ..., "command": ..., "settings": {...}},
     "records": [{"impl": ..., "pass": ..., "dtype": ..., "batch": ..., "heads": ..., "N": ..., "d": ...,
                  "causal": ..., "ms": ..., "tflops": ..., "peak_mem_bytes": ..., "device": ..., "date": ...,
                  "status": "ok" | "skipped" | "wrong" | "error", "error": ..., ...}, ...],
     "summary": {...}}

``ms`` is the median of the timed repeats; ``tflops`` uses the FA2 paper's FLOP model (``flop_model``);
``peak_mem_bytes`` is what the call held at its peak: its inputs, saved forward state, outputs and temporaries.
Records that were not timed (skipped, wrong, error) keep ``ms``/``tflops`` as null and say why in ``error``.
"""

import datetime
import json
import math
import os
import re
import tempfile

SCHEMA_VERSION = 1
REQUIRED_KEYS = ("impl", "pass", "dtype", "batch", "heads", "N", "d", "causal", "ms", "tflops",
                 "peak_mem_bytes", "device", "date")
STATUSES = ("ok", "skipped", "wrong", "error")


def utc_now():
    """The current time as an ISO-8601 string in UTC, to the second."""
    return datetime.datetime.now(datetime.timezone.utc).replace(microsecond=0).isoformat()


def device_slug(name):
    """A folder name for a device: ``'NVIDIA H100 80GB HBM3'`` → ``'nvidia-h100-80gb-hbm3'``."""
    if not isinstance(name, str) or not name.strip():
        raise ValueError(f"name must be a non-empty string, got {name!r}")
    slug = re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")
    if not slug:
        raise ValueError(f"name has no letters or digits: {name!r}")
    return slug


def default_results_path(device_name, name, root=None):
    """``benchmarks/results/<device-slug>/<name>.json`` (``root`` replaces ``benchmarks/results``)."""
    if not re.fullmatch(r"[A-Za-z0-9._-]+", name or ""):
        raise ValueError(f"name must be letters, digits, '.', '_' or '-', got {name!r}")
    root = root or os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "results")
    return os.path.join(root, device_slug(device_name), f"{name}.json")


def write_measurement(path, schema: str, rows: list, *, device: str, versions: dict, **fields) -> dict:
    """A small harness's results file: its ``schema``, the ``device``, package ``versions``, date and command line,
    any ``fields``, then ``rows``; written to ``path`` (skipped when it is None). Returns the record."""
    import sys
    out = dict(schema=schema, device=device, versions=versions, date=utc_now(), command=" ".join(sys.argv),
               **fields, rows=rows)
    if path:
        with open(path, "w") as f:
            json.dump(out, f, indent=1)
    return out


def make_record(*, impl, pass_, dtype, batch, heads, N, d, causal, device, ms=None, tflops=None,
                peak_mem_bytes=None, status="ok", error=None, date=None, **extra):
    """One benchmark record with the schema's keys (plus any ``extra`` keys, e.g. ``repeats``, ``rel_error``)."""
    if status not in STATUSES:
        raise ValueError(f"status must be one of {STATUSES}, got {status!r}")
    if status == "ok" and (ms is None or tflops is None):
        raise ValueError("an 'ok' record needs ms and tflops")
    if status != "ok" and not error:
        raise ValueError(f"a {status!r} record needs an error message saying why")
    record = {"impl": impl, "pass": pass_, "dtype": dtype, "batch": int(batch), "heads": int(heads), "N": int(N),
              "d": int(d), "causal": bool(causal), "ms": ms, "tflops": tflops,
              "peak_mem_bytes": None if peak_mem_bytes is None else int(peak_mem_bytes),
              "device": device, "date": date or utc_now(), "status": status, "error": error}
    overlap = set(extra) & set(record)
    if overlap:
        raise ValueError(f"extra keys clash with the schema: {sorted(overlap)}")
    record.update(extra)
    return record


def validate_record(record):
    """Raise ValueError if ``record`` lacks a schema key or has a value of the wrong kind."""
    if not isinstance(record, dict):
        raise TypeError(f"record must be a dict, got {type(record).__name__}")
    missing = [k for k in REQUIRED_KEYS if k not in record]
    if missing:
        raise ValueError(f"record is missing keys {missing}")
    for key in ("batch", "heads", "N", "d"):
        if isinstance(record[key], bool) or not isinstance(record[key], int) or record[key] < 1:
            raise ValueError(f"record[{key!r}] must be a positive int, got {record[key]!r}")
    if not isinstance(record["causal"], bool):
        raise ValueError(f"record['causal'] must be a bool, got {record['causal']!r}")
    if record["pass"] not in ("forward", "backward", "forward+backward"):
        raise ValueError(f"record['pass'] must be 'forward', 'backward' or 'forward+backward' (FA2's \"fwd + bwd\"), "
                         f"got {record['pass']!r}")
    status = record.get("status", "ok")
    if status not in STATUSES:
        raise ValueError(f"record['status'] must be one of {STATUSES}, got {status!r}")
    if status == "ok":
        for key in ("ms", "tflops"):
            if not isinstance(record[key], (int, float)) or record[key] <= 0:
                raise ValueError(f"an ok record needs a positive {key}, got {record[key]!r}")


def write_results(path, header, records, summary=None):
    """Write the results file atomically (a temporary file renamed over ``path``), so a run killed midway
    leaves the last complete file behind."""
    for record in records:
        validate_record(record)
    payload = {"schema": SCHEMA_VERSION, "header": header, "records": list(records)}
    if summary is not None:
        payload["summary"] = summary
    payload = _jsonable(payload)
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".results-", suffix=".json", dir=folder)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(payload, f, indent=1, allow_nan=False)
            f.write("\n")
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return path


def _jsonable(value):
    """Strict JSON: NaN and infinities become the strings 'nan', 'inf', '-inf' (a NaN error must stay visible);
    tuples become lists."""
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if value != value else ("inf" if value > 0 else "-inf")
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return value


def load_results(path):
    """Read a results file; returns ``(header, records, summary)`` after checking every record."""
    with open(path) as f:
        payload = json.load(f)
    if not isinstance(payload, dict) or "records" not in payload:
        raise ValueError(f"{path}: not a benchmark results file (no 'records')")
    if payload.get("schema") != SCHEMA_VERSION:
        raise ValueError(f"{path}: schema {payload.get('schema')!r}, expected {SCHEMA_VERSION}")
    for record in payload["records"]:
        validate_record(record)
    return payload.get("header", {}), payload["records"], payload.get("summary")
