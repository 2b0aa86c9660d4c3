"""Reaching a box: the OpenSSH seam, the ZeroMQ transport, one probe round trip, secrets, code sync
and the jobs run there (docs/ARCHITECTURE.md §4).
"""
