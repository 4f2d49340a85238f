"""The same Hugging Face Llama under disttrain (DDP, ZeRO-3), HF Accelerate (DDP), Lightning Fabric (DDP,
FSDP2), DeepSpeed (ZeRO-3) and a hand-written FSDP2 loop, each as a ratio to a hand-written DDP loop
(workloads/hf_*.py), interleaved.

    make bench-env && .venv/bin/python benchmarks/hf_frameworks.py --reps 3

Accelerate's FSDP plugin is silently ignored on CPU (it would run DDP under that name), so it is not
listed. Start-up is removed as in overhead.py (a short and a long run, the difference kept).
"""

from __future__ import annotations

import argparse
import sys

import overhead
from overhead import BENCH_PY, REPO, WORKLOADS, add_common_args, interleaved, print_table, summarize, write_results

SEQ, GLOBAL_BATCH = 256, 16
VARIANTS = ("plain", "disttrain-ddp", "disttrain-zero3", "accelerate-ddp", "fabric-ddp", "fabric-fsdp2",
            "deepspeed-zero3", "plain-fsdp2")


def model_dir():
    """The workload's config.json, written with transformers' save_pretrained (disttrain reads a directory)."""
    sys.path.insert(0, str(WORKLOADS))
    from hf_common import HF_CONFIG
    from transformers import LlamaConfig

    directory = REPO / "runs" / "bench-hf" / "model"
    LlamaConfig(**HF_CONFIG, use_cache=False).save_pretrained(directory)
    return directory


def command(variant: str, steps: int, directory) -> list[str]:
    torchrun = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    if variant.startswith("disttrain"):
        stage = 3 if variant.endswith("zero3") else 0
        return [sys.executable, "-m", "disttrain", "train", str(REPO / "configs" / "bench.yaml"), f"model.hf={directory}",
                f"data.seq_len={SEQ}", f"train.global_batch_size={GLOBAL_BATCH}", "train.micro_batch_size=8",
                f"parallel.zero_stage={stage}", f"train.steps={steps}", f"run.dir={REPO / 'runs' / 'bench-hf'}",
                "--nproc-per-node", "2"]
    if variant == "plain":
        return [sys.executable, *torchrun, str(WORKLOADS / "hf_plain_ddp.py"), "--steps", str(steps)]
    if variant == "plain-fsdp2":  # the hand-written sharded loop: fully_shard per decoder layer
        return [sys.executable, *torchrun, str(WORKLOADS / "hf_plain_fsdp.py"), "--steps", str(steps)]
    if variant == "deepspeed-zero3":
        return [sys.executable, *torchrun, str(WORKLOADS / "hf_deepspeed.py"), "--steps", str(steps)]
    script = "hf_accelerate.py" if variant.startswith("accelerate") else "hf_fabric.py"
    return [str(BENCH_PY), *torchrun, str(WORKLOADS / script), "--steps", str(steps),
            "--strategy", "fsdp" if variant.endswith("fsdp2") else "ddp"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(parser, "hf_frameworks.json")
    parser.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated subset (plain is the baseline)")
    args = parser.parse_args()
    variants = args.variants.split(",")
    if "plain" not in variants or not set(variants) <= set(VARIANTS):
        raise SystemExit(f"--variants: a subset of {','.join(VARIANTS)} that includes plain")
    if not BENCH_PY.exists():
        raise SystemExit("the comparison environment is missing: run `make bench-env` first")
    overhead.TOKENS_PER_STEP = SEQ * GLOBAL_BATCH
    directory = model_dir()
    results = interleaved(variants, lambda v, steps: command(v, steps, directory), args.reps, args.short,
                          args.long)
    summary = summarize(results, "plain")
    write_results(args.out, {"args": vars(args), "runs": results, "summary": summary})
    print_table(summary, "plain")


if __name__ == "__main__":
    main()
