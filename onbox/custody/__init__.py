"""Checkpoint custody on the box: every checkpoint write noticed, settled, hashed, checked and
recorded (`monitor`, `worker`, `units`, `locate`, `check`, `finite`, `durable`, `manifest`); what a
pull must bring back and what the teardown gate sees (`pullmanifest`, `gateview`); sealing a run
(`closeout`) and the sweep before a preemption (`preempt`). See docs/ARCHITECTURE.md §6.
"""
