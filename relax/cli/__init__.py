"""Entry points (relax-train, ...): argument handling only; the work happens in relax.runner.

Layer 6 of 0-6 (docs/design.md): imports Relax packages of lower layers only.
"""
