"""The vfleet SM75 vLLM plugin. Placeholder: no entry point is registered yet, so installing
it changes nothing in vLLM. Its features (draft-vocabulary pruning for MTP, FlashInfer on SM75)
come with the plugin issue."""

__version__ = "0.1.0"
