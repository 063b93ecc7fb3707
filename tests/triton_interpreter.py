"""Triton kernels on CPU tensors, through Triton's interpreter, in a child process.

TRITON_INTERPRET=1 must be set before Triton defines a kernel, and it stays on for the whole
process. So a test module lists its kernel cases, runs itself as a script in a child with the
variable set (`errors_in_interpreter`), and the child reports each case's traceback or None
(`report`); the parent never sets the variable, and nothing leaks into other tests.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import traceback
from collections.abc import Callable, Mapping
from pathlib import Path

import pytest

from pdserve.model.triton_attention import triton_available

Cases = Mapping[str, Callable[[], None]]


def errors_in_interpreter(script: str) -> dict[str, str | None]:
    """Run `script` (a test module) as the interpreter child; its cases' tracebacks or None.
    Skips when Triton does not import."""
    if not triton_available():
        pytest.skip("triton is not installed (`make install` adds it with --no-deps)")
    here = str(Path(__file__).parent)
    path = os.pathsep.join(p for p in (here, os.environ.get("PYTHONPATH", "")) if p)
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": path}
    proc = subprocess.run(
        [sys.executable, script], env=env, capture_output=True, text=True, timeout=280
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULTS ")]
    assert proc.returncode == 0 and lines, proc.stdout + proc.stderr
    errors: dict[str, str | None] = json.loads(lines[-1].removeprefix("RESULTS "))
    return errors


def report(cases: Cases) -> None:
    """In the child: run every case and print their tracebacks (None: passed) as one line."""
    assert os.environ.get("TRITON_INTERPRET") == "1"
    errors: dict[str, str | None] = {}
    for name, case in cases.items():
        try:
            case()
            errors[name] = None
        except Exception:
            errors[name] = traceback.format_exc()
    print("RESULTS " + json.dumps(errors))
