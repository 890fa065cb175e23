"""Entry points (relax-train, ...): argument handling only; the work happens in relax.runner.

Layer 9 of 0-9 (docs/design.md): imports Relax packages of lower layers only.
"""
