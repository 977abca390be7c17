"""msprobe monitor output (TrainerMon and monitor_v2 CSV) read column-wise into the `monitor` table.

Layouts:
  TrainerMon  `{out}/{MonDD_HH-MM-SS}-rank{r}-{uuid8}/{prefix}_{first}-{last}.csv`, prefixes actv, actv_grad,
              grad_unreduced, grad_reduced, param_origin, param_updated, exp_avg, exp_avg_sq, other; header
              `vpp_stage,name,step[,micro_step],<ops>`; a tensor missing at a step is a row of `nan` strings
  monitor_v2  `{out}/rank_{r}/{slug}_step{a}-{b}.csv`, header `vpp_stage,step,module_name,scope[,micro_step],
              <ops>`; slug module (scope forward/backward), weight_grad (reduced/unreduced), param
              (param_origin/param_updated), optimizer (exp_avg/exp_avg_sq/...)
Both become one table: rank, step, micro_step, vpp_stage, prefix (the TrainerMon prefix; monitor_v2 rows are
mapped onto it), name (as written), module (the module path), param (parameter name for parameter rows,
`layers.0.weight`, the same as param_stats.param of a dump), direction / io (as in the tensors table:
forward/backward, input/output/parameters/parameters_grad/optimizer), seq (row order within prefix, rank and
step: execution order for activations, registration order for parameters), norm, min, max, mean, zeros (a
fraction), nans (a count), shape, dtype (canonical), missing (a row of nan strings: no tensor at that step).

Size: one reader, the listing, the batched reads on a thread per core and the derived columns; the derived
columns are the larger half and could move out when the reader grows again.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from ..arrays import to_arrow
from ..errors import DumpstoreError
from .arrow import bool_array, codes, int_array, strings
from .walk import Listing, walk

PREFIXES = (
    "actv",
    "actv_grad",
    "grad_unreduced",
    "grad_reduced",
    "param_origin",
    "param_updated",
    "exp_avg",
    "exp_avg_sq",
    "other",
)
# execution order within a step: forward activations, backward activation gradients, gradients before and after
# the all-reduce, the optimizer's moments, weights before and after the update (param_origin: the step's weights)
PREFIX_ORDER = {
    "param_origin": 0,
    "actv": 1,
    "actv_grad": 2,
    "grad_unreduced": 3,
    "grad_reduced": 4,
    "exp_avg": 5,
    "exp_avg_sq": 6,
    "param_updated": 7,
    "other": 8,
}
STAT_COLUMNS = ("norm", "min", "max", "mean", "zeros", "nans")

_V1_FILE = re.compile(r"^(" + "|".join(sorted(PREFIXES, key=len, reverse=True)) + r")_(\d+)-(\d+)\.csv$")
_V1_DIR = re.compile(r"-rank(\d+)-[0-9a-fA-F]{8}$|^rank(\d+)$")
_V2_FILE = re.compile(r"^([A-Za-z0-9_.-]+?)_step(\d+)-(\d+)\.csv$")
_V2_DIR = re.compile(r"^rank_(\d+)$")
_V2_SCOPE = {
    ("module", "forward"): "actv",
    ("module", "backward"): "actv_grad",
    ("weight_grad", "reduced"): "grad_reduced",
    ("weight_grad", "unreduced"): "grad_unreduced",
}


class MonitorFormatError(DumpstoreError):
    """Monitor output that is not msprobe's CSV layout."""


class NoMonitorFiles(MonitorFormatError):
    """A folder holding no monitor CSV at all."""


def monitor_files(root: Path, listing: Listing | None = None) -> list[tuple[Path, int, str, str]]:
    """(file, rank, layout, slug-or-prefix) of every monitor CSV under `root` (the output folder, a rank folder
    or one file; `listing`: its walk.walk when made), in the canonical order: by folder (its path's parts), then
    slug, first step, last step, name."""
    return [(Path(p), rank, layout, slug) for p, rank, layout, slug in monitor_csv(root, listing)]


