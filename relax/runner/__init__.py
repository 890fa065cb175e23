"""The controller: plans the service graph, starts roles on Ray, runs the training loop.

Layer 5 of 0-6 (docs/design.md): imports Relax packages of lower layers only.
"""
