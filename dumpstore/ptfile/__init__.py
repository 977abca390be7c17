"""Safe reader for PyTorch ``.pt`` tensor files: torch.save's zip + pickle, read without torch or pickle code.

``torch.save(tensor)`` writes a zip holding ``<archive>/data.pkl`` (a pickle that rebuilds the tensor from a
storage), ``<archive>/data/<key>`` (the raw storage bytes) and ``<archive>/byteorder``. :func:`read_pt`
unpickles ``data.pkl`` with an allow-list that maps the few globals a plain tensor needs onto inert stand-ins,
so nothing the file names is ever imported or called; it then checks shape, strides and offset against the
storage and reads the bytes with numpy. A numpy array pickled by ``torch.save(ndarray)`` is read the same way
(numeric dtypes only). Anything else is refused with :class:`~dumpstore.errors.DumpFormatError` naming the
path and the problem.

The parts: ``reader`` (read_pt: the open, the fast or the general path, the errors), ``fast`` (a small plain file in
one pass), ``zipread`` (the zip, parsed here), ``unpickler`` (the allow-list), ``decode`` (the bytes into an array),
``base`` (the refusal, caps and dtype tables they share).
"""

from __future__ import annotations

from .base import DEFAULT_MAX_BYTES
from .reader import NO_FOLLOW, LinkedTensorFile, MissingTensorFile, read_pt, read_pt_stamped

__all__ = ["DEFAULT_MAX_BYTES", "NO_FOLLOW", "LinkedTensorFile", "MissingTensorFile", "read_pt", "read_pt_stamped"]