def monitor_csv(root: Path, listing: Listing | None = None) -> list[tuple[str, int, str, str]]:
    """monitor_files with the paths as strings (a run is tens of thousands of files)."""
    if listing is not None:
        found = listing
    elif root.is_file():
        found = [(str(root.parent), root.name)]
    else:
        found = walk(root)
    by_dir: dict[str, list[str]] = {}
    for parent, name in found:
        if name.endswith(".csv"):
            by_dir.setdefault(parent, []).append(name)
    out: list[tuple[str, int, str, str]] = []
    for parent in sorted(by_dir, key=lambda d: d.split(os.sep)):
        folder = os.path.basename(parent)
        d1, d2 = _V1_DIR.search(folder), _V2_DIR.match(folder)
        v1 = bool(d1 or not d2)  # TrainerMon's names, unless in a monitor_v2 rank folder
        rank = int((d1.group(1) or d1.group(2)) if d1 else d2.group(1) if d2 and not v1 else 0)
        pattern, layout = (_V1_FILE, "v1") if v1 else (_V2_FILE, "v2")
        rows = []
        for name in by_dir[parent]:
            m = pattern.match(name)
            if m:
                rows.append((m.group(1), int(m.group(2)), int(m.group(3)), name))
        rows.sort()
        head = parent + os.sep
        out += [(head + name, rank, layout, slug) for slug, _, _, name in rows]
    if not out:
        raise NoMonitorFiles(
            f"{root}: no msprobe monitor CSV found (TrainerMon `<time>-rank<r>-<id>/<prefix>_<a>-<b>.csv` or "
            "monitor_v2 `rank_<r>/<slug>_step<a>-<b>.csv`); point at the monitor's output folder"
        )
    return out


def _header(line: bytes) -> tuple[str, ...]:
    """A header line's column names."""
    return tuple(line.decode("utf-8", "replace").strip().split(","))


def _first_line(path: str) -> bytes:
    """The first line of a file, without its end."""
    try:
        with open(path, "rb") as f:
            return f.readline().rstrip(b"\n")
    except OSError as exc:
        raise MonitorFormatError(f"{path}: cannot read ({exc.strerror})") from None


def _need(layout: str, head: tuple[str, ...], path: str) -> None:
    need = {"name", "step"} if layout == "v1" else {"module_name", "step", "scope"}
    if not need <= set(head):
        raise MonitorFormatError(
            f"{path}, line 1: header {','.join(head)} lacks {', '.join(sorted(need - set(head)))}; "
            "not a monitor CSV of this msprobe layout"
        )


_INT_COLUMNS = ("step", "micro_step", "vpp_stage")
_TEXT_COLUMNS = ("name", "module_name", "scope", "shape", "dtype")
_DICT = pa.dictionary(pa.int32(), pa.string())
_BLOCK = 8 << 20  # bytes of CSV per batch: small files of a group joined up to it, a larger file read in several
_ACT_SUFFIX = r"\.(?:grad_)?(input|output)(?:_grad)?(?:\.\d+)?$"
_ACT = re.compile(_ACT_SUFFIX)
_LAST = re.compile(r"\.[^.]+$")
COLUMNS = [
    "rank",
    "step",
    "micro_step",
    "vpp_stage",
    "prefix",
    "name",
    "module",
    "param",
    "direction",
    "io",
    "seq",
    *STAT_COLUMNS,
    "shape",
    "dtype",
    "missing",
]
# the Arrow schema of the pieces (and of the Parquet parts): text columns dictionary-encoded (a name repeats at
# every step)
SCHEMA = pa.schema(
    [
        pa.field("rank", pa.int64()),
        pa.field("step", pa.int64()),
        pa.field("micro_step", pa.int64()),
        pa.field("vpp_stage", pa.int64()),
        *(pa.field(c, _DICT) for c in ("prefix", "name", "module", "param", "direction", "io")),
        pa.field("seq", pa.int32()),
        *(pa.field(c, pa.float64()) for c in STAT_COLUMNS),
        pa.field("shape", pa.list_(pa.int64())),
        pa.field("dtype", _DICT),
        pa.field("missing", pa.bool_()),
    ]
)
TEXT_COLUMNS = [f.name for f in SCHEMA if f.type == _DICT]


