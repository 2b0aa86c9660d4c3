"""Secret redaction for what the launcher records and prints (no secret in an argv, event, log or run.json).

A command line is shown and stored only after `redact_argv`: the value of a secret-looking option
(`--token=…`, `--token …`, `--password …`, `--api-key …`), of a secret-looking assignment
(`WANDB_API_KEY=…`, `trainer.hf_token=…`), the password of a URL (`https://user:pass@host`), an
`Authorization: Bearer …` value, well-known token shapes (GitHub, Hugging Face, OpenAI, Slack, AWS
key ids) and any literal value the caller knows to be secret (the values of secret-named environment
variables) become `***`. Over-redacting a harmless value (`--sort-key loss`) is accepted; letting a
secret through is not. Environment variables are recorded by name only, never by value.

Pure functions over strings; no I/O.
"""
from __future__ import annotations

import re
from typing import Iterable, List, Mapping, Optional, Sequence

MASK = "***"

# The last word of an option or variable name that marks its value as secret.
_SECRET_LAST = frozenset({
    "token", "password", "passwd", "passphrase", "secret", "key", "apikey",
    "credential", "credentials", "auth", "cookie", "pat",
})
# Words that mark the value secret wherever they appear in the name.
_SECRET_ANY = frozenset({"password", "passwd", "passphrase", "secret", "apikey", "credentials"})
# Environment names that look secret by the rules above but are not.
_NOT_SECRET = frozenset({"PWD", "OLDPWD", "SSH_AUTH_SOCK", "GPG_AGENT_INFO", "KEYTIMEOUT"})
# Shorter literal values are not searched for (they would mask digits and words everywhere).
MIN_SECRET_LEN = 6

_URL_USERINFO = re.compile(r"(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*://)(?P<user>[^/\s:@]*):(?P<pw>[^/\s@]+)@")
_AUTH_HEADER = re.compile(
    r"(?i)(authorization:\s*(?:bearer\s+|basic\s+|token\s+)?|\bbearer\s+)([^\s'\"]{8,})")
_TOKEN_SHAPES = re.compile(
    r"\b(?:gh[pousr]_[A-Za-z0-9]{20,}|github_pat_[A-Za-z0-9_]{20,}|hf_[A-Za-z0-9]{20,}"
    r"|sk-[A-Za-z0-9_-]{20,}|xox[abprs]-[A-Za-z0-9-]{10,}|AKIA[0-9A-Z]{16}|glpat-[A-Za-z0-9_-]{20,})")
# `name=value` inside free text (an error message, a log line): the name is an identifier path.
_TEXT_ASSIGN = re.compile(r"(?P<name>-{0,2}[A-Za-z_][A-Za-z0-9_.-]*)=(?P<value>[^\s'\"&]+)")
# `"api_key": "…"` in a JSON (or Python dict) literal given on a command line.
_JSON_PAIR = re.compile(r"(?P<q>[\"'])(?P<name>[A-Za-z_][A-Za-z0-9_.-]*)(?P=q)(?P<sep>\s*:\s*)"
                        r"(?P<vq>[\"'])(?P<value>[^\"']*)(?P=vq)")


def _words(name: str) -> List[str]:
    return [w for w in re.split(r"[-_.]+", name.strip("-").lower()) if w]


def is_secret_name(name: str) -> bool:
    """True for names whose value must never be shown: HF_TOKEN, --api-key, db.password, AWS_SECRET_…"""
    if name.strip("-").upper() in _NOT_SECRET:
        return False
    words = _words(name)
    if not words:
        return False
    joined = "".join(words)
    return (words[-1] in _SECRET_LAST or any(w in _SECRET_ANY for w in words)
            or joined.endswith(("apikey", "accesskey", "secretkey", "privatekey", "authtoken")))


def secret_values(env: Mapping[str, str]) -> List[str]:
    """The values of secret-named variables, long enough to search for, longest first."""
    found = {v for k, v in env.items() if is_secret_name(k) and len(v) >= MIN_SECRET_LEN}
    return sorted(found, key=len, reverse=True)


def _mask_known(text: str, secrets: Sequence[str]) -> str:
    for value in secrets:
        if value and value in text:
            text = text.replace(value, MASK)
    return text


def _mask_shapes(text: str) -> str:
    text = _URL_USERINFO.sub(lambda m: f"{m.group('scheme')}{m.group('user')}:{MASK}@", text)
    text = _AUTH_HEADER.sub(lambda m: f"{m.group(1)}{MASK}", text)
    return _TOKEN_SHAPES.sub(MASK, text)


def _option_name(arg: str) -> Optional[str]:
    """`--api-key` for "--api-key" and "--api-key=…"; None when `arg` is not an option."""
    if not arg.startswith("-") or arg in ("-", "--") or arg[1:2].isdigit():
        return None
    return arg.split("=", 1)[0]


def redact_arg(arg: str, secrets: Sequence[str] = ()) -> str:
    """One argument with the secret parts masked (see the module doc)."""
    name, eq, value = arg.partition("=")
    if eq and value and (_option_name(arg) or re.match(r"^[A-Za-z_][A-Za-z0-9_.-]*$", name)):
        if is_secret_name(name):
            return f"{name}={MASK}"
    return redact_text(arg, secrets)


def redact_argv(argv: Sequence[str], secrets: Sequence[str] = ()) -> List[str]:
    """A command line safe to store and print: `--token X` masks X, `--token=X` masks after `=`."""
    out: List[str] = []
    mask_next = False
    for arg in argv:
        if mask_next:  # the value of `--token VALUE`; a boolean flag's neighbour is masked too
            mask_next = False
            out.append(MASK)
            continue
        name = _option_name(arg)
        if name is not None and "=" not in arg and is_secret_name(name):
            mask_next = True
            out.append(arg)
            continue
        out.append(redact_arg(arg, secrets))
    return out


def redact_text(text: str, secrets: Sequence[str] = ()) -> str:
    """Free text (an error, a log line) with known values, secret assignments and URL passwords masked."""
    text = _mask_known(text, secrets)

    def assign(m: re.Match[str]) -> str:
        return f"{m.group('name')}={MASK}" if is_secret_name(m.group("name")) else m.group(0)

    def pair(m: re.Match[str]) -> str:
        if not is_secret_name(m.group("name")):
            return m.group(0)
        q, vq = m.group("q"), m.group("vq")
        return f"{q}{m.group('name')}{q}{m.group('sep')}{vq}{MASK}{vq}"

    text = _TEXT_ASSIGN.sub(assign, text)
    text = _JSON_PAIR.sub(pair, text)
    return _mask_shapes(text)


def contains_secret(text: str, secrets: Iterable[str]) -> bool:
    """True when any known secret value appears in `text` (a last check before writing)."""
    return any(s and s in text for s in secrets)


__all__ = ["MASK", "contains_secret", "is_secret_name", "redact_arg", "redact_argv", "redact_text",
           "secret_values"]
