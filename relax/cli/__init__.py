"""Entry points (relax-train, ...): argument handling only; the work happens in relax.runner."""
