"""Relax's Hydra launcher: the jobs of a multirun run concurrently as Ray tasks (`hydra/launcher=relax_ray`).

Hydra finds it through the `hydra_plugins` namespace package; `conf/config.yaml` makes it the default.
"""
