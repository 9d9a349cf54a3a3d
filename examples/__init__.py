"""Runnable examples (from the repository root: ``python -m examples.<name>``)."""
