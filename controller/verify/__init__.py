"""The proofs of a pulled run: identity, safe load, recomputed metric (docs/ARCHITECTURE.md §6).

Standard library only apart from the torch seam (safeload), which runs as a child process.
"""
