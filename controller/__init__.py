"""remote-gpu-trainer's laptop side, the `rgt` command.

The check below runs before any other module of the package: the `rgt` entry point imports
controller.cli.main, and Python runs this file first. On a Python older than the floor in
pyproject.toml's requires-python, a person then reads one line saying which Python rgt needs and
which one this is, and rgt exits 2 (a usage error), instead of a traceback from a construct that
Python does not know. Written so that even Python 2.7 parses it; tests/controller/test_python_floor.py
holds it to pyproject.toml.
"""
import sys

if sys.version_info[:2] < (3, 9):  # noqa: UP036 -- the point is to run on Pythons below the target
    sys.stderr.write("rgt needs Python 3.9 or newer; this is Python %d.%d.%d (%s)\n"  # noqa: UP031
                     % (sys.version_info[0], sys.version_info[1], sys.version_info[2], sys.executable))
    sys.exit(2)
