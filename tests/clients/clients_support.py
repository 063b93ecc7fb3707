"""What the outside-client tests import: where the clients' venvs are, and the served name.

(A module of its own: `from conftest import ...` finds whichever conftest was imported first,
which depends on the order pytest is given the test folders.)
"""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
VENVS = Path(os.environ.get("PDSERVE_CLIENT_VENVS", ROOT / ".venv-clients"))
SERVED = "pdserve-tiny"


def client_bin(venv: str, program: str) -> Path:
    path = VENVS / venv / "bin" / program
    if not path.exists():
        message = f"{path} missing: run `make client-venvs`"
        if os.environ.get("PDSERVE_REQUIRE_CLIENTS") == "1":
            pytest.fail(message)
        pytest.skip(message)
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
