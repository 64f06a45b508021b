"""Registry lives in grpokit/registry.py (every layer's choices use it, not only the algorithms'); this name stays
for code that imports it from here."""

from grpokit.registry import SIGNATURE_DOC, Registry

__all__ = ["Registry", "SIGNATURE_DOC"]
