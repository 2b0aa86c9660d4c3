"""When to wake a person or an agent: the policy, what a wake says, and `rgt watch` itself
(docs/ARCHITECTURE.md §3). It reads runs/ and the store; it never reaches a box.
"""
