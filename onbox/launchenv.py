"""What a platform profile changes about a job's start: interpreter, proxy hook, mirror variables.

Applied by the launcher when `--profile NAME` is given. Nothing here overrides what the user set:
a variable already in the launcher's environment or given with `--env` wins over the profile's.
"""
from __future__ import annotations

import dataclasses
import os
import re
from typing import Dict, List, Mapping, Sequence

from profiles import Profile

# `source` the hook, say so on stderr (train.log) if it failed, then become the job.
_HOOK_SCRIPT = ('. "$0" >/dev/null 2>&1 || echo "rgt: the proxy hook $0 failed; starting without it" >&2; '
                'exec "$@"')


@dataclasses.dataclass
class Applied:
    argv: List[str]
    env: Dict[str, str]            # profile variables to add to the job's environment
    notes: List[str]               # what was applied or skipped, for the launcher's output
    record: Dict[str, object]      # for run.json: names and paths only, never values


def apply_profile(profile: Profile, argv: Sequence[str], user_env: Mapping[str, str]) -> Applied:
    s = profile.scripts
    out = list(argv)
    notes: List[str] = []
    record: Dict[str, object] = {"name": profile.name}
    if s.python and out and re.match(r"^python[0-9.]*$", os.path.basename(out[0])):
        if os.path.exists(s.python):
            out[0] = s.python
            record["python"] = s.python
        else:
            notes.append(f"profile {profile.name}: interpreter {s.python} not found; using {out[0]}")
    if s.proxy_hook:
        if os.path.exists(s.proxy_hook):
            out = ["/bin/sh", "-c", _HOOK_SCRIPT, s.proxy_hook, *out]
            record["proxy_hook"] = s.proxy_hook
        else:
            notes.append(f"profile {profile.name}: proxy hook {s.proxy_hook} not found; not sourced")
    env = {k: v for k, v in s.env.items() if k not in user_env}
    record["env_names"] = sorted(env)
    return Applied(argv=out, env=env, notes=notes, record=record)
