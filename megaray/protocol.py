"""The shared-memory protocol of a run: control words with named operations, and the gradient ring.

Both sides live here: the writer (the GPU worker, or the relay for a worker on another node)
and the readers (the optimizer shards), so the orderings below are kept in one place and
tested once (``tests/test_protocol.py``). Nothing here knows about models or Ray.

Control words (int64, one shared file ``control``):

    [abort, decided, verdict, clip coefficient (float64 bits), version[0..P),
     grad_ready[0..P), slab_piece[0..R), slab_step[0..R)]

- ``version[p]``: optimizer steps applied to piece p. The writer stages piece p for step t
  only once ``version[p] >= t`` (``wait_version``), so a layer's weights are never read while
  their update runs, and never read stale.
- ``decided`` = t + 1 once the writer knows step t's global gradient norm; ``verdict`` says
  whether step t is applied (1) or skipped (0), and the coefficient word the exact clip
  factor the readers apply (gradients that waited in host memory are not yet clipped).
  ``decide`` writes verdict and coefficient before ``decided``; the writer decides t + 1
  only after staging every piece for t + 1, i.e. after every piece has version t + 1, so a
  reader never sees a later step's verdict.
- Gradients waiting in host memory (``optim.grad_placement`` host): one region a unit, a
  single buffer. ``HostGradients.publish`` sets ``grad_ready[p] = 2 (t + 1) + finite`` once
  piece p's bytes of step t have landed; ``take`` waits for it. The writer overwrites unit
  u's region for step t + 1 only in that step's backward, after its forward staged u, i.e.
  after every piece of u was released for step t: a region is never rewritten while read.
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

_ABORT, _DECIDED, _VERDICT, _COEF, _FIXED = 0, 1, 2, 3, 4


def control_words(num_pieces: int, ring_slabs: int) -> int:
    """How many int64 words the control file holds."""
    return _FIXED + 2 * num_pieces + 2 * ring_slabs


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
        self._ready = _FIXED + num_pieces
        self._slab_piece = _FIXED + 2 * num_pieces
        self._slab_step = _FIXED + 2 * num_pieces + ring_slabs

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
            self.publish_version(p, step + 1)

    def publish_version(self, p: int, version: int) -> None:
        self.words[self._ver + p] = version

    # ---------------------------------------------------------------- the verdict
    def decide(self, step: int, apply: bool, coef: float = 1.0) -> None:
        """Publish step ``step``'s verdict: applied (with the clip coefficient the readers
        apply), or skipped. The verdict and coefficient words first."""
        self.words[_VERDICT] = 1 if apply else 0
        self.words[_COEF] = int(torch.tensor(coef, dtype=torch.float64).view(torch.int64))
        self.words[_DECIDED] = step + 1

    def clip_coefficient(self) -> float:
        """The coefficient of the step decided last (read after ``wait_verdict``)."""
        return float(self.words[_COEF: _COEF + 1].view(torch.float64))

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
        self.words[self._ready: self._ready + self.num_pieces] = 2 * step


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
        c.publish_version(piece.index, step + 1)
        c._free(self.slab_of(piece))


class HostGradients:
    """Gradients waiting in host memory for the norm (``optim.grad_placement`` host): one
    region a unit in the shared ``grads`` file, with the control words that say when each
    piece of it holds which step's gradient."""

    def __init__(self, control: Control, region: Callable[[Piece], torch.Tensor]):
        self.control, self._region = control, region

    def _word(self, p: int) -> int:
        return int(self.control.words[self.control._ready + p])

    def publish(self, piece: Piece, step: int, finite: bool = True) -> None:
        """The writer's side, once the piece's bytes of step ``step`` have landed."""
        self.control.words[self.control._ready + piece.index] = 2 * (step + 1) + (1 if finite else 0)

    def take(self, piece: Piece, step: int, timeout_s: float, what: str = "") -> tuple[torch.Tensor, bool, float]:
        """A reader's side: wait for the piece's gradient of step ``step``; returns (its view,
        whether it is finite, seconds waited). A later step's gradient there is an error."""
        c = self.control
        waited = c.wait(lambda: self._word(piece.index) >= 2 * (step + 1),
                        f"the gradient of piece {piece.index}{what} of step {step}", timeout_s)
        if self._word(piece.index) >= 2 * (step + 2):
            raise RuntimeError(f"piece {piece.index} holds the gradient of a later step than {step}")
        return self._region(piece), bool(self._word(piece.index) & 1), waited

    def release(self, piece: Piece, step: int) -> None:
        """After the update of ``piece`` for ``step``: publish its version."""
        self.control.publish_version(piece.index, step + 1)
