"""``python -m muon_plugin.torchtitan.check``: a bad job config is one line naming the key."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("torchtitan")

from muon_plugin.torchtitan.check import main  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
CONFIG = str(ROOT / "configs" / "llama3_debug_muon.toml")


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def one_error(capsys, *argv: str) -> str:
    code, out, err = run(capsys, *argv)
    assert code == 2 and out == ""
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("config error: "), err
    return lines[0]


def test_valid_config_prints_the_dump_folder(capsys) -> None:
    code, out, err = run(capsys, CONFIG, "--optimizer.muon.no-nesterov", "--training.steps=3")
    assert code == 0 and out.splitlines()[0] == "./outputs/llama3_debug_muon", err


def test_the_paths_the_job_reads_follow_the_dump_folder(capsys, monkeypatch, tmp_path) -> None:
    """What train.sh decides on (build the local corpus or not): every ``*_path`` the job reads,
    from the TOML or the command line, absolute against the working directory."""
    monkeypatch.chdir(tmp_path)
    here = tmp_path.resolve()
    code, out, err = run(capsys, CONFIG, "--training.dataset_path", "elsewhere/corpus")
    assert code == 0, err
    assert out.splitlines()[1:] == [
        str(here / "data" / "tokenizer"),
        str(here / "elsewhere/corpus"),
    ]
    args = ["--validation.enable", "--validation.dataset_path", "/v", "--model.hf_assets_path=/t"]
    code, out, err = run(capsys, CONFIG, *args)
    assert out.splitlines()[1:] == ["/t", str(here / "data" / "corpus"), "/v"], err


def test_toml_typo_names_the_key_with_a_suggestion(capsys, tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text(Path(CONFIG).read_text().replace("ns_steps = 5", "ns_stepz = 5"))
    line = one_error(capsys, str(bad))
    assert "optimizer.muon.ns_stepz: unknown key" in line
    assert "did you mean optimizer.muon.ns_steps?" in line
    bad.write_text(Path(CONFIG).read_text().replace("[training]", "[trainig]"))
    line = one_error(capsys, str(bad))
    assert "trainig: unknown key" in line and "did you mean training?" in line


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--optimizer.muon.ns_stepz", "7"], "optimizer.muon.ns_stepz: unknown key"),
        (["--optimizer.muon.ns_stepz", "7"], "did you mean optimizer.muon.ns_steps?"),
        (["--trainig.steps", "3"], "did you mean training.steps?"),
        (["--optimizer.muon.ns_steps", "0"], "optimizer.muon.ns_steps: invalid value 0"),
        (["--optimizer.lr=-1"], "optimizer.lr: invalid value -1.0"),
        (["--optimizer.muon.orthogonalization", "x"], "'--optimizer.muon.orthogonalization'"),
        (["--training.steps", "abc"], "training.steps: invalid literal"),
        (["--optimizer.muon.output_patterns", "re:("], "optimizer.muon.output_patterns: invalid"),
        # a value given to a boolean flag: named by the flag, with both of its forms
        (
            ["--optimizer.muon.compile", "true"],
            "optimizer.muon.compile: a flag, it takes no value (command line "
            "--optimizer.muon.compile true); --optimizer.muon.compile sets it, "
            "--optimizer.muon.no-compile clears it",
        ),
        (["--checkpoint.enable=false"], "checkpoint.enable: a flag, it takes no value"),
        (["--training.steps", "7", "--optimizer.muon.compile", "7"], "arguments: 7"),  # which?
    ],
)
def test_bad_overrides_are_one_line(capsys, args: list[str], expected: str) -> None:
    line = one_error(capsys, CONFIG, *args)
    assert expected in line
    assert "--help" not in line and "check.py" not in line  # tyro's "run ... --help" tail


def test_help_is_left_to_torchtitan(capsys) -> None:
    assert run(capsys, CONFIG, "--help")[0] == 0
