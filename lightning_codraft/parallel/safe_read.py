"""Reading a checkpoint without running its code: DCP's ``.metadata`` pickle through an unpickler that admits only
DCP's own metadata classes, and a load planner that refuses pickled entries (parallel/checkpoint.py's contract:
nothing is unpickled from a checkpoint; a crafted file raises :class:`CheckpointError`).
"""

from __future__ import annotations

import io
import pickle
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner


class CheckpointError(ValueError):
    """A checkpoint directory is missing, of another format, lacks what was asked for, or is unsafe to read."""


_SAFE_GLOBALS = {
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("collections", "OrderedDict"),
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
    ("pathlib", "WindowsPath"),
    ("pathlib", "PureWindowsPath"),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
}
_SAFE_MODULES = ("torch.distributed.checkpoint.metadata",)


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP metadata and nothing else: any other global (``os.system``, ...) is refused."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _SAFE_GLOBALS or module in _SAFE_MODULES:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise CheckpointError(
            f"refusing to load checkpoint metadata: it references {module}.{name}, which DCP "
            f"metadata never contains (the file may have been crafted to run code)"
        )


class SafeFileSystemReader(FileSystemReader):
    """DCP's file reader with the ``.metadata`` pickle read by :class:`_MetadataUnpickler`."""

    def read_metadata(self, *args: Any, **kwargs: Any):
        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as f:
            try:
                metadata = _MetadataUnpickler(f).load()
            except CheckpointError:
                raise
            except Exception as e:  # noqa: BLE001 - any malformed pickle
                raise CheckpointError(f"{path} is not readable DCP metadata: {type(e).__name__}: {e}") from e
        metadata.storage_meta = getattr(metadata, "storage_meta", None)
        if metadata.storage_meta is not None:
            metadata.storage_meta.load_id = self.load_id
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's load planner that refuses pickled (non-tensor) entries: ours hold tensors only, the rest is JSON."""

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        raise CheckpointError(
            f"checkpoint entry {read_item.dest_index.fqn!r} is a pickled object, which "
            f"lightning_codraft checkpoints never contain (their non-tensor state is JSON); "
            f"refusing to unpickle it"
        )
