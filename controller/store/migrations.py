"""The store's schema: migrations, oldest first.

Append only: a released step never changes (databases out there already ran
it); a schema change is a new step at the end. SQL only, no executescript (it
would commit mid-step). controller.store.db applies them.
"""
from __future__ import annotations

import dataclasses
from typing import Tuple


@dataclasses.dataclass(frozen=True)
class Migration:
    """One schema step, applied in its own transaction. `version` is user_version after it."""

    version: int
    summary: str
    statements: Tuple[str, ...]


MIGRATIONS: Tuple[Migration, ...] = (
    Migration(1, "hosts, runs, events, cursors", (
        """CREATE TABLE hosts (
            name TEXT NOT NULL PRIMARY KEY,
            ssh TEXT NOT NULL DEFAULT '',
            profile TEXT NOT NULL DEFAULT '',
            added_at REAL NOT NULL
        )""",
        """CREATE TABLE runs (
            run TEXT NOT NULL PRIMARY KEY,
            host TEXT NOT NULL DEFAULT '',
            boot_id TEXT NOT NULL DEFAULT '',
            protocol_version INTEGER NOT NULL DEFAULT 0,
            package_version TEXT NOT NULL DEFAULT '',
            meta TEXT NOT NULL DEFAULT '{}',  -- JSON object
            endpoint TEXT NOT NULL DEFAULT '',
            first_seen REAL NOT NULL,
            last_seen REAL NOT NULL
        )""",
        """CREATE TABLE events (
            run TEXT NOT NULL,
            seq INTEGER NOT NULL,
            ts REAL NOT NULL,
            kind TEXT NOT NULL,
            sev TEXT NOT NULL,
            host TEXT NOT NULL,
            data TEXT NOT NULL,  -- JSON object
            received_at REAL NOT NULL,
            PRIMARY KEY (run, seq)
        ) WITHOUT ROWID""",
        """CREATE TABLE cursors (
            run TEXT NOT NULL PRIMARY KEY,
            last_seq INTEGER NOT NULL,
            boot_id TEXT NOT NULL DEFAULT '',
            updated_at REAL NOT NULL
        )""",
    )),
    Migration(2, "index events by kind; seqs the sidecar reported lost", (
        "CREATE INDEX events_run_kind ON events (run, kind)",
        """CREATE TABLE gaps (
            run TEXT NOT NULL,
            first_seq INTEGER NOT NULL,
            last_seq INTEGER NOT NULL,
            reason TEXT NOT NULL,
            recorded_at REAL NOT NULL,
            PRIMARY KEY (run, first_seq, last_seq)
        ) WITHOUT ROWID""",
    )),
    Migration(3, "hosts to reach boxes; where each run lives; what the controller itself saw; "
                 "wakes, wake policies and facts already shown", (
        "ALTER TABLE hosts ADD COLUMN onbox TEXT NOT NULL DEFAULT ''",
        "ALTER TABLE hosts ADD COLUMN root TEXT NOT NULL DEFAULT ''",
        "ALTER TABLE hosts ADD COLUMN installed TEXT NOT NULL DEFAULT '{}'",  # JSON object
        "ALTER TABLE runs ADD COLUMN target TEXT NOT NULL DEFAULT ''",
        "ALTER TABLE runs ADD COLUMN run_dir TEXT NOT NULL DEFAULT ''",
        # Controller-side events (link.lost, sidecar.silent, teardown, ...): they have no
        # sidecar seq, so they get their own id space.
        """CREATE TABLE local_events (
            id INTEGER PRIMARY KEY AUTOINCREMENT,
            run TEXT NOT NULL,
            ts REAL NOT NULL,
            kind TEXT NOT NULL,
            sev TEXT NOT NULL,
            data TEXT NOT NULL  -- JSON object
        )""",
        "CREATE INDEX local_events_run ON local_events (run, id)",
        # An event that ended one `rgt watch` does not end the next one.
        """CREATE TABLE wakes (
            run TEXT NOT NULL,
            key TEXT NOT NULL,
            woke_at REAL NOT NULL,
            PRIMARY KEY (run, key)
        ) WITHOUT ROWID""",
        """CREATE TABLE policies (
            run TEXT NOT NULL PRIMARY KEY,  -- '*' is the default for every run
            policy TEXT NOT NULL,  -- JSON object
            updated_at REAL NOT NULL
        )""",
        """CREATE TABLE shown (
            topic TEXT NOT NULL PRIMARY KEY,
            shown_at REAL NOT NULL
        )""",
    )),
    Migration(4, "runs across boxes: resumed runs, multi-node groups, queues over hosts", (
        # `rgt resume`: the run this one continues (one history in `rgt status`).
        "ALTER TABLE runs ADD COLUMN resumed_from TEXT NOT NULL DEFAULT ''",
        # Multi-node: every node's stream is a run of its own, tied to the logical run.
        "ALTER TABLE runs ADD COLUMN group_run TEXT NOT NULL DEFAULT ''",
        "ALTER TABLE runs ADD COLUMN node TEXT NOT NULL DEFAULT ''",
        "CREATE INDEX runs_group ON runs (group_run)",
        """CREATE TABLE queues (
            name TEXT NOT NULL PRIMARY KEY,
            hosts TEXT NOT NULL,  -- JSON list of host names
            options TEXT NOT NULL DEFAULT '{}',  -- JSON object
            created_at REAL NOT NULL,
            updated_at REAL NOT NULL
        )""",
        """CREATE TABLE queue_cells (
            queue TEXT NOT NULL,
            idx INTEGER NOT NULL,
            command TEXT NOT NULL,  -- JSON list (argv)
            state TEXT NOT NULL,  -- pending | launching | running | retrying | done | failed | cancelled
            attempts INTEGER NOT NULL DEFAULT 0,
            run TEXT NOT NULL DEFAULT '',
            host TEXT NOT NULL DEFAULT '',
            reason TEXT NOT NULL DEFAULT '',
            history TEXT NOT NULL DEFAULT '[]',  -- JSON list: one object per attempt
            updated_at REAL NOT NULL,
            PRIMARY KEY (queue, idx)
        ) WITHOUT ROWID""",
    )),
    Migration(5, "what the laptop asked for at launch, kept apart from what the box says", (
        # JSON object: command, cwd, python, code, profile, onbox_args. `rgt resume` runs this,
        # never the command the box's run.json or hello claims (controller/trust.py).
        "ALTER TABLE runs ADD COLUMN launch TEXT NOT NULL DEFAULT '{}'",
    )),
)
SCHEMA_VERSION = len(MIGRATIONS)
