"""Putting this exact version of the package on a box, from wheels built here, without its index
(docs/ARCHITECTURE.md §4).
"""
