"""Layer 2, decisions: the rules that turn settings into vLLM arguments, the planner, vLLM version
facts."""
