"""Routing traces: read and write the format of the shared folder's traces/README.md (beside the design page).

A trace is gzip'd (or plain) JSON Lines, one sequence (a prompt and its generation) per line::

    {"model": "gpt-oss-20b", "n_layers": 24, "n_experts": 32, "top_k": 4,
     "seq": "an id", "domain": "math", "prompt": "the prompt text or null",
     "experts": [[[31, 21, 22, 6], [18, 29, 12, 27], ...one list per MoE layer], ...one entry per token]}

``experts[t][l]`` lists the experts the router picked for token ``t`` at MoE layer ``l``. Every line of a file
describes the same model. Readers check everything (JSON, fields, shapes, expert ranges) and name the file and
line of the first problem in a :class:`TraceError`.

Writing, e.g. from an inference loop::

    with TraceWriter("run.jsonl.gz", model="qwen3-30b", n_layers=48, n_experts=128, top_k=8) as w:
        w.begin(seq="req-1", domain=None, prompt=prompt_text)
        for token in ...:
            w.add_token([[...experts of layer 0...], [...layer 1...], ...])   # or add_layer(layer, experts)
        w.end()
        w.write(experts, seq="req-2", prompt=...)                            # a whole sequence at once
"""

from __future__ import annotations

import contextlib
import gzip
import io
import json
import os
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from moe_l2.atomic_file import AtomicFile


class TraceError(ValueError):
    """A trace that cannot be read: names the file, the line and what is wrong."""


@dataclass
class TraceSequence:
    model: str
    n_layers: int
    n_experts: int
    top_k: int
    seq: str
    domain: str | None
    prompt: str | None
    experts: list  # [token][layer] -> list of expert ids
    source: str = ""  # "file, line N", for messages

    @property
    def n_tokens(self) -> int:
        return len(self.experts)

    def layer(self, layer: int) -> list[tuple[int, ...]]:
        """The per-token expert batches of one layer."""
        return [tuple(token[layer]) for token in self.experts]

    def to_json(self) -> dict:
        return {"model": self.model, "n_layers": self.n_layers, "n_experts": self.n_experts,
                "top_k": self.top_k, "seq": self.seq, "domain": self.domain, "prompt": self.prompt,
                "experts": self.experts}


@dataclass
class TraceSet:
    """Sequences of one model, read from one or more files."""

    model: str
    n_layers: int
    n_experts: int
    top_k: int
    sequences: list[TraceSequence] = field(default_factory=list)
    paths: list[str] = field(default_factory=list)

    @property
    def n_tokens(self) -> int:
        return sum(s.n_tokens for s in self.sequences)

    @property
    def domains(self) -> list[str]:
        return sorted({s.domain for s in self.sequences if s.domain is not None})


def _open_text(path: Path):
    if path.suffix == ".gz":
        return gzip.open(path, "rt", encoding="utf-8")
    return open(path, encoding="utf-8")


