"""Colocated or split: the operator's switch, the KV-path breaker, live interference and SLO
figures, and the automatic mode that moves `both` workers between roles."""
