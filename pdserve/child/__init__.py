"""What a pdserve process does for the launcher that started it: report where it listens (the
ready file) and stop when the launcher dies (the lifeline). Imported by both sides."""
