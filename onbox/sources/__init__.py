"""Signal sources of the sidecar: each module reads one outside system and returns plain data."""
