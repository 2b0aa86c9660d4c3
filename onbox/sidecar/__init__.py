"""The sidecar process: the server that owns one run's journal and sockets (`server`), the event
journal itself (`journal`), ZeroMQ PUB and ROUTER (`transport`), and `rgt-onbox follow` for a run
started without one (`follow`). See docs/ARCHITECTURE.md §3 and §4.
"""
