"""The laptop's SQLite store: runs, events, cursors, hosts, wakes (docs/ARCHITECTURE.md §3).

Every command reads through it; it imports nothing of the controller but the ground floor.
"""
