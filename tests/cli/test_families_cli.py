"""``fp32keep check --family`` / ``--all-families`` / ``--list``: errors first, rows not crashes."""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Iterator
from pathlib import Path

import pytest

from pytest_fp32keep.check import families
from pytest_fp32keep.check.cli import main
from pytest_fp32keep.check.families import entries, shrink
from tests.error_bounds import PARENT_BOUND_S, within

#: An override no T5Config accepts: the family stops building (a known-wrong shrink).
BROKEN_T5 = {"t5": {"feed_forward_proj": "no-such-activation"}}


@pytest.fixture
def broken_t5(monkeypatch: pytest.MonkeyPatch) -> object:
    """T5 does not build in this process (the ranks never see it: the parent probes)."""
    families.probe.cache_clear()
    monkeypatch.setattr(entries, "OVERRIDES", BROKEN_T5)
    yield
    families.probe.cache_clear()


def test_unknown_family_is_an_error_before_any_rank(capsys: pytest.CaptureFixture[str]) -> None:
    with within(PARENT_BOUND_S):
        code = main(["check", "--family", "t5", "--family", "no_such_family"])
    assert code == 2
    err = capsys.readouterr().err
    assert "fp32keep check: error: unknown --family 'no_such_family'" in err
    assert "fp32keep check --list --all-families" in err


@pytest.mark.parametrize(
    ("name", "close"),
    [("nonsense", None), ("gpt_os", "gpt_oss"), ("t55", "t5")],
    ids=["nothing-close", "gpt_oss", "t5"],
)
def test_an_unknown_family_is_named_with_close_names_and_no_path(
    capsys: pytest.CaptureFixture[str], name: str, close: str | None
) -> None:
    """Issue 36: ``--family nonsense`` printed a 276-column line with the absolute path of
    ``transformers/models``."""
    with within(PARENT_BOUND_S):
        code = main(["check", "--family", name])
    assert code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("fp32keep check: error:"), err
    assert f"unknown --family {name!r} (not a model family of the installed Transformers" in err
    assert "fp32keep check --list --all-families" in err
    assert "/" not in err.replace("--", ""), err  # no path (of transformers or anything else)
    assert max(len(line) for line in err.splitlines()) < 200, err
    if close is None:  # negative control: nothing close is offered where nothing is close
        assert "close names" not in err, err
    else:
        assert f"close names: {close}" in err, err


@pytest.mark.usefixtures("broken_t5")
def test_list_says_whether_each_family_builds(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["check", "--list", "--family", "gpt_oss", "--family", "t5"]) == 0
    out = capsys.readouterr().out
    assert "family/gpt_oss  (GptOssForCausalLM: builds)" in out
    assert "family/t5  (not buildable (build: " in out and "no-such-activation" in out


@pytest.mark.slow  # the default tier runs a family in ranks in tests/cli/test_cli.py's shared run
@pytest.mark.usefixtures("broken_t5")
def test_family_runs_in_ranks_and_an_unbuildable_one_is_a_row(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Two real ranks check one family; the family that does not build is a note, not a crash."""
    report = tmp_path / "families.json"
    # GptOss declares its norms in every supported version (a regular list: kept under fp16).
    argv = ["check", "--family", "gpt_oss", "--family", "t5", "--dtype", "fp16"]
    code = main([*argv, "--report-json", str(report)])
    out = capsys.readouterr().out
    assert code == 0, out
    result = json.loads(report.read_text())
    [case] = result["cases"]
    assert (case["target"], case["outcome"], case["ok"]) == (
        "family/gpt_oss",
        "pass",
        True,
    )
    assert case["kept"], "the norms are kept under fp16"
    assert result["unavailable"]["family/t5"].startswith("not buildable (build: ")
    assert "not checked: family/t5: not buildable" in out


@pytest.mark.usefixtures("broken_t5")
def test_no_family_builds_exits_1_with_the_rows(capsys: pytest.CaptureFixture[str]) -> None:
    with within(PARENT_BOUND_S):
        code = main(["check", "--family", "t5"])
    assert code == 1
    out = capsys.readouterr().out
    assert "family/t5: not buildable (build: " in out and "no-such-activation" in out
    assert "0 passed, 0 failed, 1 not buildable" in out


class Heard(logging.Handler):
    """What Transformers' loggers let through (what it would print), whatever captures
    stderr; each build may warn again (Transformers warns once per process, an ``lru_cache``
    of ``Logger.warning_once`` that is cleared here)."""

    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())

    def build(self, config_class: type) -> str:
        import transformers  # noqa: F401  (adds warning_once to logging.Logger)

        logging.Logger.warning_once.cache_clear()  # type: ignore[attr-defined]
        self.lines.clear()
        shrink.tiny_config(config_class)
        return "\n".join(self.lines)


@pytest.fixture
def heard() -> Iterator[Heard]:
    handler = Heard()
    logging.getLogger("transformers").addHandler(handler)
    yield handler
    logging.getLogger("transformers").removeHandler(handler)


def test_list_prints_no_transformers_config_warnings(
    heard: Heard, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 36: ``--list --all-families`` printed Transformers' advice about the shrunk configs
    ("pad_token_id must be ... within the vocabulary", MusicGen's among them)."""
    import transformers
    from transformers import MusicgenDecoderConfig
    from transformers.utils import logging as transformers_logging

    with monkeypatch.context() as unsilenced:  # the premise: this release's config warns
        unsilenced.setattr(shrink, "quiet_config", contextlib.nullcontext)
        if "within the vocabulary" not in heard.build(MusicgenDecoderConfig):
            pytest.skip(
                f"Transformers {transformers.__version__}: MusicGen's shrunk config logs no "
                "warning to silence"
            )
    verbosity = transformers_logging.get_verbosity()
    assert "within the vocabulary" not in heard.build(MusicgenDecoderConfig)
    assert transformers_logging.get_verbosity() == verbosity  # silenced while building only
    # an error Transformers logs while a config is built still shows; its warnings do not
    with shrink.quiet_config():
        logger = transformers_logging.get_logger("transformers.configuration_utils")
        assert logger.isEnabledFor(logging.ERROR)
        assert not logger.isEnabledFor(logging.WARNING)
    # negative control: unsilenced, the same shrunk config does warn
    monkeypatch.setattr(shrink, "quiet_config", contextlib.nullcontext)
    assert "within the vocabulary" in heard.build(MusicgenDecoderConfig)


def test_list_of_a_family_whose_config_warns_prints_its_row_only(
    heard: Heard, capsys: pytest.CaptureFixture[str]
) -> None:
    import transformers

    if not entries.listed("musicgen"):
        pytest.skip(f"Transformers {transformers.__version__}: MusicGen keeps nothing, not listed")
    logging.Logger.warning_once.cache_clear()  # type: ignore[attr-defined]
    families.family_pick.cache_clear()  # built again, here
    families.probe.cache_clear()
    with within(PARENT_BOUND_S):
        assert main(["check", "--list", "--family", "musicgen"]) == 0
    assert "family/musicgen  (" in capsys.readouterr().out
    assert not [line for line in heard.lines if "within the vocabulary" in line], heard.lines
