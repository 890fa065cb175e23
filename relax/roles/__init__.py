"""One Ray actor class per role: actor, rollout, reference, critic.

Layer 7 of 0-9 (docs/design.md): imports Relax packages of lower layers only.
"""
