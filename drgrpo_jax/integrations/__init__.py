"""Adapters that plug the public math (`losses`, `advantages`, `algorithms`) into other JAX trainers.

Each adapter imports its host trainer, which is an optional extra (`pip install 'drgrpo_jax[tunix]'`), so
nothing here is imported by the package's public face.
"""
