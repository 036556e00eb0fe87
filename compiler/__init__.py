"""Capture, planning and graph passes: everything that decides and edits graphs."""
