"""cloud-verifier log lines: one line per event, fields attached, as text or JSON."""

import json
import logging
import sys

from cloud.logs import JsonFormatter, TextFormatter


def _record() -> logging.LogRecord:
    try:
        raise ValueError("boom\nsecond line")
    except ValueError:
        record = logging.LogRecord("cloud-verifier", logging.WARNING, __file__, 1, "Verify failed", None, sys.exc_info())
    record.fields = {"request_id": "abc", "code": "INTERNAL"}
    return record


def test_text_lines_carry_fields_and_fold_tracebacks() -> None:
    text = TextFormatter().format(_record())
    assert "\n" not in text and "Verify failed request_id=abc code=INTERNAL" in text
    assert "ValueError: boom | second line" in text


def test_json_lines_parse_and_carry_fields() -> None:
    line = JsonFormatter().format(_record())
    entry = json.loads(line)
    assert "\n" not in line and entry["level"] == "warning" and entry["logger"] == "cloud-verifier"
    assert entry["message"] == "Verify failed" and entry["request_id"] == "abc" and entry["code"] == "INTERNAL"
    assert "ValueError: boom" in entry["exception"]
