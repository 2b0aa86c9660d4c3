"""The gate before anything destructive, and the box's dead-man lease seen from here
(docs/ARCHITECTURE.md §6, §7).
"""
