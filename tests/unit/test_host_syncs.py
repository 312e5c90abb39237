"""``benchmarks/host_syncs.py``'s count of the host's waits: torch's sync-debug warnings and ``synchronize`` calls, by
the place that made them, only once counting starts; other warnings pass through. (The benchmark itself needs a GPU:
sync debug mode exists only with CUDA.)"""

from __future__ import annotations

import warnings

from benchmarks import host_syncs


def _item_like():
    warnings.warn(f"{host_syncs.SYNC_WARNING} (a stand-in for torch's)", UserWarning)


def _other_place():
    warnings.warn(f"{host_syncs.SYNC_WARNING} (a stand-in for torch's)", UserWarning)


def test_waits_are_counted_by_place_once_counting_starts(capsys):
    waits, passed, synced = host_syncs.Waits(), [], []
    show = waits.showwarning(lambda message, *rest, **kw: passed.append(str(message)))
    synchronize = waits.synchronize(lambda: synced.append(1))
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = show
        _item_like()
        synchronize()  # before counting: run, not counted
        waits.counting = True
        for _ in range(3):
            _item_like()
        _other_place()
        synchronize()
        warnings.warn("something else", UserWarning)
    assert passed == ["something else"] and len(synced) == 2
    counts = sorted((kind, count, "_item_like" in stack, "_other_place" in stack)
                    for (kind, stack), count in waits.by_place.items())
    assert counts == [("synchronizing op", 1, False, True), ("synchronizing op", 3, True, False),
                      ("torch.cuda.synchronize", 1, False, False)]
    waits.report(top=1)
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "[host-syncs] 5 waits in 3 places: 4 synchronizing op, 1 torch.cuda.synchronize"
    assert lines[1] == "[host-syncs] 3 x synchronizing op, at:" and "_item_like" in "\n".join(lines[2:])
