"""`rgt rehearse`: the launch command run here on CPU under the sidecar, each stage judged
(docs/ARCHITECTURE.md §9).
"""
