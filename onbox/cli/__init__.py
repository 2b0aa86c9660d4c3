"""`rgt-onbox`: the `main` group and its commands (`main`), the dead-man's commands (`deadman`),
the pull manifest's (`pull`), the journal read-back (`journal`), the Xid report (`xids`) and
launch's report and exit codes (`launch`); `python -m onbox.cli` runs the same group. Commands are
thin: parse, call one function, render, map errors to exit codes. See docs/ARCHITECTURE.md §2.2.
"""
