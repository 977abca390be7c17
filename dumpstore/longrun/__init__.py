"""Long runs: training logs, TensorBoard event files and msprobe monitor output, read into the store's own
`scalars`, `monitor` and `monitor_anomalies` tables (see docs/longrun.md).

  logs         Megatron/MindSpeed, MindFormers and HF Trainer log lines, a user regex -> scalars rows
  tensorboard  TensorBoard event files (every point; TFRecord framing and the Event protobuf read here)
  monitor      msprobe monitor CSV (TrainerMon `{prefix}_{a}-{b}.csv` and monitor_v2 `{slug}_step{a}-{b}.csv`)
  anomalies    msprobe monitor's own alarms (`anomaly_detected/rank{r}/anomaly.json`)
  arrow        Arrow <-> numpy through the buffers (no pandas, no pyarrow.compute)
  store        the long-run catalog (`longruns.parquet`), its Parquet tables and DuckDB views
"""

from __future__ import annotations

SCALAR_COLUMNS = ("rank", "step", "consumed_samples", "tag", "value")
