"""``frozen_heap``: what is alive on entry is out of the collector's scans inside, dead cycles made before are
collected, everything is the collector's again after, and a nested use leaves the outer one in charge."""

import gc
import weakref

from mentorrl.core.lifetime import frozen_heap


class Node:
    def __init__(self):
        self.me = self  # a reference cycle: only the cyclic collector frees it


def test_frozen_inside_given_back_after_and_nothing_dead_frozen():
    assert gc.get_freeze_count() == 0
    dead = weakref.ref(Node())  # garbage made before entering: collected, never frozen
    alive = Node()
    with frozen_heap() as froze:
        assert froze and dead() is None and gc.get_freeze_count() > 0
        made_inside = weakref.ref(Node())
        gc.collect()
        assert made_inside() is None  # what is made inside is collected as usual
        kept = weakref.ref(alive)
        with frozen_heap() as inner:
            assert not inner
        assert gc.get_freeze_count() > 0  # the inner one did not unfreeze the outer one's
        del alive
        gc.collect()
        assert kept() is not None  # frozen: a full collection does not scan it
    assert gc.get_freeze_count() == 0
    gc.collect()
    assert kept() is None  # the collector's again: freed at the next collection


def test_unfrozen_when_the_body_raises():
    try:
        with frozen_heap():
            raise RuntimeError("a stage failed")
    except RuntimeError:
        pass
    assert gc.get_freeze_count() == 0