def _positive_int(value, what: str, where: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise TraceError(f"{where}: {what} must be a positive integer, got {value!r}")
    return value


def parse_sequence(obj, where: str, *, check: bool = True) -> TraceSequence:
    """Validate one decoded line. `where` is "file:line" for error messages."""
    if not isinstance(obj, dict):
        raise TraceError(f"{where}: a trace line must be a JSON object, got {type(obj).__name__}")
    missing = [k for k in ("model", "n_layers", "n_experts", "experts") if k not in obj]
    if missing:
        raise TraceError(f"{where}: missing field(s) {', '.join(missing)} (see the trace format in "
                         "src/moe_l2/cache/trace.py)")
    model = obj["model"]
    if not isinstance(model, str) or not model:
        raise TraceError(f"{where}: model must be a non-empty string")
    n_layers = _positive_int(obj["n_layers"], "n_layers", where)
    n_experts = _positive_int(obj["n_experts"], "n_experts", where)
    top_k = _positive_int(obj.get("top_k", 1), "top_k", where)
    seq = obj.get("seq", "")
    seq = "" if seq is None else seq
    domain = obj.get("domain")
    prompt = obj.get("prompt")
    for name, value in (("seq", seq), ("domain", domain), ("prompt", prompt)):
        if value is not None and not isinstance(value, str):
            raise TraceError(f"{where}: {name} must be a string or null, got {type(value).__name__}")
    experts = obj["experts"]
    if not isinstance(experts, list):
        raise TraceError(f"{where}: experts must be a list of tokens")
    if check:
        for t, token in enumerate(experts):
            if not isinstance(token, list) or len(token) != n_layers:
                raise TraceError(f"{where}: token {t} must list the experts of each of the {n_layers} layers")
            for layer, picked in enumerate(token):
                if not isinstance(picked, list) or not picked:
                    raise TraceError(f"{where}: token {t} layer {layer}: expected a non-empty list of experts")
                for e in picked:
                    if not isinstance(e, int) or isinstance(e, bool) or not 0 <= e < n_experts:
                        raise TraceError(f"{where}: token {t} layer {layer}: expert {e!r} is not an id in "
                                         f"0..{n_experts - 1}")
                if len(set(picked)) != len(picked):
                    raise TraceError(f"{where}: token {t} layer {layer}: expert listed twice in {picked}")
    return TraceSequence(model, n_layers, n_experts, top_k, seq, domain, prompt, experts, where)


def iter_traces(path: str | os.PathLike, *, check: bool = True) -> Iterator[TraceSequence]:
    """The sequences of one trace file, in file order; raises TraceError on the first bad line."""
    path = Path(path)
    try:
        f = _open_text(path)
    except OSError as exc:
        raise TraceError(f"cannot read trace {path}: {exc.strerror or exc}") from None
    first = None
    try:
        with f:
            lineno = 0
            while True:
                lineno += 1
                where = f"{path}, line {lineno}"
                try:
                    line = f.readline()
                except (OSError, EOFError, UnicodeDecodeError, gzip.BadGzipFile) as exc:
                    raise TraceError(f"{where}: cannot read: {exc}") from None
                if not line:
                    break
                if not line.strip():
                    continue
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise TraceError(f"{where}: not valid JSON: {exc.msg} at column {exc.colno}") from None
                s = parse_sequence(obj, where, check=check)
                if first is None:
                    first = s
                elif (s.model, s.n_layers, s.n_experts) != (first.model, first.n_layers, first.n_experts):
                    raise TraceError(f"{where}: model {s.model} ({s.n_layers} layers x {s.n_experts} experts) "
                                     f"differs from the file's first line ({first.model}, {first.n_layers} x "
                                     f"{first.n_experts}); one file holds one model")
                yield s
    except (OSError, EOFError) as exc:  # e.g. a truncated gzip stream
        raise TraceError(f"{path}: cannot read: {exc}") from None
    if first is None:
        raise TraceError(f"{path}: the trace holds no sequence")


def read_traces(paths: str | os.PathLike | Iterable[str | os.PathLike], *, check: bool = True) -> TraceSet:
    """Every sequence of one or more trace files of the same model."""
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    paths = [str(p) for p in paths]
    if not paths:
        raise TraceError("no trace file given")
    result: TraceSet | None = None
    for path in paths:
        for s in iter_traces(path, check=check):
            if result is None:
                result = TraceSet(s.model, s.n_layers, s.n_experts, s.top_k)
            elif (s.model, s.n_layers, s.n_experts) != (result.model, result.n_layers, result.n_experts):
                raise TraceError(f"{s.source}: model {s.model} ({s.n_layers} x {s.n_experts}) differs from "
                                 f"{result.paths[0]}'s {result.model} ({result.n_layers} x {result.n_experts}); "
                                 "give traces of one model at a time")
            result.sequences.append(s)
        result.paths.append(path)
    return result


class TraceWriter:
    """Sequences into a trace file (gzip'd when the name ends in .gz), written under a private name beside it and
    renamed into place at close (an AtomicFile: a link planted at the path is never written through, and readers
    see the whole file or the old one). append: the file's sequences stay before the new ones (a gzip'd one gets
    a new gzip member); a link, another user's file or one with hard links at the path is refused (UnsafeFile).
    A writer that wrote no sequence, or closed by an exception, leaves the path as it was. Not thread-safe: one
    writer per file, fed by one thread (or behind the caller's lock)."""

    def __init__(self, path: str | os.PathLike, *, model: str, n_layers: int, n_experts: int, top_k: int,
                 append: bool = False):
        self.path = Path(path)
        self.model = str(model)
        self.n_layers = _positive_int(n_layers, "n_layers", str(path))
        self.n_experts = _positive_int(n_experts, "n_experts", str(path))
        self.top_k = _positive_int(top_k, "top_k", str(path))
        self._target = AtomicFile(self.path, keep=append)
        try:
            self._raw = open(self._target.fd, "wb", closefd=False)
            binary = (gzip.GzipFile(self.path.name, "wb", fileobj=self._raw) if self.path.suffix == ".gz"
                      else self._raw)
            self._file: io.TextIOBase | None = io.TextIOWrapper(binary, encoding="utf-8")
        except BaseException:
            self._target.abort()
            raise
        self._current: dict | None = None
        self._pending: list[list[int] | None] | None = None
        self.sequences = 0

    def __enter__(self) -> "TraceWriter":
        return self

    def __exit__(self, kind, value, traceback) -> None:
        if kind is None:
            self.close()
        elif self._file is not None:
            self._abandon()

    def write(self, experts: Sequence, *, seq: str = "", domain: str | None = None,
              prompt: str | None = None) -> None:
        """One whole sequence: experts[t][l] -> expert ids (ints, lists or arrays of ints)."""
        self.begin(seq=seq, domain=domain, prompt=prompt)
        for token in experts:
            self.add_token(token)
        self.end()

    def begin(self, *, seq: str = "", domain: str | None = None, prompt: str | None = None) -> None:
        if self._file is None:
            raise ValueError(f"trace writer for {self.path} is closed")
        if self._current is not None:
            self.end()
        self._current = {"model": self.model, "n_layers": self.n_layers, "n_experts": self.n_experts,
                         "top_k": self.top_k, "seq": seq, "domain": domain, "prompt": prompt, "experts": []}

    def add_token(self, layers: Sequence) -> None:
        """One token: the experts the router picked at every MoE layer, in layer order."""
        if self._current is None:
            raise ValueError("add_token before begin()")
        if len(layers) != self.n_layers:
            raise ValueError(f"a token needs the experts of {self.n_layers} layers, got {len(layers)}")
        self._current["experts"].append([self._ids(picked) for picked in layers])

    def add_layer(self, layer: int, experts: Sequence) -> None:
        """Token-by-token recording from inside a forward pass: layer 0 starts a token, every layer must be
        given once per token. A batch of several tokens (prefill) may be given as a 2-D sequence."""
        if self._current is None:
            raise ValueError("add_layer before begin()")
        rows = experts.tolist() if hasattr(experts, "tolist") else experts
        rows = [rows] if rows and not isinstance(rows[0], (list, tuple)) else list(rows)
        if layer == 0:
            self._flush_pending()
            self._pending = [[None] * self.n_layers for _ in rows]
        if self._pending is None or not 0 <= layer < self.n_layers or len(rows) != len(self._pending):
            raise ValueError(f"add_layer({layer}) out of order: give layers 0..{self.n_layers - 1} in turn, "
                             "with the same number of tokens each")
        for token, picked in zip(self._pending, rows):
            token[layer] = self._ids(picked)

    def _flush_pending(self) -> None:
        if self._pending:
            for token in self._pending:
                if any(p is None for p in token):
                    raise ValueError("a token was recorded without all its layers")
                self._current["experts"].append(token)
        self._pending = None

    def _ids(self, picked) -> list[int]:
        ids = [int(e) for e in (picked.tolist() if hasattr(picked, "tolist") else picked)]
        for e in ids:
            if not 0 <= e < self.n_experts:
                raise ValueError(f"expert {e} out of range 0..{self.n_experts - 1}")
        return ids

    def end(self) -> None:
        """Write the current sequence (one line); a sequence without tokens is dropped."""
        if self._current is None:
            return
        self._flush_pending()
        current, self._current = self._current, None
        if current["experts"]:
            self._file.write(json.dumps(current, separators=(",", ":")) + "\n")
            self.sequences += 1

    def close(self) -> None:
        """Write the current sequence and put the file in place (unless no sequence was written)."""
        if self._file is None:
            return
        try:
            self.end()
            self._file.close()  # ends the gzip member, if any
            self._raw.close()
            if self.sequences:
                self._target.commit()
        finally:
            self._abandon()

    def _abandon(self) -> None:
        """Close the buffers before the descriptor they write to (one left open would flush, when collected, into
        whatever file has its number by then), then remove the private file unless it was put in place."""
        for layer in (self._file, self._raw):
            with contextlib.suppress(OSError, ValueError):
                layer.close()
        self._file = None
        self._target.abort()
