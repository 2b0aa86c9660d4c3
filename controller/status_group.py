"""`rgt status RUN` for a multi-node run: one line per node, and the group's verdict.

Each node line comes from that node stream's own summary (controller.status): where it runs,
its state, its last step and how old its last progress is, and its link. The verdict above them
reads the node states and the group's own events (controller.groups): a rank that failed while
the others still run, every node hung (and which stopped first), some nodes stalled, finished.
"""
from __future__ import annotations

import time
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

from controller import groups, status
from controller.render import local_time, printable
from controller.store import LocalEvent, Store
from controller.wake import number, seconds

RECENT = 3          # group events listed
FAILED = "exited failed"


def _node(store: Store, info: Mapping[str, Any], now: float) -> Dict[str, Any]:
    s = status.summarize(store, str(info["run"]), now=now)
    return {"node": info.get("node") or info["run"], "run": info["run"], "host": info.get("target") or "",
            "box": s.get("host") or "", "state": s["state"], "state_reason": s["state_reason"],
            "step": s.get("step"), "epoch": s.get("epoch"), "progress_age_s": s.get("progress_age_s"),
            "link": s["link"]["state"], "heartbeat_age_s": s.get("heartbeat_age_s")}


def _last(local: Sequence[LocalEvent], kind: str) -> Optional[LocalEvent]:
    found = [e for e in local if e.kind == kind]
    return found[-1] if found else None


def _failed(nodes: Sequence[Mapping[str, Any]], local: Sequence[LocalEvent]) -> Optional[Tuple[str, str]]:
    """"rank failed" while others still run, "failed" once all ended; the node named first."""
    bad = [n for n in nodes if n["state"] == FAILED]
    if not bad:
        return None
    ranked = _last(local, "job.rank_failed")
    culprit = next((n for n in bad if ranked is not None and n["node"] == ranked.data.get("node")), bad[0])
    live = [str(n["node"]) for n in nodes if not str(n["state"]).startswith("exited")]
    what = f"node {culprit['node']}: {culprit['state_reason']}"
    if live:
        verb = "runs" if len(live) == 1 else "run"
        return "rank failed", f"{what}; {', '.join(live)} still {verb}, waiting on it"
    return "failed", f"{what}; every node has ended"


def _hung(nodes: Sequence[Mapping[str, Any]], local: Sequence[LocalEvent]) -> Optional[Tuple[str, str]]:
    stalled = [str(n["node"]) for n in nodes if n["state"] == "stalled"]
    if not stalled:
        return None
    if len(stalled) < len(nodes):
        return "stalled", f"{', '.join(stalled)} stalled; the other nodes still progress or ended"
    onset = [e for e in local
             if e.kind in ("job.stalled", "job.progressing") and e.data.get("scope") == groups.SCOPE]
    if onset and onset[-1].kind == "job.stalled":
        d = onset[-1].data
        at = f" at step {number(d['step'])}" if d.get("step") is not None else ""
        return "hung", (f"every node stopped progressing; {d.get('first_node')} stopped first{at}, "
                        f"{seconds(d.get('idle_s'))} before the verdict")
    return "hung", "every node stopped progressing (the group verdict is not recorded yet)"


def verdict(nodes: Sequence[Mapping[str, Any]], local: Sequence[LocalEvent]) -> Tuple[str, str]:
    """(state, reason) of the whole group."""
    if not nodes:
        return "unknown", "no node stream recorded yet (rgt track HOST RUN records them)"
    if all(n["state"] == "exited ok" for n in nodes):
        return "finished", f"every node's job finished cleanly ({len(nodes)} nodes)"
    found = _failed(nodes, local) or _hung(nodes, local)
    if found is not None:
        return found
    running = [n for n in nodes if n["state"] == "running"]
    if running:
        return "running", f"{len(running)} of {len(nodes)} nodes running"
    return "unknown", "no node says it runs: " + ", ".join(f"{n['node']} {n['state']}" for n in nodes)


def _local(e: LocalEvent, now: float) -> Dict[str, Any]:
    return {"id": e.id, "kind": e.kind, "sev": e.sev, "ts": e.ts, "age_s": round(max(0.0, now - e.ts), 1),
            "data": e.data}


def summarize(store: Store, group: str, now: Optional[float] = None) -> Dict[str, Any]:
    """Everything `rgt status GROUP` shows, as a JSON-able dict."""
    t = time.time() if now is None else now
    nodes = [_node(store, info, t) for info in groups.members(store, group)]
    local = store.local_events(group)
    state, reason = verdict(nodes, local)
    return {"run": group, "group": True, "generated_at": t, "state": state, "state_reason": reason,
            "nodes": nodes, "events": [_local(e, t) for e in local[-RECENT:]]}


def _age(value: Any) -> str:
    return f"{seconds(value)} ago" if value is not None else "-"


def node_table(nodes: Sequence[Mapping[str, Any]]) -> List[str]:
    rows = [("NODE", "HOST", "STATE", "STEP", "PROGRESS", "LINK")]
    for n in nodes:
        host, box = str(n.get("host") or ""), str(n.get("box") or "")
        host = (f"{host} ({box})" if box and box != host else host) if host else (box or "-")
        step = number(n["step"]) if n.get("step") is not None else "-"
        rows.append((str(n["node"]), host, str(n["state"]), step, _age(n.get("progress_age_s")),
                     str(n["link"])))
    widths = [max(len(r[i]) for r in rows) for i in range(5)]
    return ["  " + "  ".join([*(r[i].ljust(widths[i]) for i in range(5)), r[5]]) for r in rows]


def render(s: Mapping[str, Any]) -> str:
    """One screen for people; every line escaped (node names and reasons come from boxes)."""
    lines = [f"run {s['run']} (multi-node, {len(s['nodes'])} node{'s' if len(s['nodes']) != 1 else ''})",
             f"  state     {s['state']}: {s['state_reason']}"]
    lines += node_table(s["nodes"])
    for e in s["events"]:
        who = e["data"].get("node") or e["data"].get("first_node") or ""
        lines.append(f"  group     {e['sev']}: {e['kind']}{' ' + str(who) if who else ''}"
                     f" ({local_time(e['ts'])})")
    return "\n".join(printable(line) for line in lines)


def one_line(s: Mapping[str, Any]) -> str:
    """The verdict and each node's state and step in one printable line (`rgt watch`'s timeout)."""
    parts = [f"{n['node']} {n['state']}" + (f" step {number(n['step'])}" if n.get("step") is not None else "")
             for n in s["nodes"]]
    return printable(f"{s['state']}: {s['state_reason']}" + (f" ({'; '.join(parts)})" if parts else ""))


__all__ = ["node_table", "one_line", "render", "summarize", "verdict"]
