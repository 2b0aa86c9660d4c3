"""Knowledge about runs: the symptom catalog and `rgt explain`, `rgt compare`, `rgt reconcile`
(docs/ARCHITECTURE.md §2).
"""
