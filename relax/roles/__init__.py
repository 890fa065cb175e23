"""One Ray actor class per role: actor, rollout, reference, critic."""
