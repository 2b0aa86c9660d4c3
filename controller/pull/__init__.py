"""Bringing a run home, resumably, through a staging dir that is never called complete early
(docs/ARCHITECTURE.md §6).
"""
