"""Layer 1, settings: profiles (YAML) -> typed models, with the grammars values must match."""
