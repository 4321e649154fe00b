"""The reconstruction Metric classes sync across processes: two gloo ranks, each with its own images.

``python tests/test_metric_distributed.py RANK OUTDIR`` is one rank of the test (it writes
OUTDIR/rank{RANK}.pt). The worker imports only torch and ``lightning_gp.metrics`` (not Lightning),
so each rank starts in a few seconds.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lightning_gp.metrics import ReconstructionLPIPS, ReconstructionNMI, ReconstructionPSNR, ReconstructionSSIM

REPO = Path(__file__).resolve().parents[1]
CLASSES = {
    "psnr": ReconstructionPSNR,
    "ssim": ReconstructionSSIM,
    "lpips": ReconstructionLPIPS,
    "nmi": ReconstructionNMI,
}


def rank_batches(rank: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The (reconstructions, originals) updates of one rank: rank 0 sends 3 + 2 images, rank 1 one batch of 4."""
    g = torch.Generator().manual_seed(100 + rank)
    batches = []
    for size in (3, 2) if rank == 0 else (4,):
        originals = torch.rand(size, 3, 32, 32, generator=g)
        sigma = 0.03 + 0.2 * torch.rand(size, 1, 1, 1, generator=g)
        reconstructions = (originals + sigma * torch.randn(originals.shape, generator=g)).clamp(0, 1)
        batches.append((reconstructions, originals))
    return batches


def run_rank(rank: int, outdir: str) -> None:
    """Update every metric with this rank's batches, compute (synced), save the results."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{os.path.join(outdir, 'store')}", rank=rank, world_size=2)
    try:
        metrics = {name: cls() for name, cls in CLASSES.items()}
        metrics["psnr_none"] = ReconstructionPSNR(reduction="none")
        metrics["ssim_worst"] = ReconstructionSSIM(reduction="worst")
        for reconstructions, originals in rank_batches(rank):
            for metric in metrics.values():
                metric.update(reconstructions, originals)
        results: dict = {name: metric.compute() for name, metric in metrics.items()}
        results["local_updates"] = len(metrics["psnr"].values)  # the local state is back after the sync
    finally:
        dist.destroy_process_group()
    torch.save(results, os.path.join(outdir, f"rank{rank}.pt"))


@pytest.mark.multiprocess
def test_two_process_compute_is_the_mean_over_both_ranks_images(tmp_path):
    from test_metric_classes import functional

    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    ranks = [
        subprocess.Popen(
            [sys.executable, __file__, str(rank), str(tmp_path)],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            cwd=tmp_path,
            env=env,
        )
        for rank in range(2)
    ]
    outputs = []
    try:
        for process in ranks:
            outputs.append(process.communicate(timeout=300)[0])
    finally:
        for process in ranks:  # only if one hung: end the processes this test started
            if process.poll() is None:
                process.kill()
                process.wait()
    assert [p.returncode for p in ranks] == [0, 0], "\n".join(out[-3000:] for out in outputs)

    results = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    batches = rank_batches(0) + rank_batches(1)
    for name in CLASSES:
        values = torch.cat([functional(name, rec, orig) for rec, orig in batches])
        assert values.numel() == 9
        for rank, result in enumerate(results):
            torch.testing.assert_close(
                result[name], values.mean(), msg=lambda m, name=name, rank=rank: f"{name} on rank {rank}: {m}"
            )
    psnr_values = torch.cat([functional("psnr", rec, orig) for rec, orig in batches])
    ssim_values = torch.cat([functional("ssim", rec, orig) for rec, orig in batches])
    for result in results:
        torch.testing.assert_close(result["psnr_none"], psnr_values)  # rank 0's images, then rank 1's
        torch.testing.assert_close(result["ssim_worst"], ssim_values.max())
    assert [result["local_updates"] for result in results] == [2, 1]


if __name__ == "__main__":
    run_rank(int(sys.argv[1]), sys.argv[2])
