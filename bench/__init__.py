"""Benchmarks: memory and time of the banded kernels against the ways people do local attention today.

``python -m bench --help``; ``make bench`` runs the default sweep.
"""
