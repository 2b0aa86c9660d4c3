"""Secret redaction of command lines and free text."""
from __future__ import annotations

import pytest

from onbox.launch.redact import (
    MASK,
    contains_secret,
    is_secret_name,
    redact_argv,
    redact_text,
    secret_values,
)


@pytest.mark.parametrize("argv, expected", [
    (["--token=abc123"], ["--token=***"]),
    (["--token", "abc123"], ["--token", MASK]),
    (["--password", "hunter2", "--lr", "3e-4"], ["--password", MASK, "--lr", "3e-4"]),
    (["--api-key", "k-1", "--api_key=k-2"], ["--api-key", MASK, "--api_key=***"]),
    (["--hf-token", "-starts-with-dash"], ["--hf-token", MASK]),
    (["WANDB_API_KEY=abc", "AWS_SECRET_ACCESS_KEY=x", "GH_TOKEN=y", "DB_PASSWORD=z", "MY_SECRET=q"],
     ["WANDB_API_KEY=***", "AWS_SECRET_ACCESS_KEY=***", "GH_TOKEN=***", "DB_PASSWORD=***", "MY_SECRET=***"]),
    (["trainer.hf_token=abc"], ["trainer.hf_token=***"]),
    (["https://alice:pa55@example.com/repo.git"], [f"https://alice:{MASK}@example.com/repo.git"]),
    (["s3://bucket/x?token=abc&region=eu"], [f"s3://bucket/x?token={MASK}&region=eu"]),
    (['{"api_key": "zz9", "lr": 1}'], [f'{{"api_key": "{MASK}", "lr": 1}}']),
    (["-H", "Authorization: Bearer abcdefghij"], ["-H", f"Authorization: Bearer {MASK}"]),
    (["ghp_" + "a" * 36, "hf_" + "B" * 30], [MASK, MASK]),
])
def test_secret_values_are_masked(argv: list, expected: list) -> None:
    assert redact_argv(argv) == expected


def test_ordinary_arguments_are_kept() -> None:
    argv = ["python", "train.py", "--max-tokens=512", "--tokenizer", "bert", "--lr", "3e-4",
            "--epochs", "3", "git@github.com:me/repo.git", "https://example.com/data", "NCCL_DEBUG=INFO",
            "--the-token-embeddings-dim", "64"]
    assert redact_argv(argv) == argv


def test_known_secret_values_are_masked_anywhere() -> None:
    secrets = secret_values({"HF_TOKEN": "s3cr3t-value", "PATH": "/usr/bin", "WANDB_API_KEY": "short"})
    assert secrets == ["s3cr3t-value"]  # PATH is no secret; too short a value is not searched for
    out = redact_argv(["python", "-c", "print('s3cr3t-value')", "--x=s3cr3t-value"], secrets)
    assert not contains_secret(" ".join(out), secrets)
    assert out[2] == f"print('{MASK}')"


def test_free_text() -> None:
    text = "cannot start --token=abc123 with DB_PASSWORD=pw1 at https://u:pw2@h/x (key s3cr3t-value)"
    out = redact_text(text, ["s3cr3t-value"])
    for secret in ("abc123", "pw1", "pw2", "s3cr3t-value"):
        assert secret not in out
    assert "--token=***" in out and "https://u:***@h/x" in out


@pytest.mark.parametrize("name, secret", [
    ("HF_TOKEN", True), ("WANDB_API_KEY", True), ("OPENAI_API_KEY", True), ("AWS_SECRET_ACCESS_KEY", True),
    ("DB_PASSWORD", True), ("--api-key", True), ("--auth-token", True), ("PWD", False), ("OLDPWD", False),
    ("SSH_AUTH_SOCK", False), ("PATH", False), ("MAX_TOKENS", False), ("CUDA_VISIBLE_DEVICES", False),
    ("--tokenizer", False),
])
def test_secret_names(name: str, secret: bool) -> None:
    assert is_secret_name(name) is secret
