"""The training progress display: a redrawn rich bar on a terminal, plain lines without escape codes otherwise."""

import io
import re

from rich.console import Console

from qkvjax.train.progress import TrainProgress


def _record(step, loss=2.5):
    return {
        "step": step,
        "loss": loss,
        "bits_per_byte": loss / 0.693,
        "learning_rate": 1e-3,
        "tokens_per_s": 1234.0,
        "mfu": 0.25,
    }


def test_terminal_shows_step_loss_speed_eval_and_eta():
    out = io.StringIO()
    console = Console(file=out, force_terminal=True, width=160, color_system=None)
    p = TrainProgress(3, 17, live=True, console=console)
    for step in range(4, 10):
        p.step(step)
    p.evaluated(9, {"split": "validation", "loss": 2.25, "bits_per_byte": 3.2})
    p.log(_record(9))
    p.close()
    text = out.getvalue()
    assert "\x1b[" in text or "\r" in text  # redrawn in place
    assert "step 9 eval validation loss 2.2500" in text  # messages stay
    last = text.rsplit("\r", 1)[-1]
    assert re.search(r"step\s+9/17", last), last
    assert "loss 2.5000 1,234 tok/s mfu 25.0% | eval 2.2500 @ 9" in last
    assert "eta" in last


def test_plain_lines_when_not_a_terminal():
    out = io.StringIO()
    p = TrainProgress(0, 7, live=False, console=Console(file=out))
    p.message("compiled")
    p.step(1)
    p.step(2)
    p.log(_record(2))
    p.evaluated(2, {"split": "validation", "loss": 2.0, "bits_per_byte": 2.9})
    p.close()
    lines = out.getvalue().splitlines()
    assert lines[0] == "compiled"
    assert re.fullmatch(r"step 2/7 loss 2\.5000 bpb 3\.608 lr 1\.00e-03 1,234 tok/s mfu 25\.0% eta \d+:\d\d", lines[1])
    assert lines[2] == "step 2 eval validation loss 2.0000 bpb 2.900"
    assert "\x1b" not in out.getvalue() and "\r" not in out.getvalue()


def test_other_processes_print_nothing(capsys):
    p = TrainProgress(0, 5, enabled=False)
    p.message("x")
    p.step(1)
    p.log(_record(1))
    p.close()
    assert capsys.readouterr().out == ""
