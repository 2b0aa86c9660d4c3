"""Keeping the store equal to each sidecar's journal: the per-run watcher, its link, the subscriber
with gap repair (docs/ARCHITECTURE.md §3, §4).
"""
