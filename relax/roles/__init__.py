"""One Ray actor class per role: actor, rollout, reference, critic.

Layer 4 of 0-6 (docs/design.md): imports Relax packages of lower layers only.
"""
