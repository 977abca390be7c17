"""Imported by the replay's fork server only (`run._execute`): torch and the worker loaded once, then every worker
process is forked from there ready to replay. Never imported by `dumpstore.analysis.replay` itself."""

import torch  # noqa: F401

from . import worker  # noqa: F401
