"""What both sides do the same way, written once: paced SHA-256 hashing and copying, the safetensors
header parser, durations and sizes, lock files with their holder's pid.

Standard library only, Python 3.9+, and nothing of ours imported: the sidecar and the job's helper
run it from the box's pylib copy (onbox/launch/env.py) beside `onbox` and `protocol`, and the
controller from its install. See docs/ARCHITECTURE.md §2 (the ground floor).
"""
