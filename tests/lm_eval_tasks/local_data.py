"""The local tasks' data (tests/test_lm_eval.py): a task's `custom_dataset` reads its JSONL file beside this one into
a one-split DatasetDict, so nothing is downloaded and nothing depends on the working directory."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent


def load(file: str, **_: Any):
    from datasets import Dataset, DatasetDict

    rows = [json.loads(line) for line in (HERE / file).read_text().splitlines() if line.strip()]
    return DatasetDict({"test": Dataset.from_list(rows)})
