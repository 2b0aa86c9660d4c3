"""`rgt-onbox journal`: a run's journal read straight from its files.

The controller asks for it when a run's sidecar does not answer on its sockets: the sidecar ended
(its linger ran out while the laptop slept) or has not come back yet. The journal is the run's
source of truth either way, so the store can still be brought level with it, exit included.
Thin click command (added to the `rgt-onbox` group by onbox/cli/main.py).
"""
from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Optional

import click

from onbox.cli.pull import _fail, _find, _root_option

PAGE_EVENTS = 1000
PAGE_BYTES = 4 << 20


@click.command("journal")
@click.argument("run")
@_root_option
@click.option("--since", type=click.IntRange(min=0), default=0, show_default=True, metavar="SEQ",
              help="Only events after this seq.")
@click.option("--limit", type=click.IntRange(min=1, max=PAGE_EVENTS), default=PAGE_EVENTS, show_default=True,
              help="At most this many events (with --json: one page; `more` says there is another).")
@click.option("--json", "as_json", is_flag=True,
              help="One JSON object: run, since, last_seq, more, bad_lines, events (lines as written).")
def journal_command(run: str, root: Optional[Path], since: int, limit: int, as_json: bool) -> None:
    """Print RUN's journaled events after --since, oldest first, one JSON event a line.

    RUN is a run id, <project>/<run-id> or a run directory. Reads rgt/events.jsonl and its
    rotated files without the sidecar (it may be gone); a torn last line is left out. Exit 0,
    1 when the run or its journal is not found.
    """
    from onbox.sidecar.journal import read_page

    run_dir = _find(root, run, sealed_too=True)
    rgt_dir = run_dir / "rgt"
    if not (rgt_dir / "events.jsonl").exists():
        raise _fail(f"{run_dir} has no journal (rgt/events.jsonl)", "the sidecar never started here")
    try:
        page = read_page(rgt_dir, since, limit=limit, max_bytes=PAGE_BYTES)
    except OSError as e:
        raise _fail(f"cannot read the journal in {rgt_dir}: {e}") from None
    if as_json:
        lines = [line.decode("utf-8", "replace") for line in page.lines]
        click.echo(json.dumps({"run": run_dir.name, "since": since, "last_seq": page.last_seq,
                               "more": page.more, "bad_lines": page.bad_lines, "events": lines}))
        return
    out = sys.stdout.buffer
    for line in page.lines:
        out.write(line + b"\n")
    out.flush()
    if page.more:
        click.echo(f"more after seq {page.last_seq}: --since {page.last_seq}", err=True)


__all__ = ["journal_command"]
