"""A pytest plugin that records how long each test took (setup, call and teardown together)
into the JSON file named by RADIXLM_DURATIONS_OUT, merged with what the file already holds:
`{"path/to/test_file.py::test_name[param]": seconds}`. `run_tests.py --record-durations`
loads it; `run_tests.py --fast-subset` reads the record it leaves."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

_TIMES: dict[str, float] = {}
_REPO = Path(__file__).resolve().parents[2]


def pytest_runtest_logreport(report: Any) -> None:
    _TIMES[report.nodeid] = _TIMES.get(report.nodeid, 0.0) + float(report.duration)


def pytest_sessionfinish(session: Any, exitstatus: int) -> None:
    out = os.environ.get("RADIXLM_DURATIONS_OUT")
    if not out or not _TIMES:
        return
    path = Path(out)
    record: dict[str, float] = json.loads(path.read_text()) if path.exists() else {}
    root = Path(str(session.config.rootpath))
    for nodeid, seconds in _TIMES.items():
        file, sep, rest = nodeid.partition("::")
        # Node ids are relative to pytest's rootdir; keep them relative to the repository.
        where = (root / file).resolve()
        name = where.relative_to(_REPO).as_posix() if where.is_relative_to(_REPO) else file
        record[name + sep + rest] = round(seconds, 3)
    path.write_text(json.dumps(record, indent=0, sort_keys=True) + "\n")
