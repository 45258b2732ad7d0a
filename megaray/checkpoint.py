"""Checkpoint directories: parts written in parallel, keyed by parameter position, manifest last.

Layout of one checkpoint (``<checkpoint dir>/step-00000120/``):

    manifest.json   written last: format, step, model, master dtype, and every part with its
                    size, the CRC32 of each 16 MiB block, and what it holds
    master.bin      the master weights (fp32, or bf16: optim.master_dtype), unit after unit,
                    without the shared file's page padding
    optim-<k>.bin   optimizer shard k's Adam moments: for each range it updates, exp_avg then
                    exp_avg_sq (optim.moment_dtype), with the range's step count
    trainer.json    the next step, scheduler counters, data position, schedule inputs

What a part holds is listed by position in the model, never by transport detail: master
entries are ``[unit, start, stop, byte offset]`` and moment entries
``[unit, start, stop, adam step, byte offset]`` (elements of the unit's flat layout,
``megaray.layout``). So a checkpoint resumes with any number of optimizer shards and any
gradient slab size: each reader gathers the ranges it needs from whichever parts hold them.

A checkpoint is written into ``step-XXXXXXXX.tmp-<pid>`` and renamed into place only after
its manifest is on disk, so a crash or a full disk at any moment leaves the previous
checkpoints untouched and no half checkpoint that looks valid. One that replaces a checkpoint
of the same step (a run that fell back past a corrupt one writes that step again) renames the
old one aside to ``step-XXXXXXXX.old-<pid>`` and removes it only once the new one is in
place; the next run to open the folder puts back an aside whose writer died (``recover``).
Reading verifies every byte it uses against its block's CRC32 (and every part's size up
front) and raises ``CheckpointError`` naming the part; the driver then falls back to the
previous checkpoint.

Data sampling is a pure function of (seed, stream position) and training draws no other
random numbers the checkpoint does not hold, so trainer.json's position is the whole state.
"""
from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import time
import zlib
from pathlib import Path

import torch

from megaray.errors import CheckpointError, ConfigError
from megaray.layout import DTYPES
from megaray.leftovers import pid_alive
from megaray.parts import BLOCK, as_bytes, write_json

