"""``megaray prepare``: jsonl, parquet and text into packed token shards, in Ray tasks.

Inputs are jsonl, parquet and plain text files (``.txt``, ``.md``), or folders of them.
Each record becomes one document:
- ``pretrain``: the ``text`` column (``--text-column``); a text file is one document.
- ``sft``: a ``messages`` column (a list of {"role", "content"}) rendered through the
  tokenizer's chat template when it has one, else ``megaray.tokenizer.CHAT_TEMPLATE``; or a
  ``prompt``/``response`` pair rendered as a user and an assistant message. Only the
  assistant messages (and the end-of-sequence token after each) are loss targets.

Packing: the documents of one prepare task are concatenated, each followed by the
end-of-sequence token, and cut into rows of ``seq_len + 1`` tokens; the last row is padded
and its padding is masked out of the loss (the padding counts as a document of its own). A row
may hold the end of one document and the start of the next. Each row carries a loss mask
(``mask[j] = 1`` when token j is a target) and where documents start in it (``starts``), so a
run may keep attention inside each document (``train.attention: document``) or let it cross
the boundary (``causal``: the usual GPT-style packing; the end-of-sequence token marks it).

Shards (read by ``megaray.dataset``) are Arrow IPC files (``shard-00000.arrow``, uncompressed, so training memory-maps
them) with two fixed-size-list columns, ``tokens`` (int32) and ``mask`` (uint8), and one list
column, ``starts`` (int32: the positions in the row where a document begins; a row that
begins inside a document does not list 0). Shards written before ``starts`` existed have no
such column and the manifest no ``"document_starts": true``: they train with causal attention.
``manifest.json`` (written last, after the folder is complete) records the sequence length,
the tokenizer, the vocabulary size, every shard's rows, the documents, tokens and skipped
rows by reason, and how many of the last rows are held out for evaluation.

Bad rows (malformed JSON, a missing or non-text column, empty text, malformed messages) stop
``prepare`` with a ``DataError`` naming the file and the line or row, or, with
``on_bad_row="skip"``, are skipped and counted in the manifest.
"""
from __future__ import annotations

import json
import math
import os
import resource
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import ray

from megaray.errors import ClusterError, DataError
from megaray.leftovers import remove_dead_tmp
from megaray.packing import Packer, schema
from megaray.tokenizer import BadRow, TextTokenizer

TEXT_SUFFIXES = (".txt", ".md", ".text")
JSONL_SUFFIXES = (".jsonl", ".json", ".ndjson")
PARQUET_SUFFIXES = (".parquet",)


# ---------------------------------------------------------------------------- options and tasks
@dataclass
class PrepareOptions:
    seq_len: int
    kind: str = "pretrain"                  # pretrain | sft
    text_column: str = "text"
    prompt_column: str = "prompt"
    response_column: str = "response"
    messages_column: str = "messages"
    tokenizer: str | None = None            # a model directory with tokenizer.json, or bytes
    on_bad_row: str = "error"               # error | skip
    holdout_fraction: float = 0.01
    max_undecodable: float = 0.001          # share of a text file's bytes that may be invalid UTF-8
    split_mb: float = 64.0                  # input bytes per prepare task
    batch_mb: float = 4.0                   # text tokenized at once inside a task

    def __post_init__(self):
        if self.kind not in ("pretrain", "sft"):
            raise DataError(f"kind must be pretrain or sft (got {self.kind!r})")
        if self.on_bad_row not in ("error", "skip"):
            raise DataError(f"on_bad_row must be error or skip (got {self.on_bad_row!r})")
        if self.seq_len < 2:
            raise DataError(f"seq_len must be >= 2 (got {self.seq_len})")
        if not 0 <= self.holdout_fraction < 0.5:
            raise DataError(f"holdout_fraction must be in [0, 0.5) (got {self.holdout_fraction})")
        if not 0 <= self.max_undecodable <= 1:
            raise DataError(f"max_undecodable must be in [0, 1] (got {self.max_undecodable})")


