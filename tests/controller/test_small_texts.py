"""Small texts a person reads: no internal document citations, and hints whose commands can be run.

- every `--help` of rgt and rgt-onbox, every catalog entry (`rgt explain`), every `rgt profile show`
  and SKILL.md/README.md cite no internal document (a section of the early notes, a danger code, the
  design notes by file name: `tests.helpers.CITED_SAMPLES` holds examples);
- the host-key hints name the ssh command rgt really runs: `ssh -F FILE box1` when the alias comes
  from $RGT_SSH_CONFIG, since a plain `ssh box1` reads ~/.ssh/config instead;
- the dead-man hints name the real host and run, never a literal HOST or DIR.
"""
from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
from click.testing import CliRunner

import profiles
from controller.box.ssh import HostKeyChanged, HostKeyUnknown, Ssh, Unreachable, classify
from controller.insight import catalog
from controller.runs import status
from controller.store.db import Store
from controller.teardown import deadman as ctl
from protocol import Event
from tests.helpers import CITED_SAMPLES, citations
from tests.sshbox import SshBox, sshbox  # noqa: F401 (fixture)
from tests.test_skill_contract import PROGRAMS, every_invocation

REPO = Path(__file__).resolve().parents[2]
UNKNOWN_KEY = b"No ED25519 host key is known for box1 and you have requested strict checking.\n" \
              b"Host key verification failed.\n"
CHANGED_KEY = b"@@@ WARNING: REMOTE HOST IDENTIFICATION HAS CHANGED! @@@\n" \
              b"Host key for box1 has changed and you have requested strict checking.\n"


# ---- internal documents ---------------------------------------------------------------------------


def test_the_scanner_finds_what_it_must_and_only_that() -> None:
    for cited in CITED_SAMPLES:
        assert citations(cited), cited
    for plain in ("the dead-man lease", "ad-hoc runs", "Xid 79 (GPU fell off the bus)", "issues a SIGTERM",
                  "DESIGN of the gate"):
        assert not citations(plain), plain


def test_no_help_text_cites_an_internal_document() -> None:
    runner = CliRunner()
    found = []
    invocations = every_invocation()
    assert len(invocations) > 40  # both programs were walked
    for words in invocations:
        result = runner.invoke(PROGRAMS[words[0]], [*words[1:], "--help"], prog_name=words[0])
        assert result.exit_code == 0, (words, result.output)
        found += [f"{' '.join(words)}: {line}" for line in citations(result.output)]
    assert not found, "\n".join(found)


def test_no_catalog_entry_cites_an_internal_document() -> None:
    entries = catalog.default_catalog().entries
    assert len(entries) > 100
    found = [f"{e.id}: {line}" for e in entries
             for text in (e.title, e.cause, *e.symptoms, *e.signals, *e.fix) for line in citations(text)]
    assert not found, "\n".join(found)


def test_the_agent_and_user_documents_cite_no_internal_document() -> None:
    for name in ("SKILL.md", "README.md"):
        assert not citations((REPO / name).read_text(encoding="utf-8")), name


def test_no_profile_shown_cites_an_internal_document() -> None:
    runner = CliRunner()
    found = []
    for name in profiles.names():
        result = runner.invoke(PROGRAMS["rgt"], ["profile", "show", name], prog_name="rgt")
        assert result.exit_code == 0, result.output
        found += [f"{name}: {line}" for line in citations(result.output)]
    assert not found, "\n".join(found)


# ---- the host-key hint ----------------------------------------------------------------------------


def test_host_key_hints_name_the_config_rgt_uses(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config = tmp_path / "my ssh" / "config"
    by_hand = f"ssh -F {shlex.quote(str(config))} box1"
    for stderr, kind in ((UNKNOWN_KEY, HostKeyUnknown), (CHANGED_KEY, HostKeyChanged)):
        err = classify("box1", stderr, 255, config_file=config)
        assert isinstance(err, kind) and err.hint is not None
        assert f"`{by_hand}`" in err.hint and "plain" not in err.hint, err.hint
        bare = classify("box1", stderr, 255, config_file=None)
        assert bare is not None and bare.hint is not None and "`ssh box1`" in bare.hint, bare
        # The default is the config rgt's own calls read: $RGT_SSH_CONFIG.
        monkeypatch.setenv("RGT_SSH_CONFIG", str(config))
        env = classify("box1", stderr, 255)
        assert env is not None and env.hint is not None and by_hand in env.hint, env
        monkeypatch.delenv("RGT_SSH_CONFIG")
    down = classify("box1", b"ssh: connect to host 10.0.0.1 port 22: Connection refused\n", 255,
                    config_file=config)
    assert isinstance(down, Unreachable) and down.hint is not None and str(config) in down.hint
    assert "~/.ssh/config" not in down.hint


@pytest.mark.e2e
def test_a_real_unknown_host_names_the_config_file(sshbox: SshBox, tmp_path: Path) -> None:  # noqa: F811
    empty = tmp_path / "known_hosts"
    empty.write_text("")
    cfg = sshbox.write_client_config(tmp_path / "config", known_hosts=empty)
    ssh = sshbox.track(Ssh("box", control_dir=tmp_path / "ctl", config_file=cfg))
    with pytest.raises(HostKeyUnknown) as err:
        ssh.start_master()
    assert err.value.hint is not None and f"`ssh -F {cfg} box`" in err.value.hint, err.value.hint


# ---- the dead-man hints ---------------------------------------------------------------------------


def test_a_closed_gate_hint_names_the_run_to_verify(home: Path) -> None:
    with Store.open() as store:
        store.upsert_run("run-a", host="", target="local", run_dir=str(home / "runs" / "run-a"))
        with pytest.raises(ctl.DeadmanError) as err:
            ctl.authorize(store, "local", "terminate", instance_id="i-1", typed="local")
    hint = err.value.hint or ""
    assert "rgt pull run-a" in hint and "rgt verify run-a" in hint, hint
    assert not re.search(r"\b(DIR|HOST|RUN)\b", hint), hint


def test_status_names_the_host_in_its_dead_man_hint(home: Path) -> None:
    with Store.open() as store:
        store.upsert_run("run-a", host="box1", target="gpu1", run_dir="/r/run-a")
        store.apply("run-a", [Event(run="run-a", host="box1", seq=1, ts=1_700_000_000.0, kind="deadman.armed",
                                    sev="info", data={"ttl_s": 7200.0})], 1)
        text = status.render(status.summarize(store, "run-a", now=1_700_000_060.0))
    assert "rgt deadman gpu1 status" in text and "HOST" not in text, text
