"""`rgt status RUN` for a multi-node run: one line per node, and the group's verdict.

Each node line comes from that node stream's own summary (controller.runs.status): where it runs,
its state, its last step and how old its last progress is, and its link. The verdict above them
reads each node's life (controller.runs.life) and the group's own events (controller.runs.groups): a rank
that failed while the others still run, every node hung (and which stopped first), some nodes
stalled, stopped by request, finished. A node stopped by request is not a failed rank, and
neither is one that ended after a stop was asked for another node (its peer went away).
"""
from __future__ import annotations

import time
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

from controller.render import local_time, number, printable, seconds, table
from controller.runs import groups, life, status
from controller.store.db import LocalEvent, Store

RECENT = 3          # group events listed
BAD = (life.FAILED, life.PREEMPTED, life.VANISHED)   # node lives that make a failed rank


def _node(store: Store, info: Mapping[str, Any], now: float) -> Dict[str, Any]:
    s = status.summarize(store, str(info["run"]), now=now)
    return {"node": info.get("node") or info["run"], "run": info["run"], "host": info.get("target") or "",
            "box": s.get("host") or "", "state": s["state"], "state_reason": s["state_reason"],
            "step": s.get("step"), "epoch": s.get("epoch"), "progress_age_s": s.get("progress_age_s"),
            "link": s["link"]["state"], "heartbeat_age_s": s.get("heartbeat_age_s"), "life": s["life"]}


def _last(local: Sequence[LocalEvent], kind: str) -> Optional[LocalEvent]:
    found = [e for e in local if e.kind == kind]
    return found[-1] if found else None


def _ended(n: Mapping[str, Any]) -> bool:
    return bool(n["life"].get("ended"))


def _first_stop(nodes: Sequence[Mapping[str, Any]]) -> Optional[float]:
    """When the first stop was asked for a node of the group (the laptop's clock), or None."""
    asked = [n["life"].get("evidence", {}).get("stop_request", {}).get("ts") for n in nodes
             if n["life"].get("state") == life.STOPPED]
    found = [float(t) for t in asked if isinstance(t, (int, float))]
    return min(found) if found else None


def _after_stop(n: Mapping[str, Any], stop_ts: Optional[float]) -> bool:
    """Whether node n ended after the group's first stop request: its peer went away on purpose."""
    ended = n["life"].get("evidence", {}).get("ts")
    return stop_ts is not None and isinstance(ended, (int, float)) and ended >= stop_ts


def bad_nodes(nodes: Sequence[Mapping[str, Any]]) -> List[Mapping[str, Any]]:
    """The nodes that failed: ended failed, preempted or vanished, and not after a stop asked for
    another node of the group."""
    stop_ts = _first_stop(nodes)
    return [n for n in nodes if n["life"].get("state") in BAD and not _after_stop(n, stop_ts)]


def _failed(nodes: Sequence[Mapping[str, Any]], local: Sequence[LocalEvent]) -> Optional[Tuple[str, str]]:
    """"rank failed" while others still run, "failed" once all ended; the node named first."""
    bad = bad_nodes(nodes)
    if not bad:
        return None
    ranked = _last(local, "job.rank_failed")
    culprit = next((n for n in bad if ranked is not None and n["node"] == ranked.data.get("node")), bad[0])
    live = [str(n["node"]) for n in nodes if not _ended(n)]
    what = f"node {culprit['node']}: {culprit['state_reason']}"
    if live:
        verb = "runs" if len(live) == 1 else "run"
        return "rank failed", f"{what}; {', '.join(live)} still {verb}, waiting on it"
    return "failed", f"{what}; every node has ended"


def _stopped(nodes: Sequence[Mapping[str, Any]]) -> Optional[Tuple[str, str]]:
    """"stopped" once every node ended and a stop was asked for at least one of them."""
    stopped = [n for n in nodes if n["life"].get("state") == life.STOPPED]
    if not stopped or not all(_ended(n) for n in nodes):
        return None
    by = sorted({str(n["life"].get("stopped_by") or "rgt stop") for n in stopped})
    others = [f"{n['node']} {n['state']}" for n in nodes if n not in stopped]
    return "stopped", (f"stopped by request ({', '.join(by)}): {len(stopped)} of {len(nodes)} nodes"
                       + (f"; the others ended after it ({', '.join(others)})" if others else ""))


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
    if all(n["life"].get("state") == life.FINISHED for n in nodes):
        return "finished", f"every node's job finished cleanly ({len(nodes)} nodes)"
    found = _failed(nodes, local) or _stopped(nodes) or _hung(nodes, local)
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
    """The header and one line per node, escaped (render.table)."""
    rows: List[Tuple[str, ...]] = []
    for n in nodes:
        host, box = str(n.get("host") or ""), str(n.get("box") or "")
        host = (f"{host} ({box})" if box and box != host else host) if host else (box or "-")
        step = number(n["step"]) if n.get("step") is not None else "-"
        rows.append((str(n["node"]), host, str(n["state"]), step, _age(n.get("progress_age_s")),
                     str(n["link"])))
    return table(("NODE", "HOST", "STATE", "STEP", "PROGRESS", "LINK"), rows, indent="  ").split("\n")


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


__all__ = ["bad_nodes", "node_table", "one_line", "render", "summarize", "verdict"]
