"""Network namespaces for the multi-host tests: `lab` and `Lab` (see `pdlab.netlab`),
and `require_netns`, which skips the calling test with the reason where they cannot be made."""

from __future__ import annotations

import pytest

from pdlab.netlab import IP_MISSING, Lab, lab, probe_netns

__all__ = ["IP_MISSING", "Lab", "lab", "require_netns"]


def require_netns() -> None:
    """Skip the calling test where this process cannot build a `lab`."""
    reason = probe_netns()
    if reason is not None:
        pytest.skip(reason)
