"""Hugging Face `datasets` as training data: what `Dataset.save_to_disk` writes (a Dataset or a
DatasetDict directory), a `.parquet` file or an `.arrow` file, read column by column.

The package is optional (``pip install 'dsnd[data]'``): a dataset path without it is refused by
name. Nothing is downloaded and nothing is cached outside the files themselves: directories go
through `datasets.load_from_disk`, `.arrow` files through `Dataset.from_file` (both memory-map
the Arrow data), `.parquet` files through `pyarrow.parquet` (`Dataset.from_parquet` would copy
them into a cache directory first).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from dsnd.errors import UserError

SUFFIXES = (".parquet", ".arrow")
# the files save_to_disk writes: a Dataset's state.json, a DatasetDict's dataset_dict.json
_MARKERS = ("state.json", "dataset_dict.json")
INSTALL = "pip install 'dsnd[data]' (or: pip install datasets)"


def is_dataset(path: str) -> bool:
    """Whether `path` is a Hugging Face dataset: a directory save_to_disk wrote, a .parquet or
    an .arrow file."""
    if os.path.isdir(path):
        return any(os.path.isfile(os.path.join(path, m)) for m in _MARKERS)
    return Path(path).suffix.lower() in SUFFIXES


def _datasets(path: str) -> Any:
    try:
        import datasets
    except ImportError:
        raise UserError(
            f"data.path={path} is a Hugging Face dataset, which needs the datasets "
            f"package: {INSTALL}"
        ) from None
    return datasets


def open_dataset(path: str, split: str) -> Any:
    """The dataset at `path`: a `datasets.Dataset`, or a `pyarrow.Table` for parquet."""
    datasets = _datasets(path)
    where = f"data.path={path}"
    suffix = Path(path).suffix.lower()
    if suffix not in SUFFIXES and not any(os.path.isfile(os.path.join(path, m)) for m in _MARKERS):
        raise UserError(
            f"{where}: a directory without {' or '.join(_MARKERS)}; expected what "
            "Dataset.save_to_disk writes"
        )
    try:
        if suffix == ".parquet":
            import pyarrow.parquet

            return pyarrow.parquet.read_table(path)
        if suffix == ".arrow":
            return datasets.Dataset.from_file(path)
        found = datasets.load_from_disk(path)
    except Exception as e:  # the files are the user's: any failure to read them is one line
        first = (str(e).strip().splitlines() or [""])[0]
        raise UserError(f"{where}: cannot read the dataset ({type(e).__name__}: {first})") from e
    if isinstance(found, datasets.DatasetDict):
        if split not in found:
            raise UserError(
                f"{where}: no split {split!r} in the DatasetDict (splits: "
                f"{', '.join(found)}); set data.split"
            )
        return found[split]
    return found


def column(path: str, split: str, name: str, key: str) -> Iterator[tuple[str, Any]]:
    """(where, value) of column `name` of every row, in order, read a chunk at a time; `where`
    is "PATH row N" for errors. Refuses a dataset without the column, naming the columns it has
    and the setting `key` that chose it."""
    found = open_dataset(path, split)
    table = getattr(getattr(found, "data", None), "table", found)  # a Dataset's pyarrow.Table
    if name not in table.column_names:
        raise UserError(
            f"data.path={path}: the dataset has no column {name!r} (columns: "
            f"{', '.join(table.column_names) or 'none'}); set {key}"
        )
    row = 0
    for chunk in table.column(name).chunks:
        for value in chunk.to_pylist():
            yield f"{path} row {row}", value
            row += 1
