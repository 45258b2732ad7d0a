"""The console side of a run (issue 47 item 9): the progress line at the bottom of a terminal,
redrawn on time, with log lines printed above it and never glued onto it. A terminal here is
a text stream that says it is one; what it receives is read back as a terminal shows it."""
from __future__ import annotations

import io
import logging

import pytest

from megaray.driver.runlog import LOG_FORMAT, ConsoleHandler, Progress, log


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True

    def screen(self) -> list[str]:
        """The lines a terminal shows: a carriage return goes back to the line's start and
        ESC[K erases what follows, so each line shows what was last written on it."""
        lines = [""]
        for chunk in self.getvalue().replace("\x1b[K", "").split("\n"):
            lines[-1] = chunk.split("\r")[-1] if "\r" in chunk else lines[-1] + chunk
            lines.append("")
        return lines[:-1]


def _row(step: int) -> dict:
    return {"step": step, "loss": 5.0 - step / 10, "learning_rate": 1e-3, "grad_norm": 0.5, "skipped": False,
            "tokens_per_second": 1234.0, "step_time_seconds": 0.25}


@pytest.fixture
def terminal():
    term = Terminal()
    handler = ConsoleHandler(term)
    handler.setFormatter(LOG_FORMAT)
    old = list(log.handlers)
    log.handlers[:] = [handler]
    log.setLevel(logging.INFO)
    yield term
    log.handlers[:] = old


def test_log_lines_go_above_the_progress_line(terminal):
    p = Progress(10, every_s=0.0, out=terminal)
    p.update(_row(1))
    log.warning("checkpoint written")
    p.update(_row(2), logged=False)
    p.close()
    shown = terminal.screen()
    assert shown[0].endswith("WARNING checkpoint written") and "step" not in shown[0]
    assert shown[1].startswith("[") and "step 2/10 loss 4.8000" in shown[1]
    assert "1,234 tok/s" in shown[1] and "elapsed 0m00s" in shown[1] and "eta " in shown[1]
    assert terminal.getvalue().endswith("\n")                      # what follows starts below it


def test_the_line_is_redrawn_on_time_not_only_at_logged_steps(terminal):
    never = Progress(10, every_s=float("inf"), out=terminal)
    never.update(_row(1), logged=True)
    drawn = terminal.getvalue()
    for step in range(2, 6):
        never.update(_row(step), logged=False)                     # within the interval: not redrawn
    assert terminal.getvalue() == drawn
    never.update(_row(6), logged=True)
    assert "step 6/10" in terminal.screen()[-1]
    always = Progress(10, every_s=0.0, out=terminal)
    always.update(_row(7), logged=False)                           # the interval passed: redrawn
    assert "step 7/10" in terminal.screen()[-1]


def test_without_a_terminal_each_logged_step_is_a_log_line(terminal):
    plain = io.StringIO()
    p = Progress(10, out=plain)
    assert not p.tty
    p.update(_row(1), logged=True)
    p.update(_row(2), logged=False)
    shown = terminal.getvalue().splitlines()
    assert len(shown) == 1 and "INFO step 1/10 loss 4.9000" in shown[0] and plain.getvalue() == ""


def test_the_held_out_loss_is_a_curve_by_default():
    """Issue 47 item 12: train.eval_every left unset evaluates ten times over a run of 20 steps
    or more (and once more at its end), only at the end of a shorter one; a set value wins."""
    from megaray.driver.runner import Evaluator
    from megaray.loader import load_config

    def due(*overrides):
        ev = Evaluator(load_config("demo", list(overrides)))
        return [k for k in range(1, 1001) if ev.due(k)]

    assert due() == [30, 60, 90, 120, 150, 180, 210, 240, 270]                # 300 steps; 300 itself at the end
    assert due("train.steps=25") == [2 * k for k in range(1, 13)]
    assert due("train.steps=19") == [] and due("train.steps=300", "train.eval_every=0") == []
    assert due("train.steps=10", "train.eval_every=4") == [4, 8]
