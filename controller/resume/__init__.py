"""`rgt resume`: a run continued on another box from its newest hashed checkpoint
(docs/ARCHITECTURE.md §6).
"""
