"""Queues of commands over hosts: the model and its dispatcher (docs/ARCHITECTURE.md §4).
"""
