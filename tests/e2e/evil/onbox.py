"""A fake `rgt-onbox`: `python onbox.py SCENARIO.json <rgt-onbox argv>`, run on the test box over real ssh.

It answers each subcommand with what the scenario holds for it, after putting the run id the laptop
asked for (`--run-id`) and the box root into the answer's strings ("{run_id}", "{root}"). Every call is
appended to `calls.jsonl` next to the scenario, so a test can see exactly what the laptop asked the box
to run. `launch` may start the fake sidecar (evil/sidecar.py) in the background; its pid goes to
`<scenario dir>/sidecar.pid` for the test to end.
"""
from __future__ import annotations

import json
import select
import subprocess
import sys
from pathlib import Path
from typing import Any, Dict, List

VERSION = "0.1.0"


def _fill(value: Any, subs: Dict[str, str]) -> Any:
    if isinstance(value, str):
        for key, sub in subs.items():
            value = value.replace("{" + key + "}", sub)
        return value
    if isinstance(value, list):
        return [_fill(v, subs) for v in value]
    if isinstance(value, dict):
        return {k: _fill(v, subs) for k, v in value.items()}
    return value


def _flag(argv: List[str], name: str) -> str:
    for i, word in enumerate(argv):
        if word == name and i + 1 < len(argv):
            return argv[i + 1]
        if word.startswith(name + "="):
            return word.split("=", 1)[1]
    return ""


def main() -> int:
    scenario_path = Path(sys.argv[1])
    argv = sys.argv[2:]
    here = scenario_path.parent
    scenario = json.loads(scenario_path.read_text())
    with open(here / "calls.jsonl", "a") as f:
        f.write(json.dumps(argv) + "\n")
    if argv[:1] == ["--version"]:
        print(f"rgt-onbox, version {scenario.get('version', VERSION)}")
        return 0
    sub = argv[0] if argv else ""
    if sub == "deadman":
        sub = "deadman " + (argv[1] if len(argv) > 1 else "")
    answer = scenario.get(sub)
    if answer is None:
        print(json.dumps({"error": f"the fake box has no answer for {sub!r}"}))
        return 3
    subs = {"run_id": _flag(argv, "--run-id"), "root": str(here / "runs")}
    answer = _fill(answer, subs)
    if sub == "launch" and scenario.get("sidecar") is not None:
        run_dir = Path(str(answer["run_dir"]))
        (run_dir / "rgt").mkdir(parents=True, exist_ok=True)
        (here / "sidecar.json").write_text(json.dumps(_fill(scenario["sidecar"], subs)))
        proc = subprocess.Popen([sys.executable, str(Path(__file__).with_name("sidecar.py")),
                                 str(here / "sidecar.json"), str(run_dir)],
                                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=open(here / "sidecar.log", "ab"), start_new_session=True)
        (here / "sidecar.pid").write_text(str(proc.pid))
        # Like the real launcher, answer once the sidecar has bound: it says so on its stdout
        # (a line, or EOF if it died first), waited for with a deadline.
        assert proc.stdout is not None
        if select.select([proc.stdout], [], [], 20)[0]:
            proc.stdout.readline()
    if sub == "manifest" and scenario.get("manifest_doc") is not None:
        run_dir = Path(argv[1])
        (run_dir / "rgt").mkdir(parents=True, exist_ok=True)
        (run_dir / "rgt" / "PULL_MANIFEST.json").write_text(json.dumps(_fill(scenario["manifest_doc"], subs)))
    raw = scenario.get(sub + " raw")
    if raw is not None:
        sys.stdout.write(_fill(raw, subs))
    else:
        print(json.dumps(answer, ensure_ascii=False))
    sys.stdout.flush()
    return int(scenario.get(sub + " exit", 0))


if __name__ == "__main__":
    sys.exit(main())
