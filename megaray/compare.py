"""Two runs' loss curves side by side (``megaray compare RUN RUN``): how far one run's training
went from another's, step by step, and a picture of it.

Each run directory holds ``metrics.jsonl`` (the loss of every logged step) and
``config.yaml`` (its warm-up). The steps both runs logged with a finite loss are paired; the
second run is the reference: at each step the relative difference is (a - b) / |b|. After the
reference's warm-up (``optim.warmup_steps``: the steps before it are not judged, the curves
move fastest there) ``Comparison`` holds the largest absolute relative difference and its
step, and both runs' last common step. Made for comparing one change of numerics against
its reference on the same data, seed and schedule (FP8 against bf16 products, bf16 against
fp32 gradients): the steps see the same tokens, so the difference is the numerics'.

``draw`` writes a PNG: both curves over the steps (above) and the relative difference in
percent (below), with the warm-up's end and, where given, the tolerance band. It draws with
Pillow (TensorBoard's own requirement) and its default font, so it needs no plotting
library.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import yaml

from megaray.errors import RunDirError


@dataclass(frozen=True)
class Curve:
    name: str               # the run's id: its folder's name
    steps: np.ndarray       # the logged steps, ascending
    loss: np.ndarray        # their losses (NaN where the step was skipped)
    warmup_steps: int


@dataclass(frozen=True)
class Comparison:
    a: Curve
    b: Curve                # the reference
    steps: np.ndarray       # the steps both logged with a finite loss
    loss_a: np.ndarray      # their losses, each run's
    loss_b: np.ndarray

    @property
    def rel(self) -> np.ndarray:
        """(a - b) / |b| at each common step."""
        return (self.loss_a - self.loss_b) / np.abs(self.loss_b)

    @property
    def judged_from(self) -> int:
        """The first step judged: the reference's warm-up done (steps count from 1)."""
        return self.b.warmup_steps + 1

    def _worst(self) -> tuple[int | None, float]:
        judged = self.steps >= self.judged_from
        if not judged.any():
            return None, 0.0
        i = int(np.argmax(np.where(judged, np.abs(self.rel), -1.0)))
        return int(self.steps[i]), float(abs(self.rel[i]))

    @property
    def worst_step(self) -> int | None:
        """Where |rel| is largest among the judged steps (None: none is judged)."""
        return self._worst()[0]

    @property
    def worst(self) -> float:
        """That largest |rel| (0 when none is judged)."""
        return self._worst()[1]

    @property
    def final_step(self) -> int:
        return int(self.steps[-1])

    @property
    def final(self) -> tuple[float, float, float]:
        """The last common step's losses (a, b) and their relative difference."""
        return float(self.loss_a[-1]), float(self.loss_b[-1]), float(self.rel[-1])

    def summary(self) -> str:
        a, b, r = self.final
        lines = [f"{len(self.steps)} steps logged by both ({self.a.name} against {self.b.name}, the reference)",
                 f"final (step {self.final_step}): {a:.6g} against {b:.6g}, {100 * r:+.3f}%"]
        if self.worst_step is None:
            lines.append(f"no common step after the warm-up (step {self.judged_from} on)")
        else:
            lines.append(f"after the warm-up (step {self.judged_from} on): largest difference "
                         f"{100 * self.worst:.3f}% at step {self.worst_step}")
        return "\n".join(lines)


def read_curve(run_dir: str | Path) -> Curve:
    """A run directory's logged losses and warm-up. A last row cut short (the run was killed
    while writing it) is left out; any other row that is not a step's JSON object is an error
    naming the file and line."""
    folder = Path(run_dir)
    path = folder / "metrics.jsonl"
    if not path.is_file():
        raise RunDirError(f"{path}: no such file (a run directory holds metrics.jsonl)")
    lines = path.read_text().splitlines()
    rows: dict[int, float] = {}
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            step, loss = int(row["step"]), float("nan" if row["loss"] is None else row["loss"])
        except json.JSONDecodeError:
            if n == len(lines):
                break
            raise RunDirError(f"{path}, line {n}: not a JSON object") from None
        except (KeyError, TypeError, ValueError):
            raise RunDirError(f"{path}, line {n}: a step's row needs a number 'step' and 'loss'") from None
        rows[step] = loss                     # a step logged again after a restart: its last row
    if not rows:
        raise RunDirError(f"{path}: no step logged")
    steps = np.array(sorted(rows), dtype=np.int64)
    return Curve(folder.name, steps, np.array([rows[s] for s in steps], dtype=np.float64), _warmup(folder))


def _warmup(folder: Path) -> int:
    path = folder / "config.yaml"
    if not path.is_file():
        raise RunDirError(f"{path}: no such file (a run directory holds its resolved config)")
    try:
        cfg = yaml.safe_load(path.read_text())
        return int(((cfg or {}).get("optim") or {}).get("warmup_steps", 0))
    except (yaml.YAMLError, AttributeError, TypeError, ValueError) as e:
        raise RunDirError(f"{path}: not a megaray config ({e})") from None


def compare(a: Curve, b: Curve) -> Comparison:
    """``a`` against the reference ``b`` at the steps both logged with finite losses."""
    steps = np.intersect1d(a.steps[np.isfinite(a.loss)], b.steps[np.isfinite(b.loss)])
    if not len(steps):
        raise RunDirError(f"runs {a.name} and {b.name} logged no step in common with a finite loss")
    return Comparison(a, b, steps, *(c.loss[np.searchsorted(c.steps, steps)] for c in (a, b)))


