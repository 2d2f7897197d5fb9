import os
import sys
from pathlib import Path

import pytest
import torch

# tests/ on the path so `from distributed import run_distributed` works in every test module
sys.path.insert(0, str(Path(__file__).parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


@pytest.fixture(autouse=True)
def _seed_and_threads():
    torch.manual_seed(0)
    torch.set_num_threads(1)  # tiny models: OpenMP sync costs more than it gains
    yield


REPO = Path(__file__).resolve().parent.parent
GSM8K_SHARED = REPO.parent / "shared" / "data" / "gsm8k" / "train.jsonl"
