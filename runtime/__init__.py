"""The dayzero runtime: ``load(path)`` -> a Runtime with ``prefill``."""

from .executor import Runtime, generate_batch, load

__all__ = ["Runtime", "generate_batch", "load"]
