"""Which rank ran Newton-Schulz on which matrix: a job of tests/workers/train_many.py that trains CONFIG +
OVERRIDES with every call of disttrain's orthogonalisation counted by parameter name, and writes
OUT/rank_R.json ({name: calls}).

    {"call": "muon_split:count", "args": [CONFIG, OVERRIDES, OUT]}
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import torch
import torch.distributed as dist

from disttrain.config.load import load_config
from disttrain.distributed.env import detect_env
from disttrain.distributed.runtime import Runtime
from disttrain.parallel.param_names import clean_fqn
from disttrain.train import muon
from disttrain.train.builder import build_run
from disttrain.train.loop import Trainer


def count(config: str, overrides: list[str], out: str) -> None:
    calls: Counter = Counter()
    original = muon.MuonWithAdamW._orthogonalise

    def counted(self, p, full, group):
        calls[clean_fqn(self.names[p])] += 1
        return original(self, p, full, group)

    muon.MuonWithAdamW._orthogonalise = counted
    try:
        Trainer(build_run(load_config(config, overrides), Runtime(detect_env(), torch.device("cpu"), "gloo"))).fit()
    finally:
        muon.MuonWithAdamW._orthogonalise = original
    Path(out).mkdir(parents=True, exist_ok=True)
    (Path(out) / f"rank_{dist.get_rank()}.json").write_text(json.dumps(calls))
