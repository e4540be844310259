"""vfleet: deploy and operate Qwen3.x-27B hybrid models with MTP on vLLM."""

__version__ = "0.1.0"
