"""The GPUs `muse plan` knows, by their vendors' public datasheet figures (dense tensor-core
rates, no sparsity; memory as sold per GPU). These are leads, not measurements: measured
ceilings are lower (on the H200 this repository measured about 790 of the 989 bf16
TFLOP/s, see docs/performance.md), which the projection's efficiencies account for."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class GpuSpec:
    name: str
    memory_gb: float  # HBM per GPU, 10^9 bytes
    hbm_tb_s: float  # HBM bandwidth, 10^12 bytes/s
    bf16_tflops: float  # dense
    fp8_tflops: float  # dense
    fp4_tflops: float | None  # dense; None: no FP4 tensor cores (FP4 weights run W4A16)
    nvlink_gb_s: float  # per direction, per GPU, 10^9 bytes/s

    def matmul_tflops(self, compute: str) -> float:
        """The dense rate of a GEMM whose operands are `compute` ("bf16", "fp8", "fp4")."""
        rate = {"bf16": self.bf16_tflops, "fp8": self.fp8_tflops, "fp4": self.fp4_tflops}[compute]
        return rate if rate is not None else self.bf16_tflops


GPUS = {
    # Hopper, SXM: HBM3 80 GB at 3.35 TB/s; NVLink 4, 900 GB/s both ways.
    "h100": GpuSpec("H100", 80, 3.35, 989, 1979, None, 450),
    # Hopper: HBM3e 141 GB at 4.8 TB/s; the H100's tensor cores; NVLink 4, 900 GB/s both ways.
    "h200": GpuSpec("H200", 141, 4.8, 989, 1979, None, 450),
    # Blackwell (HGX B200: 1.4 TB over 8 GPUs; 72 PF dense FP4 per 8); NVLink 5, 1.8 TB/s.
    "b200": GpuSpec("B200", 180, 8.0, 2250, 4500, 9000, 900),
    # Blackwell Ultra: 288 GB HBM3e at 8 TB/s, 15 PF dense FP4; NVLink 5, 1.8 TB/s.
    "b300": GpuSpec("B300", 288, 8.0, 2250, 4500, 15000, 900),
    # Grace Blackwell Ultra (GB300 NVL72 per GPU: 1.1 EF FP4, 360 PF FP8, 180 PF bf16 / 72).
    "gb300": GpuSpec("GB300", 288, 8.0, 2500, 5000, 15000, 900),
}
