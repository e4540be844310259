"""Checks of rendered configurations against real vLLM and pip (no GPU), and the verification
table."""
