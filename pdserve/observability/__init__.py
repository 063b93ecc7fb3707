"""Observability: handoff phases of a request timeline, spike detection, trace rendering."""
