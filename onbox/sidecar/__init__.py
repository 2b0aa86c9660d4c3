"""The sidecar process: the server that owns one run's journal and sockets (`server`), the event
journal itself (`journal`), ZeroMQ PUB and ROUTER (`transport`), the one scheduler thread of its
periodic jobs (`jobs`), the job's hints (`hints`), and `rgt-onbox follow` for a run started
without one (`follow`). See docs/ARCHITECTURE.md §3 and §4.
"""
