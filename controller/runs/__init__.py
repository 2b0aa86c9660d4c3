"""What a run is doing: its life (one state machine), status, multi-node groups, metrics, plots and
its event log (docs/ARCHITECTURE.md §3). Pure readers of the store; they never reach a box.
"""