@dataclass
class Task:
    """A slice of one input file, or several whole text files."""
    index: int
    kind: str                               # jsonl | parquet | text
    paths: list[str]
    start: int = 0                          # jsonl: byte range [start, end), first line number
    end: int = 0
    first_line: int = 1
    row_groups: list[int] = field(default_factory=list)   # parquet
    first_row: int = 0


def input_files(inputs: list[str]) -> list[tuple[str, str]]:
    """(kind, path) of every input file, folders walked in sorted order."""
    out = []
    for inp in inputs:
        p = Path(inp)
        if p.is_dir():
            files = sorted(f for f in p.rglob("*") if f.is_file())
            found = [(_kind(f), str(f)) for f in files if _kind(f)]
            if not found:
                raise DataError(f"{inp}: no .jsonl, .parquet or .txt files in this folder")
            out += found
        elif p.is_file():
            k = _kind(p)
            if k is None:
                raise DataError(f"{inp}: unknown input format (use .jsonl, .parquet, .txt or .md)")
            out.append((k, str(p)))
        else:
            raise DataError(f"{inp}: no such file or folder")
    return out


def _kind(p: Path) -> str | None:
    s = p.suffix.lower()
    return "jsonl" if s in JSONL_SUFFIXES else "parquet" if s in PARQUET_SUFFIXES else "text" if s in TEXT_SUFFIXES \
        else None


def plan_tasks(files: list[tuple[str, str]], split_bytes: int) -> list[Task]:
    """Cut the inputs into tasks of about ``split_bytes``: jsonl at line boundaries (with the
    line number each slice starts at), parquet by row groups, text files grouped."""
    tasks: list[Task] = []
    texts: list[str] = []
    text_bytes = 0

    def flush_texts():
        nonlocal texts, text_bytes
        if texts:
            tasks.append(Task(len(tasks), "text", texts))
            texts, text_bytes = [], 0

    for kind, path in files:
        if kind == "text":
            texts.append(path)
            text_bytes += os.path.getsize(path)
            if text_bytes >= split_bytes:
                flush_texts()
        elif kind == "jsonl":
            size = os.path.getsize(path)
            start, line = 0, 1
            with open(path, "rb") as f:
                while start < size:
                    f.seek(min(start + split_bytes, size))
                    f.readline()                                # to the end of that line
                    end = min(f.tell(), size) if start + split_bytes < size else size
                    tasks.append(Task(len(tasks), "jsonl", [path], start, end, line))
                    f.seek(start)
                    line += f.read(end - start).count(b"\n")
                    start = end
        else:
            import pyarrow.parquet as pq

            try:
                md = pq.ParquetFile(path).metadata
            except Exception as e:
                raise DataError(f"{path}: not a readable parquet file ({e})") from None
            group, acc, first, row = [], 0, 0, 0
            for g in range(md.num_row_groups):
                group.append(g)
                acc += md.row_group(g).total_byte_size
                row += md.row_group(g).num_rows
                if acc >= split_bytes:
                    tasks.append(Task(len(tasks), "parquet", [path], row_groups=group, first_row=first))
                    group, acc, first = [], 0, row
            if group:
                tasks.append(Task(len(tasks), "parquet", [path], row_groups=group, first_row=first))
    flush_texts()
    return tasks


# ---------------------------------------------------------------------------- records
def read_text_file(path: str, max_undecodable: float, counts: dict):
    """A text file as one record; invalid UTF-8 bytes become U+FFFD and are counted
    (``counts["undecodable_bytes"]``), and a file with more than ``max_undecodable`` of its
    bytes invalid (binary data, another encoding) is a bad row."""
    raw = Path(path).read_bytes()
    try:
        return {"text": raw.decode("utf-8")}
    except UnicodeDecodeError:
        pass
    bad = len(raw) - len(raw.decode("utf-8", errors="ignore").encode("utf-8"))
    if bad > max_undecodable * len(raw):
        return BadRow("not UTF-8 text", f"{path}: {bad} of {len(raw)} bytes are not valid UTF-8 (binary data or "
                                        f"another encoding?); the limit is --max-undecodable {max_undecodable}")
    counts["undecodable_bytes"] = counts.get("undecodable_bytes", 0) + bad
    return {"text": raw.decode("utf-8", errors="replace")}