FORMAT = 2
MANIFEST = "manifest.json"
class Checkpoint:
    """A complete checkpoint opened for reading: the manifest parsed, every part's size
    checked; ``read`` verifies each block it uses."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        p = self.path / MANIFEST
        if not p.is_file():
            raise CheckpointError(f"{self.path} has no {MANIFEST}: not a complete checkpoint")
        try:
            m = json.loads(p.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise CheckpointError(f"{p} is not valid JSON: {e}") from None
        if not isinstance(m, dict) or m.get("format") != FORMAT:
            got = m.get("format") if isinstance(m, dict) else None
            raise CheckpointError(f"{p}: checkpoint format {got!r}, this megaray reads format {FORMAT}")
        self.manifest = m
        self.parts: dict = m.get("parts") or {}
        for name, part in self.parts.items():
            f = self.path / name
            if not f.is_file():
                raise CheckpointError(f"checkpoint part {f} is missing")
            if f.stat().st_size != part["bytes"]:
                raise CheckpointError(f"checkpoint part {f} holds {f.stat().st_size} bytes, expected {part['bytes']}")
        self._scratch = None

    @property
    def step(self) -> int:
        return int(self.manifest["step"])

    def read(self, name: str, offset: int, out: memoryview) -> None:
        """Fill ``out`` with bytes [offset, offset + len(out)) of part ``name``, verifying
        the CRC32 of every block they touch."""
        part = self.parts.get(name)
        if part is None:
            raise CheckpointError(f"{self.path}: the manifest lists no part {name}")
        n, block = len(out), part["block"]
        if offset < 0 or offset + n > part["bytes"]:
            raise CheckpointError(f"{self.path / name}: bytes [{offset}, {offset + n}) are outside the part")
        if self._scratch is None or len(self._scratch) < block:
            self._scratch = bytearray(block)
        with open(self.path / name, "rb") as f:
            b = offset // block
            while b * block < offset + n:
                start = b * block
                size = min(block, part["bytes"] - start)
                f.seek(start)
                buf = memoryview(self._scratch)[:size]
                if f.readinto(buf) != size or zlib.crc32(buf) != part["crc32"][b]:
                    raise CheckpointError(f"checkpoint part {self.path / name} is corrupt (block {b} at byte "
                                          f"{start} does not match its CRC32)")
                lo, hi = max(offset, start), min(offset + n, start + size)
                out[lo - offset:hi - offset] = buf[lo - start:hi - start]
                b += 1

    def read_json(self, name: str):
        part = self.parts.get(name)
        if part is None:
            raise CheckpointError(f"{self.path}: the manifest lists no part {name}")
        buf = bytearray(part["bytes"])
        self.read(name, 0, memoryview(buf))
        try:
            return json.loads(buf.decode())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise CheckpointError(f"checkpoint part {self.path / name} is not valid JSON: {e}") from None

    def entries(self, kind: str) -> list[tuple[str, list]]:
        """(part name, entry) for every ``kind`` ('master' or 'moments') entry of every part."""
        return [(name, e) for name, part in self.parts.items() for e in part.get(kind, [])]

    def read_range(self, kind: str, unit: int, start: int, stop: int, outs: list[torch.Tensor]) -> int | None:
        """Gather elements [start, stop) of ``unit`` into ``outs`` (the master, or exp_avg and
        exp_avg_sq) from every part entry that overlaps them. Returns the ranges' Adam step
        (moments), and raises CheckpointError when any element is not covered or the steps
        of the covering ranges disagree."""
        dtype = self._dtype(kind)
        size = torch.empty(0, dtype=dtype).element_size()
        covered, steps = 0, set()
        for name, e in self.entries(kind):
            u, a, b = e[0], e[1], e[2]
            if u != unit or b <= start or a >= stop:
                continue
            lo, hi = max(a, start), min(b, stop)
            base = e[-1]
            if kind == "moments":
                steps.add(int(e[3]))
            for k, out in enumerate(outs):       # exp_avg, then exp_avg_sq (b - a elements further)
                at = base + (k * (b - a) + lo - a) * size
                dst = out[lo - start:hi - start]
                if dst.dtype == dtype and dst.is_contiguous():
                    self.read(name, at, as_bytes(dst))
                    continue
                step = BLOCK // size                # another dtype: through a small buffer
                for c in range(0, hi - lo, step):
                    buf = torch.empty(min(step, hi - lo - c), dtype=dtype)
                    self.read(name, at + c * size, as_bytes(buf))
                    dst[c:c + buf.numel()].copy_(buf)
            covered += hi - lo
        if covered != stop - start:
            raise CheckpointError(f"{self.path}: {kind} of unit {unit} elements [{start}, {stop}) are not all in "
                                  f"the checkpoint ({covered} of {stop - start} found)")
        if len(steps) > 1:
            raise CheckpointError(f"{self.path}: unit {unit} [{start}, {stop}) spans ranges at different Adam steps "
                                  f"{sorted(steps)}")
        return steps.pop() if steps else None

    @property
    def master_dtype(self) -> torch.dtype:
        return DTYPES[self.manifest["master_dtype"]]

    @property
    def moment_dtype(self) -> torch.dtype:
        return DTYPES[self.manifest["moment_dtype"]]

    def _dtype(self, kind: str) -> torch.dtype:
        return self.master_dtype if kind == "master" else self.moment_dtype


def step_dir(root: Path, step: int) -> Path:
    return Path(root) / f"step-{step:08d}"


def tmp_dir(root: Path, step: int) -> Path:
    return Path(root) / f"step-{step:08d}.tmp-{os.getpid()}"


def commit(tmp: Path, final: Path, step: int, parts: dict, meta: dict) -> Path:
    """Write the manifest last, then make the checkpoint visible by renaming its folder; one
    of the same step already there is renamed aside first and removed last, so a crash at any
    point leaves one of the two whole (``recover``)."""
    manifest = {"format": FORMAT, "step": step, "time": time.time(), **meta, "parts": parts}
    p = tmp / MANIFEST
    with open(p, "w") as f:
        json.dump(manifest, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    aside = final.with_name(f"{final.name}.old-{os.getpid()}")
    if final.exists():
        os.rename(final, aside)           # never deleted before the new one is in place
    os.rename(tmp, final)
    _fsync_dir(final.parent)
    shutil.rmtree(aside, ignore_errors=True)
    return final


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


_STEP = re.compile(r"step-\d{8}")
_LEFT = re.compile(r"(step-\d{8})\.(tmp|old)-(\d+)")


def recover(root: Path) -> list[Path]:
    """Tidy what dead writers left in a checkpoint folder (the caller holds its lock, so no
    live run writes there): their unfinished ``step-N.tmp-<pid>`` folders go, and a checkpoint
    one renamed aside to replace it (``commit``), ``step-N.old-<pid>``, becomes ``step-N``
    again where no ``step-N`` is (where one is, the new one made it and the aside goes).
    Returns the checkpoints put back."""
    back = []
    for p in sorted(Path(root).glob("step-*")):
        m = _LEFT.fullmatch(p.name)
        if m is None or int(m[3]) == os.getpid() or pid_alive(int(m[3])):
            continue
        final = p.with_name(m[1])
        if m[2] == "old" and not final.exists():
            os.rename(p, final)
            back.append(final)
        else:
            shutil.rmtree(p, ignore_errors=True)
    return back


def complete_checkpoints(root: Path) -> list[Path]:
    """Checkpoint folders with a manifest, newest first (temporary and set-aside folders excluded)."""
    root = Path(root)
    if not root.is_dir():
        return []
    out = [p for p in root.iterdir() if p.is_dir() and _STEP.fullmatch(p.name) and (p / MANIFEST).is_file()]
    return sorted(out, key=lambda p: p.name, reverse=True)


def prune(root: Path, keep: int) -> list[Path]:
    """Delete all but the newest ``keep`` complete checkpoints."""
    removed = []
    for p in complete_checkpoints(root)[keep:]:
        shutil.rmtree(p, ignore_errors=True)
        removed.append(p)
    return removed


# ----------------------------------------------------------------------------- the driver's side
LINEAGE = "lineage.json"
LOCK = ".lock"
# model keys a lineage may change: where the weights came from, and how the model is trained
# rather than what it is (the padding row, the load-balancing loss)
_NOT_LINEAGE = ("from_path", "architecture", "pad_token_id", "router_aux_loss_coef", "output_router_logits")


def lineage_of(cfg) -> dict:
    """What every checkpoint of one folder must share: the model's shape and the master's dtype."""
    model = {k: v for k, v in dataclasses.asdict(cfg.model).items() if k not in _NOT_LINEAGE}
    return {"model": model, "master_dtype": cfg.optim.master_dtype}


def checkpoint_folder(cfg, run_id: str) -> Path:
    """Where this run's checkpoints go: ``checkpoint.dir``; else, when it resumes by name
    (``resume: auto``), ``<run.dir>/checkpoints/<run.name>``, the lineage of every launch of
    that name; else a folder of its own, ``<run.dir>/checkpoints/<run id>``."""
    if cfg.checkpoint.dir:
        return Path(cfg.checkpoint.dir)
    base = Path(cfg.run.dir) / "checkpoints"
    return base / (cfg.run.name if cfg.checkpoint.resume == "auto" else run_id)


def first_to_resume(cfg) -> Checkpoint | None:
    """The checkpoint a run of ``cfg`` tries first (``checkpoint.resume``: 'auto' takes its
    folder's newest), opened without Ray or a lock; None where there is none, or where it does
    not open (loading reports that, and falls back)."""
    how = cfg.checkpoint.resume
    if how is None:
        return None
    paths = complete_checkpoints(checkpoint_folder(cfg, "")) if how == "auto" else [Path(how)]
    try:
        return Checkpoint(paths[0]) if paths else None
    except (CheckpointError, OSError):
        return None


def check_resume(cfg, ck: Checkpoint) -> str | None:
    """Refuse to resume ``ck`` (ConfigError) where ``cfg`` cannot continue it: train.steps below
    its step, or moments it would round to a narrower dtype (unless checkpoint.narrow_moments).
    Returns the conversion resuming makes, as a line for the log, or None."""
    o = cfg.optim
    if ck.step > cfg.train.steps:
        raise ConfigError("train.steps", f"{cfg.train.steps} is below the step of {ck.path} ({ck.step}); "
                                         "raise train.steps to continue that run")
    stored = ck.manifest.get("moment_dtype", "float32")
    if stored == o.moment_dtype:
        return None
    if o.moment_dtype != "float32" and not cfg.checkpoint.narrow_moments:
        raise ConfigError("optim.moment_dtype", f"{ck.path} holds the AdamW moments in {stored}; this run keeps "
                          f"them in {o.moment_dtype}, which rounds them for good. Set optim.moment_dtype: {stored} to "
                          "keep them, or checkpoint.narrow_moments: true to resume rounded")
    return (f"the AdamW moments of {ck.path} are {stored}: converted to {o.moment_dtype} (optim.moment_dtype)"
            + (", rounded (checkpoint.narrow_moments)" if o.moment_dtype != "float32" else ", exactly"))


class Checkpointer:
    """Writes, finds and loads one run's checkpoints, in one folder that belongs to one lineage.

    Opening takes the folder's lock (another live run in it is refused) and checks its
    ``lineage.json`` against this run's model (a different model is refused, naming the keys
    that differ), before any actor starts, then puts back what a dead run was replacing
    (``recover``); pruning only ever touches this folder."""

    def __init__(self, cfg, run_id: str, log):
        import fcntl

        self.cfg, self.run_id, self.log = cfg, run_id, log
        self.root = checkpoint_folder(cfg, run_id)
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            self._lock = open(self.root / LOCK, "a+")
        except OSError as e:
            raise CheckpointError(f"cannot use the checkpoint folder {self.root}: {e.strerror or e}") from None
        try:
            fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            self._lock.seek(0)
            other = self._lock.read().strip() or "another process"
            self._lock.close()
            raise CheckpointError(f"the checkpoint folder {self.root} is in use by a live run ({other}); give this "
                                  "run another run.name or checkpoint.dir") from None
        self._lock.seek(0)
        self._lock.truncate()
        self._lock.write(f"run {run_id}, pid {os.getpid()}\n")
        self._lock.flush()
        try:
            self._check_lineage()
            for back in recover(self.root):
                log.warning("put back %s: the run that was replacing it died before its new one was in place", back)
            self._check_branch()
        except BaseException:
            self._lock.close()                # refused: the folder is free again at once
            raise
        self.last_good: Path | None = None
        self.loaded: tuple[Path, int] | None = None      # the checkpoint the run's state came from, its step
        self.failed: list[str] = []

    def _check_branch(self) -> None:
        """A run writes only into the lineage it continues. Refused, before any actor starts:
        a run that does not resume from this folder's checkpoints (a fresh one, or one from a
        checkpoint elsewhere) while the folder holds some (another run's: its checkpoints and
        pruning would replace them); and a run resumed from a checkpoint of this folder older
        than the folder's newest (it would write over the later ones)."""
        how = self.cfg.checkpoint.resume
        if how == "auto":
            return
        have = complete_checkpoints(self.root)
        path = Path(how).resolve() if how is not None else None
        ours = path is not None and path.parent == self.root.resolve() and _STEP.fullmatch(path.name)
        if have and not ours:
            started = "starts fresh (checkpoint.resume: null)" if how is None else f"starts from {how}"
            raise ConfigError("checkpoint.dir", f"{self.root} holds another run's checkpoints (newest "
                              f"{have[0].name}) and this run {started}: its checkpoints would replace them. "
                              "Set checkpoint.resume: auto to continue that run, or give this run another "
                              "checkpoint.dir (or run.name)")
        if not ours:
            return
        newer = [p.name for p in complete_checkpoints(self.root) if p.name > path.name]
        if newer:
            raise ConfigError("checkpoint.resume", f"{how} is older than {', '.join(sorted(newer))} in the same "
                              f"folder ({self.root}), which this run would write over; set checkpoint.dir to "
                              "another folder to go on from there")

    def _check_lineage(self) -> None:
        want = lineage_of(self.cfg)
        path = self.root / LINEAGE
        if path.is_file():
            try:
                have = json.loads(path.read_text())
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise CheckpointError(f"{path} is not valid JSON: {e}") from None
            # a key the stored lineage lacks was written before megaray had it: its default then
            defaults = {f.name: f.default for f in dataclasses.fields(type(self.cfg.model))}
            old = {**{k: v for k, v in defaults.items() if k in want["model"]}, **have.get("model", {})}
            diff = sorted(k for k in set(want["model"]) | set(old) if want["model"].get(k) != old.get(k))
            diff = [f"model.{k}: {old.get(k)!r} there, {want['model'].get(k)!r} here" for k in diff]
            if have.get("master_dtype") != want["master_dtype"]:
                diff.append(f"optim.master_dtype: {have.get('master_dtype')!r} there, {want['master_dtype']!r} here")
            if diff:
                raise CheckpointError(
                    f"the checkpoint folder {self.root} belongs to another model ({'; '.join(diff[:4])}); "
                    "its checkpoints are left untouched. Give this run another run.name or checkpoint.dir, "
                    "or set checkpoint.resume: null to start fresh in a folder of its own")
        elif complete_checkpoints(self.root):
            raise CheckpointError(f"the checkpoint folder {self.root} holds checkpoints but no {LINEAGE}: not "
                                  "a megaray lineage; give this run another run.name or checkpoint.dir")
        else:
            tmp = path.with_suffix(f".tmp-{os.getpid()}")
            tmp.write_text(json.dumps({**want, "created_by": self.run_id}, indent=1) + "\n")
            os.replace(tmp, path)

    def close(self) -> None:
        if self._lock is not None and not self._lock.closed:
            self._lock.close()

    # ---------------------------------------------------------------- the loop asks
    def due(self, step: int) -> bool:
        """A periodic checkpoint after ``step`` steps (the final one is written by ``save_final``)."""
        every = self.cfg.checkpoint.every
        return bool(every) and step % every == 0 and step < self.cfg.train.steps

    def save(self, session, step: int, extra: dict) -> Path | None:
        """Write a checkpoint of the state after ``step`` steps; on failure keep the old ones
        and return None (the failure is logged and remembered)."""
        t0 = time.perf_counter()
        tmp = tmp_dir(self.root, step)
        try:
            tmp.mkdir()
            parts = session.save_parts(str(tmp))
            trainer = {"next_step": step, "counters": session.counters(), "seed": self.cfg.run.seed,
                       "lr_schedule": dataclasses.asdict(self.cfg.optim), "total_steps": self.cfg.train.steps,
                       **extra}
            parts["trainer.json"] = write_json(tmp / "trainer.json", trainer)
            final = commit(tmp, step_dir(self.root, step), step, parts,
                           {"run_id": self.run_id, "model": dataclasses.asdict(self.cfg.model),
                            "master_dtype": self.cfg.optim.master_dtype, "moment_dtype": self.cfg.optim.moment_dtype})
        except Exception as e:
            shutil.rmtree(tmp, ignore_errors=True)
            self.failed.append(f"step {step}: {type(e).__name__}: {e}")
            keep = f"the last good checkpoint is {self.last_good}" if self.last_good else "there is no earlier one"
            self.log.error("checkpoint at step %d failed (%s: %s); %s", step, type(e).__name__, e, keep)
            return None
        self.last_good = final
        prune(self.root, self.cfg.checkpoint.keep)
        size = sum(p["bytes"] for p in parts.values())
        dt = time.perf_counter() - t0
        self.log.info("checkpoint %s: %.1f MB in %.2f s (%.2f GB/s)", final, size / 1e6, dt, size / dt / 1e9)
        return final

    def save_final(self, session, step: int, extra: dict) -> Path:
        """The run's last state; a failure here fails the run (its work would be lost). Where
        the state is a checkpoint of this folder loaded at this very step (a relaunch of a
        finished run trained nothing), that checkpoint is the final state, not written again."""
        path, at = self.loaded or (None, None)
        if at == step and path.resolve().parent == self.root.resolve():
            self.log.info("nothing trained since %s: it is the final state, as loaded", path)
            return path
        path = self.save(session, step, extra)
        if path is None:
            keep = f"the last good checkpoint is {self.last_good}" if self.last_good else "no checkpoint was saved"
            raise CheckpointError(f"the checkpoint of step {step} could not be written ({self.failed[-1]}); {keep}")
        return path

    # ---------------------------------------------------------------- resuming
    def candidates(self, resume: str | None) -> list[Path]:
        """Checkpoints to try, newest first: this folder's ('auto'), one path, or none."""
        if resume is None:
            return []
        if resume == "auto":
            return complete_checkpoints(self.root)
        return [Path(resume)]

    def load(self, session, path: Path) -> tuple[int, dict]:
        t0 = time.perf_counter()
        ck = Checkpoint(path)
        want = dataclasses.asdict(self.cfg.model)
        defaults = {f.name: f.default for f in dataclasses.fields(type(self.cfg.model))}
        have = {**defaults, **ck.manifest.get("model", {})}     # keys a 0.2 checkpoint lacks: their defaults
        diff = sorted(k for k in want if k not in _NOT_LINEAGE and want[k] != have.get(k))
        if diff:
            raise CheckpointError(f"{path} holds a different model than model: in this config "
                                  f"({', '.join(f'model.{k}' for k in diff[:4])} differ)")
        trainer = ck.read_json("trainer.json")
        converted = check_resume(self.cfg, ck)   # a refusal is not damage: no falling back past it
        if converted:
            self.log.warning("%s", converted)
        session.load(str(path), trainer["counters"])
        size = sum(p["bytes"] for p in ck.parts.values())
        dt = time.perf_counter() - t0
        self.log.info("resumed from %s (step %d): %.1f MB in %.2f s (%.2f GB/s)", path, ck.step, size / 1e6, dt,
                      size / dt / 1e9)
        self.last_good = Path(path)
        self.loaded = (path, ck.step)
        return ck.step, trainer
