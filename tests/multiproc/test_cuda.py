"""scripts/cuda_check.py, the CUDA-tensor checks: on CUDA tensors where torch sees a GPU, and the
same checks on CPU tensors everywhere (so the script itself is tested on every machine). The
script compares every result with Horovod's and checks that the lanes carried each collective."""
import pytest
import torch

from tests.multiproc.harness import REPO, run_job

pytestmark = [pytest.mark.multiproc]
SCRIPT = REPO / "scripts" / "cuda_check.py"
ENV = {"FASTHOROVOD_PROXY_THRESHOLD_BYTES": "0", "FASTHOROVOD_NUM_LANES": "2"}  # as scripts/cuda_check.sh


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="torch sees no CUDA device"))])
def test_the_cuda_checks(device):
    result = run_job(2, "--device", device, worker=SCRIPT, env=ENV, timeout=300)
    for rank in range(2):
        assert f"CUDA CHECK rank {rank}: all ok on {device}" in result.stdout, result.stdout[-3000:]
    assert "FAILED" not in result.stdout
