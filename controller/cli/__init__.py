"""`rgt`'s commands: thin click wrappers over the capability packages (docs/ARCHITECTURE.md §2).

main finds each command module by name, lazily; base holds what every command shares. Command
modules never import each other, and nothing outside this package imports click.
"""