def read_monitor(root: Path) -> pa.Table:
    """Every monitor CSV under `root` as one `monitor` table (see the module doc)."""
    tables = [t for _, t in iter_monitor_tables(root)]
    return pa.concat_tables(tables) if tables else SCHEMA.empty_table()


def iter_monitor_tables(
    root: Path, *, workers: int | None = None, window: int = 2, files: list[tuple] | None = None
) -> Iterator[tuple[tuple, pa.Table]]:
    """(group, table) for each batch of monitor CSV files under `root` (`files`: their monitor_files listing,
    when already made), group = (rank, layout, slug-or-prefix, header), table of SCHEMA.

    The canonical order: the files of a (rank, layout, slug) in monitor_files' order (folder, then first step),
    those with the header of the first file as one group, then each other header met among them as its own group
    (in order of first appearance); the groups of (rank, layout, slug) in order of their first file. A group's
    files are read in batches of about 8 MB of text (a file per step: hundreds of files a batch, the header
    checked against the group's and dropped, the rows joined and parsed once by Arrow's C++ CSV reader; a larger
    file read 8 MB at a time), on `workers` threads (default: the usable cores), at most `window` batches per
    thread ahead of the consumer, so memory stays bounded whatever the run's length. seq (first appearance of a
    name within its prefix) runs over each group's files in order."""
    from collections import deque
    from concurrent.futures import ThreadPoolExecutor

    groups: dict[tuple, list[str]] = {}
    for path, rank, layout, slug in files if files is not None else monitor_csv(root):
        groups.setdefault((rank, layout, slug), []).append(str(path))
    n = workers or _cores()
    seqs: dict[tuple, _Seq] = {}

    def jobs():
        for (rank, layout, slug), paths in groups.items():
            raw = _first_line(paths[0])
            head = _header(raw)
            _need(layout, head, paths[0])
            for batch in _batches(paths):
                yield (rank, layout, slug), head, (batch, rank, layout, slug, head, raw)

    def odd_groups(base: tuple, odd: list[tuple[str, tuple]]):
        """The files of another header than their group's: a group per header, read here."""
        by_head: dict[tuple, list[str]] = {}
        for path, head in odd:
            by_head.setdefault(head, []).append(path)
        for head, paths in by_head.items():
            _need(base[1], head, paths[0])
            key = (*base, head)
            for batch in _batches(paths):
                pieces, again = _read_batch(batch, base[0], base[1], base[2], head, None)
                assert not again
                seq = seqs.setdefault(key, _Seq())
                for table, pairs, pair_idx in pieces:
                    yield key, _with_seq(table, pairs, pair_idx, seq)

    with ThreadPoolExecutor(max_workers=n) as pool:
        pending: deque = deque()
        todo = jobs()
        for base, head, job in todo:
            pending.append((base, head, pool.submit(_read_batch, *job)))
            if len(pending) >= n * window:
                break
        current: tuple | None = None
        odd: list[tuple[str, tuple]] = []
        try:
            while pending:
                base, head, fut = pending.popleft()
                nxt = next(todo, None)
                if nxt is not None:
                    pending.append((nxt[0], nxt[1], pool.submit(_read_batch, *nxt[2])))
                pieces, more = fut.result()
                if base != current:
                    if current is not None and odd:
                        yield from odd_groups(current, odd)
                    current, odd = base, []
                odd += more
                key = (*base, head)
                seq = seqs.setdefault(key, _Seq())
                for table, pairs, pair_idx in pieces:
                    yield key, _with_seq(table, pairs, pair_idx, seq)
            if current is not None and odd:
                yield from odd_groups(current, odd)
        except BaseException:
            for _, _, f in pending:
                f.cancel()
            raise


