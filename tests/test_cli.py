"""The command line's manners: help that exits 0 and describes every argument with its
default, the shipped configs listed, ``--version``, options before or after the config, and
output cut short by its reader ending quietly."""
from __future__ import annotations

import re
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest

from megaray.cli import COMMANDS, main

CONFIGS = Path(__file__).resolve().parents[1] / "configs"


def _help(capsys, *args: str) -> str:
    with pytest.raises(SystemExit) as e:
        main([*args, "--help"])
    assert e.value.code == 0
    return capsys.readouterr().out


def _entries(text: str) -> list[tuple[str, str]]:
    """(flags, description) of each argument in a help text's argument sections."""
    out, cur = [], None
    for line in text.splitlines():
        if line and not line.startswith(" "):          # a section title, the usage or the epilog
            cur = None
            continue
        m = re.match(r"^  (\S.*?)(?:\s{2,}(.*))?$", line)
        if m and not line.startswith("   "):
            cur = [m.group(1), m.group(2) or ""]
            out.append(cur)
        elif cur is not None:
            cur[1] += " " + line.strip()
    return [(a, b.strip()) for a, b in out]


def test_megaray_help_and_version(capsys):
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    assert all(f"  {name} " in out for name in COMMANDS)
    assert main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"megaray {metadata.version('megaray')}"
    assert main(["frobnicate"]) == 2 and "unknown command 'frobnicate'" in capsys.readouterr().err


@pytest.mark.parametrize("cmd", sorted(COMMANDS))
def test_every_argument_is_described_with_its_default(capsys, cmd):
    text = _help(capsys, cmd)
    entries = _entries(text)
    assert len(entries) >= 2, text
    for flags, what in entries:
        assert what, f"megaray {cmd}: {flags} has no description"
    # an option with a default says it: --shard-gb's 5.0, --kind's pretrain, bench's --seq 2048
    defaults = {"export": ("--shard-gb", "5.0"), "prepare": ("--kind", "pretrain"), "bench": ("--seq", "2048"),
                "clean": ("--shm-dir", "/dev/shm")}
    if cmd in defaults:
        flag, value = defaults[cmd]
        (what,) = [w for f, w in entries if f.startswith(flag)]
        assert f"(default: {value})" in what
    if cmd in ("train", "plan"):
        shipped = sorted(p.stem for p in CONFIGS.glob("*.yaml"))
        assert "demo" in shipped and f"shipped configs (use the name as CONFIG): {', '.join(shipped)}" in text


def test_options_may_come_before_or_after_the_config(capsys):
    outs = []
    for argv in (["plan", "--gpu-gib", "24", "--host-gib", "64", "debug", "train.steps=3"],
                 ["plan", "debug", "--gpu-gib", "24", "train.steps=3", "--host-gib", "64"]):
        main(argv)
        outs.append(capsys.readouterr().out)
    assert "a machine of 64 GiB host memory and a 24 GiB GPU" in outs[0]
    assert outs[0] == outs[1]


@pytest.mark.parametrize("args", [["-h"], ["plan", "debug"]], ids=["help", "plan"])
def test_output_into_a_reader_that_went_away_ends_without_a_traceback(args):
    proc = subprocess.Popen([sys.executable, "-m", "megaray.cli", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    proc.stdout.close()                   # as `| head` does once it has its lines, here before the first
    err = proc.stderr.read().decode()
    proc.wait(timeout=300)
    assert "Traceback" not in err and "BrokenPipeError" not in err, err
    assert proc.returncode == 141         # as a shell reports a writer a closed pipe stopped


def test_plan_reads_as_words_and_ends_with_its_verdict(capsys):
    """Counts and sizes a person reads (no 0.000B parameters, no 0.015625 MiB), and a last line
    that says FITS or DOES NOT FIT."""
    from megaray.plan import count, size

    assert [count(n) for n in (12, 26_784, 770_000, 1_235_814_400)] == ["12", "26.8K", "770K", "1.24B"]
    assert [size(b) for b in (300, 16384, 720 * 2**10, 64 * 2**20, 1.25 * 2**30)] == \
        ["300 B", "16 KiB", "720 KiB", "64 MiB", "1.25 GiB"]
    assert main(["plan", "debug", "--host-gib", "64", "--gpu-gib", "24"]) == 0
    out = capsys.readouterr().out
    assert "model: 26.8K parameters" in out and "0.000B" not in out and "0.015625" not in out
    assert out.rstrip().splitlines()[-1] == "FITS a machine of 64 GiB host memory and a 24 GiB GPU"
    assert main(["plan", "debug", "--host-gib", "2", "--gpu-gib", "24"]) == 1
    assert capsys.readouterr().out.rstrip().splitlines()[-1] == \
        "DOES NOT FIT a machine of 2 GiB host memory and a 24 GiB GPU"


def test_plan_agrees_with_itself_and_says_what_it_assumed(capsys):
    """Issue 47 item 11: the GPU header and the predicted step name the same kept blocks; a
    plan for a GPU that is not here says which speeds its step assumes; an option that needs
    more host memory because of the placement says why."""
    import re

    assert main(["plan", "qwen14b", "--host-gib", "128", "--gpu-gib", "80"]) == 1
    out = capsys.readouterr().out
    header = re.search(r"GPU \(keeping (\d+) blocks' activations", out).group(1)
    step = re.search(r"predicted step: .*keeping (\d+) blocks' activations", out).group(1)
    assert header == step and int(header) > 0, out                 # the worker keeps as many as fit
    assert "assumed for the step: the reference H200's measured bf16 rates" in out and "(--cores)" in out
    # the remedies are tried on the config as asked: bf16 gradients, which free the GPU for
    # resident units (their state leaves host memory), though this plan streams every unit
    assert main(["plan", "gemma3_12b", "--host-gib", "121.04", "--gpu-gib", "78.6", "train.loss_chunk_tokens=2048",
                 "optim.num_shards=7"]) == 1
    out = capsys.readouterr().out
    assert "every unit streamed" in out and "fits with: optim.grad_dtype=bfloat16\n" in out, out
    assert main(["plan", "debug", "--host-gib", "64", "--gpu-gib", "24", "train.compute_dtype=bfloat16"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"option optim.master_dtype=bfloat16: needs [\d.]+ KiB more of host memory .*a bf16 master is "
                     r"never resident, so the 3 resident units' state moves to host memory", out), out
    # bf16 moments stay resident: they save the streamed head's moments only, and say nothing of it
    assert re.search(r"option optim.moment_dtype=bfloat16: saves 128 B of host memory \([\d.]+ bytes/param\)\n", out)
    assert re.search(r"predicted step: [\d.]+ ms", out) and " 0.00 " not in out


def test_a_folder_named_like_a_shipped_config_is_not_taken_for_it(tmp_path, monkeypatch, capsys):
    """`megaray plan demo` in a folder holding a folder named demo (a run.dir, data) plans the
    shipped demo; a path to a folder is refused as one."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "demo").mkdir()
    assert main(["plan", "demo"]) == 0
    assert capsys.readouterr().out.rstrip().endswith("FITS this machine")
    (tmp_path / "mine").mkdir()
    assert main(["plan", "mine"]) == 2
    assert "mine: a folder, not a config file (a YAML file, or a shipped config's name: " in capsys.readouterr().err
