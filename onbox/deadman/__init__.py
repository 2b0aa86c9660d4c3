"""The box's dead-man timer: the lease and its files (`lease`), when it fires and what is due
(`clock`), the one daemon per box that waits on it and acts (`daemon`), and what it tells the
sidecar (`feed`). It never takes a destructive action by default. See docs/ARCHITECTURE.md §4
and §7.
"""