def _cores() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


class _Seq:
    """The seq of each (prefix, name) pair of a group: its order of first appearance within its prefix."""

    def __init__(self) -> None:
        self.of: dict[tuple, int] = {}
        self.count: dict[str | None, int] = {}
        self.last: tuple[list, np.ndarray] | None = None

    def codes(self, pairs: list[tuple]) -> np.ndarray:
        if self.last is not None and self.last[0] == pairs:
            return self.last[1]
        codes = np.zeros(len(pairs) + 1, np.int32)
        for k, pair in enumerate(pairs):
            v = self.of.get(pair)
            if v is None:
                v = self.of[pair] = self.count.get(pair[0], 0)
                self.count[pair[0]] = v + 1
            codes[k] = v
        self.last = (pairs, codes)
        return codes


def _with_seq(table: pa.Table, pairs: list[tuple], pair_idx: np.ndarray, seq: _Seq) -> pa.Table:
    """The table with its seq column, counted over the group's files so far."""
    valid = pair_idx >= 0
    col = int_array(seq.codes(pairs)[pair_idx], pa.int32(), None if valid.all() else valid)
    return table.set_column(SCHEMA.get_field_index("seq"), "seq", col)


def _batches(paths: list[str]) -> list[list[str]]:
    """Consecutive files of one group, about _BLOCK bytes a batch as the group's first file's size says
    (TrainerMon writes a file per step unless step_count_per_record says otherwise: thousands of files of a few
    hundred rows); the reader parses a batch in several texts where its files are larger."""
    try:
        size = os.stat(paths[0]).st_size
    except OSError:
        size = _BLOCK
    per = max(1, min(4096, _BLOCK // max(size, 1)))
    return [paths[k : k + per] for k in range(0, len(paths), per)]


def _read_batch(
    paths: list[str], rank: int, layout: str, slug: str, head: tuple[str, ...], raw: bytes | None
) -> tuple[list[tuple], list[tuple[str, tuple]]]:
    """The pieces of a batch of monitor CSV files of one group, and the files of another header (path, header)
    left out of them. Files up to _BLOCK bytes are read whole and joined into one text (the header once, each
    file's rows in order) parsed at once; a larger file is parsed from disk by itself; a text that does not parse
    is parsed file by file, to name the file and line."""
    pieces: list[tuple] = []
    odd: list[tuple[str, tuple]] = []
    text: list = []
    names: list[str] = []
    size = 0

    def flush() -> None:
        nonlocal size
        if names:
            body = b"".join(text)
            try:
                pieces.extend(_read_file(pa.py_buffer(body), rank, layout, slug, head, name=names[0]))
            except MonitorFormatError:
                for p in names:
                    _read_file(Path(p), rank, layout, slug, head)  # raises, naming the file and line
                raise
        text.clear()
        names.clear()
        size = 0

    for p in paths:
        try:
            data, big = _read_bytes(p)
        except OSError as exc:
            raise MonitorFormatError(f"{p}: cannot read ({exc.strerror})") from None
        cut = data.find(b"\n")
        line = data if cut < 0 else data[:cut]
        if line != raw:
            got = _header(line)
            if got != head:
                odd.append((p, got))
                continue
        if big:
            flush()
            pieces.extend(_read_file(Path(p), rank, layout, slug, head))
            continue
        if not names:
            text.append(line + b"\n")
        if cut >= 0 and cut + 1 < len(data):
            view = memoryview(data)[cut + 1 :]
            text.append(view)
            if data[-1:] != b"\n":
                text.append(b"\n")
        names.append(p)
        size += len(data)
        if size >= _BLOCK:
            flush()
    flush()
    return pieces, odd


def _read_bytes(path: str) -> tuple[bytes, bool]:
    """A file's bytes, and whether it is over _BLOCK (then only its first 64 KB: enough for the header)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        if size > _BLOCK:
            return os.read(fd, 1 << 16), True
        parts = [os.read(fd, size + 1)]
        while len(parts[-1]) and sum(map(len, parts)) > size:  # grown since: read to the end
            parts.append(os.read(fd, 1 << 20))
        return b"".join(parts) if len(parts) > 1 else parts[0], False
    finally:
        os.close(fd)


_ROW = re.compile(r"(?:CSV parse error: )?Row #(\d+): ")


def _read_file(
    path: Path | pa.Buffer, rank: int, layout: str, slug: str, head: tuple[str, ...], name: Path | str | None = None
) -> list[tuple]:
    """The pieces of one monitor CSV (a file, or CSV text in a buffer: `name` in errors): (table of SCHEMA with
    seq 0, its (prefix, name) pairs in order of first appearance, each row's index into them, -1 for a row
    without a name)."""
    import pyarrow.csv as pcsv

    cols = [c for c in dict.fromkeys(head) if c in STAT_COLUMNS or c in _INT_COLUMNS or c in _TEXT_COLUMNS]
    types: dict[str, Any] = {c: pa.float64() for c in cols if c in STAT_COLUMNS}
    types.update({c: pa.int64() for c in cols if c in _INT_COLUMNS})
    types.update({c: _DICT for c in cols if c in _TEXT_COLUMNS})
    out = []
    source = pa.BufferReader(path) if isinstance(path, pa.Buffer) else path
    try:
        reader = pcsv.open_csv(
            source,
            read_options=pcsv.ReadOptions(use_threads=False, block_size=_BLOCK),
            convert_options=pcsv.ConvertOptions(
                column_types=types, include_columns=cols, null_values=[""], strings_can_be_null=True
            ),
        )
        for batch in reader:
            if batch.num_rows:
                out.append(_piece(batch, rank, layout, slug))
    except (pa.ArrowException, OSError, UnicodeError) as exc:
        text = str(exc).strip()
        first = text.splitlines()[0] if text else type(exc).__name__
        m = _ROW.search(first)
        where = f"{name or path}"
        if m and name is None:  # Arrow's row number: the file's line (the header is row 1)
            where += f", line {m.group(1)}"
            first = first[: m.start()] + first[m.end() :]
        raise MonitorFormatError(
            f"{where}: not a monitor CSV ({first}); expected header vpp_stage,name,step[,micro_step],<ops>"
        ) from None
    return out


def _piece(batch: pa.RecordBatch, rank: int, layout: str, slug: str) -> tuple:
    n = batch.num_rows
    names = batch.schema.names

    def col(c: str, typ: pa.DataType) -> pa.Array:
        return batch.column(names.index(c)) if c in names else pa.nulls(n, typ)

    name = col("name" if layout == "v1" else "module_name", _DICT)
    if layout == "v1":
        prefix = pa.DictionaryArray.from_arrays(int_array(np.zeros(n, np.int32), pa.int32()), strings([slug]))
    else:
        scope = col("scope", _DICT)
        mapped = [None if v is None else _V2_SCOPE.get((slug, v), v) for v in scope.dictionary.to_pylist()]
        prefix = pa.DictionaryArray.from_arrays(scope.indices, strings(mapped))
    pairs, pair_idx, derived = _names(prefix, name)
    shape, dtype, missing = _shapes(col("shape", _DICT), col("dtype", _DICT))
    arrays = {
        "rank": int_array(np.full(n, rank, np.int64), pa.int64()),
        "step": col("step", pa.int64()),
        "micro_step": col("micro_step", pa.int64()),
        "vpp_stage": col("vpp_stage", pa.int64()),
        "prefix": prefix,
        "name": name,
        **derived,
        "seq": pa.nulls(n, pa.int32()),
        **{c: col(c, pa.float64()) for c in STAT_COLUMNS},
        "shape": shape,
        "dtype": dtype,
        "missing": missing,
    }
    return pa.Table.from_arrays([arrays[c] for c in COLUMNS], schema=SCHEMA), pairs, pair_idx


def _names(prefix: pa.DictionaryArray, name: pa.DictionaryArray) -> tuple[list[tuple], np.ndarray, dict]:
    """The (prefix, name) pairs of a batch in order of first appearance, each row's index into them (-1: no
    name), and module, param, direction, io of each row: derived once per pair (a name repeats at every step)
    and taken by the rows as dictionary codes."""
    pnames = prefix.dictionary.to_pylist()
    nnames = name.dictionary.to_pylist()
    pi = codes(prefix)
    ni = codes(name)
    key = None
    # one prefix (TrainerMon) and the name dictionary in order of first appearance (Arrow's CSV reader builds it
    # so): the pairs are the dictionary, the rows' codes their index
    if len(pnames) == 1 and (pi >= 0).all() and not (np.diff(np.maximum.accumulate(np.append(-1, ni))) > 1).any():
        key = (pnames[0], tuple(nnames))
        pair_idx = ni
        got = _LAST_NAMES.get(key)
        if got is not None:
            pairs, dicts = got
        else:
            pairs = [(pnames[0], v) for v in nnames]
            dicts = _derived_dictionaries(pairs)
            if len(_LAST_NAMES) > 64:
                _LAST_NAMES.clear()
            _LAST_NAMES[key] = (pairs, dicts)
    else:
        pairs, pair_idx = _first_seen(pi, ni, pnames, nnames)
        dicts = _derived_dictionaries(pairs)
    has = pair_idx >= 0
    code = np.where(has, pair_idx, 0).astype(np.int32)
    cols = {}
    for c, (values, known) in dicts.items():  # a pair without the value (no param of an activation): null code
        valid = has if known[:-1].all() else has & known[code]
        cols[c] = pa.DictionaryArray.from_arrays(int_array(code, pa.int32(), None if valid.all() else valid), values)
    return pairs, pair_idx, cols


_LAST_NAMES: dict[tuple, tuple] = {}  # (prefix, names) -> pairs and derived dictionaries: files repeat their names


def _derived_dictionaries(pairs: list[tuple]) -> dict[str, tuple[pa.Array, np.ndarray]]:
    """module, param, direction, io of each pair: (dictionary values, whether the pair has one); a dictionary
    holds no null (Arrow cannot unify those), a missing value is a null code."""
    derived = [_derive_name(pre, nm) for pre, nm in pairs]
    out = {}
    for k, c in enumerate(("module", "param", "direction", "io")):
        values = [d[k] for d in derived]
        known = np.array([v is not None for v in values] + [False])
        out[c] = (strings(["" if v is None else v for v in values]), known)
    return out


def _first_seen(pi: np.ndarray, ni: np.ndarray, pnames: list, nnames: list) -> tuple[list[tuple], np.ndarray]:
    """(prefix, name) pairs in order of first appearance and each row's index into them (-1: no name)."""
    has = ni >= 0
    pcode = np.where(pi >= 0, pi, len(pnames))  # a row without a prefix: its own slot (prefix None)
    code = np.where(has, pcode * (len(nnames) + 1) + ni, -1)
    uniq, first, inverse = np.unique(code, return_index=True, return_inverse=True)
    keep = uniq >= 0
    order = np.argsort(first[keep], kind="stable")
    rank_of = np.full(len(uniq), -1, np.int64)
    rank_of[np.flatnonzero(keep)[order]] = np.arange(len(order))
    pairs = []
    for c in uniq[keep][order].tolist():
        p, q = divmod(c, len(nnames) + 1)
        pairs.append((pnames[p] if p < len(pnames) else None, nnames[q]))
    return pairs, rank_of[inverse.reshape(-1)]


_DERIVED: dict[tuple, tuple] = {}


def _derive_name(prefix: str | None, name: str) -> tuple:
    """module, param, direction, io of a (prefix, name) pair."""
    key = (prefix, name)
    got = _DERIVED.get(key)
    if got is not None:
        return got
    act = prefix in ("actv", "actv_grad")
    grads = prefix in ("grad_unreduced", "grad_reduced")
    params = prefix in ("param_origin", "param_updated")
    if act:
        m = _ACT.search(name)
        module = _ACT.sub("", name, count=1).strip(".")
        io = m.group(1) if m else None
    else:
        module = _LAST.sub("", name, count=1)
        io = "parameters_grad" if grads else "parameters" if params else prefix
    if prefix == "actv":
        direction = "forward"
    elif prefix == "actv_grad":
        direction = "backward"
    elif grads:
        direction = "parameters_grad"
    elif params:
        direction = "parameters"
    elif prefix is not None and prefix.startswith("exp_avg"):
        direction = "optimizer"
    else:
        direction = "other"
    got = (module, None if act else name, direction, io)
    if len(_DERIVED) < 200_000:  # a bounded cache: a run has thousands of names, not millions
        _DERIVED[key] = got
    return got


def _shapes(shape: pa.DictionaryArray, dtype: pa.DictionaryArray) -> tuple:
    """shape (list of int64), dtype (canonical: `torch.` dropped) and missing (dtype null, `nan` or empty: a row
    of nan strings) of each row, worked out once per distinct text."""
    dvals = dtype.dictionary.to_pylist()
    miss_of = np.array([d is None or d.lower() in ("nan", "") for d in dvals] + [True])
    di = codes(dtype)
    missing = miss_of[di]  # -1 (null dtype): the last entry, missing
    canon = [None if d is None else re.sub(r"^torch\.", "", d) for d in dvals]
    dvalid = ~missing
    d_idx = int_array(np.where(dvalid, di, 0).astype(np.int32), pa.int32(), None if dvalid.all() else dvalid)
    # a missing entry's text (`nan`) never becomes a dictionary value: map it to the first kept one, masked
    dtype_out = pa.DictionaryArray.from_arrays(d_idx, strings([c if c is not None else "" for c in canon]))
    lists = [_shape_list(s) for s in shape.dictionary.to_pylist()]
    si = codes(shape)
    ok = np.array([v is not None for v in lists] + [False])
    svalid = (si >= 0) & ~missing & ok[si]
    # each row's list gathered from the distinct shapes' flat values (no pyarrow.compute)
    ulen = np.array([len(v or []) for v in lists] + [0], np.int64)
    ustart = np.concatenate([[0], np.cumsum(ulen)])
    flat = [x for v in lists for x in (v or [])]
    uvals = np.array([0 if x is None else x for x in flat], np.int64)
    uknown = np.array([x is not None for x in flat], bool)
    lens = np.where(svalid, ulen[si], 0)
    offsets = np.zeros(len(si) + 1, np.int64)
    np.cumsum(lens, out=offsets[1:])
    gather = np.repeat(np.where(svalid, ustart[si], 0) - offsets[:-1], lens) + np.arange(offsets[-1])
    values = to_arrow(uvals[gather], pa.int64(), None if uknown.all() else ~uknown[gather])
    shape_out = to_arrow(offsets.astype(np.int32), pa.list_(pa.int64()), ~svalid, child=values)
    return shape_out, dtype_out, bool_array(missing)


def _shape_list(text: str | None) -> list | None:
    """`[4096, 4096]` -> [4096, 4096], `(2,)` -> [2]; an element that is not an integer: None; no text: None."""
    if text is None:
        return None
    t = text.strip("[]() ")
    if t == "":
        return None
    out: list = []
    for part in (p.strip() for p in t.split(",")):
        if part:
            out.append(int(part) if part.lstrip("-").isdigit() else None)
    return out