# ---------------------------------------------------------------------------------- the picture
WIDTH, HEIGHT = 960, 640
COLORS = ((31, 119, 180), (255, 127, 14))      # run a, the reference b
DIFF, BAND, GRID, INK = (44, 160, 44), (214, 39, 40), (225, 225, 225), (40, 40, 40)


def ticks(lo: float, hi: float, n: int = 5) -> list[float]:
    """About n round values (1, 2 or 5 times a power of ten apart) covering [lo, hi]."""
    if not hi > lo:
        return [lo]
    raw = (hi - lo) / n
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 5, 10) if m * mag >= raw)
    first = math.ceil(lo / step - 1e-9) * step
    return [round(first + k * step, 12) for k in range(int((hi - first) / step + 1e-9) + 1)]


def _label(v: float) -> str:
    return f"{v:.4g}"


class _Panel:
    """One plot area: data coordinates to pixels, axes, grid and tick labels."""

    def __init__(self, draw, box: tuple[int, int, int, int], x: tuple[float, float], y: tuple[float, float],
                 font):
        self.d, self.box, self.font = draw, box, font
        pad = (y[1] - y[0]) * 0.05 or abs(y[0]) * 0.05 or 1.0
        self.x, self.y = x if x[1] > x[0] else (x[0] - 1, x[1] + 1), (y[0] - pad, y[1] + pad)

    def px(self, x: float, y: float) -> tuple[float, float]:
        left, top, right, bottom = self.box
        return (left + (x - self.x[0]) / (self.x[1] - self.x[0]) * (right - left),
                bottom - (y - self.y[0]) / (self.y[1] - self.y[0]) * (bottom - top))

    def frame(self, ylabel: str) -> None:
        left, top, right, bottom = self.box
        for v in ticks(*self.y):
            _, yy = self.px(self.x[0], v)
            self.d.line([(left, yy), (right, yy)], fill=GRID)
            self.d.text((left - 6, yy), _label(v), fill=INK, font=self.font, anchor="rm")
        for v in ticks(*self.x):
            xx, _ = self.px(v, self.y[0])
            self.d.line([(xx, top), (xx, bottom)], fill=GRID)
            self.d.text((xx, bottom + 4), _label(v), fill=INK, font=self.font, anchor="mt")
        self.d.rectangle(self.box, outline=INK)
        self.d.text((left, top - 4), ylabel, fill=INK, font=self.font, anchor="lb")

    def line(self, xs, ys, fill, width: int = 2) -> None:
        pts = [self.px(x, y) for x, y in zip(xs, ys) if math.isfinite(y)]
        if len(pts) > 1:
            self.d.line(pts, fill=fill, width=width)
        elif pts:
            self.d.ellipse([pts[0][0] - 2, pts[0][1] - 2, pts[0][0] + 2, pts[0][1] + 2], fill=fill)

    def vline(self, x: float, fill) -> None:
        if self.x[0] <= x <= self.x[1]:
            xx, _ = self.px(x, self.y[0])
            self.d.line([(xx, self.box[1]), (xx, self.box[3])], fill=fill, width=1)

    def hline(self, y: float, fill) -> None:
        _, yy = self.px(self.x[0], y)
        self.d.line([(self.box[0], yy), (self.box[2], yy)], fill=fill, width=1)


def draw(c: Comparison, path: str | Path, within: float | None = None) -> Path:
    """Both runs' curves and their relative difference (percent) as a PNG at ``path``;
    ``within`` (percent) draws the tolerance band."""
    from PIL import Image, ImageDraw, ImageFont

    img = Image.new("RGB", (WIDTH, HEIGHT), "white")
    d = ImageDraw.Draw(img)
    font = ImageFont.load_default()
    x = (float(min(c.a.steps[0], c.b.steps[0])), float(max(c.a.steps[-1], c.b.steps[-1])))
    finite = np.concatenate([c.a.loss[np.isfinite(c.a.loss)], c.b.loss[np.isfinite(c.b.loss)]])
    top = _Panel(d, (90, 50, WIDTH - 30, 390), x, (float(finite.min()), float(finite.max())), font)
    top.frame("loss")
    for curve, color in zip((c.b, c.a), COLORS[::-1]):      # the reference under
        top.line(curve.steps, curve.loss, color)
    top.vline(c.judged_from - 1, BAND)
    pct = 100 * c.rel
    span = max(float(np.abs(pct).max()), within or 0.0)
    low = _Panel(d, (90, 440, WIDTH - 30, HEIGHT - 40), x, (-span, span), font)
    low.frame(f"({c.a.name} - {c.b.name}) / {c.b.name}, %")
    low.hline(0.0, INK)
    if within is not None:
        low.hline(within, BAND)
        low.hline(-within, BAND)
    low.vline(c.judged_from - 1, BAND)
    low.line(c.steps, pct, DIFF, width=1)
    d.text((90, 12), f"loss: {c.a.name} against {c.b.name}", fill=INK, font=font)
    for k, (name, color) in enumerate(((c.a.name, COLORS[0]), (c.b.name, COLORS[1]))):
        y = 16 + 14 * k
        d.line([(WIDTH - 260, y), (WIDTH - 236, y)], fill=color, width=3)
        d.text((WIDTH - 230, y), name, fill=INK, font=font, anchor="lm")
    d.text((WIDTH // 2, HEIGHT - 14), "step (the red line: the warm-up's end)", fill=INK, font=font, anchor="mm")
    out = Path(path)
    img.save(out, format="PNG")
    return out
