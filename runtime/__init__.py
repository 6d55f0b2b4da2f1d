"""The dayzero runtime: ``load(path)`` -> a Runtime with ``prefill``."""

from .executor import Runtime, load

__all__ = ["Runtime", "load"]
