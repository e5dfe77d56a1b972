"""bench/kv_capacity.py: the published configs' groups and the saving window freeing gives."""

from __future__ import annotations

import pytest

from bench import kv_capacity


def test_window_freeing_fits_more_long_sequences(capsys: pytest.CaptureFixture[str]) -> None:
    assert kv_capacity.main([]) == 0
    out = capsys.readouterr().out
    assert "gemma-3-27b   52/62 local, w=1024  7x10" in out
    rows = {(r[0], r[3]): r for r in kv_capacity.rows(40.0, 16, 2048)}
    gemma3 = rows[("gemma-3-12b", "128k")]
    assert gemma3[7] == "0" and int(gemma3[8]) >= 4  # 128k sequences in 40 GiB: none without, 4 with
    assert all(float(r[6].rstrip("x")) >= 1.8 for r in rows.values())
