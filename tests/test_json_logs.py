"""The JSON log handler follows sys.stderr: a stream swapped out and closed after install is never written to."""

from __future__ import annotations

import io
import json
import logging
import sys

import pytest

from kubelora.contract.logs import install_json_handler, log_event


@pytest.fixture
def restored_root_logger():
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield root
    root.handlers[:], root.level = handlers, level


def test_records_go_to_the_current_stderr_after_the_install_time_one_is_closed(restored_root_logger, monkeypatch):
    first, second = io.StringIO(), io.StringIO()
    monkeypatch.setattr(sys, "stderr", first)
    install_json_handler("info")
    log_event(logging.getLogger("kubelora.test"), "before_swap", n=1)
    monkeypatch.setattr(sys, "stderr", second)
    first.close()  # what pytest does to a test's captured stream once the test is over
    errors = []
    monkeypatch.setattr(logging.Handler, "handleError", lambda self, record: errors.append(sys.exc_info()[1]))
    log_event(logging.getLogger("kubelora.test"), "after_swap", n=2)
    assert errors == []
    assert [json.loads(line)["event"] for line in second.getvalue().splitlines()] == ["after_swap"]
