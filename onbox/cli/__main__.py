"""`python -m onbox.cli`: the rgt-onbox group, for a box where the entry point is not on PATH."""
from onbox.cli.main import main

main()
