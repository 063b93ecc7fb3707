"""GPU check step: the CUDA engine tests and the Triton kernel tests under pytest.

They skip where there is no GPU (the Triton tests then run in Triton's interpreter); their
output goes to `<out>/cuda_tests.log`.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path
from typing import Any

TESTS = ("tests/unit/engine/test_cuda_engine.py", "tests/unit/model/test_triton_attention.py")


def run(workdir: Path, args: argparse.Namespace) -> dict[str, Any]:
    """pytest over `TESTS` from the checkout's root; passed when pytest exits 0."""
    repo = Path(__file__).resolve().parents[3]
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs", *TESTS]
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=repo, timeout=300)
    (Path(args.out) / "cuda_tests.log").write_text(done.stdout + done.stderr)
    lines = done.stdout.strip().splitlines()
    return {
        "returncode": done.returncode,
        "summary": lines[-1] if lines else "",
        "passed": done.returncode == 0,
    }
