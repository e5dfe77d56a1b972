"""Freezing the start-up heap keeps what is alive out of later collections, and nothing is lost."""

from __future__ import annotations

import gc

from pagedserve.shared.heap import freeze_startup_heap


def test_objects_alive_at_start_up_move_to_the_permanent_generation() -> None:
    kept = [object() for _ in range(100)]
    try:
        freeze_startup_heap()
        assert gc.get_freeze_count() >= len(kept)
        made_later = [object() for _ in range(10)]
        gc.collect()
        assert all(o is not None for o in made_later)
    finally:
        gc.unfreeze()  # the rest of the test session collects as before
