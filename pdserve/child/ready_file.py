"""The ready file a pdserve child writes once it listens: {"url", "pid"}, read by its launcher
(`process.wait_child_ready`), which cannot know the port a `--port 0` child was given."""

from __future__ import annotations

import json
import os
from pathlib import Path


def write_ready_file(path: Path, url: str) -> None:
    """Write {"url", "pid"} to `path` atomically (a temp file in the same folder, then a
    rename): the launcher never reads half a file."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps({"url": url, "pid": os.getpid()}) + "\n", encoding="utf-8")
    os.replace(tmp, path)
