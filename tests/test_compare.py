"""``megaray compare``: two runs' losses paired by step, judged after the reference's warm-up,
against values worked out by hand here; the picture read back with Pillow; bad run
directories named."""
from __future__ import annotations

import json
import math

import numpy as np
import pytest
from PIL import Image

from megaray.compare import COLORS, compare, read_curve, ticks
from megaray.errors import RunDirError
from megaray.pipelines.compare import main


def _run(folder, losses: dict[int, float], warmup: int, tail: str = ""):
    folder.mkdir()
    rows = [json.dumps({"step": s, "loss": v, "tokens": 64}) for s, v in losses.items()]
    (folder / "metrics.jsonl").write_text("\n".join(rows) + "\n" + tail)
    (folder / "config.yaml").write_text(f"run:\n  name: x\noptim:\n  lr: 0.001\n  warmup_steps: {warmup}\n")
    return folder


@pytest.fixture
def pair(tmp_path):
    # the reference skipped step 3 (NaN); the judged run logged a step 6 the reference did not
    ref = _run(tmp_path / "bf16", {1: 10.0, 2: 8.0, 3: math.nan, 4: 5.0, 5: 4.0}, warmup=1)
    run = _run(tmp_path / "fp8", {1: 11.0, 2: 8.8, 3: 6.06, 4: 5.1, 5: 3.96, 6: 3.9}, warmup=0,
               tail='{"step": 7, "lo')         # a last row cut short by a kill: left out
    return run, ref


def test_the_steps_both_logged_judged_after_the_references_warmup(pair):
    run, ref = pair
    c = compare(read_curve(run), read_curve(ref))
    # steps 1, 2, 4, 5: (11-10)/10, (8.8-8)/8, (5.1-5)/5, (3.96-4)/4
    np.testing.assert_array_equal(c.steps, [1, 2, 4, 5])
    np.testing.assert_allclose(c.rel, [0.1, 0.1, 0.02, -0.01], rtol=1e-12)
    assert c.judged_from == 2                      # the reference's one warm-up step is not judged
    assert c.worst_step == 2 and c.worst == pytest.approx(0.1)
    assert c.final_step == 5 and c.final == pytest.approx((3.96, 4.0, -0.01))
    assert c.a.name == "fp8" and c.b.name == "bf16" and list(c.a.steps) == [1, 2, 3, 4, 5, 6]


def test_the_command_says_which_step_is_out_of_tolerance_and_draws_both_curves(pair, capsys):
    run, ref = pair
    assert main([str(run), str(ref), "--within", "5"]) == 1
    out, err = capsys.readouterr()
    assert "largest difference 10.000% at step 2" in out and "final (step 5): 3.96 against 4, -1.000%" in out
    assert "step 2 differs by 10.000% (more than 5.0%)" in err
    assert main([str(run), str(ref), "--within", "10.5", "--final-within", "0.5"]) == 1
    assert "the last common step differs by 1.000%" in capsys.readouterr().err
    assert main([str(run), str(ref), "--within", "10.5", "--final-within", "1.5"]) == 0
    png = run / "compare-bf16.png"
    with Image.open(png) as img:           # the real reader: a PNG with both runs' colours drawn
        assert img.format == "PNG" and img.size == (960, 640)
        pixels = np.asarray(img.convert("RGB")).reshape(-1, 3)
    for color in COLORS:
        assert (pixels == color).all(axis=1).sum() > 50, color
    assert main([str(run), str(ref), "--png", "none"]) == 0
    assert main([str(run), str(ref), "--png", str(run / "x.png")]) == 0 and (run / "x.png").is_file()


def test_bad_run_directories_are_named(tmp_path, capsys):
    ref = _run(tmp_path / "ref", {1: 2.0, 2: 1.0}, warmup=0)
    with pytest.raises(RunDirError, match=r"nothing/metrics.jsonl: no such file"):
        read_curve(tmp_path / "nothing")
    bad = _run(tmp_path / "bad", {1: 2.0}, warmup=0, tail='not json\n{"step": 3, "loss": 1.0}\n')
    with pytest.raises(RunDirError, match=r"bad/metrics.jsonl, line 2: not a JSON object"):
        read_curve(bad)
    nostep = _run(tmp_path / "nostep", {1: 2.0}, warmup=0, tail='{"loss": 1.0}\n')
    with pytest.raises(RunDirError, match=r"line 2: a step's row needs a number 'step' and 'loss'"):
        read_curve(nostep)
    apart = _run(tmp_path / "apart", {5: 2.0, 6: 1.0}, warmup=0)
    with pytest.raises(RunDirError, match=r"logged no step in common"):
        compare(read_curve(apart), read_curve(ref))
    (ref / "config.yaml").unlink()
    assert main([str(apart), str(ref)]) == 2
    assert "ref/config.yaml: no such file" in capsys.readouterr().err


def test_ticks_are_round_and_cover_the_range():
    assert ticks(0.0, 1000.0) == [0.0, 200.0, 400.0, 600.0, 800.0, 1000.0]
    assert ticks(1.93, 2.61) == [2.0, 2.2, 2.4, 2.6]          # 0.68 / 5 = 0.136: steps of 0.2
    assert ticks(-3.9, 3.9) == [-2.0, 0.0, 2.0]
