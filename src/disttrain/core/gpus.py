"""Accelerator table for the planner and for MFU: dense peak FLOP/s, memory and link bandwidths.

Peaks are dense (no 2:4 sparsity) tensor-core figures from each vendor's datasheet. Bandwidths are
per GPU and per direction, in GB/s (1e9 bytes/s): `intra_node_gbs` is NVLink / Infinity Fabric (or
PCIe where a card has no such link), `inter_node_gbs` the usual network of that generation's
reference systems (one NIC per GPU). Both are overridable on the command line because clusters
differ far more than chips do.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class GPUSpec:
    name: str
    description: str
    peak_tflops: dict[str, float]  # dtype -> dense TFLOP/s
    memory_gb: float  # 1e9 bytes, as datasheets quote it
    intra_node_gbs: float
    inter_node_gbs: float
    source: str
    notes: str = ""
    aliases: tuple[str, ...] = field(default=())

    @property
    def memory_bytes(self) -> int:
        return int(self.memory_gb * 1e9)

    def peak_flops(self, dtype: str) -> float:
        return self.peak_tflops[dtype] * 1e12


def _tflops(bf16: float, tf32: float, fp32: float) -> dict[str, float]:
    return {"bf16": bf16, "fp16": bf16, "tf32": tf32, "fp32": fp32}


GPUS: dict[str, GPUSpec] = {g.name: g for g in [
    GPUSpec("a100-40g", "NVIDIA A100 SXM4 40GB", _tflops(312, 156, 19.5), 40, 300, 25,
            "https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/a100/pdf/"
            "nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf",
            "NVLink 3: 600 GB/s bidirectional; DGX A100: 8x 200 Gb/s HDR InfiniBand", ("a100",)),
    GPUSpec("a100-80g", "NVIDIA A100 SXM4 80GB", _tflops(312, 156, 19.5), 80, 300, 25,
            "https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/a100/pdf/"
            "nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf",
            "NVLink 3: 600 GB/s bidirectional; DGX A100: 8x 200 Gb/s HDR InfiniBand"),
    GPUSpec("v100-32g", "NVIDIA V100 SXM2 32GB", {"bf16": 15.7, "fp16": 125, "tf32": 15.7, "fp32": 15.7}, 32.5, 150,
            12.5, "https://images.nvidia.com/content/technologies/volta/pdf/volta-v100-datasheet-update-us-1165301-r5.pdf",
            "NVLink 2: 300 GB/s bidirectional; no bf16 or tf32 tensor cores (bf16 runs at the fp32 rate: "
            "train V100s in fp16); 100 Gb/s network typical", ("v100",)),
    GPUSpec("h100", "NVIDIA H100 SXM5 80GB", _tflops(989.4, 494.7, 66.9), 80, 450, 50,
            "https://resources.nvidia.com/en-us-tensor-core/nvidia-tensor-core-gpu-datasheet",
            "NVLink 4: 900 GB/s bidirectional; DGX H100: 8x 400 Gb/s NDR InfiniBand", ("h100-sxm",)),
    GPUSpec("h100-pcie", "NVIDIA H100 PCIe 80GB", _tflops(756.5, 378, 51.2), 80, 64, 25,
            "https://resources.nvidia.com/en-us-tensor-core/nvidia-tensor-core-gpu-datasheet",
            "PCIe Gen5 x16 between cards (NVLink bridges join pairs only); 200 Gb/s network typical"),
    GPUSpec("h200", "NVIDIA H200 SXM 141GB", _tflops(989.4, 494.7, 66.9), 141, 450, 50,
            "https://www.nvidia.com/en-us/data-center/h200/",
            "NVLink 4: 900 GB/s bidirectional; 400 Gb/s NDR per GPU"),
    GPUSpec("b200", "NVIDIA B200 (HGX B200) 180GB", _tflops(2250, 1100, 75), 180, 900, 50,
            "https://www.nvidia.com/en-us/data-center/hgx/",
            "NVLink 5: 1.8 TB/s bidirectional; datasheet quotes sparse figures, halved here"),
    GPUSpec("l40s", "NVIDIA L40S 48GB", _tflops(362.05, 183, 91.6), 48, 32, 25,
            "https://www.nvidia.com/en-us/data-center/l40s/",
            "no NVLink: PCIe Gen4 x16 (32 GB/s per direction)"),
    GPUSpec("l4", "NVIDIA L4 24GB", _tflops(121, 60, 30.3), 24, 32, 12.5,
            "https://www.nvidia.com/en-us/data-center/l4/",
            "no NVLink: PCIe Gen4 x16; 100 Gb/s network typical"),
    GPUSpec("mi300x", "AMD Instinct MI300X 192GB", _tflops(1307.4, 653.7, 163.4), 192, 448, 50,
            "https://www.amd.com/en/products/accelerators/instinct/mi300/mi300x.html",
            "Infinity Fabric: 7 links x 128 GB/s = 896 GB/s bidirectional per GPU; 400 Gb/s per GPU typical"),
]}


def find_gpu(name: str) -> GPUSpec:
    """Look a GPU up by table key or alias, case-insensitively; KeyError names the allowed keys."""
    key = name.lower()
    for gpu in GPUS.values():
        if key == gpu.name or key in gpu.aliases:
            return gpu
    raise KeyError(f"{name}: unknown GPU (allowed: {', '.join(GPUS)})")


def match_device_name(device_name: str) -> GPUSpec | None:
    """Map `torch.cuda.get_device_name()` (e.g. 'NVIDIA H100 80GB HBM3') onto the table, or None."""
    text = device_name.lower()
    if "h200" in text:
        return GPUS["h200"]
    if "h100" in text:
        return GPUS["h100-pcie"] if "pcie" in text else GPUS["h100"]
    if "a100" in text:
        return GPUS["a100-80g"] if "80g" in text.replace(" ", "") else GPUS["a100-40g"]
    if "v100" in text:
        return GPUS["v100-32g"]  # (a 16 GB V100 has the same peaks; only memory differs)
    for key in ("b200", "l40s", "mi300x"):
        if key in text:
            return GPUS[key]
    if "l4" in text.split() or text.endswith(" l4"):
        return GPUS["l4"]
    return None
