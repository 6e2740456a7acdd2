"""Every option of every command given odd values, one at a time, on a real tiny run: the command finishes, or
refuses in one line (exit 2), and writes nothing into the folder it was started from. 312 commands, an option
added later included; 26 s on one worker, 2026-11-30 (most are refused before anything compiles, the others reuse
the process's compiled programs). The first such sweep (2026-11-30) found an empty ``--workdir`` training into the
current folder, counts that filled the memory, plots written under another name and a hang (README.md,
Reliability)."""

import pytest

from qkvjax.cli import Option, commands
from tests.helpers import TINY, run_in_process, train_args

pytestmark = pytest.mark.xdist_group("odd_values")  # one worker builds the run they all read

INTS = ["0", "-1", "-7", str(2**40), str(10**30)]
FLOATS = ["0", "-1", "nan", "inf", "-inf", "1e308"]
PATHS = ["", "{tmp}/missing/x", "{tmp}/afile", "{tmp}/adir", "/dev/null", "{tmp}/afile/sub"]
# options that start or join other processes, or read standard input: tested where they are (test_multiprocess,
# test_chat)
SKIP = {"--coordinator", "--coordinator-port", "--num-processes", "--process-id", "--distributed-timeout",
        "--messages"}  # fmt: skip
BASE = {
    "schemes": ["schemes"],
    "train": ["train", f"--config={TINY}", "--workdir={out}", "--config.train.num_steps=2",
              "--config.data.source_path={text}", "--config.data.data_dir={data}"],
    "plan": ["plan", f"--config={TINY}", "--devices", "2"],
    "eval": ["eval", "--workdir", "{run}"],
    "sample": ["sample", "--workdir", "{run}", "--prompt", "ab", "--num-tokens", "3"],
    "info": ["info", "--workdir", "{run}"],
    "convert": ["convert", "--workdir", "{run}", "--out", "{out}", "--to", "mla", "--rank", "8"],
    "analyze": ["analyze", "--workdir", "{run}"],
    "import": ["import", "{hf}", "--workdir", "{out}"],
    "export": ["export", "{out}", "--workdir", "{run}"],
    "compare": ["compare", "{run}"],
    "prepare": ["prepare", "{docs}", "--out", "{out}", "--tokenizer", "bytes", "--val-fraction", "0.5",
                "--workers", "1"],
}  # fmt: skip


def _cases():
    for command in commands():
        for item in command.options:
            for option in [item] if isinstance(item, Option) else item[1]:
                flag, kw = option.flags[0], option.kwargs
                if flag in SKIP or kw.get("action") == "store_true" or kw.get("choices"):
                    continue
                kind = kw.get("type")
                values = INTS if kind is int else FLOATS if kind is float else PATHS if kind is None else []
                for value in values:
                    yield pytest.param(command.name, flag, value, id=f"{command.name} {flag}={value}")


def _argv(command: str, flag: str, value: str) -> list[str]:
    argv = list(BASE[command])
    if not flag.startswith("-"):  # a positional: the first after the command
        argv[1] = value
    elif flag in argv:
        argv[argv.index(flag) + 1] = value
    else:
        argv.append(f"{flag}={value}")
    return argv


@pytest.fixture(scope="module")
def places(tmp_path_factory, small_text, data_dir):
    root = tmp_path_factory.mktemp("odd")
    run, hf = root / "run", root / "hf"
    assert run_in_process(train_args(run, small_text, data_dir, **{"train.num_steps": 2})) == 0
    assert run_in_process(["export", str(hf), "--workdir", str(run)]) == 0
    docs = root / "docs"
    docs.mkdir()
    for i in range(9):
        (docs / f"d{i}.txt").write_text(f"document {i}\n" * (i + 1))
    return {"run": str(run), "hf": str(hf), "text": small_text, "data": data_dir, "docs": str(docs)}


@pytest.mark.parametrize("command, flag, value", list(_cases()))
def test_the_command_finishes_or_refuses_in_one_line(command, flag, value, places, tmp_path, monkeypatch, capsys):
    (tmp_path / "afile").write_text("x")
    (tmp_path / "adir").mkdir()
    (tmp_path / "cwd").mkdir()
    monkeypatch.chdir(tmp_path / "cwd")
    fill = places | {"tmp": str(tmp_path), "out": str(tmp_path / "out")}
    argv = [a.format(**fill) for a in _argv(command, flag, value)]
    try:
        code = run_in_process(argv)
    except SystemExit as e:  # argparse refusing a value of the wrong type: its usage and one error line
        code = e.code
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if "error:" in line]
    assert code in (0, 2) and "Traceback" not in err, err[-2000:]
    assert code == 0 or len(errors) == 1, err[-2000:]
    assert not any((tmp_path / "cwd").iterdir()), sorted(p.name for p in (tmp_path / "cwd").iterdir())
