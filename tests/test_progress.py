"""Progress in a log: whole lines, none for short work, nothing when disabled."""

import io
import sys

import containers.progress as progress
from containers.progress import progress_bar


def _capture(monkeypatch):
    err = io.StringIO()
    monkeypatch.setattr(sys, "stderr", err)
    return err


def test_short_work_prints_nothing_in_a_log(monkeypatch):
    err = _capture(monkeypatch)
    for _ in progress_bar(range(1000), desc="quick"):
        pass
    assert err.getvalue() == ""


def test_a_log_gets_whole_lines_without_carriage_returns(monkeypatch):
    err = _capture(monkeypatch)
    monkeypatch.setattr(progress, "LOG_INTERVAL_S", 0.0)
    with progress_bar(total=3, desc="work", unit="step") as bar:
        for _ in range(3):
            bar.update(1)
    text = err.getvalue()
    assert "\r" not in text
    lines = text.splitlines()
    assert lines and all(line.startswith("work:") for line in lines)
    assert lines[-1].startswith("work: 100%") and "3/3" in lines[-1]
    assert len(lines) == len(set(lines)), "a line was repeated"


def test_disabled_bar_prints_nothing(monkeypatch):
    err = _capture(monkeypatch)
    monkeypatch.setattr(progress, "LOG_INTERVAL_S", 0.0)
    with progress_bar(total=3, desc="work", enabled=False) as bar:
        bar.update(3)
    assert err.getvalue() == ""


def test_heartbeat_refreshes_a_bar_with_no_updates(monkeypatch):
    _capture(monkeypatch)
    bar = progress_bar(desc="compile")
    calls = []
    refresh = bar.refresh
    monkeypatch.setattr(bar, "refresh", lambda: calls.append(refresh()))
    beat = progress.Heartbeat(bar, 0.001)
    while len(calls) < 3:
        beat.done.wait(0.001)
    beat.stop()
    after = len(calls)
    beat.done.wait(0.01)
    bar.close()
    assert len(calls) == after, "the heartbeat went on after stop()"
