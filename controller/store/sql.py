"""The SQL of controller/store/db.py that is more than one line (kept apart to keep store.py short)."""

UPSERT_RUN = """
INSERT INTO runs (run, host, boot_id, protocol_version, package_version, meta, endpoint,
                  first_seen, last_seen, target, run_dir)
VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)
ON CONFLICT (run) DO UPDATE SET
    host = CASE WHEN excluded.host != '' THEN excluded.host ELSE runs.host END,
    boot_id = CASE WHEN excluded.boot_id != '' THEN excluded.boot_id ELSE runs.boot_id END,
    protocol_version = CASE WHEN excluded.protocol_version != 0
                            THEN excluded.protocol_version ELSE runs.protocol_version END,
    package_version = CASE WHEN excluded.package_version != ''
                           THEN excluded.package_version ELSE runs.package_version END,
    meta = CASE WHEN excluded.meta != '{}' THEN excluded.meta ELSE runs.meta END,
    endpoint = CASE WHEN excluded.endpoint != '' THEN excluded.endpoint ELSE runs.endpoint END,
    target = CASE WHEN excluded.target != '' THEN excluded.target ELSE runs.target END,
    run_dir = CASE WHEN excluded.run_dir != '' THEN excluded.run_dir ELSE runs.run_dir END,
    last_seen = excluded.last_seen
"""

INSERT_EVENT = """
INSERT OR IGNORE INTO events (run, seq, ts, kind, sev, host, data, received_at)
VALUES (?, ?, ?, ?, ?, ?, ?, ?)
"""

# The cursor remembers the boot id of the sidecar the run was last heard from.
SET_CURSOR = """
INSERT INTO cursors (run, last_seq, boot_id, updated_at)
VALUES (?1, ?2, COALESCE((SELECT boot_id FROM runs WHERE run = ?1), ''), ?3)
ON CONFLICT (run) DO UPDATE SET
    last_seq = excluded.last_seq, boot_id = excluded.boot_id, updated_at = excluded.updated_at
"""

RUNS = """
SELECT r.run AS run, r.host, r.boot_id, r.protocol_version, r.package_version, r.meta,
       r.endpoint, r.first_seen, r.last_seen AS last_seen, COALESCE(c.last_seq, 0), c.updated_at,
       r.target, r.run_dir, r.resumed_from, r.group_run, r.node, r.launch
FROM runs AS r LEFT JOIN cursors AS c ON c.run = r.run
UNION ALL
SELECT c.run, '', c.boot_id, 0, '', '{}', '', c.updated_at, c.updated_at, c.last_seq, c.updated_at,
       '', '', '', '', '', '{}'
FROM cursors AS c WHERE c.run NOT IN (SELECT run FROM runs)
ORDER BY last_seen DESC, run
"""

RUN_FIELDS = ("run", "host", "boot_id", "protocol_version", "package_version", "meta",
               "endpoint", "first_seen", "last_seen", "last_seq", "cursor_updated_at", "target",
               "run_dir", "resumed_from", "group_run", "node", "launch")
