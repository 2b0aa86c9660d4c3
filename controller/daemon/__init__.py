"""The follower daemon: the one background process of rgt on the laptop (docs/ARCHITECTURE.md,
"The process model"). server.py is the process; queues.py drives the queues inside it.
controller.follow.client is how every other command reaches it."""
