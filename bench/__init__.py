"""Relax performance suite: `python -m bench` (see bench/run_all.py and docs/performance.md)."""
