"""A compromised box for the tests: a fake `rgt-onbox` and a fake sidecar that say what a scenario says."""
