"""The controller: plans the service graph, starts roles on Ray, runs the training loop.

Layer 8 of 0-9 (docs/design.md): imports Relax packages of lower layers only.
"""
