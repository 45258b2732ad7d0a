"""The shared-memory protocol of a run: control words with named operations, and the gradient ring.

Both sides live here: the writer (the GPU worker, or the relay for a worker on another node)
and the readers (the optimizer shards), so the orderings below are kept in one place and
tested once (``tests/test_protocol.py``). Nothing here knows about models or Ray.

Control words (int64, one shared file ``control``):

    [abort, decided, verdict, version[0..P), slab_piece[0..R), slab_step[0..R)]

- ``version[p]``: optimizer steps applied to piece p. The writer stages piece p for step t
  only once ``version[p] >= t`` (``wait_version``), so a layer's weights are never read while
  their update runs, and never read stale.
- ``decided`` = t + 1 once the writer knows step t's global gradient norm; ``verdict`` says
  whether step t is applied (1) or skipped (0). ``decide`` writes the verdict before
  ``decided``; the writer decides t + 1 only after staging every piece for t + 1, i.e.
  after every piece has version t + 1, so a reader never sees a later step's verdict.
- The gradient ring: R slabs in a shared file; piece p of a step travels through slab
  ``p mod R``. ``slab_piece[s]`` is p + 1 from the moment the writer has copied piece p into
  slab s (``slab_step[s]`` its step) until the piece's reader has applied it, and 0 when the
  slab is free. ``put`` writes a slab only when it is free; ``take`` hands a reader the slab
  only when it holds that piece of that step (another step's piece is an error, never
  applied); ``release`` publishes the piece's new version *before* freeing the slab, so a
  writer that finds slab s free knows the update of its last piece is visible.
- ``abort`` = 1 makes every wait raise ``RunAborted``, so no actor hangs on a dead peer;
  a wait also gives up after its timeout with ``TimeoutError`` naming what it waited for.
"""
from __future__ import annotations

import time
from collections.abc import Callable

import torch

from megaray.errors import RunAborted
from megaray.layout import Piece

_ABORT, _DECIDED, _VERDICT, _FIXED = 0, 1, 2, 3


def control_words(num_pieces: int, ring_slabs: int) -> int:
    """How many int64 words the control file holds."""
    return _FIXED + num_pieces + 2 * ring_slabs


def wait_until(ready: Callable[[], bool], what: str, timeout_s: float, aborted: Callable[[], bool]) -> float:
    """Wait until ``ready()``; returns the seconds waited. Raises ``RunAborted`` when
    ``aborted()`` and ``TimeoutError`` after ``timeout_s``."""
    if ready():
        return 0.0
    t0 = time.perf_counter()
    spins = 0
    while not ready():
        if aborted():
            raise RunAborted(f"run aborted while waiting for {what}")
        waited = time.perf_counter() - t0
        if waited > timeout_s:
            raise TimeoutError(f"waited {waited:.0f} s for {what} (worker.wait_timeout_s={timeout_s})")
        spins += 1
        # Spin briefly, then poll every 0.2 ms; a long wait (a shard waiting for the
        # worker's whole backward) backs off to 5 ms so it leaves the cores to the others.
        time.sleep(0 if spins < 100 else 0.0002 if waited < 0.05 else 0.001 if waited < 1.0 else 0.005)
    return time.perf_counter() - t0


