"""Code that runs on a serving host or inside a vLLM virtualenv: standard library only, imports
nothing of vfleet."""
