"""remote-gpu-trainer's box side, the `rgt-onbox` sidecar.

The check below runs before any other module of the package: the `rgt-onbox` entry point imports
onbox.cli, and Python runs this file first. On a Python older than the floor in pyproject.toml's
requires-python (a rental image's old system Python), a person, or the controller reading the
box's answer, then gets one line saying which Python rgt-onbox needs and which one this is, and exit
2, instead of a traceback from a construct that Python does not know. Written so that even
Python 2.7 parses it; tests/controller/test_python_floor.py holds it to pyproject.toml.
"""
import sys

if sys.version_info[:2] < (3, 9):  # noqa: UP036 -- the point is to run on Pythons below the target
    sys.stderr.write("rgt-onbox needs Python 3.9 or newer; this is Python %d.%d.%d (%s)\n"  # noqa: UP031
                     % (sys.version_info[0], sys.version_info[1], sys.version_info[2], sys.executable))
    sys.exit(2)