def iter_records(task: Task, columns: list[str], max_undecodable: float = 0.001, counts: dict | None = None):
    """(where, record) pairs of a task, ``where`` naming the file and the line or row;
    a malformed record comes as (where, BadRow)."""
    counts = {} if counts is None else counts
    if task.kind == "text":
        for path in task.paths:
            yield f"{path}", read_text_file(path, max_undecodable, counts)
    elif task.kind == "jsonl":
        path = task.paths[0]
        with open(path, "rb") as f:
            f.seek(task.start)
            line_no = task.first_line
            while f.tell() < task.end:
                raw = f.readline()
                where = f"{path} line {line_no}"
                line_no += 1
                if not raw.strip():
                    continue
                try:
                    rec = json.loads(raw)
                except (json.JSONDecodeError, UnicodeDecodeError) as e:
                    yield where, BadRow("malformed json", f"{where}: malformed JSON ({e})")
                    continue
                if not isinstance(rec, dict):
                    yield where, BadRow("malformed json",
                                        f"{where}: a JSON object was expected, got {type(rec).__name__}")
                    continue
                yield where, rec
    else:
        import pyarrow.parquet as pq

        path = task.paths[0]
        pf = pq.ParquetFile(path)
        missing = [c for c in columns if c not in pf.schema_arrow.names]
        if len(missing) == len(columns):
            raise DataError(f"{path}: no column {' or '.join(repr(c) for c in columns)} "
                            f"(the file has {pf.schema_arrow.names})")
        row = task.first_row
        for batch in pf.iter_batches(row_groups=task.row_groups, columns=[c for c in columns if c not in missing],
                                     batch_size=1024):
            for rec in batch.to_pylist():
                yield f"{path} row {row}", rec
                row += 1


def segments(rec: dict, opts: PrepareOptions, tok: TextTokenizer, where: str) -> list[tuple[str, bool]]:
    """A record as (text, is_target) pieces; raises BadRow."""
    if opts.kind == "pretrain":
        text = rec.get(opts.text_column)
        if opts.text_column not in rec:
            raise BadRow("missing column", f"{where}: no column {opts.text_column!r}")
        if not isinstance(text, str):
            raise BadRow("not text", f"{where}: column {opts.text_column!r} is {type(text).__name__}, not text")
        if not text.strip():
            raise BadRow("empty text", f"{where}: empty text in column {opts.text_column!r}")
        return [(text, True)]
    if opts.messages_column in rec:
        msgs = rec[opts.messages_column]
        if not isinstance(msgs, list) or not msgs or not all(
                isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                for m in msgs):
            raise BadRow("malformed messages", f"{where}: column {opts.messages_column!r} must be a non-empty list "
                                               "of {'role': str, 'content': str}")
    elif opts.prompt_column in rec and opts.response_column in rec:
        p, r = rec[opts.prompt_column], rec[opts.response_column]
        if not isinstance(p, str) or not isinstance(r, str):
            raise BadRow("not text", f"{where}: {opts.prompt_column!r} and {opts.response_column!r} must be text")
        msgs = [{"role": "user", "content": p}, {"role": "assistant", "content": r}]
    else:
        raise BadRow("missing column", f"{where}: no column {opts.messages_column!r}, nor both "
                                       f"{opts.prompt_column!r} and {opts.response_column!r}")
    if not any(m["role"] == "assistant" and m["content"].strip() for m in msgs):
        raise BadRow("empty text", f"{where}: no non-empty assistant message to train on")
    # Each assistant message is the text the template adds after the prompt for it.
    out, done = [], ""
    for i, m in enumerate(msgs):
        if m["role"] != "assistant":
            continue
        prompt = tok.render_chat(msgs[:i], add_generation_prompt=True)
        full = tok.render_chat(msgs[:i + 1])
        if not prompt.startswith(done) or not full.startswith(prompt):
            raise BadRow("chat template error", f"{where}: the chat template does not render messages as a prefix "
                                                "of the conversation; cannot find the assistant's tokens")
        out += [(prompt[len(done):], False), (full[len(prompt):], True)]
        done = full
    rest = tok.render_chat(msgs)[len(done):]
    if rest:
        out.append((rest, False))
    return [s for s in out if s[0]]