class Control:
    """A run's control words (an int64 tensor in shared memory), by name."""

    def __init__(self, words: torch.Tensor, num_pieces: int, ring_slabs: int):
        assert words.dtype == torch.int64 and words.numel() >= control_words(num_pieces, ring_slabs)
        self.words, self.num_pieces, self.ring_slabs = words, num_pieces, ring_slabs
        self._ver = _FIXED
        self._slab_piece = _FIXED + num_pieces
        self._slab_step = _FIXED + num_pieces + ring_slabs

    # ---------------------------------------------------------------- abort and waiting
    def abort(self) -> None:
        self.words[_ABORT] = 1

    @property
    def aborted(self) -> bool:
        return bool(self.words[_ABORT])

    def wait(self, ready: Callable[[], bool], what: str, timeout_s: float) -> float:
        return wait_until(ready, what, timeout_s, lambda: self.aborted)

    # ---------------------------------------------------------------- versions
    def version(self, p: int) -> int:
        return int(self.words[self._ver + p])

    def versions(self, pieces: range) -> int:
        """The least version over a consecutive range of pieces (a unit's)."""
        return int(self.words[self._ver + pieces.start: self._ver + pieces.stop].min())

    def wait_version(self, p: int, step: int, what: str, timeout_s: float) -> float:
        """The writer's side: wait until piece p holds the weights of step ``step``."""
        return self.wait(lambda: self.version(p) >= step, what, timeout_s)

    def wait_versions(self, pieces: range, step: int, what: str, timeout_s: float) -> float:
        return self.wait(lambda: self.versions(pieces) >= step, what, timeout_s)

    def skip(self, pieces, step: int) -> None:
        """A reader's side of a skipped step: its pieces reach version step + 1 unchanged."""
        for p in pieces:
            self.words[self._ver + p] = step + 1

    # ---------------------------------------------------------------- the verdict
    def decide(self, step: int, apply: bool) -> None:
        """Publish step ``step``'s verdict: applied, or skipped. The verdict word first."""
        self.words[_VERDICT] = 1 if apply else 0
        self.words[_DECIDED] = step + 1

    def decided(self, step: int) -> bool:
        return int(self.words[_DECIDED]) >= step + 1

    def wait_verdict(self, step: int, timeout_s: float) -> tuple[bool, float]:
        """A reader's side: wait for step ``step``'s verdict; returns (applied, seconds waited)."""
        waited = self.wait(lambda: self.decided(step), f"the verdict on step {step}", timeout_s)
        return bool(self.words[_VERDICT]), waited

    # ---------------------------------------------------------------- the ring's words
    def slab_holder(self, s: int) -> int | None:
        """The piece slab s holds, or None when it is free."""
        v = int(self.words[self._slab_piece + s])
        return v - 1 if v else None

    def slab_step(self, s: int) -> int:
        return int(self.words[self._slab_step + s])

    def in_flight(self) -> int:
        """Slabs holding a piece not yet applied."""
        return int((self.words[self._slab_piece: self._slab_piece + self.ring_slabs] != 0).sum())

    def _fill(self, s: int, piece: int, step: int) -> None:
        self.words[self._slab_step + s] = step
        self.words[self._slab_piece + s] = piece + 1

    def _free(self, s: int) -> None:
        self.words[self._slab_piece + s] = 0

    def reset(self, step: int) -> None:
        """The state of a run whose weights are those after ``step`` steps: every piece at that
        version, the ring empty, nothing decided beyond it."""
        self.words[self._ver: self._ver + self.num_pieces] = step
        self.words[self._slab_piece: self._slab_piece + self.ring_slabs] = 0
        self.words[_DECIDED] = step


class GradientRing:
    """The ring's slabs (views into the shared ``ring`` file) with the control words that own them."""

    def __init__(self, control: Control, slab: Callable[[int, int], torch.Tensor]):
        self.control, self._slab = control, slab
        self.slabs = control.ring_slabs

    def slab_of(self, piece: Piece) -> int:
        return piece.index % self.slabs

    def put(self, piece: Piece, step: int, copy: Callable[[torch.Tensor], None], timeout_s: float) -> float:
        """The writer's side for one piece: wait until its slab is free, ``copy(slab view)`` the
        gradient in, and hand the slab to the piece's reader. Returns the seconds waited."""
        c, s = self.control, self.slab_of(piece)
        waited = c.wait(lambda: c.slab_holder(s) is None,
                        f"gradient slab {s} (for piece {piece.index} of step {step})", timeout_s)
        copy(self._slab(s, piece.numel))
        c._fill(s, piece.index, step)
        return waited

    def take(self, piece: Piece, step: int, timeout_s: float, what: str = "") -> tuple[torch.Tensor, float]:
        """A reader's side: wait until the piece's slab holds it; returns (the gradient's view,
        seconds waited). A slab holding this piece of another step is an error."""
        c, s = self.control, self.slab_of(piece)
        waited = c.wait(lambda: c.slab_holder(s) == piece.index,
                        f"the gradient of piece {piece.index}{what} of step {step}", timeout_s)
        if c.slab_step(s) != step:
            raise RuntimeError(f"slab {s} holds piece {piece.index} of step {c.slab_step(s)}, expected step {step}")
        return self._slab(s, piece.numel), waited

    def release(self, piece: Piece, step: int) -> None:
        """After the update of ``piece`` for ``step``: publish its version, then free its slab."""
        c = self.control
        c.words[c._ver + piece.index] = step + 1
        c._free(self.slab_of(piece))
