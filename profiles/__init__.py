"""Platform profiles as data: profiles/<name>.toml, read with the standard library and validated.

Imports nothing of ours. One schema (profiles/schema.py), and a key it does not know is refused with
the file, the key and its line. A profile carries:

- `[scripts]`: what the launcher applies (interpreter, proxy hook, mirror variables, data and
  durable directories);
- `[surface]`: what a person must hear before renting (what really stops the meter, the danger
  clocks, short notes), printed once per platform by the controller;
- `[storage.<tier>]`: each tier's path and whether it survives a stop and a release;
- `[actions.<name>]` and `meter_stop_action`: what each provider action stops, deletes and still
  bills, how to run it;
- `[ssh]`, `[spot]`: how the box is reached, and what notice an interruption gives;
- `[deadman]`: what a forgotten box does to itself, never destructive by default.

Every money- or data-affecting fact carries `verified = "YYYY-MM"` and a `source`;
`stale()` lists the stamps that have grown old.
"""
from __future__ import annotations

from profiles.commands import command_fields, fill_command
from profiles.loader import directory, load, load_all, names
from profiles.model import NOTIFY, Action, Deadman, Profile, Scripts, Spot, Ssh, Stamp, Storage, Surface
from profiles.schema import KINDS, PLACEHOLDERS, ProfileError
from profiles.stamps import STALE_MONTHS, Aged, ages, is_month, months_between, stale, stamps, this_month

__all__ = [
    "KINDS", "NOTIFY", "PLACEHOLDERS", "STALE_MONTHS", "Action", "Aged", "Deadman", "Profile",
    "ProfileError", "Scripts", "Spot", "Ssh", "Stamp", "Storage", "Surface", "ages", "command_fields",
    "directory", "fill_command", "is_month", "load", "load_all", "months_between", "names", "stale", "stamps",
    "this_month",
]