# ---------------------------------------------------------------------------- one task
def run_task(task: Task, opts: PrepareOptions, out_dir: str) -> dict:
    """Tokenize and pack one task into ``shard-<index>.arrow``; returns its statistics."""
    import pyarrow as pa

    t0 = time.perf_counter()
    rss0 = _rss_bytes()
    tok = TextTokenizer(opts.tokenizer)
    cols = [opts.text_column] if opts.kind == "pretrain" else [opts.messages_column, opts.prompt_column,
                                                                 opts.response_column]
    path = os.path.join(out_dir, f"shard-{task.index:05d}.arrow")
    skipped: dict = {}
    counts: dict = {}
    pending: list[list[tuple[str, bool]]] = []     # records' segments waiting for one tokenizer call
    pending_bytes = 0
    with pa.OSFile(path, "wb") as sink, pa.ipc.new_file(sink, schema(opts.seq_len + 1)) as writer:
        packer = Packer(writer, opts.seq_len + 1, tok.eos_id, eos_trained=opts.kind == "pretrain")
        for where, rec in iter_records(task, cols, opts.max_undecodable, counts):
            try:
                if isinstance(rec, BadRow):
                    raise rec
                segs = segments(rec, opts, tok, where)
            except BadRow as e:
                if opts.on_bad_row == "error":
                    raise DataError(f"{e} (prepare with --on-bad-row skip to skip and count such rows)") from None
                skipped[e.reason] = skipped.get(e.reason, 0) + 1
                continue
            pending.append(segs)
            pending_bytes += sum(len(text) for text, _ in segs)
            if pending_bytes >= opts.batch_mb * 2**20:
                packer.add_records(pending, tok)
                pending, pending_bytes = [], 0
        packer.add_records(pending, tok)
        packer.close()
    return {"shard": os.path.basename(path), "rows": packer.rows, "documents": packer.documents,
            "tokens": packer.tokens, "skipped": skipped, "undecodable_bytes": counts.get("undecodable_bytes", 0),
            "seconds": time.perf_counter() - t0, "rss_growth_bytes": _rss_bytes() - rss0,
            "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


# ---------------------------------------------------------------------------- prepare
def prepare(inputs: list[str], out: str, opts: PrepareOptions, log=print, num_cpus: int | None = None,
            address: str | None = None) -> dict:
    """Tokenize ``inputs`` into packed shards under ``out`` with Ray tasks; returns the manifest.
    The tasks run on the Ray this process is connected to, else the cluster at ``address``
    (``RAY_ADDRESS`` by default: every node must see ``inputs`` and ``out`` at the same
    paths), else a local Ray of ``num_cpus`` started for them."""
    out_p = Path(out).absolute()        # absolute: the tasks run in another folder
    if out_p.exists():
        raise DataError(f"{out}: already exists; prepare writes a new folder")
    for left in remove_dead_tmp(out_p):
        log(f"prepare: removed {left}, what a killed prepare left unfinished")
    files = [(kind, os.path.abspath(p)) for kind, p in input_files(inputs)]
    tasks = plan_tasks(files, int(opts.split_mb * 2**20))
    total_bytes = sum(os.path.getsize(p) for _, p in files)
    tmp = out_p.with_name(out_p.name + f".tmp-{os.getpid()}")
    tmp.mkdir(parents=True)
    started = not ray.is_initialized()
    address = address or os.environ.get("RAY_ADDRESS")
    if started and address:
        from megaray.driver.cluster import attach

        try:
            attach(address, log_to_driver=False)
        except ClusterError:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        log(f"prepare: attached to the Ray cluster at {address}")
    elif started:
        from megaray.driver.cluster import start_local_ray

        start_local_ray(num_cpus=num_cpus or os.cpu_count(), include_dashboard=False,
                        object_store_memory=128 * 2**20, log_to_driver=False)
    t0 = time.perf_counter()
    try:
        # A fresh worker process per task (max_calls=1), so a task's memory is its own.
        fn = ray.remote(num_cpus=1, max_calls=1, max_retries=0)(run_task)
        log(f"prepare: {len(files)} files, {total_bytes / 1e6:.1f} MB, {len(tasks)} tasks, "
            f"{'tokenizer ' + opts.tokenizer if opts.tokenizer else 'byte-level tokens'}, seq_len {opts.seq_len}")
        refs = {fn.remote(t, opts, str(tmp)): t for t in tasks}
        results, waiting = {}, list(refs)
        tokens = 0
        while waiting:
            done, waiting = ray.wait(waiting, num_returns=1)
            try:
                r = ray.get(done[0])
            except ray.exceptions.RayTaskError as e:
                for w in waiting:
                    ray.cancel(w, force=True)
                cause = getattr(e, "cause", None)
                if isinstance(cause, DataError):
                    raise cause from None
                raise DataError(f"prepare task for {refs[done[0]].paths} failed: {cause or e}") from None
            results[refs[done[0]].index] = r
            tokens += r["tokens"]
            dt = time.perf_counter() - t0
            log(f"prepare: {len(results)}/{len(tasks)} tasks, {tokens:,} tokens, {tokens / dt:,.0f} tokens/s")
        stats = [results[i] for i in range(len(tasks))]
        rows = sum(s["rows"] for s in stats)
        tok = TextTokenizer(opts.tokenizer)
        skipped: dict[str, int] = {}
        for s in stats:
            for k, v in s["skipped"].items():
                skipped[k] = skipped.get(k, 0) + v
        if rows == 0:
            raise DataError(f"{', '.join(inputs)}: no usable rows (skipped: {skipped or 'none'})")
        manifest = {
            "format": "megaray-shards-1", "seq_len": opts.seq_len, "kind": opts.kind, "document_starts": True,
            "tokenizer": opts.tokenizer or "bytes", "vocab_size": tok.vocab_size, "eos_id": tok.eos_id,
            "rows": rows, "heldout_rows": min(rows - 1, math.ceil(rows * opts.holdout_fraction)),
            "documents": sum(s["documents"] for s in stats), "tokens": sum(s["tokens"] for s in stats),
            "skipped": skipped, "undecodable_bytes": sum(s["undecodable_bytes"] for s in stats),
            "inputs": [p for _, p in files], "options": asdict(opts),
            "shards": [{"file": s["shard"], "rows": s["rows"]} for s in stats],
            "seconds": time.perf_counter() - t0,
            "task_peak_rss_bytes": max(s["peak_rss_bytes"] for s in stats),
            "task_rss_growth_bytes": max(s["rss_growth_bytes"] for s in stats),
        }
        (tmp / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
        tmp.rename(out_p)
        log(f"prepare: {manifest['documents']:,} documents, {manifest['tokens']:,} tokens in {rows:,} rows of "
            f"{opts.seq_len + 1} ({manifest['heldout_rows']} held out) in {manifest['seconds']:.1f} s "
            f"({manifest['tokens'] / manifest['seconds']:,.0f} tokens/s); skipped {skipped or 'none'}; "
            f"{manifest['undecodable_bytes']} bytes not UTF-8 replaced -> {out}")
        return manifest
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        if started:
            ray.shutdown()
