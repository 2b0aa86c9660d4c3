"""Provider calls the dead-man makes from the box itself, where a provider has no CLI there.

    python3 -m onbox.deadman.provider lambda-terminate INSTANCE_ID

lambda-terminate asks Lambda's Cloud API to terminate one instance: POST
{base}/instance-operations/terminate with {"instance_ids": [INSTANCE_ID]}, the key from the
environment variable LAMBDA_API_KEY as a bearer token, at most 30 s. The base URL is
https://cloud.lambda.ai/api/v1, or $RGT_LAMBDA_API_URL (tests serve it from 127.0.0.1). The key
is never printed, logged or put on a command line. Exit 0 when the API accepted the request,
1 when it refused or could not be reached, 2 on bad usage (no key, a malformed instance id).

Standard library only; Python 3.9+.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
import urllib.error
import urllib.request
from typing import IO, Mapping, Optional, Sequence

LAMBDA_API_URL = "https://cloud.lambda.ai/api/v1"
TIMEOUT_S = 30.0
INSTANCE_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}$")


def _short(text: str, key: str) -> str:
    """A body excerpt for a message, with the key masked should a server echo it."""
    return text.replace(key, "***")[:300] if key else text[:300]


def lambda_terminate(instance_id: str, environ: Mapping[str, str], out: IO[str], err: IO[str]) -> int:
    key = environ.get("LAMBDA_API_KEY", "")
    if not INSTANCE_ID.match(instance_id):
        err.write("error: the instance id must be 1-128 of A-Z a-z 0-9 . _ : -\n")
        return 2
    if not key:
        err.write("error: LAMBDA_API_KEY is not set\n"
                  "hint: push it to the box with `rgt secret push HOST LAMBDA_API_KEY`\n")
        return 2
    base = (environ.get("RGT_LAMBDA_API_URL") or LAMBDA_API_URL).rstrip("/")
    request = urllib.request.Request(
        f"{base}/instance-operations/terminate", method="POST",
        data=json.dumps({"instance_ids": [instance_id]}).encode(),
        headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json",
                 "Accept": "application/json", "User-Agent": "rgt-onbox-deadman"})
    try:
        with urllib.request.urlopen(request, timeout=TIMEOUT_S) as answer:
            body = answer.read(64 << 10).decode(errors="replace")
            status = answer.status
    except urllib.error.HTTPError as e:
        detail = e.read(4096).decode(errors="replace")
        err.write(f"error: Lambda refused to terminate {instance_id}: HTTP {e.code} {_short(detail, key)}\n")
        return 1
    except (urllib.error.URLError, OSError) as e:
        reason = getattr(e, "reason", e)
        err.write(f"error: Lambda's API at {base} could not be reached: {_short(str(reason), key)}\n")
        return 1
    try:
        gone = [i.get("id") for i in json.loads(body)["data"]["terminated_instances"]]
    except (ValueError, KeyError, TypeError, AttributeError):
        gone = []
    out.write(json.dumps({"instance_id": instance_id, "status": status, "terminated": gone}) + "\n")
    return 0


def main(argv: Optional[Sequence[str]] = None, environ: Optional[Mapping[str, str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python3 -m onbox.deadman.provider",
                                     description="Provider calls the dead-man runs on the box.")
    sub = parser.add_subparsers(dest="op", required=True)
    term = sub.add_parser("lambda-terminate", help="Terminate this Lambda instance through the Cloud API.")
    term.add_argument("instance_id")
    args = parser.parse_args(argv)
    env = os.environ if environ is None else environ
    return lambda_terminate(args.instance_id, env, sys.stdout, sys.stderr)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
