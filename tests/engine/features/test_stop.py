"""Stopping in the middle of a source transaction (SIGTERM while the server is still sending a large one, and it
does not end within ``runner.STOP_GRACE``): the open target transaction is rolled back whole, nothing of the
unfinished source transaction stays on the target, the summary counts only what the target committed, and the next
run applies the transaction exactly once.

The source is real; the stall is made by wrapping it (``Runner(wrap_source=…)``, as ``applier verify`` does):
after a number of frames it sets the runner's stop and then gives nothing more, as a walsender busy decoding
would.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from applier.decoder.framing import Frame
from applier.engine.runner import Runner

from .conftest import Rig

ROWS = 6000  # three of the engine's 2,000-row batches: some are applied to the target before the stall


class StallingSource:
    """``source`` until ``frames`` frames were read; then it sets ``stop`` and gives nothing."""

    def __init__(self, source: Any, frames: int, stop: threading.Event) -> None:
        self.source, self.frames, self.stop = source, frames, stop

    def read(self, timeout: float) -> Frame | None:
        if self.frames <= 0:
            self.stop.set()
            time.sleep(min(timeout, 0.05))
            return None
        frame = self.source.read(timeout)
        if frame is not None:
            self.frames -= 1
        return frame

    def __getattr__(self, name: str) -> Any:
        return getattr(self.source, name)


def test_a_stop_mid_transaction_rolls_the_group_back_and_the_next_run_applies_it_once(rig: Rig) -> None:
    rig.both("CREATE TABLE small (id int PRIMARY KEY)")
    rig.both("CREATE TABLE big (id int)")  # no key: a row applied twice would stay twice
    rig.publish("small", "big")
    rig.init()
    rig.src("INSERT INTO small VALUES (1)")  # a whole transaction ahead of the big one
    rig.src(f"INSERT INTO big SELECT g FROM generate_series(1, {ROWS}) g")
    before = rig.progress_lsn()
    stop = threading.Event()
    # the first transaction's 4 messages, and the big one's Relation + Begin + 5,000 of its inserts
    runner = Runner(rig.cfg(), catchup=False, stop=stop,
                    wrap_source=lambda src: StallingSource(src, 5010, stop))
    runner.stop_grace = 0.5  # the 5 s it gives a transaction to end, shortened
    summary = runner.run()
    assert stop.is_set()
    assert rig.tgt("SELECT count(*) FROM big") == [(0,)]
    small = rig.tgt("SELECT count(*) FROM small")[0][0]  # committed on its own before the big one, or not
    assert (summary.transactions, summary.rows) == (small, small)  # the summary counts what the target has
    assert rig.progress_lsn() > before if small else rig.progress_lsn() == before
    again = rig.catchup()
    assert (again.transactions, again.rows) == (2 - small, ROWS + 1 - small)
    assert rig.tgt("SELECT count(*), count(DISTINCT id) FROM big") == [(ROWS, ROWS)]
    assert rig.tgt("SELECT id FROM small") == [(1,)]
