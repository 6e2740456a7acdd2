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
    assert "training loss 2.5000 @ 9 1,234 tok/s mfu 25.0% | eval 2.2500 @ 9" in last
    assert "eta" in last


def test_an_evaluation_shows_on_the_live_line_when_it_finishes():
    """The loop logs a step, then evaluates at it: the line shows that evaluation at once, not one interval later
    (round 4: the figure lagged one evaluation behind)."""
    out = io.StringIO()
    console = Console(file=out, force_terminal=True, width=160, color_system=None)
    p = TrainProgress(0, 40, live=True, console=console)
    p.step(20)
    p.log(_record(20))  # logged first, as the loop's cadences run
    p.evaluated(20, {"split": "validation", "loss": 2.125, "bits_per_byte": 3.1})
    text = out.getvalue()
    p.close()
    assert "loss 2.5000 @ 20 1,234 tok/s mfu 25.0% | eval 2.1250 @ 20" in text, text  # redrawn with the eval


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


def test_the_live_line_counts_finished_steps_and_says_what_the_run_is_doing(monkeypatch):
    """Steps dispatched ahead of the device are not shown as done: the line waits for a step (at most every
    REDRAW_S) before it draws it, the time left is the finished steps' rate, and a status word names evaluating and
    saving while they run."""
    import qkvjax.train.progress as progress

    clock = [100.0]
    monkeypatch.setattr(progress.time, "perf_counter", lambda: clock[0])
    out = io.StringIO()
    console = Console(file=out, force_terminal=True, width=160, color_system=None)
    p = TrainProgress(0, 101, live=True, console=console)
    finished = []
    p.step(1, lambda: finished.append(1))  # the first step: compiled, waited for, the clock starts
    for step in range(2, 41):  # dispatched 0.01 s apart: the line waits only every REDRAW_S
        clock[0] += 0.01
        p.step(step, lambda s=step: finished.append(s))
    assert finished == [1]  # 0.39 s of dispatching, under REDRAW_S: no wait, no step drawn as done
    assert re.search(r"step\s+1/101", out.getvalue().rsplit("\r", 1)[-1])  # step 1 drawn, 2-40 not yet
    p.doing("evaluating")
    assert "evaluating" in out.getvalue().rsplit("\r", 1)[-1]
    p.doing("saving checkpoint")
    assert "saving checkpoint" in out.getvalue().rsplit("\r", 1)[-1]
    clock[0] += 1.0
    p.step(41, lambda: finished.append(41))  # REDRAW_S has passed: waits, draws step 41
    last = out.getvalue().rsplit("\r", 1)[-1]
    assert finished[-1] == 41 and re.search(r"41/101", last), last
    # 40 steps in 1.39 s since step 1: 60 left at that rate
    assert "eta 0:02" in last, last
    p.close()
