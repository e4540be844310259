"""Host-side helpers that run next to vLLM with no dependencies beyond the standard library."""

__version__ = "0.1.0"
