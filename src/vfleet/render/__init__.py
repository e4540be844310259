"""Layer 3, artefacts: the release files, the deploy plan, monitoring, dashboards, images,
compose."""
