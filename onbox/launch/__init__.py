"""Starting a job on the box: the launch flow (`launcher`) with its gates (disk budget, pre-flight,
one launch at a time), the job's interpreter and environment (`env`), secrets and their redaction
(`secrets`, `redact`), multi-node naming (`nodes`), a checkpoint brought in from elsewhere
(`resume`), the job wrapper and sidecar supervisor (`supervise`), `--wait` under a scheduler
(`wait`), and what run.json tells the sidecar to watch (`settings`). See docs/ARCHITECTURE.md §4.
"""
