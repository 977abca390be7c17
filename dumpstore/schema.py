"""The store's Arrow schemas and version: one row per leaf of a dump record, one row per ingested run."""

from __future__ import annotations

import pyarrow as pa

SCHEMA_VERSION = 1

# Partition columns (run, step, rank) live in the hive path, not in the files.
TENSOR_FIELDS: list[tuple[str, pa.DataType, str]] = [
    ("ingest_id", pa.string(), "ingest that wrote the row; the catalog names the live one per run"),
    ("rank_dir", pa.string(), "rank folder as dumped: rank0, proc1234, or '' for a lone dump.json"),
    ("source", pa.string(), "'' or the MindSpore split folder: graph / pynative"),
    ("seq", pa.int32(), "execution order of the record within step and rank (dump.json order)"),
    ("leaf", pa.int32(), "order of the leaf within step and rank"),
    ("record", pa.string(), "msprobe record key, e.g. Functional.linear.0.forward"),
    ("prefix", pa.string(), "Functional, Torch, Tensor, Module, Cell, Primitive, Mint, debug, file, ..."),
    ("api", pa.string(), "API name (linear) or module path and class (layers.0.fc1.Linear)"),
    ("op_type", pa.string(), "API name, or module class (Linear)"),
    ("call", pa.int32(), "call counter from the record key"),
    ("direction", pa.string(), "forward / backward / parameters_grad / debug / tensor"),
    ("module", pa.string(), "parent module record from construct.json"),
    ("is_recompute", pa.bool_(), "msprobe 8.x is_recompute flag"),
    ("io", pa.string(), "input / output / parameters / parameters_grad / debug / tensor"),
    ("index_path", pa.string(), "position in nested args/kwargs, '.'-joined"),
    ("name", pa.string(), "msprobe row name: record.io.index_path"),
    ("kind", pa.string(), "tensor / scalar / null / error"),
    ("value_type", pa.string(), "type as dumped: torch.Tensor, int, float, slice, torch.Size, ..."),
    ("value", pa.string(), "JSON value of a non-tensor leaf"),
    ("scalar_value", pa.float64(), "numeric value of an int/float/bool leaf"),
    ("dtype", pa.string(), "canonical dtype (float32, bfloat16, int64, ...)"),
    ("dtype_raw", pa.string(), "dtype as dumped (torch.float32, BFloat16, ...)"),
    ("shape", pa.list_(pa.int64()), "shape as dumped"),
    ("numel", pa.int64(), "number of elements"),
    ("requires_grad", pa.bool_(), "requires_grad as dumped"),
    ("min", pa.float64(), "minimum (exact from the tensor file when stats_source='tensor')"),
    ("max", pa.float64(), "maximum"),
    ("mean", pa.float64(), "mean"),
    ("norm", pa.float64(), "L2 norm"),
    ("stats_source", pa.string(), "tensor (recomputed in float64 from the file) / dump (the dumper's JSON) / none"),
    ("nan_count", pa.int64(), "NaN elements (null when only statistics were dumped)"),
    ("posinf_count", pa.int64(), "+Inf elements"),
    ("neginf_count", pa.int64(), "-Inf elements"),
    ("zero_count", pa.int64(), "zero elements"),
    ("sat_count", pa.int64(), "elements at +-finfo(dtype).max (Ascend saturation)"),
    ("has_nan", pa.bool_(), "NaN present (from counts, else inferred from the dumper's statistics)"),
    ("has_posinf", pa.bool_(), "+Inf present"),
    ("has_neginf", pa.bool_(), "-Inf present"),
    ("has_sat", pa.bool_(), "+-finfo.max present"),
    ("dump_max", pa.float64(), "the dumper's Max"),
    ("dump_min", pa.float64(), "the dumper's Min"),
    ("dump_mean", pa.float64(), "the dumper's Mean"),
    ("dump_norm", pa.float64(), "the dumper's Norm"),
    ("checksum", pa.string(), "the dumper's md5 field (CRC-32 hex, or 0x-prefixed XOR fold)"),
    ("checksum_kind", pa.string(), "crc32 / xor"),
    ("data_name", pa.string(), "tensor file name from dump.json"),
    ("file_status", pa.string(), "loaded / missing / none / error"),
    ("sample", pa.list_(pa.float64()), "values at deterministic positions (see dumpstore.summary)"),
    ("sketch", pa.list_(pa.float64()), "linear signed fold into min(M, numel) buckets"),
    ("stack_id", pa.int32(), "key into the stacks table"),
    ("error", pa.string(), "why this leaf could not be read fully (null when fine)"),
    (
        "content_hash",
        pa.binary(),
        "XXH3-128 (16 bytes) of the loaded tensor (dtype, shape, values); not cryptographic: --exact also asks the "
        "exact statistics to agree",
    ),
    ("file_size", pa.int64(), "size in bytes of the tensor file when it was read"),
    ("file_mtime_ns", pa.int64(), "modification time (ns) of the tensor file when it was read"),
]

# Columns set only for leaves whose tensor file was loaded (null in stores written before they existed):
# `--exact` compares a pair of equal content hashes once and trusts them while size and mtime are unchanged.
TENSOR_FILE_COLUMNS = ("content_hash", "file_size", "file_mtime_ns")

TENSOR_SCHEMA = pa.schema([pa.field(n, t) for n, t, _ in TENSOR_FIELDS])

STACK_SCHEMA = pa.schema(
    [
        pa.field("ingest_id", pa.string()),
        pa.field("step", pa.int64()),
        pa.field("rank", pa.int64()),
        pa.field("stack_id", pa.int32()),
        pa.field("frames", pa.list_(pa.string())),
    ]
)

RUN_FIELDS: list[tuple[str, pa.DataType, str]] = [
    ("run", pa.string(), "run name given to ingest"),
    ("ingest_id", pa.string(), "id of the live ingest"),
    ("schema_version", pa.int32(), "store schema version that wrote the run"),
    ("source_path", pa.string(), "path that was ingested"),
    ("framework", pa.string(), "pytorch / mindspore / mindtorch / files"),
    ("task", pa.string(), "statistics / tensor / debug / files (comma-joined if mixed)"),
    ("level", pa.string(), "L0 / L1 / mix / debug"),
    ("dump_mode", pa.string(), "tensor / statistics / md5 / xor / files"),
    ("generation", pa.string(), "msprobe generation guessed from the format: 8.x / 26.x"),
    ("steps", pa.list_(pa.int64()), "steps present"),
    ("ranks", pa.list_(pa.int64()), "ranks present"),
    ("n_files", pa.int64(), "dump.json / debug.json / tensor files read"),
    ("n_records", pa.int64(), "records"),
    ("n_rows", pa.int64(), "leaf rows"),
    ("n_tensors", pa.int64(), "tensor leaf rows"),
    ("n_tensor_files", pa.int64(), "tensor files loaded"),
    ("n_errors", pa.int64(), "leaf rows with an error"),
    ("sample_k", pa.int32(), "sample size K"),
    ("sketch_m", pa.int32(), "sketch buckets M"),
    ("created_at", pa.string(), "UTC time of the ingest"),
    ("dumpstore_version", pa.string(), "dumpstore version"),
]
RUN_SCHEMA = pa.schema([pa.field(n, t) for n, t, _ in RUN_FIELDS])
