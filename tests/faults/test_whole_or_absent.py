"""import, export and convert write a folder whole or not at all: killed (SIGKILL) at each of their file
boundaries in turn, the target is absent afterwards, and the next run, which finds the killed attempt's
leftovers, succeeds. Untrusted model folders are bounded: links and index paths may not leave the folder, and a
tokenizer is parsed before it is copied."""

import json
import os
import shutil
import signal
import subprocess
import sys
import threading

import pytest

from tests.helpers import REPO, run_in_process

transformers = pytest.importorskip("transformers", reason="the reference model needs the hf and bench extras")
torch = pytest.importorskip("torch", reason="the reference model needs the hf and bench extras")

STRICT_DTYPE_PROMOTION = False  # optax (convert's fresh optimizer state)
KILL_AT = str(REPO / "tests" / "faults" / "kill_at.py")


@pytest.fixture(scope="module")
def gpt2(tmp_path_factory):
    """A tiny GPT-2 folder (transformers' save_pretrained) with a word-level tokenizer.json."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    torch.manual_seed(0)
    config = transformers.GPT2Config(n_embd=15, n_layer=2, n_head=3, n_positions=17, vocab_size=41,
                                     bos_token_id=0, eos_token_id=0)  # fmt: skip
    folder = tmp_path_factory.mktemp("gpt2")
    transformers.GPT2LMHeadModel(config).save_pretrained(folder)
    words = [f"w{i}" for i in range(41)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token=words[0]))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(folder / "tokenizer.json"))
    return folder


def _kill_at(n: int | str, args: list[str], cwd) -> int:
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(REPO))
    env.pop("XLA_FLAGS", None)
    return subprocess.run([sys.executable, KILL_AT, str(n), *args], cwd=cwd, env=env, capture_output=True,
                          timeout=120).returncode  # fmt: skip


def _every_boundary(args: list[str], target, cwd, limit: int = 80) -> int:
    """Kills the command at boundary 1, 2, ... until it finishes; after every kill ``target`` must be absent.
    Returns the number of boundaries."""
    for n in range(1, limit):
        rc = _kill_at(n, args, cwd)
        if rc == 0:
            return n - 1
        assert rc == -signal.SIGKILL, (n, rc)
        assert not os.path.exists(target), f"killed at boundary {n}: {target} exists, half-written"
    raise AssertionError(f"more than {limit} boundaries")


def test_a_target_that_cannot_be_made_is_one_line(gpt2, tmp_path, capsys):
    (tmp_path / "afile").write_text("x")
    assert run_in_process(["import", str(gpt2), "--workdir", str(tmp_path / "afile" / "w")]) == 2
    err = capsys.readouterr().err
    assert "afile/w cannot be created: Not a directory" in err and len(err.strip().splitlines()) == 1, err


@pytest.mark.slow  # ~36 runs of the CLI: 3 minutes; CI kills each command at its first and its publishing boundary
def test_import_and_export_are_whole_or_absent_at_every_kill(gpt2, tmp_path):
    w, out = tmp_path / "w", tmp_path / "exported"
    assert _every_boundary(["import", str(gpt2), "--workdir", str(w)], w, tmp_path) >= 5
    assert sorted(os.listdir(w)) == ["config.json", "params", "special_tokens.json", "tokenizer.json"]
    assert run_in_process(["info", "--workdir", str(w)]) == 0
    assert _every_boundary(["export", "--workdir", str(w), str(out)], out, tmp_path) >= 3
    assert sorted(os.listdir(out)) == ["config.json", "model.safetensors", "tokenizer.json"]
    assert not [n for n in os.listdir(tmp_path) if ".partial" in n]  # the killed attempts' are gone
    model = transformers.AutoModelForCausalLM.from_pretrained(out)
    assert model.config.n_layer == 2


@pytest.mark.parametrize("where", ["first", "last"])
def test_import_and_export_are_whole_or_absent_when_killed(gpt2, tmp_path, where):
    w, out = tmp_path / "w", tmp_path / "exported"
    for args, target in (
        (["import", str(gpt2), "--workdir", str(w)], w),
        (["export", "--workdir", str(w), str(out)], out),
    ):
        assert _kill_at(1 if where == "first" else "publish", args, tmp_path) == -signal.SIGKILL
        assert not target.exists()
        assert run_in_process(args) == 0  # the rerun finds the leftovers and succeeds
    assert sorted(os.listdir(out)) == ["config.json", "model.safetensors", "tokenizer.json"]
    assert not [n for n in os.listdir(tmp_path) if ".partial" in n]


@pytest.mark.parametrize("where", ["first", "last"])
def test_convert_is_whole_or_absent_when_killed(gpt2, tmp_path, where):
    w, out = tmp_path / "w", tmp_path / "mla"
    assert run_in_process(["import", str(gpt2), "--workdir", str(w)]) == 0
    args = ["convert", "--workdir", str(w), "--out", str(out), "--to", "mla", "--rank", "12"]
    # the first boundary, or the last one: the rename that would publish the finished folder
    assert _kill_at(1 if where == "first" else "publish", args, tmp_path) == -signal.SIGKILL
    if where == "last":
        [staging] = tmp_path.glob(".mla.partial.*")
        assert (staging / "config.json").exists()  # everything written but the publishing
    assert not out.exists()
    assert run_in_process(args) == 0  # the rerun finds the leftovers and succeeds
    assert run_in_process(["info", "--workdir", str(out)]) == 0


@pytest.mark.slow
def test_convert_is_whole_or_absent_at_every_kill(gpt2, tmp_path):
    w, out = tmp_path / "w", tmp_path / "mla"
    assert run_in_process(["import", str(gpt2), "--workdir", str(w)]) == 0
    _every_boundary(
        ["convert", "--workdir", str(w), "--out", str(out), "--to", "mla", "--rank", "12"], out, tmp_path, limit=200
    )
    assert run_in_process(["info", "--workdir", str(out)]) == 0


def _copy(gpt2, tmp_path):
    folder = tmp_path / "m"
    shutil.copytree(gpt2, folder)
    return folder


def test_a_tokenizer_that_is_a_link_or_truncated_is_refused_in_one_line(gpt2, tmp_path, capsys):
    secret = tmp_path / "secret.txt"
    secret.write_text("not for copying")
    folder = _copy(gpt2, tmp_path)
    (folder / "tokenizer.json").unlink()
    (folder / "tokenizer.json").symlink_to(secret)
    assert run_in_process(["import", str(folder), "--workdir", str(tmp_path / "a")]) != 0
    err = capsys.readouterr().err
    assert "outside" in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "a").exists()

    folder = _copy(gpt2, tmp_path / "t")
    text = (folder / "tokenizer.json").read_text()
    (folder / "tokenizer.json").write_text(text[: len(text) // 2])  # a disk that filled up
    assert run_in_process(["import", str(folder), "--workdir", str(tmp_path / "b")]) != 0
    err = capsys.readouterr().err
    assert "is not a tokenizer the tokenizers library can read" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "b").exists()


def test_shard_paths_may_not_leave_the_folder(gpt2, tmp_path, capsys):
    folder = _copy(gpt2, tmp_path)
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    shutil.move(folder / "model.safetensors", outside / "model.safetensors")
    from safetensors import safe_open

    with safe_open(str(outside / "model.safetensors"), framework="numpy") as f:
        names = list(f.keys())
    index = {"weight_map": {name: "../elsewhere/model.safetensors" for name in names}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    assert run_in_process(["import", str(folder), "--workdir", str(tmp_path / "a")]) != 0
    err = capsys.readouterr().err
    assert "outside" in err and "../elsewhere/model.safetensors" in err and len(err.strip().splitlines()) == 1
    # a weights file that is a link to one elsewhere: refused too
    (folder / "model.safetensors.index.json").unlink()
    (folder / "model.safetensors").symlink_to(outside / "model.safetensors")
    assert run_in_process(["import", str(folder), "--workdir", str(tmp_path / "b")]) != 0
    assert "outside" in capsys.readouterr().err


def _sparse_safetensors(file, name: str, values: int) -> None:
    """A valid safetensors file holding one float32 tensor of ``values`` values, sparse on disk (a few KiB)."""
    header = json.dumps({name: {"dtype": "F32", "shape": [values], "data_offsets": [0, 4 * values]}}).encode()
    header += b" " * (-len(header) % 8)
    with open(file, "wb") as f:
        f.write(len(header).to_bytes(8, "little") + header)
        f.truncate(8 + len(header) + 4 * values)


def test_an_extra_giant_tensor_is_refused_from_the_header_without_reading_it(gpt2, tmp_path):
    folder = _copy(gpt2, tmp_path)
    from safetensors import safe_open

    with safe_open(str(folder / "model.safetensors"), framework="numpy") as f:
        names = list(f.keys())
    _sparse_safetensors(folder / "extra.safetensors", "extra.weight", 3 << 30)  # 12 GiB, sparse
    weight_map = {n: "model.safetensors" for n in names} | {"extra.weight": "extra.safetensors"}
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env.pop("XLA_FLAGS", None)
    command = [sys.executable, "-m", "qkvjax.cli", "import", str(folder), "--workdir", str(tmp_path / "w")]
    # os.wait4 gives this child's own peak memory; RUSAGE_CHILDREN would be the largest of every child this
    # worker has waited for, so an earlier test's bigger process would fail (or hide) this one.
    with open(tmp_path / "stderr", "w+") as stderr:
        proc = subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=stderr)
        timer = threading.Timer(120, proc.kill)
        timer.start()
        _, status, usage = os.wait4(proc.pid, 0)
        timer.cancel()
        proc.returncode = os.waitstatus_to_exitcode(status)
        stderr.seek(0)
        message = stderr.read()
    assert proc.returncode not in (0, -signal.SIGKILL), (proc.returncode, message)
    assert "'extra.weight'" in message and "more than the whole model" in message, message
    assert len(message.strip().splitlines()) == 1, message
    assert usage.ru_maxrss < 2 << 20, usage.ru_maxrss  # KiB: under 2 GiB, so the 12 GiB were never read
    assert not (tmp_path / "w").exists()


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda f: _edit_config(f, n_positions=10**9), "max_len=1,000,000,000 positions; allowed: at most 1,048,576"),
        (lambda f: (f / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json!}"),
         "is not a readable safetensors file"),
        (lambda f: (f / "model.safetensors").write_bytes(b"\xff" * 8 + b"{}"), "is not a readable safetensors file"),
    ],
)  # fmt: skip
def test_unrunnable_sizes_and_malformed_headers_are_refused_in_one_line(gpt2, tmp_path, capsys, edit, message):
    folder = _copy(gpt2, tmp_path)
    edit(folder)
    assert run_in_process(["import", str(folder), "--workdir", str(tmp_path / "w")]) != 0
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "w").exists()


def _edit_config(folder, **fields) -> None:
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(config | fields))


def test_a_full_disk_during_import_or_export_leaves_nothing_and_the_rerun_succeeds(gpt2, tmp_path, monkeypatch, capsys):
    """ENOSPC raised where the last file is written (no root needed): the target is absent, the staging folder
    removed, the error one line; once there is room again the same command succeeds."""
    import errno

    import qkvjax.workdir as wd

    real = wd.write_text

    def full(target, text):
        raise OSError(errno.ENOSPC, "No space left on device", str(target))

    w, out = tmp_path / "w", tmp_path / "out"
    monkeypatch.setattr(wd, "write_text", full)
    assert run_in_process(["import", str(gpt2), "--workdir", str(w)]) != 0
    assert "No space left on device" in capsys.readouterr().err
    assert not w.exists() and not list(tmp_path.glob(".w.partial*"))
    monkeypatch.setattr(wd, "write_text", real)
    assert run_in_process(["import", str(gpt2), "--workdir", str(w)]) == 0

    import qkvjax.hf.folder as folder

    monkeypatch.setattr(folder.json, "dump", lambda *a, **k: full("config.json", ""))
    assert run_in_process(["export", "--workdir", str(w), str(out)]) != 0
    assert not out.exists() and not list(tmp_path.glob(".out.partial*"))
    monkeypatch.undo()
    assert run_in_process(["export", "--workdir", str(w), str(out)]) == 0
    assert sorted(os.listdir(out)) == ["config.json", "model.safetensors", "tokenizer.json"]
