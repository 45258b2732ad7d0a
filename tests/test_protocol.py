"""The shared-memory protocol on its own (``megaray.protocol``): each named operation, and the
orderings that must never happen, with a writer and a reader in two threads that map the same
real shared files separately (as two actors do)."""
from __future__ import annotations

import threading
import time

import pytest
import torch

from megaray.errors import RunAborted
from megaray.layout import Piece
from megaray.protocol import Control, GradientRing, control_words
from megaray.shm import ShmFile

P, R, N = 6, 2, 64          # pieces, ring slabs, elements a slab
PIECES = [Piece(i, i // 2, (i % 2) * N, (i % 2 + 1) * N, True) for i in range(P)]


class Side:
    """One process's view of a run: the control file and the ring file, mapped on their own."""

    def __init__(self, d, create: bool):
        words = ShmFile(str(d / "control"), 8 * control_words(P, R), create)
        ring = ShmFile(str(d / "ring"), 4 * N * R, create)
        self.control = Control(words.view(torch.int64, 0, control_words(P, R)), P, R)
        self.ring = GradientRing(self.control, lambda s, n: ring.view(torch.float32, 4 * N * s, n))


@pytest.fixture
def sides(tmp_path):
    writer = Side(tmp_path, create=True)
    return writer, Side(tmp_path, create=False)


def test_words_are_shared_and_named(sides):
    w, r = sides
    w.control.reset(3)
    assert [r.control.version(p) for p in range(P)] == [3] * P and r.control.versions(range(2, 4)) == 3
    assert r.control.decided(2) and not r.control.decided(3)
    r.control.skip([1, 4], 3)
    assert [w.control.version(p) for p in range(P)] == [3, 4, 3, 3, 4, 3]
    assert w.control.versions(range(0, 2)) == 3                 # a unit is as old as its oldest piece
    assert w.control.in_flight() == 0 and w.control.slab_holder(0) is None


def test_a_step_through_the_ring_in_order(sides):
    """The writer puts every piece of step 0 (slab p mod R), the reader takes and releases them;
    the reader sees exactly the bytes written, and the writer never overwrites an unread slab."""
    w, r = sides
    w.control.reset(0)
    grads = [torch.full((N,), float(i + 1)) for i in range(P)]
    seen, events = [], []

    def reader():
        applied, _ = r.control.wait_verdict(0, 10)
        assert applied
        for p in PIECES:
            g, _ = r.ring.take(p, 0, 10)
            seen.append(g.clone())
            time.sleep(0.01)                                     # a slow update
            events.append(("released", p.index))
            r.ring.release(p, 0)

    t = threading.Thread(target=reader)
    t.start()
    w.control.decide(0, True)
    for p in PIECES:
        def copy(dst, p=p):
            # the slab's previous piece (p - R) was released, and its version published, first
            if p.index >= R:
                assert ("released", p.index - R) in events
                assert w.control.version(p.index - R) == 1
            dst.copy_(grads[p.index])
        w.ring.put(p, 0, copy, 10)
        events.append(("put", p.index))
        assert w.control.in_flight() <= R
    t.join(10)
    assert [float(g[0]) for g in seen] == [float(i + 1) for i in range(P)]
    assert [w.control.version(p) for p in range(P)] == [1] * P
    assert w.control.in_flight() == 0


def test_the_writer_waits_for_a_free_slab(sides):
    w, r = sides
    w.control.reset(0)
    w.ring.put(PIECES[0], 0, lambda dst: dst.fill_(1.0), 1)
    with pytest.raises(TimeoutError, match="gradient slab 0"):     # piece 2 shares slab 0
        w.ring.put(PIECES[2], 0, lambda dst: dst.fill_(2.0), 0.2)
    g, _ = r.ring.take(PIECES[0], 0, 1)
    assert float(g[0]) == 1.0                                      # not overwritten by the refused put


def test_a_reader_never_applies_another_steps_gradient(sides):
    w, r = sides
    w.control.reset(4)
    w.ring.put(PIECES[1], 4, lambda dst: dst.fill_(1.0), 1)
    with pytest.raises(RuntimeError, match="holds piece 1 of step 4, expected step 5"):
        r.ring.take(PIECES[1], 5, 1)
    assert r.control.version(1) == 4                                # nothing published


def test_release_publishes_the_version_before_freeing_the_slab(sides):
    """A writer waiting for a slab proceeds only when the piece's new version is visible."""
    w, r = sides
    w.control.reset(0)
    w.ring.put(PIECES[0], 0, lambda dst: dst.fill_(1.0), 1)
    seen = []

    def writer():
        w.ring.put(PIECES[2], 0, lambda dst: seen.append(w.control.version(0)), 60)

    t = threading.Thread(target=writer)
    t.start()
    time.sleep(0.05)
    assert not seen                                                 # still waiting for slab 0
    r.ring.take(PIECES[0], 0, 1)
    r.ring.release(PIECES[0], 0)
    t.join(60)
    assert seen == [1]


def test_the_verdict_of_a_later_step_is_never_read_early(sides):
    w, r = sides
    w.control.reset(0)
    w.control.decide(0, False)                                      # step 0 skipped
    assert r.control.wait_verdict(0, 1)[0] is False
    with pytest.raises(TimeoutError, match="verdict on step 1"):    # step 1 not decided yet
        r.control.wait_verdict(1, 0.1)
    w.control.decide(1, True)
    assert r.control.wait_verdict(1, 1)[0] is True


def test_the_writer_stages_a_piece_only_at_its_version(sides):
    w, r = sides
    w.control.reset(2)
    with pytest.raises(TimeoutError, match="update of block.0"):
        w.control.wait_version(3, 3, "update of block.0", 0.1)
    r.control.skip([3], 2)
    assert w.control.wait_version(3, 3, "update of block.0", 1) >= 0


def test_abort_releases_every_waiter(sides):
    w, r = sides
    w.control.reset(0)
    errors = []

    def wait(fn):
        try:
            fn()
        except RunAborted as e:
            errors.append(str(e))

    threads = [threading.Thread(target=wait, args=(fn,)) for fn in (
        lambda: r.control.wait_verdict(0, 60),
        lambda: r.ring.take(PIECES[0], 0, 60),
        lambda: w.control.wait_version(0, 1, "an update", 60))]
    for t in threads:
        t.start()
    time.sleep(0.05)
    t0 = time.perf_counter()
    w.control.abort()
    for t in threads:
        t.join(120)
    assert len(errors) == 3 and time.perf_counter() - t0 < 30     # released, not timed out (60 s)
    assert all("run aborted while waiting for" in e for e in errors)
